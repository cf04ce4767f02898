"""Resume: a run that failed in epoch 3 continues from its last full checkpoint and ends as the uninterrupted run
did, bit for bit, its curves one curve from the first epoch; a resume that cannot continue the same training is
refused before any worker starts."""

from __future__ import annotations

import psutil
import pytest
from training_jobs import fine_tune_failing_once, train_ner_failing_once

import flair_nbddp
from flair_nbddp import ResumeError, WorkerError, launch, start
from flair_nbddp.synthetic import ner_corpus, sentiment_corpus

CURVES = ("train/loss", "dev/loss", "dev/score", "train/batch_loss")  # per epoch, and per step
CORPUS = dict(n_train=32, n_dev=8, n_test=8, seed=4)


@pytest.fixture(scope="module")
def whole(warm_pool, tiny_model_path, tmp_path_factory):
    """The uninterrupted 4-epoch run the interrupted ones are compared with (the same seed, corpus and function)."""
    corpus = sentiment_corpus(**CORPUS)
    base = tmp_path_factory.mktemp("whole")
    result = warm_pool.launch(fine_tune_failing_once, (corpus, tiny_model_path, str(base), str(base / "no-marker")),
                              seed=11, dashboard=False)  # fmt: skip
    assert [epoch for epoch, _ in result.history("dev/score")] == [1, 2, 3, 4]
    assert [checkpoint.epoch for checkpoint in result.checkpoints] == [1, 2, 3, 4]
    return result


@pytest.mark.process
def test_a_failed_run_resumed_from_its_last_checkpoint_ends_as_the_uninterrupted_run(whole, warm_pool, tiny_model_path,
                                                                                     tmp_path, capsys):  # fmt: skip
    corpus = sentiment_corpus(**CORPUS)
    marker = tmp_path / "fail"

    def run(name: str, **options):
        args = (corpus, tiny_model_path, str(tmp_path / name), str(marker))
        return launch(fine_tune_failing_once, args, seed=11, dashboard=False, **options)

    marker.touch()
    with pytest.raises(WorkerError, match="rank 1 failed in epoch 3"):
        run("interrupted", pool=warm_pool)
    failed = flair_nbddp.history(limit=1)[0]
    assert failed.status == "failed" and [c["epoch"] for c in failed.checkpoints] == [1, 2]

    resumed = run("interrupted", pool=warm_pool, resume=failed)  # on the workers the pool put in place
    # one curve, in the result and in the ledger: the failed run's up to its checkpoint (the end of epoch 2), then
    # the resumed run's own: the uninterrupted run's curves
    record = flair_nbddp.history(limit=1)[0]
    for name in CURVES:
        assert resumed.history(name) == record.history(name) == whole.history(name), name
    assert resumed.resumed_at == record.resumed_at == (2, failed.checkpoints[-1]["steps"]) == (2, 8)
    assert resumed.value["test_score"] == whole.value["test_score"]
    assert record.resumed_from == failed.id
    assert f"resuming run #{failed.id} from the end of epoch 2" in capsys.readouterr().out  # the cell says so

    # the same function and corpus are required...
    other = sentiment_corpus(**{**CORPUS, "seed": 5})
    with pytest.raises(ResumeError, match="the corpus differs"):
        launch(fine_tune_failing_once, (other, tiny_model_path, str(tmp_path / "other"), str(marker)),
               processes=2, device="cpu", dashboard=False, resume=failed.id)  # fmt: skip
    with pytest.raises(ResumeError, match="ran 2 processes and this one would run 1"):
        run("one", processes=1, device="cpu", resume="last")


@pytest.mark.process
def test_a_run_stopped_mid_epoch_resumes_from_the_batch_it_stopped_at_and_ends_as_the_uninterrupted_run(
    warm_pool, whole, tiny_model_path, tmp_path
):
    from conftest import wait_for

    corpus = sentiment_corpus(**CORPUS)
    absent = str(tmp_path / "no-marker")  # nothing fails in these runs

    def args(name: str) -> tuple:
        return (corpus, tiny_model_path, str(tmp_path / name), absent)

    run = start(fine_tune_failing_once, args("stopped"), pool=warm_pool, seed=11)
    wait_for(lambda: run.state.snapshot().epoch >= 2, 120, "epoch 2")
    run.stop()
    stopped = run.wait()
    ends = [checkpoint.epoch for checkpoint in stopped.checkpoints if not checkpoint.batch]  # epochs that ended
    assert stopped.status == "stopped" and ends == list(range(1, len(ends) + 1)) and 1 <= len(ends) < 4
    # the stop's own checkpoint, batches into the epoch after (none when the stop came at an epoch's last batch,
    # whose evaluation is still to come: then the end of the epoch before is the last)
    assert stopped.checkpoints[-1].epoch == ends[-1]
    resumed = warm_pool.launch(fine_tune_failing_once, args("stopped"), seed=11, dashboard=False, resume=stopped)
    for name in CURVES:
        assert resumed.history(name) == whole.history(name), name
    assert resumed.resumed_at == (stopped.checkpoints[-1].epoch, stopped.checkpoints[-1].steps)
    assert resumed.value["test_score"] == whole.value["test_score"]


# -- refusals, in the notebook's process: no worker starts --------------------------------------------------------


@pytest.fixture
def earlier(tmp_path):
    """A ledger holding one failed 2-process run of ``train`` that wrote checkpoints at the ends of epochs 1 and 2."""
    from flair_nbddp.ledger.store import Ledger, RunRecord
    from flair_nbddp.worker.checkpoint_files import FORMAT, write

    ledger = Ledger(tmp_path / "ledger.sqlite")
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir()
    sha256 = write(path, {"format": FORMAT, "epoch": 2})
    params = {"args": [{"type": "Corpus", "train": 48, "dev": 12, "test": 12, "sha256": "c0"}], "kwargs": {}}
    record = RunRecord(name="train", status="failed", source_hash="s0", params=params, world_size=2,
                       checkpoints=[{"epoch": 1, "path": str(path), "sha256": "old"},
                                    {"epoch": 2, "path": str(path), "sha256": sha256}])  # fmt: skip
    record.id = ledger.insert(record)
    return ledger, record, path


def _new(earlier_record, **changes):
    from dataclasses import replace

    return replace(earlier_record, **{"id": None, "status": "running", "checkpoints": [], **changes})


def test_a_resume_finds_the_last_checkpoint_by_result_record_id_or_last(earlier):
    from flair_nbddp.engine.resume import resume_point

    ledger, record, path = earlier
    for resume in (record, record.id, str(record.id), "last"):
        point = resume_point(resume, _new(record), 2, False, ledger)
        assert (point.record_id, point.epoch, point.path) == (record.id, 2, str(path))
    assert point.describe() == f"resuming run #{record.id} from the end of epoch 2 ({path})"


@pytest.mark.parametrize("change, cause", [
    (dict(source_hash="s1"), "the function's source differs from run #"),
    (dict(params={"args": [{"type": "Corpus", "sha256": "c1"}], "kwargs": {}}), "the corpus differs from run #"),
])  # fmt: skip
def test_another_function_or_corpus_is_refused_unless_forced(earlier, change, cause):
    from flair_nbddp.engine.resume import resume_point

    ledger, record, _ = earlier
    with pytest.raises(ResumeError, match=cause) as refused:
        resume_point(record.id, _new(record, **change), 2, False, ledger)
    assert "resume_force=True" in str(refused.value)
    assert resume_point(record.id, _new(record, **change), 2, True, ledger).epoch == 2


def test_a_changed_or_missing_checkpoint_or_another_world_size_or_no_run_is_refused(earlier):
    from flair_nbddp.engine.resume import resume_point

    ledger, record, path = earlier
    with pytest.raises(ResumeError, match="resumes its own random generators. Resume with processes=2"):
        resume_point(record, _new(record), 4, False, ledger)
    with pytest.raises(ResumeError, match="has no run #999"):
        resume_point(999, _new(record), 2, False, ledger)
    with pytest.raises(ResumeError, match="names no run"):
        resume_point(2.5, _new(record), 2, False, ledger)
    path.write_bytes(path.read_bytes()[:-4])  # cut: never read
    with pytest.raises(ResumeError, match="is not the checkpoint run #.* wrote \\(its sha256 differs"):
        resume_point(record, _new(record), 2, False, ledger)
    path.unlink()
    with pytest.raises(ResumeError, match="is gone"):
        resume_point(record, _new(record), 2, False, ledger)
    on_a_node = _new(record, id=8, checkpoints=[{"epoch": 2, "path": f"node-3:{path}", "sha256": "x"}])
    with pytest.raises(ResumeError, match=f"left its checkpoint on node node-3 \\({path}\\)"):
        resume_point(on_a_node, _new(record), 2, False, ledger)
    with pytest.raises(ResumeError, match="wrote no checkpoint"):
        resume_point(_new(record, id=7), _new(record), 2, False, ledger)


def test_a_ledger_an_earlier_version_wrote_gets_the_new_columns(tmp_path):
    import sqlite3

    from flair_nbddp.ledger.store import Ledger, RunRecord

    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as connection:  # schema 1: no checkpoints, no resumed_from
        connection.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, name, status, started_at)")
        connection.execute("INSERT INTO runs (name, status, started_at) VALUES ('train', 'finished', 1.0)")
        connection.execute("PRAGMA user_version = 1")
    ledger = Ledger(path)
    [old] = ledger.records()
    assert (old.name, old.checkpoints, old.resumed_from) == ("train", [], None)
    new_id = ledger.insert(RunRecord(name="train", checkpoints=[{"epoch": 1, "path": "p", "sha256": "x"}]))
    assert ledger.get(new_id).checkpoints == [{"epoch": 1, "path": "p", "sha256": "x"}]


@pytest.mark.process
def test_a_rank_killed_in_epoch_3_is_restarted_from_its_last_checkpoint_and_the_run_ends_as_the_uninterrupted_one(
    whole, warm_pool, tiny_model_path, tmp_path, capsys, monkeypatch
):
    from flair_nbddp.wire import payload

    corpus = sentiment_corpus(**CORPUS)
    marker = tmp_path / "kill"
    packing = []
    monkeypatch.setattr(payload, "write_payload", lambda *call, pack=payload.write_payload: packing.append(1) or
                        pack(*call))  # fmt: skip

    def args(name: str) -> tuple:
        return (corpus, tiny_model_path, str(tmp_path / name), str(marker), "kill")

    marker.touch()  # 4 batches an epoch: checkpoints every 3 steps, the last before the kill 1 batch into epoch 3
    result = warm_pool.launch(fine_tune_failing_once, args("restarted"), seed=11, dashboard=False, max_restarts=1,
                              checkpoint_every=3)  # fmt: skip
    assert result.status == "finished" and len(packing) == 1  # the corpus packed once for both attempts
    first, last = result.attempts
    assert isinstance(first.error, WorkerError) and first.error.exit_code == -9 and first.status == "failed"
    assert (last.error, last.status, last.resumed_from_epoch, last.record_id) == (None, "finished", 2, result.record_id)
    out = capsys.readouterr().out
    assert "rank 1 died (was killed by signal SIGKILL)" in out and "restart 1 of 1 from epoch 3, batch 1" in out
    failed = flair_nbddp.history(limit=2)[1]
    assert [(c["epoch"], c["batch"]) for c in failed.checkpoints] == [(0, 3), (1, 0), (1, 2), (2, 0), (2, 1)]
    assert failed.id == first.record_id and flair_nbddp.history(limit=1)[0].resumed_from == failed.id
    for name in CURVES:  # one curve from the first epoch: the uninterrupted run's, bit for bit
        assert result.history(name) == whole.history(name), name
    assert result.resumed_at == (2, failed.checkpoints[-1]["steps"]) == (2, 9)  # epoch 3, batch 1: step 9
    assert result.value["test_score"] == whole.value["test_score"]
    # the failed attempt's workers are gone (the pool replaced them), and the restart ran on the new ones
    assert not [rank.pid for rank in first.error.result.ranks if psutil.pid_exists(rank.pid)]
    assert {rank.pid for rank in result.ranks}.isdisjoint(rank.pid for rank in first.error.result.ranks)


@pytest.mark.process
def test_embeddings_flair_stored_on_evaluated_sentences_are_resumed_with_them(warm_pool, tmp_path):
    """flair's ``train`` stores the one-hot embeddings its evaluations computed on the dev and test sentences, and
    every later evaluation reuses them: a restart puts them back, or its dev scores would be others. Here on 2 ranks
    of a lazy corpus (its sentences named by where the corpus builds them from); a built corpus in one process:
    tests/test_checkpoints.py."""
    corpus = ner_corpus(n_train=32, n_dev=16, n_test=8, seed=3)
    marker = tmp_path / "fail"

    def run(name: str, **options):
        return warm_pool.launch(train_ner_failing_once, (corpus, str(tmp_path / name), str(marker)), seed=5,
                                dashboard=False, lazy_corpus=True, **options)  # fmt: skip

    whole = run("whole")
    marker.touch()
    restarted = run("restarted", max_restarts=1)
    assert [attempt.status for attempt in restarted.attempts] == ["failed", "finished"]
    for name in CURVES:
        assert restarted.history(name) == whole.history(name), name
    assert restarted.value["test_score"] == whole.value["test_score"]


@pytest.mark.process
def test_the_same_failure_after_every_restart_ends_the_run_with_the_last_error(warm_pool):
    from training_jobs import fail_at_once

    with pytest.raises(WorkerError, match="rank 1 fails every time") as failed:
        warm_pool.launch(fail_at_once, dashboard=False, max_restarts=2)
    attempts = failed.value.result.attempts
    assert [attempt.status for attempt in attempts] == ["failed"] * 3
    assert attempts[-1].error is failed.value and all(attempt.resumed_from_epoch == 0 for attempt in attempts)


@pytest.mark.process
def test_out_of_memory_with_halve_chunk_restarts_with_half_the_chunk_until_it_fits(warm_pool, tiny_model_path,
                                                                                  tmp_path, capsys):  # fmt: skip
    from training_jobs import fine_tune_out_of_memory_in_chunks_over_1

    corpus = sentiment_corpus(n_train=16, n_dev=4, n_test=4, seed=4)
    result = warm_pool.launch(fine_tune_out_of_memory_in_chunks_over_1, (corpus, tiny_model_path, str(tmp_path)),
                              seed=3, dashboard=False, on_oom="halve_chunk")  # fmt: skip
    assert result.status == "finished" and [attempt.status for attempt in result.attempts] == ["failed"] * 2 + ["finished"]
    assert all(isinstance(attempt.error, flair_nbddp.OutOfMemoryError) for attempt in result.attempts[:2])
    assert [attempt.resumed_from_epoch for attempt in result.attempts] == [0, 1, 1]  # each from the end of epoch 1
    out = capsys.readouterr().out
    assert "rank 1 ran out of memory; restarting from the end of epoch 1 with mini_batch_chunk_size=2" in out
    assert "with mini_batch_chunk_size=1" in out
    records = flair_nbddp.history(limit=3)
    assert [record.options.get("mini_batch_chunk_size") for record in records] == [1, 2, None]  # newest first


@pytest.mark.process
def test_the_panel_and_start_restart_a_run_whose_rank_failed_from_its_last_checkpoint(whole, warm_pool, tiny_model_path,
                                                                                     tmp_path):  # fmt: skip
    from flair_nbddp.notebook.panel import TrainingPanel
    from flair_nbddp.pool import set_current_pool
    from flair_nbddp.engine.restarts import RestartingRun

    marker = tmp_path / "fail"
    marker.touch()
    fixed = {"model_path": tiny_model_path, "base_path": str(tmp_path / "panel"), "marker": str(marker)}
    panel = TrainingPanel(fine_tune_failing_once, sentiment_corpus(**CORPUS), fixed=fixed, seed=11, max_restarts=1)
    set_current_pool(warm_pool)  # as after '%ddp_pool start': the panel runs on it
    try:
        run = panel.train()  # through start(), which returns a run that restarts itself
        first = run.current
        result = panel.wait(timeout=180)
    finally:
        set_current_pool(None)
    assert isinstance(run, RestartingRun) and run.current is not first and not first.active
    assert result.status == "finished" and [attempt.status for attempt in result.attempts] == ["failed", "finished"]
    assert result.attempts[1].resumed_from_epoch == 2 and result.value["test_score"] == whole.value["test_score"]
    [record] = panel.runs
    assert len(record.restarts) == 1 and "rank 1 failed (RuntimeError)" in record.restarts[0], record.restarts
    assert record.restarts[0].endswith("restart 1 of 1 from the end of epoch 2")
    assert not panel.active and not panel.train_button.disabled and "● finished" in panel.status.value
