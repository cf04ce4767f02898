"""Make the documentation's pictures of the live dashboard and the training panel, in a real JupyterLab.

Serves a scratch directory with JupyterLab on 127.0.0.1, opens it in headless Chromium (Debian's
``/usr/bin/chromium``, driven by Playwright: ``apt-get install chromium``, ``pip install playwright``) through the
test suite's harness (``tests/browser.py``), and trains on 2 CPU processes (gloo) whatever the machine has:

- ``dashboard.png``: ``launch`` of a small text classifier, 4 epochs, photographed once it has finished training
  (the frozen dashboard: curves, per-epoch table, ranks, output);
- ``panel.png``: a ``TrainingPanel`` after its Train button was clicked and the run has finished.

Each picture is cropped to the widget (Playwright's ``element.screenshot()``), about 1000 px wide (the dashboard
is at most 980). The runs are seeded (``FLAIR_NBDDP_SEED``) and recorded in a private run ledger
(``FLAIR_NBDDP_HOME`` in a scratch directory), one for each picture, so the panel's table shows only its own run.
One JupyterLab at a time; about two minutes on 2 CPU cores::

    .venv/bin/python docs/screenshots.py                 # writes docs/images/dashboard.png and panel.png
    .venv/bin/python docs/screenshots.py --out /tmp/pics --width 1200
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the browser harness and its kernel environment

from browser import MISSING, chromium_page, jupyter_lab, open_notebook, run_all_cells  # noqa: E402

SETUP_CELL = """\
import flair_nbddp
from flair_nbddp.demo import train_classifier
from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

model_path = tiny_transformer("tiny-model")
corpus = sentiment_corpus(n_train=600, n_dev=60, n_test=60, words=(60, 120), seed=3)"""
TRAIN_CELL = """\
result = flair_nbddp.launch(train_classifier, args=(corpus, model_path, "out"),
                            kwargs={"max_epochs": 4, "mini_batch_size": 8, "return_model": False})"""
PANEL_CELL = """\
from flair_nbddp import TrainingPanel
from flair_nbddp.demo import train_classifier
from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

panel = TrainingPanel(
    train_classifier,
    corpus=sentiment_corpus(n_train=600, n_dev=60, n_test=60, words=(60, 120), seed=3),
    params={"learning_rate": 5e-3, "max_epochs": (1, 10, 3), "mini_batch_size": [8, 16, 32], "return_model": False},
    fixed={"model_path": tiny_transformer("tiny-model"), "base_path": "out"},
)
panel"""
ENVIRONMENT = {"FLAIR_NBDDP_DEVICE": "cpu", "FLAIR_NBDDP_PROCESSES": "2", "FLAIR_NBDDP_SEED": "7"}


def _fit_width(page, selector: str, width: int) -> None:
    """Resize the browser window until the element ``selector`` is about ``width`` px wide (the widgets reflow),
    or as wide as it gets (the dashboard stops at 980 px)."""
    before = None
    for _ in range(5):
        box = page.locator(selector).first.bounding_box()
        if box is None or abs(box["width"] - width) < 8 or box["width"] == before:
            return
        before = box["width"]
        size = page.viewport_size
        page.set_viewport_size({"width": int(size["width"] + width - box["width"]), "height": size["height"]})
        time.sleep(0.5)


def _settle(page) -> None:
    """Let the last redraws land, with the mouse out of the way."""
    time.sleep(1.5)
    page.mouse.move(0, 0)  # no hover highlight on the picture


def dashboard(lab, out: Path, width: int) -> Path:
    """Train with ``launch`` in a notebook and photograph its dashboard once the run has finished."""
    lab.write_notebook("dashboard", [SETUP_CELL, TRAIN_CELL])
    with chromium_page(width=width + 400, height=1400) as page:
        open_notebook(page, lab, "dashboard")
        run_all_cells(page)
        page.wait_for_selector(".nbddp-dashboard", timeout=120_000)
        _fit_width(page, ".nbddp-dashboard", width)
        page.wait_for_selector(".nbddp-status:has-text('finished')", timeout=300_000)
        page.wait_for_selector(".nbddp-outcome", state="visible", timeout=30_000)
        _fit_width(page, ".nbddp-dashboard", width)
        _settle(page)
        path = out / "dashboard.png"
        page.locator(".nbddp-dashboard").first.screenshot(path=str(path))
    return path


def panel(lab, out: Path, width: int) -> Path:
    """Show a ``TrainingPanel``, click Train, and photograph the panel once its run has finished."""
    lab.write_notebook("panel", [PANEL_CELL])
    with chromium_page(width=width + 400, height=1600) as page:
        open_notebook(page, lab, "panel")
        run_all_cells(page)
        page.wait_for_selector(".nbddp-panel-status:has-text('ready')", timeout=120_000)
        _fit_width(page, ".nbddp-panel", width)
        page.click(".nbddp-train")
        page.wait_for_selector(".nbddp-panel .nbddp-dashboard", timeout=60_000)
        page.wait_for_selector(".nbddp-panel-status:has-text('finished')", timeout=300_000)
        _fit_width(page, ".nbddp-panel", width)
        _settle(page)
        path = out / "panel.png"
        page.locator(".nbddp-panel").first.screenshot(path=str(path))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="where the PNGs go")
    parser.add_argument("--width", type=int, default=1000, help="the widgets' width in pixels")
    parser.add_argument("--only", choices=("dashboard", "panel"), help="make one picture only")
    args = parser.parse_args(argv)
    if MISSING is not None:
        sys.exit(f"cannot take screenshots: {MISSING}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, take in (("dashboard", dashboard), ("panel", panel)):
        if args.only not in (None, name):
            continue
        # a JupyterLab and a run ledger of its own for each picture, one after the other
        with tempfile.TemporaryDirectory(prefix=f"nbddp-screenshots-{name}-") as scratch:
            home, root = Path(scratch) / "home", Path(scratch) / "lab"
            root.mkdir()
            with jupyter_lab(root, env={**ENVIRONMENT, "FLAIR_NBDDP_HOME": str(home)}) as lab:
                print(take(lab, args.out, args.width))
                lab.shut_down_kernels()  # the kernel and its workers end before the next picture


if __name__ == "__main__":
    main()
