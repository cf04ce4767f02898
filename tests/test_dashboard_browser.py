"""The dashboard in a real JupyterLab and Chromium: it renders, advances while 2 CPU processes train, ends finished."""

import time

import nbformat
import pytest
from browser import (  # noqa: F401 - fixtures
    lab,
    needs_browser,
    page,
    run_notebook,
    save_notebook,
    screenshot,
)

SETUP_CELL = """\
import flair_nbddp
from flair_nbddp.demo import train_classifier
from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

model_path = tiny_transformer("tiny-model")
corpus = sentiment_corpus(n_train=600, n_dev=40, n_test=40, words=(60, 120), seed=3)"""
TRAIN_CELL = """\
result = flair_nbddp.launch(train_classifier, args=(corpus, model_path, "out"),
                            kwargs={"max_epochs": 3, "mini_batch_size": 8, "return_model": False})"""
PROGRESS_PERCENT = "el => parseFloat(el.style.width)"


def _progress_until_finished(page, timeout: float) -> list[float]:
    """The progress bar's width in percent, read every quarter second until the status says the run ended.

    The first time the bar is past a third, the dashboard is photographed mid-run.
    """
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.append(page.eval_on_selector(".nbddp-progress .progress-bar", PROGRESS_PERCENT))
        if 33 < seen[-1] < 100 and not any(33 < value < 100 for value in seen[:-1]):
            screenshot(page, "dashboard-running", ".nbddp-dashboard")
        status = page.inner_text(".nbddp-status")
        if "finished" in status or "failed" in status:  # the bar read before this may be a refresh older
            return [*seen, page.eval_on_selector(".nbddp-progress .progress-bar", PROGRESS_PERCENT)]
        time.sleep(0.25)
    raise AssertionError(f"the run did not end within {timeout} s; progress seen: {seen}")


@needs_browser
@pytest.mark.browser
def test_dashboard_renders_advances_and_finishes_in_jupyterlab(lab, page):
    run_notebook(page, lab, "train", [SETUP_CELL, TRAIN_CELL])
    page.wait_for_selector(".nbddp-dashboard", timeout=60_000)

    seen = _progress_until_finished(page, timeout=90)
    page.wait_for_selector(".nbddp-outcome", state="visible")  # finish() froze it with the scores
    screenshot(page, "dashboard-notebook")
    screenshot(page, "dashboard", ".nbddp-dashboard")

    status = page.inner_text(".nbddp-status")
    assert "finished" in status, f"{status!r}\n{lab.log_tail()}"
    assert seen == sorted(seen), f"progress went backwards: {seen}"
    assert len({value for value in seen if 0 < value < 100}) >= 2, f"no live progress seen: {seen}"
    assert seen[-1] == 100
    assert "By class:" in page.inner_text(".nbddp-log")  # the tail of flair's final evaluation

    save_notebook(page)  # the saved output describes the end for readers without the live widget
    outputs = nbformat.read(lab.root_dir / "train.ipynb", as_version=4).cells[1].outputs
    displays = [output for output in outputs if output.output_type == "display_data"]
    assert len(displays) == 1, outputs
    output = displays[0]
    assert output.data["text/plain"].startswith("flair_nbddp: finished in")
    assert "dev/score" in output.data["text/plain"] and "nbddp-summary" in output.data["text/html"]

