"""The notebooks in ``notebooks/`` run top to bottom, offline, on 2 CPU processes, and say what they said.

Each notebook runs in its own ``python -m pytest --nbval-lax`` (a fresh kernel of this interpreter, started by
nbval), on a copy in a temporary directory so that the models and checkpoints it writes (``work/``) and its run
directories stay out of the repository. ``--nbval-lax`` runs every cell and compares the output only of the cells
tagged ``nbval-check-output``: statuses, predicted labels, error class names, never timings or losses. Those
cells keep their expected output in the committed notebook; every other cell is committed without output.

To refresh a notebook's checked outputs after an intended change: execute it (e.g. ``jupyter nbconvert --execute
--to notebook --inplace`` with the environment below), then clear every output but the tagged cells' and drop
``metadata.widgets``; ``test_notebooks_are_committed_clean`` says what is left to clear.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CHECK_TAG = "nbval-check-output"
CELL_TIMEOUT_SECONDS = 600
NOTEBOOK_TIMEOUT_SECONDS = 900
# a fixed seed: the checked predictions come from short trainings of a tiny model (they held for seeds 0-4)
ENVIRONMENT = {
    "FLAIR_NBDDP_DEVICE": "cpu", "FLAIR_NBDDP_PROCESSES": "2", "FLAIR_NBDDP_SEED": "0", "HF_HUB_OFFLINE": "1",
}


# what a Binder session (1-2 GB) can count on for the quickstart: the kernel and its 2 CPU workers, summed as PSS
# (shared pages counted once), peak over the whole run
BINDER_NOTEBOOK = "01_quickstart.ipynb"
BINDER_MEMORY_BYTES = int(1.5 * 2**30)


class KernelMemory(threading.Thread):
    """Samples, until the ``with`` block ends, the summed PSS of every Jupyter kernel below process ``root``
    and of the kernel's own children (the workers); keeps the peak in bytes."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.peak = psutil.Process(root), interval, 0
        self._done = threading.Event()

    def _sample(self) -> int:
        total = 0
        for process in self.root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ipykernel" in " ".join(process.cmdline()):
                    for member in [process, *process.children(recursive=True)]:
                        with contextlib.suppress(psutil.Error):
                            total += member.memory_full_info().pss
        return total

    def run(self) -> None:
        while not self._done.wait(self.interval):
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self._sample())

    def __enter__(self) -> "KernelMemory":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()


def _code_cells(path: Path) -> list[dict]:
    return [cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]


def test_there_are_notebooks():
    names = {path.name for path in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_ddp_train_magic.ipynb", "04_ner.ipynb", "05_batch_size_and_scaling.ipynb",
            "06_troubleshooting.ipynb"} <= names, names


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebooks_are_committed_clean(notebook):
    """No widget state; outputs only in checked cells, which have theirs (and the execution count nbval needs)."""
    content = json.loads(notebook.read_text())
    assert "widgets" not in content["metadata"], f"{notebook.name}: remove metadata.widgets (saved widget state)"
    checked = 0
    for index, cell in enumerate(_code_cells(notebook)):
        where = f"{notebook.name}, code cell {index}"
        if CHECK_TAG in cell["metadata"].get("tags", []):
            checked += 1
            # nbval compares only cells that were run: an expected output needs its execution count
            assert cell["outputs"] and cell["execution_count"], f"{where}: tagged {CHECK_TAG} but has no expected output"
        else:
            assert not cell["outputs"], f"{where}: clear its output (not tagged {CHECK_TAG})"
            assert cell["execution_count"] is None, f"{where}: clear its execution count"
    assert checked, f"{notebook.name}: no cell is tagged {CHECK_TAG}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebooks_have_the_switch_to_the_real_thing(notebook):
    first_code = _code_cells(notebook)[0]["source"]
    first_line = "".join(first_code).splitlines()[0]
    assert first_line.startswith("REAL = False  # True: "), f"{notebook.name}: first code cell is not the REAL switch"


@pytest.mark.kernel
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_and_its_checked_outputs_hold(notebook, tmp_path):
    shutil.copy(notebook, tmp_path / notebook.name)
    env = {**os.environ, **ENVIRONMENT, "FLAIR_NBDDP_RUNS": str(tmp_path / "runs")}
    command = [
        sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
        f"--nbval-cell-timeout={CELL_TIMEOUT_SECONDS}", "-p", "no:cacheprovider", "-q", "-rf", notebook.name,
    ]
    started = time.monotonic()
    with subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as nbval, KernelMemory(nbval.pid) as memory:
        output, _ = nbval.communicate(timeout=NOTEBOOK_TIMEOUT_SECONDS)
    seconds = time.monotonic() - started
    assert nbval.returncode == 0, f"{notebook.name} failed after {seconds:.0f} s:\n{output[-12000:]}"
    print(f"{notebook.name}: {seconds:.0f} s, peak PSS of the kernel and its workers {memory.peak / 2**30:.2f} GiB")
    if notebook.name == BINDER_NOTEBOOK:
        assert memory.peak < BINDER_MEMORY_BYTES, (
            f"{notebook.name} took {memory.peak / 2**30:.2f} GiB (kernel + workers, PSS): more than a Binder session "
            f"can count on ({BINDER_MEMORY_BYTES / 2**30:.1f} GiB; see README, Notebooks and Binder)"
        )
