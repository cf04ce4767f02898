"""The shape of the package: import-linter's contracts (pyproject.toml) hold, imports run one way, workers and
plain imports stay light, one exception family."""

import ast
import builtins
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import flair_nbddp
from flair_nbddp import errors

PACKAGE = Path(flair_nbddp.__file__).parent
MODULES = sorted(info.name for info in pkgutil.walk_packages([str(PACKAGE)], "flair_nbddp."))


def _loaded_by(code: str) -> set[str]:
    return set(subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout.split())  # fmt: skip


def test_the_import_contracts_hold():
    linter = Path(sys.executable).with_name("lint-imports")
    checked = subprocess.run([str(linter)], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout[-4000:] + checked.stderr[-2000:]
    assert "4 kept, 0 broken" in checked.stdout


def test_the_top_level_holds_what_a_user_reads_first_and_the_engine_its_own_package():
    top = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert top == ["__init__", "__main__", "_version", "api", "demo", "errors", "options", "pool", "result",
                   "synthetic"], "a module a user does not import belongs in a subpackage (the engine's: engine/)"
    engine = sorted(path.stem for path in (PACKAGE / "engine").glob("*.py"))
    assert {"run", "supervisor", "worker_source", "local_ranks", "forkserver", "restarts", "state"} <= set(engine)


def test_the_package_imports_form_no_cycle():
    graph = grimp.build_graph("flair_nbddp")
    modules = graph.modules - {"flair_nbddp"}  # the root re-exports the API: it imports everything
    cycles = []
    for module in sorted(modules):
        for imported in graph.find_modules_directly_imported_by(module) & modules:
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back and "flair_nbddp" not in back:
                cycles.append(" -> ".join([module, *back]))
    assert cycles == []


def test_a_worker_imports_neither_ipython_nor_ipywidgets():
    loaded = _loaded_by("import flair_nbddp.worker.main")
    assert "flair_nbddp.worker.main" in loaded and not {"IPython", "ipywidgets", "ipykernel"} & loaded


def test_the_dask_backend_is_imported_only_when_cluster_is_used():
    loaded = _loaded_by("import flair_nbddp; from flair_nbddp.engine.worker_source import source_for")
    assert "flair_nbddp.api" in loaded and not {"flair_nbddp.cluster", "distributed", "dask"} & loaded


def test_every_exception_class_of_the_kit_is_a_flair_nbddp_error():
    classes = set()
    for module in MODULES:
        if not module.endswith("__main__"):
            for _, value in inspect.getmembers(importlib.import_module(module), inspect.isclass):
                if issubclass(value, BaseException) and value.__module__.startswith("flair_nbddp"):
                    classes.add(value)
    assert errors.WorkerError in classes and len(classes) > 10
    assert [cls.__name__ for cls in classes if not issubclass(cls, errors.FlairNbddpError)] == []


def test_the_kit_makes_no_bare_builtin_exception():
    builtin_errors = {name for name in dir(builtins) if isinstance(getattr(builtins, name), type)
                      and issubclass(getattr(builtins, name), Exception)}  # fmt: skip
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in builtin_errors:
                bare.append(f"{path.relative_to(PACKAGE)}:{node.lineno} makes a {node.func.id}")
    assert bare == []


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (errors.ShippingError, TypeError), (errors.NotCallableError, TypeError), (errors.UnknownOptionError, TypeError),
        (errors.ConfigurationError, ValueError), (errors.DeviceError, ValueError), (errors.WorkerError, RuntimeError), (errors.RunTimeoutError, TimeoutError),
        (errors.StillRunningError, TimeoutError), (errors.PayloadWriteError, OSError),
        (errors.RunActiveError, RuntimeError), (errors.PoolClosedError, RuntimeError),
    ],
)  # fmt: skip
def test_each_error_keeps_the_builtin_callers_expect(cls, builtin):
    assert issubclass(cls, builtin) and issubclass(cls, errors.FlairNbddpError)
    assert getattr(flair_nbddp, cls.__name__) is cls  # exported, as the README lists it
