"""A lazy corpus reads like the built one, holds only what is in use, and keeps what flair stores embeddings on;
objects put on a pool (``PoolRef``) are packed once and refused once released. Fast tier: no processes."""

from __future__ import annotations

import gc
import sys
import tracemalloc
import weakref

import pytest
import torch
from flair.data import Corpus, Sentence
from flair.datasets import FlairDatapointDataset
from torch.utils.data import Subset

from flair_nbddp import PoolClosedError, PoolRefError, ShippingError, WorkerPool
from flair_nbddp.errors import CorpusMismatchError
from flair_nbddp.synthetic import ner_corpus, sentiment_corpus
from flair_nbddp.wire import codec, payload, pool_ref
from flair_nbddp.wire.lazy_corpus import (
    LazyDataPoints,
    decode_lazy,
    keep_embedded,
    keep_stored_embeddings,
)


@pytest.fixture(scope="module")
def sentiment():
    return sentiment_corpus(n_train=60, n_dev=10, n_test=10, seed=1)


@pytest.fixture(autouse=True)
def collections_see_what_the_test_made():
    """The objects from before the test are frozen, so a test's ``gc.collect()`` looks only at what the test made
    (a collection of this test process's whole heap takes about half a second)."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture()
def lazy(sentiment):
    return decode_lazy(codec.encode(sentiment))


def texts(dataset) -> list[str]:
    return [str(sentence) for sentence in dataset]


def test_a_lazy_corpus_reads_like_the_built_one(sentiment, lazy):
    assert type(lazy.train.datapoints) is LazyDataPoints
    assert len(lazy.train) == len(sentiment.train) and len(lazy.dev) == len(sentiment.dev)
    assert texts(lazy.train) == texts(sentiment.train)
    assert str(lazy.train[-1]) == str(sentiment.train[-1])
    assert [str(s) for s in lazy.train.datapoints[5:9]] == [str(s) for s in sentiment.train.datapoints[5:9]]
    labels = [s.get_label("sentiment").value for s in lazy.train]
    assert labels == [s.get_label("sentiment").value for s in sentiment.train]
    part = Subset(lazy.train, [3, 1, 4])
    assert texts(part) == [str(sentiment.train[i]) for i in (3, 1, 4)]
    assert lazy.make_label_dictionary("sentiment", add_unk=False).get_items() == sentiment.make_label_dictionary(
        "sentiment", add_unk=False
    ).get_items()
    downsampled = decode_lazy(codec.encode(sentiment)).downsample(0.5)
    assert len(downsampled.train) == 30 and all(isinstance(s, Sentence) for s in downsampled.train)
    with pytest.raises(IndexError):
        lazy.train.datapoints[60]


def test_a_sentence_is_built_when_read_and_let_go_when_nothing_holds_it(lazy):
    sentence = lazy.train[7]
    assert lazy.train[7] is sentence  # held: the same object
    held = weakref.ref(sentence)
    del sentence
    gc.collect()
    assert held() is None
    again = lazy.train[7]
    assert again.get_label("sentiment").value in {"POSITIVE", "NEGATIVE"}


def test_a_change_to_a_sentence_lasts_while_it_is_held(lazy):
    sentence = lazy.train[2]
    sentence.add_label("checked", "yes")
    sentence.add_metadata("seen", True)
    assert lazy.train[2].get_label("checked").value == "yes"
    del sentence
    gc.collect()
    rebuilt = lazy.train[2]
    assert rebuilt.get_labels("checked") == [] and "seen" not in rebuilt._metadata


def test_side_table_values_are_fresh_for_each_build():
    sentences = [Sentence("a b c"), Sentence("d e")]
    sentences[0].add_metadata("source", {"doc": 7})
    lazy = decode_lazy(codec.encode(FlairDatapointDataset(sentences)))
    first = lazy[0]
    first.get_metadata("source")["doc"] = 8
    del first
    gc.collect()
    assert lazy[0].get_metadata("source") == {"doc": 7}


def test_linked_sentences_are_built_up_front():
    sentences = [Sentence(f"sentence {i}") for i in range(4)]
    Sentence.set_context_for_sentences(sentences)
    rebuilt = decode_lazy(codec.encode(FlairDatapointDataset(sentences)))
    assert type(rebuilt.datapoints) is list
    assert rebuilt[2].previous_sentence() is rebuilt[1]


def test_spans_come_back_on_every_build():
    corpus = ner_corpus(n_train=12, n_dev=2, n_test=2, seed=2)
    lazy = decode_lazy(codec.encode(corpus))
    for built, original in zip(lazy.train, corpus.train):
        assert [(s.text, s.tag) for s in built.get_spans("ner")] == [(s.text, s.tag) for s in original.get_spans("ner")]
        assert all(span.sentence is built for span in built.get_spans("ner"))


def test_what_flair_stores_embeddings_on_is_kept_and_nothing_else(lazy):
    kept, dropped = lazy.train[0], lazy.train[1]
    kept.set_embedding("document", torch.ones(3))
    dropped[0].set_embedding("word", torch.ones(3))
    dropped.clear_embeddings()
    keep_embedded([kept, dropped], "cpu")
    keep_embedded([lazy.train[3]], "none")  # flair cleared everything: nothing to keep
    kept_id, dropped_ref = id(kept), weakref.ref(dropped)
    del kept, dropped
    gc.collect()
    assert id(lazy.train[0]) == kept_id and torch.equal(lazy.train[0].get_embedding(), torch.ones(3))
    assert dropped_ref() is None


def test_storing_a_lazy_split_touches_only_what_is_built(monkeypatch, lazy):
    """flair's trainer stores embeddings of the whole dev split after each evaluation; on a lazy split that must
    not build every sentence at once."""
    import flair.training_utils

    from flair_nbddp.wire import lazy_corpus

    original = flair.training_utils.store_embeddings
    seen = []
    monkeypatch.setattr(flair.training_utils, "store_embeddings", lambda points, mode, *a, **k: seen.append(points))
    keep_stored_embeddings()
    wrapper = flair.training_utils.store_embeddings
    held = lazy.dev[3]
    before = len(lazy_corpus._ORIGINS)
    wrapper(Subset(lazy.dev, range(10)), "cpu")
    assert list(seen[0]) == [held] and len(lazy_corpus._ORIGINS) == before  # nothing else was built
    assert isinstance(seen[0], torch.utils.data.Dataset)  # iterated as flair iterates a split: same random draws
    wrapper([held], "cpu")
    assert seen[-1] == [held]
    monkeypatch.setattr(flair.training_utils, "store_embeddings", original)


def test_a_pair_with_embeddings_on_its_concatenation_is_kept():
    from flair.data import DataPair

    pairs = [DataPair(Sentence(f"first {i}"), Sentence(f"second {i}")) for i in range(4)]
    lazy = decode_lazy(codec.encode(FlairDatapointDataset(pairs)))
    pair = lazy[1]
    pair.concatenated_data = Sentence("first 1 [SEP] second 1")
    pair.concatenated_data.set_embedding("document", torch.ones(2))
    keep_embedded([pair], "cpu")
    kept = id(pair)
    del pair
    gc.collect()
    assert id(lazy[1]) == kept and lazy[1].concatenated_data is not None


def test_flair_store_embeddings_is_watched_in_every_module_that_imported_it(monkeypatch, lazy):
    import flair.training_utils

    original = flair.training_utils.store_embeddings
    modules = [m for m in list(sys.modules.values()) if vars(m).get("store_embeddings") is original]
    for module in modules:
        monkeypatch.setattr(module, "store_embeddings", original)  # restored after the test
    keep_stored_embeddings()
    keep_stored_embeddings()  # a second call changes nothing
    import flair.trainers.trainer

    wrapper = flair.trainers.trainer.store_embeddings
    assert wrapper.__wrapped__ is original and all(module.store_embeddings is wrapper for module in modules)
    sentence = lazy.train[4]
    sentence.set_embedding("static", torch.zeros(2))  # no grad: flair keeps it in "cpu" mode
    wrapper([sentence], "cpu")
    del sentence
    gc.collect()
    assert "static" in lazy.train[4]._embeddings


def peak_bytes(decode, data: bytes) -> int:
    """Peak memory of decoding ``data`` and reading every training sentence once, as an epoch does, with the
    collector set up as a worker sets it (what was there before frozen, then one collection)."""
    gc.collect()
    gc.freeze()
    gc.collect()
    tracemalloc.start()
    try:
        corpus = decode(data)
        for sentence in corpus.train:
            assert len(sentence) >= 100
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        gc.unfreeze()


def test_a_lazy_corpus_holds_what_is_read_not_the_corpus():
    corpus = sentiment_corpus(n_train=1500, n_dev=10, n_test=10, words=(100, 140), seed=3)
    large = codec.encode(corpus)
    first_half = FlairDatapointDataset(corpus.train.datapoints[:750])  # a Subset would ship all 1,500
    small = codec.encode(Corpus(first_half, corpus.dev, corpus.test, sample_missing_splits=False))
    built = peak_bytes(codec.decode, small)
    lazy_small, lazy_large = peak_bytes(decode_lazy, small), peak_bytes(decode_lazy, large)
    assert lazy_large < built / 15, (built, lazy_large)  # twice the documents, lazy, in a 15th of the memory
    growth_per_1000 = (lazy_large - lazy_small) / 0.75
    assert growth_per_1000 < 1e6, f"{growth_per_1000 / 1e6:.2f} MB more per 1,000 documents read"


def test_read_payload_keeps_corpora_lazy_when_asked_or_when_large(tmp_path, sentiment, monkeypatch):
    from flair_nbddp.wire import lazy_corpus

    path = tmp_path / "payload.pkl"
    payload.write_payload(path, len, (sentiment,), {})
    assert type(payload.read_payload(path)[1][0].train.datapoints) is list
    assert type(payload.read_payload(path, lazy_corpus=True)[1][0].train.datapoints) is LazyDataPoints
    assert type(payload.read_payload(path, lazy_corpus=None)[1][0].train.datapoints) is list  # small: built
    tokens = codec.token_count(codec.encode(sentiment))
    monkeypatch.setattr(lazy_corpus, "BUILD_UP_TO_BYTES", tokens * lazy_corpus.BUILT_BYTES_PER_TOKEN - 1)
    assert type(payload.read_payload(path, lazy_corpus=None)[1][0].train.datapoints) is LazyDataPoints


# -- objects put on a pool ----------------------------------------------------------------------------------


@pytest.fixture()
def pool(tmp_path):
    pool = WorkerPool(2, "cpu", run_dir=tmp_path / "pool")  # no worker starts: put() packs in the parent
    yield pool
    pool.close()


def test_put_packs_once_and_each_read_decodes_a_fresh_copy(pool, sentiment):
    ref = pool.put(sentiment)
    assert ref.path.is_file() and oct(ref.path.stat().st_mode & 0o777) == "0o600" and ref.nbytes > 0
    packed = payload.dumps((ref,))
    assert len(packed) < 1000  # the job carries the ref, not the corpus
    first, second = payload.loads(packed)[0], payload.loads(packed)[0]
    assert first is not second and texts(first.train) == texts(sentiment.train)
    pool_ref.keep_only([])
    assert pool_ref._WORKER_COPIES == {}


def test_matches_sees_a_new_object_and_new_splits_not_changes_inside(pool):
    corpus = sentiment_corpus(n_train=20, n_dev=4, n_test=4, seed=5)
    ref = pool.put(corpus)
    assert ref.matches(corpus)
    corpus.train[0].add_label("sentiment", "POSITIVE")  # inside a sentence: the README's rule
    assert ref.matches(corpus)
    assert not ref.matches(sentiment_corpus(n_train=20, n_dev=4, n_test=4, seed=5))
    corpus.downsample(0.5)
    assert not ref.matches(corpus)
    assert not pool.put([1, 2]).matches([1, 2])  # a list cannot be held weakly: never assumed unchanged


def test_a_released_ref_is_refused_with_what_to_do(pool, sentiment, tmp_path):
    ref = pool.put(sentiment)
    ref.release()
    assert ref.released and ref not in pool.refs
    assert ref.path.exists()  # a job started before may still read it: it goes once that job is over
    with pytest.raises(PoolRefError, match="was released .* Put the object on the pool again"):
        payload.write_payload(tmp_path / "p.pkl", len, (ref,), {})
    ref.release()  # idempotent
    pool.release(clean=True, reason="finished")  # a job ended (the one that may have read it): it goes
    assert not ref.path.exists()


def test_a_ref_the_notebook_no_longer_holds_is_dropped(pool, sentiment):
    path = pool.put(sentiment).path  # e.g. `ref = pool.put(corpus)` run again: the first ref is garbage
    gc.collect()
    assert pool.refs == [] and path.exists()
    pool.close()
    assert not path.exists() and list((pool.run_dir / "shared").iterdir()) == []


def test_closing_the_pool_releases_its_refs(tmp_path, sentiment):
    pool = WorkerPool(2, "cpu", run_dir=tmp_path / "pool")
    ref = pool.put(sentiment)
    pool.close()
    assert ref.released and not ref.path.exists()
    with pytest.raises(PoolClosedError):
        pool.put(sentiment)


def test_a_worker_copy_that_is_damaged_or_gone_says_so(pool, sentiment):
    ref = pool.put(sentiment)
    packed = payload.dumps(ref)
    ref.path.write_bytes(ref.path.read_bytes()[:-1] + b"x")
    pool_ref.keep_only([])
    with pytest.raises(CorpusMismatchError, match="changed or damaged"):
        payload.loads(packed)
    ref.path.unlink()
    with pytest.raises(PoolRefError, match="was deleted"):
        payload.loads(packed)


def test_put_names_what_cannot_be_pickled(pool):
    import threading

    with pytest.raises(ShippingError, match=r"the dict given to put\(\) cannot be sent .*\['lock'\] is a lock"):
        pool.put({"lock": threading.Lock()})


def test_the_panel_puts_its_corpus_on_the_pool_once_and_again_when_it_changes(pool):
    from flair_nbddp import TrainingPanel

    def train(corpus, max_epochs=1):
        return max_epochs

    corpus = sentiment_corpus(n_train=20, n_dev=4, n_test=4, seed=8)
    panel = TrainingPanel(train, corpus=corpus, params={"max_epochs": (1, 3)})
    assert panel._corpus_for(None) is corpus  # cold workers: the corpus itself
    first = panel._corpus_for(pool)
    assert panel._corpus_for(pool) is first and pool.refs == [first]  # packed once
    corpus.downsample(0.5)  # new splits: put again, the old copy released
    second = panel._corpus_for(pool)
    assert second is not first and first.released and pool.refs == [second]
    panel.corpus = corpus  # assigned (after a change inside it): put afresh on the next run
    assert second.released and panel._corpus_for(pool) not in (first, second)
