"""What mybinder.org builds from binder/, built in the background while the rest of the suite runs.

The build (a fresh virtual environment, ``pip install -r binder/requirements.txt``, the stand-ins for Binder's
base image, ``binder/postBuild``) takes about a minute of mostly one core, and the suite's other tests leave part
of the second core idle. ``conftest.py`` starts it once the tests are collected, if the Binder test is among
them, and runs that test last; the test waits for the build here and then runs the quickstart in it. See
``tests/test_binder.py`` for what is built and how it differs from Binder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

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
        self._error: BaseException | None = None
        self._step: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._build, name="binder-build", daemon=True)

    def start(self) -> BinderBuild:
        self._thread.start()
        return self

    def wait(self, timeout: float = 1800) -> BinderBuild:
        """The finished build.

        Raises:
            AssertionError: a step failed (its command and output), or the build is still going after ``timeout``.
        """
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the Binder build did not finish within {timeout} s"
        if self._error is not None:
            raise self._error
        return self

    def processes(self) -> set[int]:
        """The processes the build runs now (a step and what it started): nobody's leftovers."""
        step = self._step
        if step is None or step.poll() is not None:
            return set()
        try:
            return {step.pid, *(child.pid for child in psutil.Process(step.pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def _build(self) -> None:
        try:
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
        except BaseException as error:  # noqa: BLE001 - handed to the test, which raises it
            self._error = error

    def _run(self, step: str, command: list[str], cwd: Path, timeout: float) -> None:
        started = time.monotonic()
        self._step = subprocess.Popen(
            command, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            output, _ = self._step.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._step.kill()
            output, _ = self._step.communicate()
        seconds = self.timings[step] = time.monotonic() - started
        assert self._step.returncode == 0, f"{' '.join(command)} failed after {seconds:.0f} s:\n{output[-12000:]}"


_BUILD: BinderBuild | None = None


def start(home: Path) -> BinderBuild:
    """Start building in ``home`` (the test run's one build)."""
    global _BUILD
    _BUILD = BinderBuild(home, binder_python()).start()
    return _BUILD


def current() -> BinderBuild | None:
    """The build started for this test run, if any."""
    return _BUILD
