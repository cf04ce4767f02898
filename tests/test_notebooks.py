"""The notebooks in ``notebooks/`` run top to bottom, offline, on 2 CPU processes, and say what they said.

Two ``python -m pytest --nbval-lax`` processes side by side run them (a fresh kernel of this interpreter for each,
started by nbval), each a copy in a temporary directory of its own so that the models and checkpoints it writes
(``work/``) and its run directories stay out of the repository; the quickstart runs in ``tests/test_binder.py``'s
Binder-like environment instead, through ``notebook_runs.run_notebooks`` too. ``--nbval-lax`` runs every cell and
compares the output only of the cells tagged ``nbval-check-output``: statuses, predicted labels, error class names,
never timings or losses.

The notebooks are stored executed, every code cell with its outputs, because the documentation site renders them
as stored: the dashboards' final state, the plots, the scores. They are stored without saved widget state and
without widget views (what would not render without a kernel); the dashboard's static HTML and text stay.

To refresh the stored outputs after a change to a notebook or to what it shows, run (from the repository root)::

    .venv/bin/python docs/execute_notebooks.py                            # all of them, about 6 minutes on 2 CPU cores
    .venv/bin/python docs/execute_notebooks.py notebooks/09_runs_that_survive.ipynb

It runs each notebook with the environment below in a temporary directory and stores it cleaned as
``test_notebooks_are_committed_clean`` requires.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from notebook_runs import BINDER_NOTEBOOK, Nbval, run_notebooks

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CHECK_TAG = "nbval-check-output"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"  # needs a live kernel: never stored
TEMPORARY = "flair_nbddp-notebook-"  # docs/execute_notebooks.py's temporary directories, written work/ in outputs
# a fixed seed: the checked predictions come from short trainings of a tiny model (they held for seeds 0-4)
ENVIRONMENT = {
    "FLAIR_NBDDP_DEVICE": "cpu", "FLAIR_NBDDP_PROCESSES": "2", "FLAIR_NBDDP_SEED": "0", "HF_HUB_OFFLINE": "1",
}




def _code_cells(path: Path) -> list[dict]:
    return [cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]


def test_there_are_notebooks():
    names = {path.name for path in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_ddp_train_magic.ipynb", "04_ner.ipynb", "05_batch_size_and_scaling.ipynb",
            "06_troubleshooting.ipynb"} <= names, names


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebooks_are_committed_clean(notebook):
    """Stored as docs/execute_notebooks.py stores them: every code cell executed, top to bottom, its outputs kept;
    no widget state or widget views; no path of the directory it ran in or of this checkout; the checked cells have
    their output."""
    content = json.loads(notebook.read_text())
    refresh = "refresh it with docs/execute_notebooks.py"
    assert "widgets" not in content["metadata"], f"{notebook.name}: saved widget state (metadata.widgets); {refresh}"
    cells = _code_cells(notebook)
    counts = [cell["execution_count"] for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{notebook.name}: not run top to bottom ({counts}); {refresh}"
    checked = 0
    for index, cell in enumerate(cells):
        where = f"{notebook.name}, code cell {index}"
        for output in cell["outputs"]:
            assert output["output_type"] != "error", f"{where}: stored with an error ({output.get('ename')}); {refresh}"
            assert WIDGET_VIEW not in output.get("data", {}), f"{where}: a widget view is stored; {refresh}"
            shown = json.dumps(output)
            assert TEMPORARY not in shown, f"{where}: shows the directory it ran in; {refresh}"
            assert str(NOTEBOOKS_DIR.parent) not in shown, f"{where}: shows this checkout's path; {refresh}"
        if CHECK_TAG in cell["metadata"].get("tags", []):
            checked += 1
            assert cell["outputs"], f"{where}: tagged {CHECK_TAG} but has no expected output; {refresh}"
    assert checked, f"{notebook.name}: no cell is tagged {CHECK_TAG}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebooks_have_the_switch_to_the_real_thing(notebook):
    first_code = _code_cells(notebook)[0]["source"]
    first_line = "".join(first_code).splitlines()[0]
    assert first_line.startswith("REAL = False  # True: "), f"{notebook.name}: first code cell is not the REAL switch"


@pytest.fixture(scope="module")
def nbval(tmp_path_factory) -> Nbval:
    """Every notebook but the quickstart, in two nbval processes side by side, each with a run ledger and a claim
    directory of its own, so that each half's runs take the devices they ask for (the
    quickstart runs in the Binder-like environment of tests/test_binder.py, which holds its memory to a Binder
    session's). Part of a notebook's time is waiting on its kernel and workers: one after another the eight took
    150 s of a suite run on this 2-core machine, side by side 116-118 s (each ran about 1.75 times longer)."""
    workdir = tmp_path_factory.mktemp("notebooks")
    notebooks = [path for path in NOTEBOOKS if path.name != BINDER_NOTEBOOK]

    def run(half: int) -> Nbval:
        env = {**os.environ, **ENVIRONMENT, "FLAIR_NBDDP_RUNS": str(workdir / f"runs-{half}"),
               "FLAIR_NBDDP_CLAIMS": str(workdir / f"claims-{half}")}  # fmt: skip
        return run_notebooks(notebooks[half::2], workdir, env)

    with ThreadPoolExecutor(2) as pool:
        return Nbval.together(list(pool.map(run, (0, 1))))


@pytest.mark.kernel
@pytest.mark.parametrize("notebook", [path for path in NOTEBOOKS if path.name != BINDER_NOTEBOOK], ids=lambda p: p.stem)
def test_notebook_runs_and_its_checked_outputs_hold(notebook, nbval):
    nbval.check(notebook)
