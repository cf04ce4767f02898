"""What mybinder.org builds from binder/: a fresh virtual environment, ``pip install -r binder/requirements.txt``, the
stand-ins for Binder's base image, ``binder/postBuild``.

The build takes about a minute of mostly one core. ``conftest.py`` orders its test right after the notebooks, so
that with ``pytest -n 2`` it runs beside them. See ``tests/test_binder.py`` for what is built and how it
differs from Binder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"
UNREACHABLE_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
STAND_IN_FOR_BINDER_BASE = ["ipykernel", "nbval", "pytest"]
# what a Binder clone of the repository would not hold, or what this machine built
NOT_IN_A_CLONE = shutil.ignore_patterns(
    ".git", ".venv", ".whl", "__pycache__", "*.egg-info", ".pytest_cache", "build", "work", "artifacts"
)


def runtime_version() -> tuple[int, int]:
    """The Python version binder/runtime.txt asks for."""
    match = re.fullmatch(r"python-(\d+)\.(\d+)", (BINDER / "runtime.txt").read_text().strip())
    assert match, "binder/runtime.txt must read python-X.Y"
    return int(match[1]), int(match[2])


def binder_python() -> str:
    """An interpreter of runtime.txt's version: this one, else ``pythonX.Y`` on PATH, else this one anyway."""
    version = runtime_version()
    if sys.version_info[:2] == version:
        return sys.executable
    other = shutil.which("python{}.{}".format(*version))
    if other is None:
        print(f"no python{version[0]}.{version[1]} here: the Binder environment is built with {sys.version.split()[0]}")
    return other or sys.executable


class BinderBuild:
    """The environment under ``home``: ``repo`` (a clone's files), ``venv``, ``env`` (the environment its
    programs run in), ``python``, and each step's seconds in ``timings``."""

    def __init__(self, home: Path, python: str) -> None:
        self.home, self.repo, self.venv = home, home / "repo", home / "venv"
        self.python = str(self.venv / "bin" / "python")
        # as in a Binder image: nothing of the suite's own environment, the kit's settings come from binder/start
        self.env = {
            key: value for key, value in os.environ.items()
            if not key.startswith(("FLAIR_NBDDP_", "HF_HUB_", "VIRTUAL_ENV", "PYTHONPATH", "PYTEST_"))
        }  # fmt: skip
        self.env.update(PATH=f"{self.venv / 'bin'}{os.pathsep}{self.env['PATH']}", VIRTUAL_ENV=str(self.venv))
        self.env["FLAIR_NBDDP_RUNS"] = str(home / "runs")  # the run directories stay with the build's files
        self.timings: dict[str, float] = {}
        self._base_python = python

    def build(self) -> BinderBuild:
        """Build it.

        Raises:
            AssertionError: a step failed (its command and output).
        """
        shutil.copytree(ROOT, self.repo, ignore=NOT_IN_A_CLONE)
        self._run("venv", [self._base_python, "-m", "venv", str(self.venv)], self.home, 120)
        requirements = self.home / "requirements.txt"
        requirements.write_text(  # tests/test_binder.py: the PyTorch CPU index is not reachable from here
            (BINDER / "requirements.txt").read_text().replace(UNREACHABLE_INDEX, "# (index dropped: unreachable)")
        )
        pip = [self.python, "-m", "pip", "install", "-q"]
        self._run("requirements", [*pip, "-r", str(requirements)], self.repo, 1500)
        self._run("base stand-in", [*pip, *STAND_IN_FOR_BINDER_BASE], self.repo, 600)
        self._run("postBuild", ["binder/postBuild"], self.repo, 600)
        return self

    def _run(self, step: str, command: list[str], cwd: Path, timeout: float) -> None:
        started = time.monotonic()
        process = subprocess.Popen(
            command, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        seconds = self.timings[step] = time.monotonic() - started
        assert process.returncode == 0, f"{' '.join(command)} failed after {seconds:.0f} s:\n{output[-12000:]}"
