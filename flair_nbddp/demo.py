"""The demo job: a text classifier trained on every device through the launcher.

``python -m flair_nbddp demo`` runs it offline on a generated corpus and a tiny transformer; ``--real``
switches to IMDB and ``distilbert-base-uncased`` (downloads both; for users online, ideally on GPUs).

Example::

    from flair_nbddp.demo import train_classifier
    launch_distributed(train_classifier, corpus, model_path, base_path="out")
    # {'test_score': 0.9, 'model': TextClassifier(...)}
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

REAL_MODEL = "distilbert-base-uncased"


def train_classifier(
    corpus: Any,
    model_path: str,
    base_path: str,
    *,
    label_type: str = "sentiment",
    max_epochs: int = 4,
    mini_batch_size: int = 16,
    mini_batch_chunk_size: int | None = None,
    learning_rate: float = 5e-3,
    return_model: bool = True,
) -> dict:
    """Fine-tune a ``TextClassifier`` over ``model_path`` with ``multi_gpu=True``; runs on every rank.

    Returns flair's training result (``test_score``...) and, with ``return_model``, the trained model.
    """
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    embeddings = TransformerDocumentEmbeddings(model_path, fine_tune=True)
    dictionary = corpus.make_label_dictionary(label_type, add_unk=False)
    classifier = TextClassifier(embeddings, label_type=label_type, label_dictionary=dictionary)
    result = ModelTrainer(classifier, corpus).fine_tune(
        base_path,
        max_epochs=max_epochs,
        mini_batch_size=mini_batch_size,
        mini_batch_chunk_size=mini_batch_chunk_size,
        learning_rate=learning_rate,
        multi_gpu=True,
    )
    out = {"test_score": result["test_score"]}
    if return_model:
        out["model"] = classifier
    return out


def run_demo(
    processes: int | None = None,
    device: str | None = None,
    epochs: int = 4,
    documents: int = 400,
    real: bool = False,
    workdir: str | None = None,
) -> Any:
    """Build a corpus here, train on every device through :func:`flair_nbddp.launch`, print the score.

    Returns the :class:`~flair_nbddp.RunResult`.
    """
    # here, not at the top: the workers import this module for train_classifier, and need no launcher
    from .api import launch
    from .synthetic import sentiment_corpus, tiny_transformer

    workdir = Path(workdir or tempfile.mkdtemp(prefix="flair_nbddp-demo-"))
    if real:  # the real thing: downloads IMDB (~85 MB) and distilbert-base-uncased (~260 MB)
        from flair.datasets import IMDB

        corpus, model_path, label_type, learning_rate = IMDB(), REAL_MODEL, "sentiment", 5e-5
    else:
        corpus = sentiment_corpus(n_train=documents, n_dev=documents // 8, n_test=documents // 8, seed=0)
        model_path, label_type, learning_rate = tiny_transformer(workdir / "tiny-transformer"), "sentiment", 5e-3
    print(f"corpus: {corpus}")
    started = time.time()
    result = launch(
        train_classifier,
        args=(corpus, model_path, str(workdir / "training")),
        kwargs={"label_type": label_type, "max_epochs": epochs, "learning_rate": learning_rate},
        processes=processes,
        device=device,
    )
    from flair.data import Sentence

    sentence = Sentence("a wonderful and gripping film with a superb cast")
    result.value["model"].predict(sentence)
    print(
        f"trained on {result.world_size} × {result.device_type} ({result.backend}) in {time.time() - started:.1f} s; "
        f"first batch after {result.time_to_first_batch:.1f} s; {result.samples_per_second:.0f} samples/s"
    )
    print(f"per-epoch train loss: {[round(v, 4) for _, v in result.history('train/loss')]}")
    print(f"returned model predicts: {sentence.get_label(label_type).value} for {sentence.to_original_text()!r}")
    print(f"test score: {result.value['test_score']:.4f}")
    print(f"logs: {result.run_dir}")
    return result
