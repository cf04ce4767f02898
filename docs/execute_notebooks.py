"""Execute the tutorial notebooks and store their outputs, so that the documentation site shows them.

The site renders ``notebooks/*.ipynb`` as they are stored (mkdocs-jupyter with ``execute: false``). This script runs
each notebook top to bottom with nbclient, in the environment the tests run them in (2 CPU processes, a fixed seed,
offline), with a run ledger (``FLAIR_NBDDP_HOME``), run directories (``FLAIR_NBDDP_RUNS``), device claims
(``FLAIR_NBDDP_CLAIMS``: other kernels of the machine do not change what a notebook's runs get) and a working
directory of its own in a temporary directory, so that nothing it writes lands in the repository. It then writes the
notebook back with every code cell's outputs and execution count, less what would not render without a kernel or
would not be true of another machine:

- ``metadata.widgets`` (saved widget state) is dropped;
- the ``application/vnd.jupyter.widget-view+json`` mime type is removed from every output: the dashboard replaces
  its own output at the end of a run with a static ``text/html`` rendering and a ``text/plain`` summary, which stay
  (a widget output without a ``text/html`` rendering, whose ``text/plain`` is only ipywidgets' repr, is dropped);
- the temporary directory's path is written ``work/`` wherever an output shows it, and the paths of this
  interpreter's packages and of this checkout's ``flair_nbddp`` (in tracebacks) ``site-packages/``;
- no cell keeps the time it ran at (``metadata.execution``);
- the lines a cell printed to one stream one after the other are one output, as JupyterLab shows them (the ranks'
  lines arrive one message each).

Usage (from the repository root)::

    .venv/bin/python docs/execute_notebooks.py                               # all of them, one after the other
    .venv/bin/python docs/execute_notebooks.py notebooks/08_sweeps.ipynb     # only these
    .venv/bin/python docs/execute_notebooks.py --out /tmp/executed           # write the results elsewhere

``tests/test_notebooks.py::test_notebooks_are_committed_clean`` checks the stored notebooks against these rules.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
# the environment the tests run the notebooks in (tests/test_notebooks.py)
ENVIRONMENT = {
    "FLAIR_NBDDP_DEVICE": "cpu", "FLAIR_NBDDP_PROCESSES": "2", "FLAIR_NBDDP_SEED": "0", "HF_HUB_OFFLINE": "1",
}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
CELL_TIMEOUT_SECONDS = 600


def execute(notebook: Path, out: Path) -> float:
    """Run ``notebook`` in a temporary directory of its own, store the cleaned result at ``out``; returns seconds."""
    import nbformat
    from nbclient import NotebookClient

    content = nbformat.read(notebook, as_version=4)
    with tempfile.TemporaryDirectory(prefix="flair_nbddp-notebook-") as temporary:
        temporary = Path(temporary).resolve()
        workdir = temporary / notebook.stem
        workdir.mkdir()
        private = {"FLAIR_NBDDP_RUNS": str(temporary / "runs"), "FLAIR_NBDDP_HOME": str(temporary / "home"),
                   "FLAIR_NBDDP_CLAIMS": str(temporary / "claims")}  # fmt: skip
        saved = {name: os.environ.get(name) for name in [*ENVIRONMENT, *private]}
        os.environ.update(ENVIRONMENT, **private)  # the kernel inherits them: its run ledger and studies are new
        started = time.monotonic()
        try:
            NotebookClient(
                content, timeout=CELL_TIMEOUT_SECONDS, kernel_name="python3", resources={"metadata": {"path": workdir}},
                store_widget_state=False, record_timing=False,
            ).execute()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        seconds = time.monotonic() - started
        clean(content, [str(workdir / "work"), str(workdir), str(temporary)])
    nbformat.write(content, out)
    return seconds


def clean(content: dict, temporary_paths: list[str]) -> None:
    """Drop saved widget state, widget views and run times; write the temporary paths as ``work/`` and the packages'
    paths as ``site-packages/`` in every output; one output for the lines a cell printed one after the other to one
    stream."""
    content["metadata"].pop("widgets", None)
    # this machine's paths as a user's installation shows them: the temporary directory (longest first) as work/,
    # this interpreter's packages and this checkout's package as site-packages/
    neutral_paths = {path: "work/" for path in temporary_paths}
    neutral_paths[sysconfig.get_paths()["purelib"]] = "site-packages/"
    neutral_paths[str(ROOT / "flair_nbddp")] = "site-packages/flair_nbddp/"
    pattern = re.compile("|".join(re.escape(path) + r"/?" for path in neutral_paths))

    def neutral(value: object) -> object:
        if isinstance(value, str):
            return pattern.sub(lambda found: neutral_paths[found.group(0).rstrip("/")], value)
        if isinstance(value, list):
            return [neutral(item) for item in value]
        if isinstance(value, dict):
            return type(value)({key: neutral(item) for key, item in value.items()})
        return value

    for cell in content["cells"]:
        if cell["cell_type"] != "code":
            continue
        cell["metadata"].pop("execution", None)  # when it ran: true of one run only
        outputs = []
        for output in cell["outputs"]:
            data = output.get("data")
            if data is not None and WIDGET_VIEW in data:
                data.pop(WIDGET_VIEW)
                if "text/html" not in data:  # a widget without a static rendering: its text is ipywidgets' repr
                    continue
                output.get("metadata", {}).pop(WIDGET_VIEW, None)
            output = neutral(output)
            previous = outputs[-1] if outputs else None
            if previous and output["output_type"] == previous["output_type"] == "stream" and (
                output["name"] == previous["name"]
            ):
                previous["text"] = "".join(previous["text"]) + "".join(output["text"])
            else:
                outputs.append(output)
        cell["outputs"] = outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to run (default: all of notebooks/)")
    parser.add_argument("--out", type=Path, help="write the executed notebooks to this directory instead")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    for notebook in notebooks:
        notebook = notebook.resolve()
        out = (args.out / notebook.name) if args.out else notebook
        print(f"{notebook.name}: running ...", flush=True)
        seconds = execute(notebook, out)
        print(f"{notebook.name}: {seconds:.0f} s, {out.stat().st_size / 1024:.0f} KiB -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
