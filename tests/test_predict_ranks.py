"""flair_nbddp.predict on 2 CPU ranks (the session's warm pool): the same answers as flair's own predict for each kind
of model, in input order, in place or as new sentences or a JSON Lines file; a stop keeps the finished prefix; a
failing rank fails the call; a pool's ref is loaded once per worker; the ledger records the call."""

from __future__ import annotations

import _thread
import json
import threading

import pytest

import flair_nbddp
from flair_nbddp import WorkerError
from flair_nbddp.wire.label_records import record_of

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def models(tiny_model_path):
    import torch
    from flair.data import Dictionary
    from flair.embeddings import TransformerDocumentEmbeddings, TransformerWordEmbeddings
    from flair.models import SequenceTagger, TextClassifier, TextPairClassifier

    from flair_nbddp.synthetic import ner_corpus, sentiment_corpus

    torch.manual_seed(0)
    sentiment = sentiment_corpus(60, 10, 10)
    ner = ner_corpus(60, 10, 10)
    classes = sentiment.make_label_dictionary("sentiment", add_unk=False)
    tags = ner.make_label_dictionary("ner", add_unk=False)
    pairs = Dictionary(add_unk=False)
    for value in ("SAME", "OTHER"):
        pairs.add_item(value)
    built = {
        "classifier": TextClassifier(TransformerDocumentEmbeddings(tiny_model_path), label_type="sentiment",
                                     label_dictionary=classes),
        "tagger with CRF": SequenceTagger(TransformerWordEmbeddings(tiny_model_path), tags, "ner", hidden_size=16,
                                          use_crf=True, use_rnn=True),
        "tagger without CRF": SequenceTagger(TransformerWordEmbeddings(tiny_model_path), tags, "ner", use_crf=False,
                                             use_rnn=False),
        "pair classifier": TextPairClassifier(TransformerDocumentEmbeddings(tiny_model_path), label_type="pair",
                                              label_dictionary=pairs),
    }  # fmt: skip
    for model in built.values():
        model.eval()
    return built, sentiment, ner


def _copies(points: list) -> list:
    """Copies of data points, span labels included (``copy.deepcopy`` cannot copy flair's spans)."""
    from flair.datasets import FlairDatapointDataset

    from flair_nbddp.wire import codec

    return list(codec.decode(codec.encode(FlairDatapointDataset(list(points)))))


def _inputs(kind: str, sentiment, ner) -> list:
    from flair.data import Sentence, TextPair

    if kind == "classifier":
        return _copies([*sentiment.train, *sentiment.dev])
    if kind == "pair classifier":
        texts = [s.to_plain_string() for s in sentiment.train]
        return [TextPair(Sentence(a), Sentence(b)) for a, b in zip(texts, texts[1:] + texts[:1])]
    return _copies([*ner.train, *ner.dev])


def _same(ours: list, flairs: list, label_name: str) -> None:
    """Every label value equal, every score within 1e-5, every token distribution too."""
    assert len(ours) == len(flairs)
    for index, (mine, theirs) in enumerate(zip(ours, flairs)):
        mine, theirs = record_of(mine, label_name, True), record_of(theirs, label_name, True)
        assert [label[:6] for label in mine[0]] == [label[:6] for label in theirs[0]], index
        assert all(abs(a[6] - b[6]) <= 1e-5 for a, b in zip(mine[0], theirs[0])), index
        if theirs[1] is not None:
            assert [[value for value, _ in dist] for dist in mine[1]] == [[value for value, _ in d] for d in theirs[1]]
            assert all(abs(a[1] - b[1]) <= 1e-5 for x, y in zip(mine[1], theirs[1]) for a, b in zip(x, y))


@pytest.mark.parametrize("kind", ["classifier", "tagger with CRF", "tagger without CRF", "pair classifier"])
@pytest.mark.parametrize("all_classes", [False, True], ids=["best", "every class"])
def test_the_same_labels_as_flairs_predict_in_place(warm_pool, models, kind, all_classes):
    built, sentiment, ner = models
    model = built[kind]
    data = _inputs(kind, sentiment, ner)
    theirs = _copies(data)
    model.predict(theirs, mini_batch_size=4, return_probabilities_for_all_classes=all_classes)
    predictions = warm_pool.predict(model, data, mini_batch_size=4, return_probabilities_for_all_classes=all_classes)
    assert (predictions.status, predictions.done, predictions.total) == ("finished", len(data), len(data))
    assert predictions.sentences[0] is data[0] and predictions.world_size == 2
    assert sum(len(point.get_labels(model.label_type)) for point in data) > 0  # predictions were made at all
    _same(data, theirs, model.label_type)


def test_texts_come_back_as_new_sentences_in_input_order(warm_pool, models):
    from flair.data import Sentence

    built, sentiment, _ = models
    texts = [s.to_plain_string() for s in [*sentiment.train, *sentiment.test]]
    predictions = warm_pool.predict(built["classifier"], texts, mini_batch_size=2)
    assert [s.to_plain_string() for s in predictions] == texts
    theirs = [Sentence(text) for text in texts]
    built["classifier"].predict(theirs, mini_batch_size=2)
    _same(list(predictions), theirs, "sentiment")


def test_a_file_streams_to_json_lines_in_input_order(warm_pool, models, tmp_path):
    from flair.data import Sentence

    built, _, ner = models
    texts = [s.to_plain_string() for s in [*ner.train, *ner.test]]
    source = tmp_path / "texts.txt"
    source.write_text("\r\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "tags.jsonl"
    predictions = warm_pool.predict(built["tagger with CRF"], source, output=out, mini_batch_size=3)
    assert predictions.done == len(texts) and predictions.sentences == [] and predictions.output == out
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [row["text"] for row in rows] == texts
    theirs = [Sentence(text) for text in texts]
    built["tagger with CRF"].predict(theirs, mini_batch_size=3)
    for row, sentence in zip(rows, theirs):
        spans = sentence.get_labels("ner")
        assert [(r["value"], r["start"], r["end"]) for r in row["labels"]] == [
            (label.value, label.data_point.start_position, label.data_point.end_position) for label in spans
        ]
        assert all(abs(r["score"] - label.score) <= 1e-5 for r, label in zip(row["labels"], spans))
        assert all(row["text"][r["start"]:r["end"]] == label.data_point.text for r, label in zip(row["labels"], spans))


def test_a_pool_ref_is_loaded_once_per_worker_and_kept(warm_pool, models):
    built, sentiment, _ = models
    ref = warm_pool.put(built["classifier"])
    try:
        texts = [s.to_plain_string() for s in sentiment.train]
        first = warm_pool.predict(ref, texts)
        kept_first = [rank.value for rank in warm_pool.exec(
            "from flair_nbddp.wire import pool_ref\n{key: id(model) for key, model in pool_ref._WORKER_KEPT.items()}")]
        second = warm_pool.predict(ref, texts)
        kept_second = [rank.value for rank in warm_pool.exec(
            "from flair_nbddp.wire import pool_ref\n{key: id(model) for key, model in pool_ref._WORKER_KEPT.items()}")]
        values = [[s.get_labels("sentiment")[0].value for s in call] for call in (first, second)]
        assert values[0] == values[1]
        assert all(ref.id in kept for kept in kept_first) and kept_first == kept_second  # the same objects
    finally:
        ref.release()
    kept_after = [rank.value for rank in warm_pool.exec(
        "from flair_nbddp.wire import pool_ref\nsorted(pool_ref._WORKER_KEPT)")]
    assert kept_after == [[], []]


def test_an_interrupt_returns_the_finished_prefix(warm_pool, models, tmp_path):
    built, _, _ = models
    texts = [f"text number {index} " + "word " * (index % 7) for index in range(3000)]
    out = tmp_path / "part.jsonl"

    def interrupt_once_some_are_written():
        while not out.exists() or out.stat().st_size == 0:
            threading.Event().wait(0.05)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_once_some_are_written, daemon=True).start()
    workers = warm_pool.pids
    predictions = warm_pool.predict(built["classifier"], texts, output=out, mini_batch_size=1)
    rows = out.read_text(encoding="utf-8").splitlines()
    assert predictions.status == "stopped" and 0 < predictions.done < len(texts)
    assert len(rows) == predictions.done
    assert [json.loads(row)["text"] for row in rows] == texts[: predictions.done]
    assert predictions.run.status == "stopped"
    assert warm_pool.pids == workers  # a stopped share returned cleanly: the pool keeps its workers (and their model)


def test_a_file_that_cannot_be_written_fails_the_call_naming_how_many_rows_it_holds(warm_pool, models):
    from flair_nbddp import PredictionsWriteError

    built, sentiment, _ = models
    texts = [s.to_plain_string() for s in sentiment.train] * 20  # more than a write buffer of rows
    with pytest.raises(PredictionsWriteError, match=r"writing /dev/full failed .*holds the first [\d,]+ rows"):
        warm_pool.predict(built["classifier"], texts, output="/dev/full")


def test_a_failing_rank_fails_the_call_with_its_traceback(warm_pool, models):
    from flair.data import Sentence

    built, _, _ = models
    with pytest.raises(WorkerError) as raised:
        warm_pool.predict(built["pair classifier"], [Sentence("not a pair") for _ in range(8)])
    assert raised.value.exc_type == "AttributeError" and "concatenated_data" in raised.value.remote_traceback
    assert "predict_rank.py" in raised.value.remote_traceback  # the rank's own traceback, as launch() gives it


def test_the_ledger_records_the_call(warm_pool, models, tmp_path, monkeypatch):
    monkeypatch.setenv("FLAIR_NBDDP_LEDGER", str(tmp_path / "runs.sqlite"))
    built, sentiment, _ = models
    texts = [s.to_plain_string() for s in sentiment.train]
    predictions = warm_pool.predict(built["classifier"], texts)
    record = flair_nbddp.history(limit=1)[0]
    assert record.id == predictions.run.record_id and record.origin == "predict"
    assert record.name == "predict TextClassifier" and record.status == "finished"
    assert record.params["inputs"] == {"type": "Texts", "len": len(texts)}
    assert record.scores["predicted"] == len(texts) and record.scores["texts_per_second"] > 0
    assert record.samples_per_second == pytest.approx(predictions.texts_per_second)


def test_cold_workers_predict_and_go(models, no_leftover_processes):
    built, sentiment, _ = models
    data = _copies(sentiment.test)
    theirs = _copies(data)
    built["classifier"].predict(theirs)
    predictions = flair_nbddp.predict(built["classifier"], data, processes=2, device="cpu", precision="fp32")
    assert predictions.done == len(data) and predictions.world_size == 2
    _same(data, theirs, "sentiment")
