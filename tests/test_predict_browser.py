"""A predict call's progress bar in a real JupyterLab and Chromium: texts done, texts per second and the time left
while it runs; a call made with ``wait=False`` leaves the cell free, its Stop button stops every rank, the call ends
with the finished prefix (the file holds exactly those rows), and no worker is left. A call that holds its cell
says that the kernel's interrupt stops it."""

import json
import re

import pytest
from browser import lab, needs_browser, page, run_notebook, screenshot, workers_under  # noqa: F401 - fixtures

SETUP_CELL = """\
import tempfile
from pathlib import Path
import flair_nbddp
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

folder = Path(tempfile.mkdtemp())
corpus = sentiment_corpus(n_train=8, n_dev=2, n_test=2)
model = TextClassifier(TransformerDocumentEmbeddings(tiny_transformer(folder / "tiny")), label_type="sentiment",
                       label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))
texts = [f"review number {i} " + "good " * (i % 9) for i in range(20000)]"""
PREDICT_CELL = """\
call = flair_nbddp.predict(model, texts, output="predict-part.jsonl", mini_batch_size=1, processes=2, device="cpu",
                           wait=False)"""
HOLDING_CELL = """\
predictions = flair_nbddp.predict(model, texts[:4000], mini_batch_size=1, processes=2, device="cpu")
print("OUTCOME", predictions.status, predictions.done)"""


@needs_browser
@pytest.mark.browser
def test_the_progress_bar_shows_the_pace_and_its_stop_button_ends_a_call_that_left_the_cell_free(lab, page):
    run_notebook(page, lab, "predict", [SETUP_CELL, PREDICT_CELL])
    view = ".nbddp-predict"
    page.wait_for_selector(f"{view}:has-text('texts/s')", timeout=120_000)
    page.wait_for_selector(f"{view}:has-text('left')", timeout=30_000)
    screenshot(page, "predict-running", view)
    assert re.search(r"[\d,]+ / 20,000 texts", page.inner_text(view))
    page.wait_for_function(  # a thousand texts done or more: past the first windows of sorted chunks
        "() => /\\d,\\d{3} \\/ 20,000/.test(document.querySelector('.nbddp-predict').innerText)", timeout=60_000
    )

    page.click(f"{view} button:has-text('Stop')")
    page.wait_for_selector(f"{view}:has-text('stopped:')", timeout=60_000)
    screenshot(page, "predict-stopped", view)
    done = int(re.search(r"stopped: ([\d,]+) of 20,000", page.inner_text(view)).group(1).replace(",", ""))
    rows = (lab.root_dir / "predict-part.jsonl").read_text().splitlines()
    assert 0 < done < 20000 and len(rows) == done  # the file holds exactly the finished prefix
    assert [json.loads(row)["text"] for row in rows[:3]] == ["review number 0 ", "review number 1 good ",
                                                            "review number 2 good good "]
    assert workers_under(lab.process.pid) == []


@needs_browser
@pytest.mark.browser
def test_a_call_that_holds_its_cell_says_the_interrupt_stops_it(lab, page):
    run_notebook(page, lab, "predict-holding", [SETUP_CELL, HOLDING_CELL])
    page.wait_for_selector(".nbddp-predict:has-text('interrupt the kernel')", timeout=120_000)
    assert not page.is_visible(".nbddp-predict button:has-text('Stop')")
    page.wait_for_selector("text=OUTCOME finished 4000", timeout=180_000)
    assert "finished: 4,000 of 4,000" in page.inner_text(".nbddp-predict")
