"""A sweep's widget in a real JupyterLab and Chromium: two trials at once in its table and curves, Stop clicked,
both trials stopped with their models, nothing left running."""

import pytest
from browser import lab, needs_browser, page, run_notebook, screenshot, workers_under  # noqa: F401 - fixtures

SWEEP_CELL = """\
import optuna
import flair_nbddp
from flair.embeddings import DocumentRNNEmbeddings, OneHotEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from flair_nbddp.synthetic import sentiment_corpus

corpus = sentiment_corpus(n_train=120, n_dev=20, n_test=20, seed=2)

def train(corpus, lr):
    words = OneHotEmbeddings.from_corpus(corpus, embedding_length=16, min_freq=1)
    model = TextClassifier(DocumentRNNEmbeddings([words], hidden_size=8), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))
    return ModelTrainer(model, corpus).train(f"out-{lr}", max_epochs=40, mini_batch_size=16, learning_rate=lr,
                                             multi_gpu=True)

space = {"lr": optuna.distributions.CategoricalDistribution([0.05, 0.5])}
result = flair_nbddp.sweep(train, (corpus,), space=space, n_trials=4, device="cpu", wait=False)"""


@needs_browser
@pytest.mark.browser
def test_the_sweep_widget_shows_trials_side_by_side_and_its_stop_button_ends_the_sweep(lab, page):
    run_notebook(page, lab, "sweep", [SWEEP_CELL])
    sweep = ".nbddp-sweep"
    page.wait_for_selector(f"{sweep}:has-text('2 running of 4 (2 at a time)')", timeout=90_000)
    page.wait_for_function(  # both running trials' curves drawn (besides the best-so-far chart)
        "() => document.querySelectorAll('.nbddp-sweep svg polyline').length >= 2", timeout=60_000
    )
    screenshot(page, "sweep-running", sweep)
    assert page.locator(f"{sweep} table tr").count() == 3  # the header and two trials, each on its lane
    assert page.locator(f"{sweep} td:has-text('CPU')").count() == 2

    page.click(f"{sweep} button:has-text('Stop')")
    page.wait_for_selector(f"{sweep}:has-text('2 stopped of 4')", timeout=60_000)
    screenshot(page, "sweep-stopped", sweep)
    assert page.is_disabled(f"{sweep} button:has-text('Stop')")
    assert page.locator(f"{sweep} td:has-text('running')").count() == 0  # no trial started after the Stop
    assert workers_under(lab.process.pid) == []
