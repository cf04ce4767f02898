"""flair_nbddp.predict without processes: dealing, inputs, label records, the collector, the views, and every error
a bad call gets before a worker starts (this tier refuses to start workers, so each error is proven to come first)."""

from __future__ import annotations

import json

from pathlib import Path

import numpy as np
import pytest

import flair_nbddp
from flair_nbddp import ConfigurationError, DashboardUnavailableError, UnknownOptionError
from flair_nbddp.notebook.predict_view import PredictText, open_predict_view, progress_text
from flair_nbddp.predicting.collector import Collector
from flair_nbddp.predicting.dealing import deal, window_size
from flair_nbddp.wire import label_records
from flair_nbddp.wire.predict_inputs import DataPoints, TextFile, Texts, read_inputs


@pytest.fixture(scope="module")
def classifier(tiny_model_path):
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(8, 2, 2)
    return TextClassifier(TransformerDocumentEmbeddings(tiny_model_path), label_type="sentiment",
                          label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip


# -- dealing -------------------------------------------------------------------------------------------------------
def test_chunks_cover_every_input_once_longest_first_within_windows_in_order():
    lengths = np.random.default_rng(0).integers(1, 500, size=1000)
    chunks = deal(lengths, chunk=16, window=128)
    flat = np.concatenate(chunks)
    assert sorted(flat.tolist()) == list(range(1000))
    assert all(len(chunk) <= 16 for chunk in chunks)
    for start in range(0, 1000, 128):  # a window's chunks come before the next window's, longest first
        window = flat[start:start + 128]
        assert sorted(window.tolist()) == list(range(start, min(start + 128, 1000)))
        assert (np.diff(lengths[window]) <= 0).all()
    assert window_size(1000, 16) == 48 and window_size(10**6, 16) == 256 and window_size(10**6, 512) == 4096


# -- inputs --------------------------------------------------------------------------------------------------------
def test_a_text_file_keeps_only_where_lines_start_and_reads_them_back(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_bytes("first line\r\nsecond, längere Zeile\n\nlast without newline".encode())
    inputs = read_inputs(path)
    assert isinstance(inputs, TextFile) and len(inputs) == 4
    assert [inputs.text(i) for i in range(4)] == ["first line", "second, längere Zeile", "", "last without newline"]
    assert inputs.lengths().tolist() == [12, 23, 1, 20]
    assert [token.text for token in inputs.points([1])[0]] == ["second", ",", "längere", "Zeile"]
    assert isinstance(read_inputs(str(path)), TextFile)
    inputs.close()


def test_strings_and_data_points_are_read_as_such():
    from flair.data import Sentence

    assert isinstance(read_inputs(["a", "b c"]), Texts)
    sentences = [Sentence("a b"), Sentence("c")]
    inputs = read_inputs(sentences)
    assert isinstance(inputs, DataPoints) and inputs.in_place and inputs[1] is sentences[1]
    assert inputs.lengths().tolist() == [2, 1]
    assert [token.text for token in read_inputs(["x, y"], use_tokenizer=False).points([0])[0]] == ["x,", "y"]


@pytest.mark.parametrize("data, says", [
    ([], "no inputs"),
    ("just one text", "one string"),
    ("rated 5/10 overall", "one string"),
    ("x" * 5000, "one string"),
    ("/no/such/file.txt", "does not exist"),
    ("~/no-such-file.txt", "does not exist"),
    ({"a": 1}, "cannot read inputs from dict"),
    ({"a"}, "cannot read inputs from set"),
    (["a", 3], "a list of strings with a int"),
    ([1, 2], "cannot predict on int items"),
    (42, "cannot read inputs from int"),
])  # fmt: skip
def test_bad_inputs_are_refused_naming_the_cause(data, says):
    with pytest.raises(ConfigurationError, match=says):
        read_inputs(data)


def test_a_file_that_is_not_utf8_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("fine\ncafé au lait\n".encode("latin-1"))
    with pytest.raises(ConfigurationError, match=r"line 2, is not UTF-8 .*iconv"):
        read_inputs(path)


def test_a_folder_or_an_empty_file_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="not a file"):
        read_inputs(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigurationError, match="is empty"):
        read_inputs(tmp_path / "empty.txt")


# -- label records -------------------------------------------------------------------------------------------------
def test_records_carry_point_span_and_token_labels_and_distributions_back_exactly():
    from flair.data import Label, Sentence

    sentence = Sentence("Anna lives in Berlin")
    sentence.add_label("kind", "PLAIN", 0.75)
    sentence[0:1].add_label("kind", "PER", 0.9)
    sentence[3].add_label("kind", "LOC", 0.8)
    sentence[2].add_tags_proba_dist("kind", [Label(sentence[2], "O", 0.7), Label(sentence[2], "LOC", 0.3)])
    record = label_records.record_of(sentence, "kind", distributions=True)
    fresh = Sentence("Anna lives in Berlin")
    fresh.add_label("kind", "STALE", 1.0)  # flair's predict replaces the old labels of the type
    label_records.apply(fresh, record, "kind")
    assert label_records.record_of(fresh, "kind", distributions=True) == record
    assert [label.value for label in fresh.get_labels("kind")] == ["PLAIN", "PER", "LOC"]
    row = label_records.as_json(record)
    assert row["labels"][1] == {"value": "PER", "score": 0.9, "start": 0, "end": 4}
    assert row["probabilities"][2] == {"O": 0.7, "LOC": 0.3}


def test_records_of_pairs_are_the_pairs_own_labels():
    from flair.data import Sentence, TextPair

    pair = TextPair(Sentence("a b"), Sentence("c"))
    pair.add_label("same", "YES", 0.6)
    fresh = TextPair(Sentence("a b"), Sentence("c"))
    label_records.apply(fresh, label_records.record_of(pair, "same"), "same")
    assert [(label.value, label.score) for label in fresh.get_labels("same")] == [("YES", 0.6)]


# -- the collector -------------------------------------------------------------------------------------------------
def _record(value: str) -> tuple:
    return (("p", -1, -1, -1, -1, value, 0.5),), None


def test_the_collector_puts_predictions_in_input_order_whatever_order_chunks_come_in(tmp_path):
    texts = ["t0", "t1", "t2", "t3", "t4"]
    chunks = [np.array([1, 0]), np.array([3, 2]), np.array([4])]
    out = open(tmp_path / "out.jsonl", "w", encoding="utf-8")
    collector = Collector(Texts(texts), chunks, "label", keep=True, output=out)
    collector.take(2, [_record("v4")])
    collector.take(1, [_record("v3"), _record("v2")])
    assert collector.done == 0  # nothing before input 0 is done
    collector.take(0, [_record("v1"), _record("v0")])
    out.close()
    assert collector.done == 5
    assert [s.get_labels("label")[0].value for s in collector.kept] == ["v0", "v1", "v2", "v3", "v4"]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(row["text"], row["labels"][0]["value"]) for row in rows] == [(f"t{i}", f"v{i}") for i in range(5)]


def test_the_last_chunks_are_taken_when_the_run_ends_and_concludes_while_the_taker_takes(tmp_path):
    """The run's last chunks arrive, and it ends and concludes, between the taker's taking and its look at the run:
    the taker takes them before it returns."""
    from types import SimpleNamespace

    from flair_nbddp.predicting.runner import PredictCall
    from flair_nbddp.wire.events import Predicted

    class EndingRun:  # the supervisor applies the last chunk, ends the run and the cell concludes it, just then
        def __init__(self) -> None:
            self.arrived = False
            self.pending = [Predicted(0, 0, (_record("v0"),))]
            self.state = SimpleNamespace(take_predicted=self.take_predicted)

        def take_predicted(self) -> list:
            if not self.arrived:
                self.arrived = True  # after this take: the chunk arrives, the run ends and is concluded
                return []
            taken, self.pending = self.pending, []
            return taken

        ended = property(lambda self: self.arrived)
        active = property(lambda self: not self.arrived)

    call = PredictCall(EndingRun(), Texts(["t0"]), [np.array([0])], "label", None, view=None)
    call._collector = Collector(call.inputs, call.chunks, "label", keep=True, output=None)
    call._take()
    assert call._collector.done == call.received == 1


# -- errors before any worker starts -------------------------------------------------------------------------------
def test_a_model_that_is_not_a_flair_model_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="needs a flair model that predicts"):
        flair_nbddp.predict("model.pt", ["a text"])


def test_a_label_type_the_model_does_not_predict_is_refused(classifier):
    with pytest.raises(ConfigurationError, match="predicts 'sentiment' labels, not 'ner'"):
        flair_nbddp.predict(classifier, ["a text"], label_name="ner")


def test_texts_for_a_pair_classifier_and_context_models_are_refused(tiny_model_path):
    from flair.data import Dictionary
    from flair.embeddings import TransformerDocumentEmbeddings, TransformerWordEmbeddings
    from flair.models import SequenceTagger, TextPairClassifier

    labels = Dictionary(add_unk=False)
    labels.add_item("A")
    pairs = TextPairClassifier(TransformerDocumentEmbeddings(tiny_model_path), label_type="x", label_dictionary=labels)
    with pytest.raises(ConfigurationError, match="predicts on pairs of texts"):
        flair_nbddp.predict(pairs, ["a text"])
    context = SequenceTagger(TransformerWordEmbeddings(tiny_model_path, use_context=True), labels, "x", use_rnn=False)
    with pytest.raises(ConfigurationError, match="reads each sentence's neighbours"):
        flair_nbddp.predict(context, ["a text"])


def test_an_output_in_a_missing_folder_options_predict_decides_and_a_bad_batch_are_refused(classifier, tmp_path):
    with pytest.raises(ConfigurationError, match="does not exist"):
        flair_nbddp.predict(classifier, ["a"], output=tmp_path / "missing" / "out.jsonl")
    with pytest.raises(ConfigurationError, match="is a folder"):
        flair_nbddp.predict(classifier, ["a"], output=tmp_path)
    with pytest.raises(ConfigurationError, match="takes the path of a JSON Lines file"):
        flair_nbddp.predict(classifier, ["a"], output=True)
    source = tmp_path / "texts.txt"
    source.write_text("a text\n")
    with pytest.raises(ConfigurationError, match="is the input file itself"):
        flair_nbddp.predict(classifier, source, output=source)
    assert source.read_text() == "a text\n"  # nothing of the user's is lost
    with pytest.raises(UnknownOptionError, match="max_restarts= is not taken here"):
        flair_nbddp.predict(classifier, ["a"], max_restarts=2)
    with pytest.raises(UnknownOptionError, match="compile_model= is not taken here"):
        flair_nbddp.predict(classifier, ["a"], options=flair_nbddp.RunOptions(compile_model=True))
    for bad in (0, True, 2.5):
        with pytest.raises(ConfigurationError, match="mini_batch_size must be a positive"):
            flair_nbddp.predict(classifier, ["a"], mini_batch_size=bad)
    with pytest.raises(ConfigurationError, match="label_name must be a label type"):
        flair_nbddp.predict(classifier, ["a"], label_name=3)
    with pytest.raises(DashboardUnavailableError, match="needs a Jupyter kernel"):
        flair_nbddp.predict(classifier, ["a"], dashboard=True)
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ConfigurationError, match="cannot be used"):
        flair_nbddp.predict(classifier, ["a"], output="~no-such-user-here/out.jsonl")
    with pytest.raises(ConfigurationError):
        flair_nbddp.predict(classifier, Path("~no-such-user-here/in.txt"))


def test_a_pool_ref_needs_its_own_pool_and_a_released_one_is_refused(classifier, tmp_path):
    import weakref

    from flair_nbddp import PoolRefError
    from flair_nbddp.wire.pool_ref import PoolRef

    class Pool:  # a pool's part in a ref: where the object's file goes
        def drop(self, ref):
            ref.released = True

    pool, other = Pool(), Pool()
    ref = PoolRef.put(pool, tmp_path, classifier)
    for wrong in (None, other):
        with pytest.raises(ConfigurationError, match="pass the pool it was put on too"):
            flair_nbddp.predict(ref, ["a"], pool=wrong)
    ref.release()
    with pytest.raises(PoolRefError, match="was released"):
        flair_nbddp.predict(ref, ["a"], pool=pool)
    texts = PoolRef.put(pool, tmp_path, ["not", "a", "model"])
    with pytest.raises(ConfigurationError, match="holds a list, not a flair model"):
        flair_nbddp.predict(texts, ["a"], pool=pool)
    assert weakref.ref(ref)  # the ref itself is untouched by the refusals


# -- the views -----------------------------------------------------------------------------------------------------
class _Call:
    def __init__(self, received: int, rate: float) -> None:
        from types import SimpleNamespace

        self.received, self.total, self.texts_per_second, self.status = received, 1000, rate, "running"
        self.eta = (1000 - received) / rate if rate else None
        self.run = SimpleNamespace(plan=SimpleNamespace(world_size=2, device_type="cpu"),
                                   state=SimpleNamespace(stop_requested=False))  # fmt: skip


def test_the_progress_line_says_done_of_all_rate_time_left_and_devices():
    assert progress_text(_Call(250, 50.0)) == "250 / 1,000 texts · 50 texts/s · 15 s left · 2 × cpu"
    assert progress_text(_Call(0, 0.0)) == "0 / 1,000 texts · 2 × cpu"


def test_outside_a_kernel_the_view_is_text_lines_and_nothing_without_a_dashboard(capsys):
    assert type(open_predict_view(False)).__name__ == "PredictView"
    view = open_predict_view(None)
    assert isinstance(view, PredictText)
    view.start(_Call(0, 0.0))
    view.finish(_Call(10, 5.0), None, KeyboardInterrupt())
    assert "interrupted: every worker was ended after 10 of 1,000 texts" in capsys.readouterr().out
