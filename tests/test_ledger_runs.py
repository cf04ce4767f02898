"""Real runs (2 gloo processes) in the run ledger: what a finished, stopped, failed or unstartable run, and a run
on a warm pool, leave there."""

import hashlib
import threading
import time
import warnings

import pytest
from training_jobs import train_ner, train_sentiment

from flair_nbddp import WorkerPool, history, launch, start
from flair_nbddp.errors import LedgerWarning, ShippingError, WorkerError
from flair_nbddp.synthetic import ner_corpus
from flair_nbddp.wire import codec

pytestmark = pytest.mark.process


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAIR_NBDDP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _fail_on_rank_one(hf_token):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    dist.barrier()


def test_a_finished_training_is_recorded_whole(tmp_path):
    corpus = ner_corpus(n_train=60, n_dev=10, n_test=10)
    result = launch(train_ner, (corpus, str(tmp_path / "out")), {"epochs": 2}, dashboard=False, seed=5)
    [record] = history()
    assert record.id == result.record_id and record.status == "finished" and record.error is None
    assert (record.name, record.origin, record.workers) == ("train_ner", "launch", "ColdWorkers")
    assert record.source.startswith("def train_ner(") and record.source_hash == hashlib.sha256(
        record.source.encode()).hexdigest()  # fmt: skip
    digest = hashlib.sha256(codec.encode(corpus)).hexdigest()
    assert record.params == {
        "args": [{"type": "Corpus", "train": 60, "dev": 10, "test": 10, "sha256": digest}, str(tmp_path / "out")],
        "kwargs": {"epochs": 2},
    }
    assert (record.seed, record.world_size, record.device_type, record.backend) == (5, 2, "cpu", "gloo")
    # every metric, in order, as the cell got it
    assert [(p.name, p.step, p.value) for p in record.metrics()] == [(p.name, p.step, p.value) for p in result.metrics]
    assert record.history("dev/score") == result.history("dev/score") and len(record.history("dev/score")) == 2
    assert record.final_metrics == result.final_metrics and record.scores == result.scores
    assert record.scores["test_score"] == result.value["test_score"]
    assert [rank["rank"] for rank in record.ranks] == [0, 1] and all(rank["samples"] > 0 for rank in record.ranks)
    assert record.models == [str(tmp_path / "out" / "final-model.pt")] == [str(path) for path in result.models]
    assert record.elapsed == pytest.approx(result.elapsed) and record.run_dir == str(result.run_dir)
    assert record.ended_at >= record.started_at and record.checkpoint is None


def test_a_stopped_run_keeps_its_checkpoint_and_a_failed_one_its_error(tmp_path, tiny_model_path):
    run = start(train_sentiment, (str(tiny_model_path), str(tmp_path / "out")), {"epochs": 50, "docs": 64})
    deadline = time.monotonic() + 120
    while run.state.snapshot().first_batch_at is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert history()[0].status == "running"  # recorded from the start
    run.stop()
    stopped = run.wait(timeout=120)
    assert stopped.status == "stopped"

    with pytest.raises(WorkerError):
        launch(_fail_on_rank_one, (), {"hf_token": "hf_secret"}, dashboard=False)
    failed, recorded = history()
    assert (recorded.status, recorded.checkpoint) == ("stopped", str(stopped.checkpoint))
    assert recorded.origin == "start" and recorded.history("train/batch_loss")
    assert failed.status == "failed" and failed.error.startswith("WorkerError: ") and "rank 1 cannot go on" in failed.error
    assert failed.params["kwargs"] == {"hf_token": "***"}  # a secret never reaches the ledger
    assert "hf_secret" not in (tmp_path / "home" / "runs.sqlite").read_bytes().decode("latin-1")


def test_a_run_that_cannot_be_packed_is_recorded_as_failed(no_leftover_processes):
    with pytest.raises(ShippingError):
        launch(print, (threading.Lock(),), dashboard=False)
    [record] = history()
    assert record.status == "failed" and record.error.startswith("ShippingError: ") and "lock" in record.error
    assert record.ended_at is not None and record.params["args"] == [{"type": "lock"}]


def test_runs_on_a_warm_pool_are_recorded_with_the_object_put(tmp_path):
    corpus = ner_corpus(n_train=40, n_dev=8, n_test=8)
    with WorkerPool(2, "cpu") as pool:
        ref = pool.put(corpus)
        for epochs in (1, 2):
            pool.launch(train_ner, (ref, str(tmp_path / f"out{epochs}")), {"epochs": epochs}, dashboard=False)
    records = history()
    assert [record.kwargs["epochs"] for record in records] == [2, 1]
    assert {record.workers for record in records} == {"WorkerPool"}
    [put] = {json_key(record.params["args"][0]) for record in records}
    assert dict(put) == {"type": "Corpus", "train": 40, "dev": 8, "test": 8, "sha256": ref.digest, "put_on_pool": True}


def json_key(described: dict) -> tuple:
    return tuple(sorted(described.items()))


def test_a_damaged_ledger_costs_a_run_one_warning_and_nothing_else(home):
    home.mkdir()
    (home / "runs.sqlite").write_bytes(b"not a database, and not to be replaced" * 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = launch(divmod, (7, 2), dashboard=False)
    assert (result.status, result.value, result.record_id) == ("finished", (3, 1), None)
    [warning] = [item for item in caught if issubclass(item.category, LedgerWarning)]
    assert "damaged or not an SQLite file" in str(warning.message) and "goes on, unrecorded" in str(warning.message)
    assert (home / "runs.sqlite").read_bytes().startswith(b"not a database")
