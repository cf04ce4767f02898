"""binder/ builds what mybinder.org would build, and the quickstart notebook runs in it.

Binder (repo2docker) makes a Python 3.11 environment (``runtime.txt``) that already holds JupyterLab 4, ipykernel
and ipywidgets 8, runs ``pip install -r binder/requirements.txt`` in it, then ``binder/postBuild`` from the
repository root, and starts the server through ``binder/start``. The slow test repeats that in a fresh virtual
environment and runs ``notebooks/01_quickstart.ipynb`` there with nbval (a kernel of that environment), holding its
memory to what a Binder session can count on; it is the quickstart's only run in the suite.

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
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from notebook_runs import BINDER_MEMORY_BYTES, BINDER_NOTEBOOK, run_notebooks
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: read the installed kit's metadata instead (make test reinstalls it)
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"
NOTEBOOK = f"notebooks/{BINDER_NOTEBOOK}"
UNREACHABLE_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
STAND_IN_FOR_BINDER_BASE = ["ipykernel", "nbval", "pytest"]
# what a Binder clone of the repository would not hold, or what this machine built
NOT_IN_A_CLONE = shutil.ignore_patterns(
    ".git", ".venv", ".whl", "__pycache__", "*.egg-info", ".pytest_cache", "build", "work", "artifacts"
)


def _project() -> dict:
    """``requires-python`` and ``dependencies`` of pyproject.toml."""
    if tomllib is not None:
        return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    metadata = importlib.metadata.metadata("flair_nbddp")
    requires = importlib.metadata.requires("flair_nbddp") or []
    return {"requires-python": metadata["Requires-Python"], "dependencies": [r for r in requires if "extra ==" not in r]}


def _runtime_version() -> tuple[int, int]:
    match = re.fullmatch(r"python-(\d+)\.(\d+)", (BINDER / "runtime.txt").read_text().strip())
    assert match, "binder/runtime.txt must read python-X.Y"
    return int(match[1]), int(match[2])


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
    major, minor = _runtime_version()
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


def _binder_python() -> str:
    """An interpreter of runtime.txt's version: this one, else ``pythonX.Y`` on PATH, else this one anyway."""
    version = _runtime_version()
    if sys.version_info[:2] == version:
        return sys.executable
    other = shutil.which("python{}.{}".format(*version))
    if other is None:
        print(f"no python{version[0]}.{version[1]} here: the Binder environment is built with {sys.version.split()[0]}")
    return other or sys.executable


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> float:
    started = time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - started
    assert done.returncode == 0, f"{' '.join(command)} failed after {seconds:.0f} s:\n{(done.stdout + done.stderr)[-12000:]}"
    return seconds


@pytest.mark.kernel
def test_binder_environment_runs_the_quickstart(tmp_path):
    repo, venv = tmp_path / "repo", tmp_path / "venv"
    shutil.copytree(ROOT, repo, ignore=NOT_IN_A_CLONE)
    # as in a Binder image: nothing of this test's own environment, the kit's settings come from binder/start
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("FLAIR_NBDDP_", "HF_HUB_", "VIRTUAL_ENV", "PYTHONPATH", "PYTEST_"))
    }
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv))
    env["FLAIR_NBDDP_RUNS"] = str(tmp_path / "runs")  # keep the run directories with the test's files
    python = str(venv / "bin" / "python")
    timings = {}

    timings["venv"] = _run([_binder_python(), "-m", "venv", str(venv)], tmp_path, env, 120)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(  # see the module docstring: the PyTorch CPU index is not reachable from here
        (BINDER / "requirements.txt").read_text().replace(UNREACHABLE_INDEX, "# (index dropped: unreachable here)")
    )
    timings["requirements"] = _run([python, "-m", "pip", "install", "-q", "-r", str(requirements)], repo, env, 1500)
    timings["base stand-in"] = _run([python, "-m", "pip", "install", "-q", *STAND_IN_FOR_BINDER_BASE], repo, env, 600)
    timings["postBuild"] = _run(["binder/postBuild"], repo, env, 600)
    # the quickstart runs here only (tests/test_notebooks.py runs the others), with the suite's seed for its checks
    quickstart = repo / NOTEBOOK
    nbval = run_notebooks(
        [quickstart], tmp_path / "notebook", {**env, "FLAIR_NBDDP_SEED": "0"}, python, (str(repo / "binder/start"),)
    )
    timings["notebook"] = nbval.seconds
    nbval.check(quickstart)
    assert max(nbval.peaks) < BINDER_MEMORY_BYTES, (
        f"{quickstart.name} took {max(nbval.peaks) / 2**30:.2f} GiB (kernel + workers, PSS): more than a Binder "
        f"session can count on ({BINDER_MEMORY_BYTES / 2**30:.1f} GiB; see README, Notebooks and Binder)"
    )
    installed = subprocess.run(
        [python, "-c", "import torch, flair_nbddp; print(torch.__version__, flair_nbddp.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, env=env, check=True,
    ).stdout.split()
    assert installed[0] == str(_pins()["torch"].specifier).removeprefix("=="), installed
    assert Path(installed[1]).is_relative_to(repo), "postBuild did not install the kit from the repository"
    print("binder build and quickstart: " + ", ".join(f"{step} {seconds:.0f} s" for step, seconds in timings.items()))
