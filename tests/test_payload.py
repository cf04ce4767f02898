import json
import os
import stat
import threading

import pytest
from conftest import python_program

from flair_nbddp.wire import payload


@pytest.mark.process
def test_function_from_a_fileless_main_travels_by_value(tmp_path):
    path = tmp_path / "payload.pkl"
    python_program(
        f"""
from flair_nbddp.wire.payload import write_payload
offset = 10
class Box:
    def __init__(self, v): self.v = v
def notebook_fn(x, scale=1):
    return Box((x + offset) * scale).v
write_payload({str(path)!r}, notebook_fn, (5,), {{"scale": 3}})
"""
    )
    out = python_program(
        f"""
from flair_nbddp.wire.payload import read_payload
fn, args, kwargs = read_payload({str(path)!r})
print(fn(*args, **kwargs))
"""
    )
    assert out.strip() == "45"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.process
def test_corpus_captured_in_a_closure_travels_through_the_codec(tmp_path):
    # span labels cannot be pickled in flair 0.15.1: arriving intact means the closure's corpus took the codec
    path = tmp_path / "payload.pkl"
    sent = python_program(
        f"""
import json
from flair_nbddp.wire.payload import write_payload
from flair_nbddp.synthetic import ner_corpus

def make(corpus):
    def notebook_fn():
        return [[(span.text, span.tag) for span in sentence.get_spans("ner")] for sentence in corpus.train]
    return notebook_fn

fn = make(ner_corpus(n_train=20, n_dev=2, n_test=2, seed=4))
write_payload({str(path)!r}, fn, (), {{}})
print(json.dumps(fn()))
"""
    )
    arrived = python_program(
        f"""
import json
from flair_nbddp.wire.payload import read_payload
fn, args, kwargs = read_payload({str(path)!r})
print(json.dumps(fn(*args, **kwargs)))
"""
    )
    assert json.loads(arrived) == json.loads(sent) and len(json.loads(sent)) == 20


def test_unpicklable_argument_is_named_before_anything_starts(tmp_path):
    with pytest.raises(payload.ShippingError, match=r"argument 'guard' \(lock\) cannot be sent"):
        payload.write_payload(tmp_path / "p.pkl", print, (1, 2), {"guard": threading.Lock()})
    assert not (tmp_path / "p.pkl").exists()


NOTEBOOK_CELLS = """
import threading
lock = threading.Lock()
settings = {"epochs": 2, "guard": lock}
def helper():
    with lock:
        return 1
def train():
    return helper()
def configured():
    return settings["epochs"]
"""


@pytest.mark.parametrize(
    ("function", "says"),
    [
        ("train", "train uses the variable 'helper', which uses the variable 'lock', a lock that cannot be pickled "
                  "(TypeError: cannot pickle '_thread.lock' object). Build it inside the function 'helper' instead"),
        ("configured", "configured uses the variable 'settings', whose settings['guard'] is a lock that cannot be "
                       "pickled"),
    ],
)
def test_a_notebook_function_names_the_global_that_cannot_travel_and_its_path(tmp_path, function, says):
    notebook = {"__name__": "__main__"}  # what a cell defines: cloudpickle ships it by value, globals included
    exec(NOTEBOOK_CELLS, notebook)
    with pytest.raises(payload.ShippingError) as caught:
        payload.write_payload(tmp_path / "p.pkl", notebook[function], (), {})
    assert str(caught.value).startswith(f"the function {function!r} cannot be sent to the worker processes: {says}")


def test_unpicklable_result_names_its_type(tmp_path):
    with pytest.raises(payload.ShippingError, match="returned a generator"):
        payload.write_result(tmp_path / "r.pkl", (i for i in range(3)))


def test_payload_write_failure_names_the_path(tmp_path):
    target = tmp_path / "missing-dir" / "payload.pkl"
    with pytest.raises(OSError, match="cannot write the run's payload"):
        payload.write_payload(target, print, (), {})


@pytest.mark.parametrize("subclassed", [False, True], ids=["flairs", "a-notebooks-subclass"])
def test_flair_model_travels_through_flair_save_and_arrives_on_cpu(tmp_path, tiny_model_path, subclassed):
    import torch
    from flair.data import Sentence
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    from flair_nbddp.synthetic import sentiment_corpus

    class MyClassifier(TextClassifier):  # defined in a function, as in a notebook: travels by value
        pass

    Classifier = MyClassifier if subclassed else TextClassifier
    corpus = sentiment_corpus(8, 2, 2)
    model = Classifier(
        TransformerDocumentEmbeddings(tiny_model_path, fine_tune=True),
        label_type="sentiment",
        label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
    )
    payload.write_result(tmp_path / "r.pkl", {"model": model, "note": "x"})
    back = payload.read_result(tmp_path / "r.pkl")
    assert back["note"] == "x" and type(back["model"]).__name__ == Classifier.__name__
    assert next(back["model"].parameters()).device == torch.device("cpu")
    for a, b in zip(model.state_dict().values(), back["model"].state_dict().values()):
        assert torch.equal(a.cpu(), b)
    original, copy = Sentence("a superb film"), Sentence("a superb film")
    model.eval()
    model.predict(original, return_probabilities_for_all_classes=True)
    back["model"].predict(copy, return_probabilities_for_all_classes=True)
    assert [(l.value, round(l.score, 5)) for l in original.labels] == [(l.value, round(l.score, 5)) for l in copy.labels]


def test_a_model_class_with_a_constructor_of_its_own_travels_whole(tmp_path):
    import torch
    from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings
    from flair.models import TextClassifier

    from flair_nbddp.synthetic import sentiment_corpus

    class Tempered(TextClassifier):  # flair's load could not call this constructor: cloudpickle carries it
        def __init__(self, temperature: float, **kwargs):
            super().__init__(**kwargs)
            self.temperature = temperature

    corpus = sentiment_corpus(8, 2, 2)
    model = Tempered(
        2.0, embeddings=DocumentPoolEmbeddings([OneHotEmbeddings.from_corpus(corpus, embedding_length=8)]),
        label_type="sentiment", label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
    )  # fmt: skip
    model.note = "kept"
    payload.write_result(tmp_path / "r.pkl", model)
    back = payload.read_result(tmp_path / "r.pkl")
    assert (type(back).__name__, back.temperature, back.note) == ("Tempered", 2.0, "kept")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def test_result_round_trip_of_plain_data(tmp_path):
    value = {"scores": [0.5, 0.75], "text": "é" * 10}
    payload.write_result(tmp_path / "r.pkl", value)
    back = payload.read_result(tmp_path / "r.pkl")
    assert back == value and type(back["scores"]) is list  # plain data stays plain: no wrapper types
    assert json.dumps(back) == json.dumps(value)


def test_returned_model_moves_a_gpu_notebook_to_cpu(tmp_path, tiny_model_path, monkeypatch):
    """On a GPU machine the notebook's flair.device is cuda: the model must still predict there, on CPU."""
    import flair
    import torch
    from flair.data import Sentence
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(8, 2, 2)
    model = TextClassifier(TransformerDocumentEmbeddings(tiny_model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))
    payload.write_result(tmp_path / "r.pkl", model)
    monkeypatch.setattr(flair, "device", torch.device("cuda:0"))  # what a GPU machine's notebook has
    with pytest.warns(UserWarning, match="set flair.device from cuda:0 to cpu"):
        back = payload.read_result(tmp_path / "r.pkl")
    assert flair.device == torch.device("cpu") and next(back.parameters()).device.type == "cpu"
    sentence = Sentence("a superb film")
    back.predict(sentence)
    assert sentence.get_label("sentiment").value in {"POSITIVE", "NEGATIVE"}


def test_each_rank_checks_the_bytes_it_read_and_does_not_re_encode(monkeypatch):
    import hashlib

    from flair_nbddp.errors import CorpusMismatchError
    from flair_nbddp.synthetic import ner_corpus
    from flair_nbddp.wire import codec

    data = codec.encode(ner_corpus(n_train=10, n_dev=2, n_test=2))
    monkeypatch.setattr(codec, "fingerprint", lambda corpus: pytest.fail("a rank re-encoded the corpus"))
    corpus = payload.rebuild_corpus(data, hashlib.sha256(data).hexdigest())
    assert len(corpus.train) == 10
    damaged = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(CorpusMismatchError, match="differs from the one packed in the notebook"):
        payload.rebuild_corpus(damaged, hashlib.sha256(data).hexdigest())
