"""The training panel in a real JupyterLab and Chromium: click Train, watch it train, click Stop, see it stopped."""

import time

import pytest
from browser import lab, needs_browser, page, run_notebook, screenshot, workers_under  # noqa: F401 - fixtures

PANEL_CELL = """\
from flair_nbddp.notebook.panel import TrainingPanel
from flair_nbddp.demo import train_classifier
from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

panel = TrainingPanel(
    train_classifier,
    corpus=sentiment_corpus(400),
    params={"learning_rate": 5e-3, "max_epochs": (1, 30, 20), "mini_batch_size": [4, 8, 16], "return_model": False},
    fixed={"model_path": tiny_transformer("tiny-model"), "base_path": "out"},
)
panel"""
PROGRESS_PERCENT = "el => parseFloat(el.style.width)"


def _progress_until(page, percent: float, timeout: float) -> list[float]:
    """The dashboard's progress bar width, read every quarter second until it passes ``percent``."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.append(page.eval_on_selector(".nbddp-progress .progress-bar", PROGRESS_PERCENT))
        if seen[-1] >= percent:
            return seen
        time.sleep(0.25)
    raise AssertionError(f"training did not reach {percent}% within {timeout} s; progress seen: {seen}")


@needs_browser
@pytest.mark.browser
def test_train_and_stop_clicked_in_jupyterlab(lab, page):
    run_notebook(page, lab, "panel", [PANEL_CELL])
    page.wait_for_selector(".nbddp-panel-status:has-text('ready')", timeout=90_000)
    screenshot(page, "panel-ready", ".nbddp-panel")

    page.click(".nbddp-train")
    page.wait_for_selector(".nbddp-stop:enabled", timeout=10_000)
    page.wait_for_selector(".nbddp-panel .nbddp-dashboard", timeout=10_000)  # the browser draws it as it comes
    assert page.is_disabled(".nbddp-train")
    assert page.is_disabled(".nbddp-panel .widget-dropdown select")  # the form is locked while training
    seen = _progress_until(page, percent=12, timeout=90)
    page.wait_for_selector(".nbddp-panel-status:has-text('running')")
    screenshot(page, "panel-running", ".nbddp-panel")

    page.click(".nbddp-stop")
    page.wait_for_selector(".nbddp-panel-status:has-text('stopped')", timeout=60_000)
    screenshot(page, "panel-stopped-notebook")
    screenshot(page, "panel", ".nbddp-panel")

    status = page.inner_text(".nbddp-panel-status")
    assert "model saved" in status, f"{status!r}\n{lab.log_tail()}"
    assert seen == sorted(seen) and len({value for value in seen if 0 < value < 100}) >= 2, f"no live progress: {seen}"
    assert "stopped" in page.inner_text(".nbddp-history") and "stopped" in page.inner_text(".nbddp-status")
    assert page.is_enabled(".nbddp-train") and page.is_disabled(".nbddp-stop")
    assert workers_under(lab.process.pid) == []
