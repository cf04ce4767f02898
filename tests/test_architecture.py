"""The shape of the package: imports run one way, the engine imports no UI, one exception family."""

import ast
import builtins
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import flair_nbddp
from flair_nbddp import errors

PACKAGE = Path(flair_nbddp.__file__).parent
MODULES = sorted(info.name for info in pkgutil.iter_modules([str(PACKAGE)]))
ENGINE = ("devices", "events", "group", "rundir", "run", "sources", "state", "supervisor", "worker", "payload")
UI = {"dashboard", "panel", "magic", "IPython", "ipywidgets"}


def imports_of(module: str) -> set[str]:
    """The package modules and UI libraries ``module`` imports, at any level of its code."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
    return {name for name in found if name in MODULES or name in UI}


def test_package_imports_form_no_cycle():
    graph = {module: imports_of(module) & set(MODULES) for module in MODULES}
    path: list[str] = []

    def visit(module: str, seen: set[str]) -> None:
        assert module not in path, f"import cycle: {' -> '.join([*path[path.index(module):], module])}"
        if module in seen:
            return
        path.append(module)
        for imported in graph[module]:
            visit(imported, seen)
        path.pop()
        seen.add(module)

    seen: set[str] = set()
    for module in MODULES:
        visit(module, seen)


@pytest.mark.parametrize("module", ENGINE)
def test_the_engine_imports_no_ui(module):
    def reachable(name: str, seen: set[str]) -> set[str]:
        for imported in imports_of(name) - seen:
            seen.add(imported)
            if imported in MODULES:
                reachable(imported, seen)
        return seen

    assert not reachable(module, set()) & UI


def test_a_worker_imports_neither_ipython_nor_ipywidgets():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, flair_nbddp.worker; print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert "flair_nbddp.worker" in loaded and not {"IPython", "ipywidgets", "ipykernel"} & set(loaded)


def test_every_exception_class_of_the_kit_is_a_flair_nbddp_error():
    classes = set()
    for module in MODULES:
        if module != "__main__":
            for _, value in inspect.getmembers(importlib.import_module(f"flair_nbddp.{module}"), inspect.isclass):
                if issubclass(value, BaseException) and value.__module__.startswith("flair_nbddp"):
                    classes.add(value)
    assert errors.WorkerError in classes and len(classes) > 10
    assert [cls.__name__ for cls in classes if not issubclass(cls, errors.FlairNbddpError)] == []


def test_the_kit_makes_no_bare_builtin_exception():
    builtin_errors = {name for name in dir(builtins) if isinstance(getattr(builtins, name), type)
                      and issubclass(getattr(builtins, name), Exception)}  # fmt: skip
    bare = []
    for module in MODULES:
        for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in builtin_errors:
                bare.append(f"{module}.py:{node.lineno} makes a {node.func.id}")
    assert bare == []


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (errors.ShippingError, TypeError), (errors.NotCallableError, TypeError),
        (errors.ConfigurationError, ValueError), (errors.DeviceError, ValueError), (errors.WorkerError, RuntimeError), (errors.RunTimeoutError, TimeoutError),
        (errors.StillRunningError, TimeoutError), (errors.PayloadWriteError, OSError),
        (errors.RunActiveError, RuntimeError), (errors.PoolClosedError, RuntimeError),
    ],
)  # fmt: skip
def test_each_error_keeps_the_builtin_callers_expect(cls, builtin):
    assert issubclass(cls, builtin) and issubclass(cls, errors.FlairNbddpError)
    assert getattr(flair_nbddp, cls.__name__) is cls  # exported, as the README lists it


def _readme_module_table() -> list[tuple[list[str], set[str]]]:
    """The README's "Modules, each with one job" table: each row's modules, with the kit modules it says they import."""
    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme.split("### Modules, each with one job", 1)[1].split("\n\n", 2)[1]
    rows = []
    for row in table.splitlines()[2:]:
        names, _, imports = [cell.strip() for cell in row.strip("|").split("|")]
        modules = [name.strip("` ").removesuffix(".py") for name in names.split(",")]
        rows.append((modules, {name.strip().split(" ")[0] for name in imports.split(",")} - {"—", ""}))
    return rows


def test_the_readme_module_table_lists_every_module_and_what_it_imports():
    rows = _readme_module_table()
    missing = sorted(set(MODULES) - {"__main__", "errors"} - {module for modules, _ in rows for module in modules})
    assert missing == [], f"README's module table does not list {missing}"
    for modules, said in rows:
        actual = set().union(*(imports_of(module) & set(MODULES) for module in modules)) - {"errors", *modules}
        assert actual == said, f"README says {modules} import {sorted(said)}; the code: {sorted(actual)}"
