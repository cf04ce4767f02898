"""Big corpora in the workers: lazy corpora train exactly as built ones, worker memory does not grow with the
corpus, and an object put on a pool is packed once for every job (process tier: 2 gloo ranks)."""

from __future__ import annotations

import pytest
from training_jobs import peak_memory_after_reading, read_and_change, train_compared

from flair_nbddp import WorkerPool, launch
from flair_nbddp.synthetic import ner_corpus, sentiment_corpus
from flair_nbddp.wire import payload

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_processes")]

COMPARED = ("dev/score", "dev/loss", "train/loss", "test/score")


def curves(result) -> dict[str, list]:
    return {name: result.history(name) for name in COMPARED if result.history(name)}


@pytest.mark.parametrize("kind", ["train", "fine_tune", "tagger"])
def test_a_lazy_corpus_trains_exactly_as_a_built_one(warm_pool, tiny_model_path, tmp_path, kind):
    if kind == "tagger":
        corpus = ner_corpus(n_train=96, n_dev=16, n_test=16, seed=4)
    else:
        corpus = sentiment_corpus(n_train=96, n_dev=16, n_test=16, seed=4)
    results = {
        lazy: warm_pool.launch(
            train_compared, (corpus, tiny_model_path, str(tmp_path / str(lazy)), kind), seed=11, dashboard=False,
            lazy_corpus=lazy,
        )  # fmt: skip
        for lazy in (True, False)
    }
    lazy, built = results[True], results[False]
    assert lazy.value["lazy"] and not built.value["lazy"]
    assert curves(lazy)["train/loss"] and len(curves(lazy)["dev/score"]) == 3
    assert curves(lazy) == curves(built)  # every epoch's losses and scores, bit for bit
    assert lazy.value["test_score"] == built.value["test_score"]
    kept = lazy.value["kept"]
    if kind == "train":  # frozen embeddings stored on the sentences: those stay built, as flair expects
        assert kept >= 96
    elif kind == "fine_tune":  # nothing stored: nothing kept
        assert kept == 0
    else:  # trained embeddings are cleared after each batch; evaluation's (no grad) are stored, in "cpu" mode
        assert 0 < kept <= 32


def test_worker_memory_stays_flat_with_3000_documents():
    peaks = {}
    for docs in (1000, 3000):
        corpus = sentiment_corpus(n_train=docs, n_dev=10, n_test=10, words=(200, 260), seed=0)
        with WorkerPool(2, "cpu") as fresh:  # fresh workers per size: a peak is a high-water mark
            value = fresh.launch(peak_memory_after_reading, (corpus,), lazy_corpus=True, dashboard=False).value
        assert value["tokens"] == 2 * sum(len(sentence) for sentence in corpus.train)
        assert value["labels"] == ["NEGATIVE", "POSITIVE"] or value["labels"] == ["POSITIVE", "NEGATIVE"]
        peaks[docs] = value["peak_bytes"]
    growth_per_1000 = (peaks[3000] - peaks[1000]) / 2  # a corpus built in the worker: ~120 MB per 1,000
    print(f"worker peak: {peaks[1000] / 1e6:.0f} MB (1,000 documents), {peaks[3000] / 1e6:.0f} MB (3,000)")
    assert growth_per_1000 <= 10e6, f"{growth_per_1000 / 1e6:.1f} MB more worker memory per 1,000 documents"


def test_a_put_corpus_is_packed_once_and_serves_three_jobs(tmp_path, monkeypatch):
    corpus = sentiment_corpus(n_train=40, n_dev=4, n_test=4, seed=6)
    encodes = []
    encode = payload.codec.encode
    monkeypatch.setattr(payload.codec, "encode", lambda obj: encodes.append(obj) or encode(obj))
    with WorkerPool(2, "cpu", run_dir=tmp_path / "pool") as pool:
        ref = pool.put(corpus)
        first = pool.launch(read_and_change, (ref,), dashboard=False)
        ref.path.unlink()  # the workers keep what they read: later jobs need no file
        later = [pool.launch(read_and_change, (ref,), dashboard=False, lazy_corpus=lazy) for lazy in (True, False)]
        assert len(encodes) == 1, "the corpus was packed again"
        expected = {"first": corpus.train[0].get_label("sentiment").value, "size": 40, "text": str(corpus.train[0])}
        for result in (first, *later):
            expected["text"] = result.value["text"]  # the job's own change shows in its own text
            assert result.value == expected  # and no job sees another's change
        assert all(result.run_dir.stat().st_size < 10_000 for result in (first, *later))
        ref.release()
        with pytest.raises(Exception, match="was released"):
            pool.launch(read_and_change, (ref,), dashboard=False)


def test_the_magic_uses_a_put_corpus_until_it_changes_and_says_which_it_used(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "flair_nbddp")
        corpus = shell.user_ns["corpus"] = sentiment_corpus(n_train=20, n_dev=2, n_test=2, seed=7)
        original = corpus.train[0].get_label("sentiment").value
        cell = "len(corpus.train), corpus.train[0].get_label('sentiment').value"
        shell.run_line_magic("ddp_pool", "start 2 --device cpu")
        shell.run_line_magic("ddp_pool", "put corpus")
        assert "put corpus on the pool (PoolRef Corpus" in capsys.readouterr().out
        assert shell.run_cell_magic("ddp_train", "--no-dashboard", cell) == (20, original)
        assert "flair_nbddp: corpus: the pool's copy (PoolRef Corpus" in capsys.readouterr().out
        # a change inside a sentence is not seen (the README's rule), and every cell says which copy it used
        corpus.train[0].set_label("sentiment", "CHANGED")
        assert shell.run_cell_magic("ddp_train", "--no-dashboard", cell) == (20, original)
        assert "changes made inside it since do not reach the workers" in capsys.readouterr().out
        shell.run_line_magic("ddp_pool", "put corpus")  # put again: the change arrives
        assert shell.run_cell_magic("ddp_train", "--no-dashboard", cell) == (20, "CHANGED")
        corpus.downsample(0.5)  # new splits: the cell packs the corpus itself, and says so
        assert shell.run_cell_magic("ddp_train", "--no-dashboard", cell)[0] == 10
        assert "corpus changed since it was put on the pool" in capsys.readouterr().out
        shell.run_line_magic("ddp_pool", "release corpus")
        assert shell.run_cell_magic("ddp_train", "--no-dashboard", cell)[0] == 10
        assert "pool's copy" not in capsys.readouterr().out
    finally:
        shell.run_line_magic("ddp_pool", "stop")
        InteractiveShell.clear_instance()


def test_a_ref_released_while_its_job_starts_still_serves_that_job(tmp_path):
    from flair_nbddp import start

    corpus = sentiment_corpus(n_train=30, n_dev=3, n_test=3, seed=9)
    with WorkerPool(2, "cpu", run_dir=tmp_path / "pool") as pool:
        ref = pool.put(corpus)
        run = start(read_and_change, (ref,), pool=pool)
        ref.release()  # the job was handed the ref before: it may still be reading it
        assert run.wait(timeout=120).value["size"] == 30
        assert not ref.path.exists()  # gone once that job was over


def test_a_corpus_that_cannot_be_packed_leaves_no_worker_behind():
    import threading

    from flair_nbddp import ShippingError

    corpus = sentiment_corpus(n_train=30, n_dev=3, n_test=3, seed=9)
    with pytest.raises(ShippingError, match="lock"):  # new workers started while it was packed: they are ended
        launch(read_and_change, (corpus, threading.Lock()), dashboard=False)
