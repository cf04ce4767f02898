"""The parity jobs: one training function that flair's own launcher and the kit both run.

``train(corpus, kind, model_path, base_path)`` trains one of ``KINDS`` with ``multi_gpu=True`` and returns what
parity compares, as exact floats: every epoch's train loss, dev loss and dev score, the learning rate each epoch
ended with, the test score, and a digest of the trained weights. flair's lifecycle runs it through
``flair_own_launcher.py`` (each rank seeds, builds its corpus and trains); the kit ships the corpus built once.
"""

from __future__ import annotations

import hashlib

KINDS = ("classifier", "fine_tune", "tagger", "tagger_fine_tune")
SEED = 42
EPOCHS = 4
BATCH = 8
SIZES = (96, 37, 29)  # train, dev, test: 5 and 4 evaluation batches of 8, the last short; uneven shares on 2 ranks
RECORDED = ("train/loss", "dev/loss", "dev/score", "learning_rate")


def build_corpus(kind: str):
    """The same corpus on every call (each of flair's ranks builds its own; the kit builds it once)."""
    from flair_nbddp.synthetic import ner_corpus, sentiment_corpus

    train, dev, test = SIZES
    if kind in ("tagger", "tagger_fine_tune"):
        return ner_corpus(n_train=train, n_dev=dev, n_test=test, seed=5)
    return sentiment_corpus(n_train=train, n_dev=dev, n_test=test, words=(6, 20), seed=5)


def train(corpus, kind: str, model_path: str, base_path: str) -> dict:
    """Train ``kind`` on ``corpus`` as a user's function would, and return the figures parity compares.

    - ``classifier``: a ``TextClassifier`` on ``DocumentRNNEmbeddings`` with dropout, SGD
      through ``train`` with annealing after one bad epoch;
    - ``fine_tune``: a ``TextClassifier`` on the tiny transformer (dropout 0.1), ``fine_tune`` with its linear
      schedule and warm-up;
    - ``tagger``: a ``SequenceTagger`` (BiLSTM-CRF, flair's dropouts) on span labels, through ``train``;
    - ``tagger_fine_tune``: a ``SequenceTagger`` (linear, no CRF) on the tiny transformer's word embeddings (each
      word's first sub-token), ``fine_tune``.
    """
    from flair.embeddings import (
        DocumentRNNEmbeddings,
        OneHotEmbeddings,
        TransformerDocumentEmbeddings,
        TransformerWordEmbeddings,
    )
    from flair.models import SequenceTagger, TextClassifier
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin

    figures: dict[str, list[float]] = {name: [] for name in RECORDED}

    class Record(TrainerPlugin):
        @TrainerPlugin.hook
        def metric_recorded(self, record) -> None:
            if str(record.name) in ("train/loss", "dev/loss", "dev/score"):
                figures[str(record.name)].append(float(record.value))

        @TrainerPlugin.hook
        def after_training_epoch(self, epoch, **_) -> None:
            figures["learning_rate"].append(float(self.trainer.optimizer.param_groups[0]["lr"]))

    options = dict(
        max_epochs=EPOCHS, mini_batch_size=BATCH, eval_batch_size=BATCH, multi_gpu=True, plugins=[Record()]
    )
    if kind == "tagger":
        embeddings = OneHotEmbeddings.from_corpus(corpus, embedding_length=16, min_freq=1)
        model = SequenceTagger(
            hidden_size=16, embeddings=embeddings, tag_dictionary=corpus.make_label_dictionary("ner"), tag_type="ner"
        )
        scores = ModelTrainer(model, corpus).train(base_path, learning_rate=0.1, **options)
    elif kind == "tagger_fine_tune":
        embeddings = TransformerWordEmbeddings(model_path, fine_tune=True, layers="-1", subtoken_pooling="first")
        model = SequenceTagger(
            hidden_size=16, embeddings=embeddings, tag_dictionary=corpus.make_label_dictionary("ner", add_unk=False),
            tag_type="ner", use_crf=False, use_rnn=False, reproject_embeddings=False,
        )
        scores = ModelTrainer(model, corpus).fine_tune(base_path, learning_rate=5e-3, **options)
    elif kind == "classifier":
        words = OneHotEmbeddings.from_corpus(corpus, embedding_length=16, min_freq=1)
        # dropout only: flair 0.15.1 cannot save its word or locked dropout (to_params reads a .p they lack)
        document = DocumentRNNEmbeddings([words], hidden_size=16, dropout=0.3)
        model = TextClassifier(
            document, label_type="sentiment", label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False)
        )
        trainer = ModelTrainer(model, corpus)
        scores = trainer.train(base_path, learning_rate=0.05, patience=0, anneal_factor=0.5, **options)
    else:
        model = TextClassifier(
            TransformerDocumentEmbeddings(model_path, fine_tune=True),
            label_type="sentiment",
            label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
        )
        scores = ModelTrainer(model, corpus).fine_tune(base_path, learning_rate=5e-3, **options)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    return {**figures, "test/score": float(scores["test_score"]), "weights": digest.hexdigest()}


def flair_main(kinds: list[str], model_path: str, base_path: str) -> dict:
    """flair's way, for each of ``kinds``: every rank seeds, then builds its own corpus and trains."""
    import flair

    figures = {}
    for kind in kinds:
        flair.set_seed(SEED)
        figures[kind] = train(build_corpus(kind), kind, model_path, f"{base_path}/{kind}")
    return figures


def kit_train(corpus, kind: str, model_path: str, base_path: str) -> dict:
    """The kit's way (the corpus built once and shipped, the kit's seed), with what the run's defaults did: the
    evaluation batches each rank computed in shared-out evaluations, and whether the corpus arrived lazy."""
    import torch.distributed as dist

    from flair_nbddp.worker import distributed_eval

    figures = train(corpus, kind, model_path, base_path)
    computed: list = [None] * dist.get_world_size()
    dist.all_gather_object(computed, distributed_eval.batches_computed())
    lazy = type(getattr(corpus.train, "datapoints", None)).__name__ == "LazyDataPoints"
    return {"figures": figures, "batches_computed": computed, "lazy": lazy}
