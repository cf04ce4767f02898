"""binder/ builds what mybinder.org would build, and the quickstart notebook runs in it.

Binder (repo2docker) makes a Python 3.11 environment (``runtime.txt``) that already holds JupyterLab 4, ipykernel
and ipywidgets 8, runs ``pip install -r binder/requirements.txt`` in it, then ``binder/postBuild`` from the
repository root, and starts the server through ``binder/start``. The slow test repeats that in a fresh virtual
environment and runs ``notebooks/01_quickstart.ipynb`` there with nbval (a kernel of that environment), holding its
memory to what a Binder session can count on; it is the quickstart's only run in the suite. It runs right after
the notebooks, beside them under ``pytest -n 2`` (``tests/conftest.py``); the build is ``tests/binder_build.py``.

Two honest differences from Binder:

* ``--extra-index-url https://download.pytorch.org/whl/cpu`` is dropped from the requirements: that index is not
  reachable from this machine. ``torch==2.13.0+cpu`` then resolves to the very same wheel
  (``torch-2.13.0+cpu-cp311-...whl``) from this machine's local wheel directory, which pip's configuration here
  points at (``find-links``); everything else comes from PyPI, as on Binder.
* Binder's base environment is stood in for by ``ipykernel`` (the kernel) and ``nbval``/``pytest`` (which drive
  the notebook instead of a browser); JupyterLab itself is not installed.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path

import pytest
from binder_build import BINDER, UNREACHABLE_INDEX, BinderBuild, binder_python, runtime_version
from notebook_runs import BINDER_MEMORY_BYTES, BINDER_NOTEBOOK, run_notebooks
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: read the installed kit's metadata instead (make test reinstalls it)
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = f"notebooks/{BINDER_NOTEBOOK}"


def _project() -> dict:
    """``requires-python`` and ``dependencies`` of pyproject.toml."""
    if tomllib is not None:
        return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    metadata = importlib.metadata.metadata("flair_nbddp")
    requires = importlib.metadata.requires("flair_nbddp") or []
    return {"requires-python": metadata["Requires-Python"], "dependencies": [r for r in requires if "extra ==" not in r]}


def _pins() -> dict[str, Requirement]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    requirements = [Requirement(line.split("#")[0].strip()) for line in lines if line.strip() and line[0] not in "#-"]
    return {requirement.name.lower(): requirement for requirement in requirements}


def test_binder_files_exist_and_scripts_are_executable():
    for name in ("requirements.txt", "runtime.txt", "postBuild", "start"):
        assert (BINDER / name).is_file(), name
    for script in ("postBuild", "start"):
        assert os.access(BINDER / script, os.X_OK), f"binder/{script} must be executable (git: chmod +x)"
        assert (BINDER / script).read_text().startswith("#!/bin/bash\n")
    assert 'exec "$@"' in (BINDER / "start").read_text(), "binder/start must end by starting the server"


def test_runtime_is_a_python_the_project_supports():
    major, minor = runtime_version()
    requires = _project()["requires-python"]
    assert Requirement(f"python{requires}").specifier.contains(f"{major}.{minor}"), (major, minor, requires)


def test_requirements_pin_every_dependency_of_the_project():
    """Every dependency in pyproject.toml is pinned (==) in binder/requirements.txt, to a version it accepts."""
    pins = _pins()
    dependencies = _project()["dependencies"]
    for dependency in map(Requirement, dependencies):
        pin = pins.get(dependency.name.lower())
        assert pin is not None, f"binder/requirements.txt does not pin {dependency.name}"
        (spec,) = pin.specifier
        assert spec.operator == "==", f"{pin} is not an exact pin"
        assert dependency.specifier.contains(spec.version, prereleases=True), f"{pin} does not satisfy {dependency}"
    assert str(pins["torch"].specifier).endswith("+cpu"), "Binder has no GPU: pin torch's CPU build"
    assert UNREACHABLE_INDEX in (BINDER / "requirements.txt").read_text()


@pytest.mark.kernel
def test_binder_environment_runs_the_quickstart(tmp_path):
    build = BinderBuild(tmp_path, binder_python()).build()
    # the quickstart runs here only (tests/test_notebooks.py runs the others), with the suite's seed for its checks
    quickstart = build.repo / NOTEBOOK
    nbval = run_notebooks(
        [quickstart], tmp_path / "notebook", {**build.env, "FLAIR_NBDDP_SEED": "0"}, build.python,
        (str(build.repo / "binder/start"),),
    )  # fmt: skip
    nbval.check(quickstart)
    assert max(nbval.peaks) < BINDER_MEMORY_BYTES, (
        f"{quickstart.name} took {max(nbval.peaks) / 2**30:.2f} GiB (kernel + workers, PSS): more than a Binder "
        f"session can count on ({BINDER_MEMORY_BYTES / 2**30:.1f} GiB; see docs/getting-started.md, Binder)"
    )
    installed = subprocess.run(
        [build.python, "-c", "import torch, flair_nbddp; print(torch.__version__, flair_nbddp.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, env=build.env, check=True,
    ).stdout.split()
    assert installed[0] == str(_pins()["torch"].specifier).removeprefix("=="), installed
    assert Path(installed[1]).is_relative_to(build.repo), "postBuild did not install the kit from the repository"
    timings = {**build.timings, "notebook": nbval.seconds}
    print("binder build and quickstart: " + ", ".join(f"{step} {seconds:.0f} s" for step, seconds in timings.items()))
