"""Notebooks run by nbval in a process of their own, with each kernel's memory watched (tests/test_notebooks.py,
tests/test_binder.py).

Example::

    nbval = run_notebooks([Path("notebooks/02_ddp_train_magic.ipynb")], tmp_path, dict(os.environ))
    nbval.check(Path("notebooks/02_ddp_train_magic.ipynb"))   # fails with nbval's words unless every cell passed
    max(nbval.peaks)                                           # bytes: the largest kernel with its workers (PSS)
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

CELL_TIMEOUT_SECONDS = 600
NOTEBOOK_TIMEOUT_SECONDS = 900
# what a Binder session (1-2 GB) can count on for the quickstart, which tests/test_binder.py runs: the kernel and its
# 2 CPU workers, summed as PSS (shared pages counted once), peak over the whole run
BINDER_NOTEBOOK = "01_quickstart.ipynb"
BINDER_MEMORY_BYTES = int(1.5 * 2**30)


class KernelMemory(threading.Thread):
    """Samples, until the ``with`` block ends, the PSS of each Jupyter kernel below process ``root`` summed with its
    own children's (the workers); keeps each kernel's peak in bytes, in the order the kernels started."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = psutil.Process(root), interval
        self._peaks: dict[int, int] = {}
        self._done = threading.Event()

    @property
    def peaks(self) -> list[int]:
        return list(self._peaks.values())

    def _sample(self) -> None:
        for process in self.root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ipykernel" in " ".join(process.cmdline()):
                    total = 0
                    for member in [process, *process.children(recursive=True)]:
                        with contextlib.suppress(psutil.Error):
                            total += member.memory_full_info().pss
                    self._peaks[process.pid] = max(self._peaks.get(process.pid, 0), total)

    def run(self) -> None:
        while not self._done.wait(self.interval):
            with contextlib.suppress(psutil.Error):
                self._sample()

    def __enter__(self) -> "KernelMemory":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()


def run_notebooks(
    notebooks: list[Path], workdir: Path, env: dict[str, str], python: str = sys.executable, launcher: tuple = ()
) -> Nbval:
    """Run ``notebooks`` with one nbval process of ``python`` (started through ``launcher``, e.g. Binder's
    ``start`` script), each in a directory of its own under ``workdir`` (nbval starts each one's kernel there),
    watching the memory of their kernels and workers."""
    names = []
    for notebook in notebooks:
        (workdir / notebook.stem).mkdir(parents=True)
        shutil.copy(notebook, workdir / notebook.stem / notebook.name)
        names.append(f"{notebook.stem}/{notebook.name}")
    report = workdir / f"nbval-{notebooks[0].stem}.xml"  # one per nbval process: several may share ``workdir``
    command = [
        *launcher, python, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
        f"--nbval-cell-timeout={CELL_TIMEOUT_SECONDS}", "-p", "no:cacheprovider", "-q", "-rf", f"--junitxml={report}",
        *names,
    ]  # fmt: skip
    started = time.monotonic()
    with subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as nbval, KernelMemory(nbval.pid) as memory:
        output, _ = nbval.communicate(timeout=NOTEBOOK_TIMEOUT_SECONDS * len(notebooks))
    cells = _cells_by_notebook(report) if report.exists() else {}
    return Nbval(output, time.monotonic() - started, memory.peaks, cells)


@dataclass
class Nbval:
    """What one nbval process said: its output, seconds, each kernel's peak memory, each notebook's cells run."""

    output: str
    seconds: float
    peaks: list[int]  # bytes, one per kernel (with its workers), in the order the kernels started
    cells: dict[str, dict[str, str | None]]  # notebook file name -> cell -> None (passed) or its failure

    @staticmethod
    def together(runs: list[Nbval]) -> Nbval:
        """What nbval processes that ran side by side said, as one."""
        cells = {name: found for run in runs for name, found in run.cells.items()}
        return Nbval("\n".join(run.output for run in runs), max(run.seconds for run in runs),
                     [peak for run in runs for peak in run.peaks], cells)  # fmt: skip

    def check(self, notebook: Path) -> None:
        """Fail, with nbval's words, unless every cell of ``notebook`` ran and its checked outputs held."""
        cells = self.cells.get(notebook.name)
        assert cells, f"{notebook.name} did not run ({self.seconds:.0f} s):\n{self.output[-12000:]}"
        failed = {cell: failure for cell, failure in cells.items() if failure is not None}
        assert not failed, f"{notebook.name}: {sorted(failed)} failed:\n" + "\n".join(failed.values())[-12000:]


def _cells_by_notebook(report: Path) -> dict[str, dict[str, str | None]]:
    """nbval's JUnit report: for each notebook, each cell run, None where it passed, else its failure."""
    from xml.etree import ElementTree

    cells: dict[str, dict[str, str | None]] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        notebook = case.get("classname", "").partition(".")[2]  # "<stem>.<stem>.ipynb": the directory, the file
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        text = None if problem is None else f"{case.get('name')}: {problem.get('message', '')}\n{problem.text or ''}"
        cells.setdefault(notebook, {})[case.get("name", "")] = text
    return cells
