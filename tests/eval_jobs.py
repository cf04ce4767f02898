"""Corpora, models and the job for the distributed-evaluation tests (importable by reference in the workers).

Every builder is deterministic: each rank builds the same corpus and, under the kit's seed, the same model.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from flair.models import TextClassifier

KINDS = ("text", "multi_label", "tagger_crf", "tagger", "pair", "regression", "relation")
BATCH = 4
TEST_SIZE = 37  # 10 batches of 4 (the last of 1): uneven shares on 2 ranks
# (train size, epochs, learning rate) per kind: enough for varied predictions, which make the equality telling
TRAINING = {"tagger_crf": (48, 8, 0.1), "tagger": (48, 8, 0.1), "relation": (48, 8, 0.1)}
TRANSFORMER_TRAINING = (160, 6, 5e-3)
TRANSFORMER_KINDS = ("text", "multi_label", "pair", "regression")


def _sentiment(n: int, seed: int) -> list:
    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(n_train=n, n_dev=0, n_test=0, words=(6, 14), seed=seed)
    return list(corpus.train)


def _dataset(points: list):
    from flair.datasets import FlairDatapointDataset

    return FlairDatapointDataset(points)


def _corpus(make, train_size: int):
    from flair.data import Corpus

    train, dev, test = (make(n, seed) for seed, n in enumerate((train_size, 13, TEST_SIZE), 1))
    return Corpus(_dataset(train), _dataset(dev), _dataset(test), sample_missing_splits=False)


def _multi_label(n: int, seed: int) -> list:
    sentences = _sentiment(n, seed)
    for sentence in sentences:
        sentence.add_label("tags", sentence.get_label("sentiment").value)
        sentence.add_label("tags", "LONG" if len(sentence) > 10 else "SHORT")
    return sentences


def _pairs(n: int, seed: int) -> list:
    from flair.data import TextPair

    first, second = _sentiment(n, seed), _sentiment(n, seed + 100)
    pairs = []
    for a, b in zip(first, second):
        pair = TextPair(a, b)
        same = a.get_label("sentiment").value == b.get_label("sentiment").value
        pair.add_label("pair", "SAME" if same else "DIFFERENT")
        pairs.append(pair)
    return pairs


def _scored(n: int, seed: int) -> list:
    rng = random.Random(seed)
    sentences = _sentiment(n, seed)
    for sentence in sentences:
        base = 0.8 if sentence.get_label("sentiment").value == "POSITIVE" else 0.2
        sentence.add_label("score", str(round(base + rng.uniform(-0.1, 0.1), 3)))
    return sentences


def _ner(n: int, seed: int) -> list:
    from flair_nbddp.synthetic import ner_corpus

    return list(ner_corpus(n_train=n, n_dev=0, n_test=0, seed=seed).train)


def _relations(n: int, seed: int) -> list:
    from flair.data import Relation

    sentences = _ner(n, seed)
    for sentence in sentences:
        spans = sentence.get_spans("ner")
        people = [span for span in spans if span.tag == "PER"]
        places = [span for span in spans if span.tag == "LOC"]
        if people and places:
            Relation(people[0], places[0]).add_label("relation", "VISITED")
    return sentences


def build(kind: str, model_path: str):
    """``(corpus, model, gold label type)`` of one kind of model."""
    from flair.data import Dictionary
    from flair.embeddings import (
        DocumentPoolEmbeddings,
        OneHotEmbeddings,
        TransformerDocumentEmbeddings,
    )
    from flair.models import (
        RelationClassifier,
        SequenceTagger,
        TextClassifier,
        TextPairClassifier,
        TextRegressor,
    )

    def document_embeddings():
        return TransformerDocumentEmbeddings(model_path, fine_tune=True)

    size = TRAINING.get(kind, TRANSFORMER_TRAINING)[0]

    if kind in ("text", "multi_label"):
        label_type = "sentiment" if kind == "text" else "tags"
        corpus = _corpus(_sentiment if kind == "text" else _multi_label, size)
        model = TextClassifier(
            document_embeddings(), label_type=label_type, multi_label=kind == "multi_label",
            label_dictionary=corpus.make_label_dictionary(label_type, add_unk=False),
        )  # fmt: skip
    elif kind.startswith("tagger"):
        label_type, corpus = "ner", _corpus(_ner, size)
        model = SequenceTagger(
            hidden_size=16, embeddings=OneHotEmbeddings.from_corpus(corpus, embedding_length=16, min_freq=1),
            tag_dictionary=corpus.make_label_dictionary("ner"), tag_type="ner", use_crf=kind == "tagger_crf",
            use_rnn=kind == "tagger_crf",
        )  # fmt: skip
    elif kind == "pair":
        label_type, corpus = "pair", _corpus(_pairs, size)
        model = TextPairClassifier(
            document_embeddings(), label_type="pair", label_dictionary=corpus.make_label_dictionary("pair", add_unk=False)
        )
    elif kind == "regression":
        label_type, corpus = "score", _corpus(_scored, size)
        model = TextRegressor(document_embeddings(), label_name="score")
    else:
        # pooled one-hot words, the entity markers among them, so the direction of a pair can be learnt
        label_type, corpus = "relation", _corpus(_relations, size)
        words = Dictionary(add_unk=True)
        for word in [token.text for sentence in corpus.get_all_sentences() for token in sentence] + [
            f"[{slash}{end}-{tag}]" for slash in ("", "/") for end in ("HEAD", "TAIL") for tag in ("PER", "LOC")
        ]:
            words.add_item(word)
        model = RelationClassifier(
            DocumentPoolEmbeddings(OneHotEmbeddings(words, embedding_length=16), fine_tune_mode="none"),
            label_dictionary=corpus.make_label_dictionary("relation"), label_type="relation", entity_label_types="ner",
        )  # fmt: skip
        corpus = model.transform_corpus(corpus)
    return corpus, model, label_type


def splits(corpus) -> dict:
    """The splits each kind is evaluated on: the whole (odd-sized) test split, one sentence, none."""
    test = [corpus.test[i] for i in range(len(corpus.test))]
    return {"test": test, "one": test[:1], "none": []}


def evaluated(model, points: list, label_type: str, out_path):
    """``model.evaluate`` of ``points``, or the error it raised as ``(type name, message)`` (flair's
    ``TextRegressor`` cannot evaluate fewer than 2 points: that must be the same distributed)."""
    try:
        return model.evaluate(points, gold_label_type=label_type, out_path=out_path, mini_batch_size=BATCH)
    except Exception as error:  # noqa: BLE001 - compared with what one process raises
        return type(error).__name__, str(error)


def summary(result) -> tuple:
    """What must be identical: main score, scores, detailed results (or the error)."""
    return result if isinstance(result, tuple) else (result.main_score, result.scores, result.detailed_results)


def evaluate_everywhere(kinds: tuple, model_path: str, base_path: str) -> dict:
    """On every rank: train each kind one epoch (the trainer's dev evaluations are shared out too), then evaluate
    it on each split; rank 0 returns the models, results and files, with what every rank got and computed, and
    whether each evaluation left the random streams where flair's own leaves them."""
    import torch.distributed as dist
    from flair.trainers import ModelTrainer

    from flair_nbddp.worker import distributed_eval, random_streams

    rank, world = dist.get_rank(), dist.get_world_size()
    returned = {}
    for kind in kinds:
        corpus, model, label_type = build(kind, model_path)
        base = Path(base_path) / kind
        _, epochs, learning_rate = TRAINING.get(kind, TRANSFORMER_TRAINING)
        trainer = ModelTrainer(model, corpus)
        before_training = distributed_eval.batches_computed()
        train = trainer.fine_tune if kind in TRANSFORMER_KINDS else trainer.train  # AdamW for transformers, or SGD
        train(
            base / "training", max_epochs=epochs, mini_batch_size=8, eval_batch_size=BATCH, learning_rate=learning_rate,
            multi_gpu=True,
        )  # fmt: skip
        model.eval()
        trained: list = [None] * world
        dist.all_gather_object(trained, distributed_eval.batches_computed() - before_training)
        outcome = {
            "model": model, "results": {}, "files": {}, "written": {}, "every_rank": {}, "computed_here": {},
            "streams_as_flairs": {}, "computed_in_training": trained, "epochs": epochs,
            "sizes": (len(corpus.dev), len(corpus.test)),
        }  # fmt: skip
        for name, points in splits(corpus).items():
            out = base / f"rank{rank}-{name}.tsv"
            before = distributed_eval.batches_computed()
            streams = random_streams.snapshot()
            result = evaluated(model, points, label_type, out)
            here = distributed_eval.batches_computed() - before
            seen: list = [None] * world
            as_flairs = _streams_left_as_flairs(model, points, label_type, streams)
            dist.all_gather_object(seen, (summary(result), here, as_flairs))
            outcome["results"][name] = result
            outcome["written"][name] = [r for r in range(world) if (base / f"rank{r}-{name}.tsv").exists()]
            outcome["files"][name] = out.read_text() if out.exists() else None
            outcome["every_rank"][name] = [entry[0] for entry in seen]
            outcome["computed_here"][name] = [entry[1] for entry in seen]
            outcome["streams_as_flairs"][name] = [entry[2] for entry in seen]
        returned[kind] = outcome
    return returned


def _streams_left_as_flairs(model, points: list, label_type: str, before) -> bool:
    """Whether the evaluation just made (from the random streams at ``before``) left every stream where flair's own
    ``evaluate`` of the whole split leaves it: run that from ``before`` and compare."""
    import inspect

    from flair_nbddp.worker import random_streams

    after = random_streams.snapshot()
    random_streams.restore(before)
    flairs = inspect.unwrap(type(model).evaluate)
    try:
        flairs(model, points, gold_label_type=label_type, mini_batch_size=BATCH)
    except ValueError:  # TextRegressor on one point, as in evaluated()
        pass
    return random_streams.snapshot() == after


class DrawingClassifier(TextClassifier):
    """A ``TextClassifier`` whose ``predict`` draws a random number first, as Monte Carlo dropout would."""

    def predict(self, *args, **kwargs):
        torch.rand(1)
        return super().predict(*args, **kwargs)


def evaluate_a_classifier_whose_prediction_draws(model_path: str) -> dict:
    """A classifier whose ``predict`` draws a random number (as Monte Carlo dropout would) evaluates the test split
    on every rank; returns the model, the result, the batches each rank computed in shares and whether each
    rank's random streams were left where flair's own evaluation leaves them."""
    import torch.distributed as dist
    from flair.embeddings import TransformerDocumentEmbeddings

    from flair_nbddp.worker import distributed_eval, random_streams

    corpus = _corpus(_sentiment, 8)
    label_dictionary = corpus.make_label_dictionary("sentiment", add_unk=False)
    model = DrawingClassifier(TransformerDocumentEmbeddings(model_path), "sentiment", label_dictionary=label_dictionary)
    model.eval()
    points, streams, before = splits(corpus)["test"], random_streams.snapshot(), distributed_eval.batches_computed()
    result = summary(evaluated(model, points, "sentiment", None))
    computed = distributed_eval.batches_computed() - before
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (computed, _streams_left_as_flairs(model, points, "sentiment", streams)))
    return {"model": model, "result": result, "computed": [e[0] for e in seen], "as_flairs": [e[1] for e in seen]}


def evaluate_on_rank_0_only(kind: str, model_path: str, base_path: str) -> dict:
    """Rank 0 evaluates an untrained model alone, as scripts often do; the other ranks return at once."""
    import torch.distributed as dist

    corpus, model, label_type = build(kind, model_path)
    model.eval()
    if dist.get_rank() != 0:
        return {}
    out = Path(base_path) / "rank0-test.tsv"
    result = evaluated(model, splits(corpus)["test"], label_type, out)
    return {"model": model, "result": result, "file": out.read_text()}


def evaluate_a_pair_regressor_twice(model_path: str) -> list:
    """flair's TextPairRegressor has an ``evaluate`` of its own, which the kit does not share out."""
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextPairRegressor

    pairs = _pairs(9, 1)
    for pair in pairs:
        pair.add_label("similarity", "1.0" if pair.get_label("pair").value == "SAME" else "0.0")
    model = TextPairRegressor(TransformerDocumentEmbeddings(model_path), label_type="similarity")
    model.eval()
    return [model.evaluate(pairs, gold_label_type="similarity", mini_batch_size=BATCH).main_score for _ in range(2)]


def evaluate_dev_on_rank_0_then_test(kind: str, model_path: str, out_dir: str) -> dict:
    """Rank 0 evaluates dev alone (say, to print it), then every rank evaluates test; each rank writes the batches
    it computed in shares to ``out_dir`` (no collective after the evaluations: rank 1 returns at once, so rank 0's
    test evaluation need not wait out the agreement's deadline)."""
    import torch.distributed as dist

    from flair_nbddp.worker import distributed_eval

    corpus, model, label_type = build(kind, model_path)
    model.eval()
    dev = summary(evaluated(model, list(corpus.dev), label_type, None)) if dist.get_rank() == 0 else None
    before = distributed_eval.batches_computed()
    test = summary(evaluated(model, splits(corpus)["test"], label_type, None))
    Path(out_dir, f"computed-{dist.get_rank()}").write_text(str(distributed_eval.batches_computed() - before))
    return {"model": model, "dev": dev, "test": test}
