"""A Run on a worker source of the test's own (no processes): the protocol, the defects it had, its limits."""

import _thread
import os
import socket
import threading
import time
from multiprocessing.connection import Connection

from pathlib import Path

import pytest
from conftest import wait_for

import flair_nbddp
from flair_nbddp.engine.devices import DevicePlan
from flair_nbddp.errors import (
    DashboardUnavailableError,
    RunHangError,
    RunStateError,
    StillRunningError,
    WorkerError,
    describe_exit,
)
from flair_nbddp.options import RunOptions
from flair_nbddp.engine.restarts import RestartingRun
from flair_nbddp.engine.run import Run, runs
from flair_nbddp.wire import payload
from flair_nbddp.wire.events import (
    CheckpointSaved,
    EventSender,
    Failed,
    Finished,
    Job,
    ResultReady,
    Started,
)


class FakeRanks:
    """A :class:`~flair_nbddp.engine.worker_source.RankGroup` whose ranks are this test: it sends their events
    itself."""

    def __init__(self, world_size: int) -> None:
        pairs = [socket.socketpair() for _ in range(world_size)]
        self.connections = [Connection(parent.detach()) for parent, _ in pairs]
        self.ranks = [EventSender(Connection(child.detach())) for _, child in pairs]
        self.terminating = False
        self.requests: list = []

    def send_all(self, message):
        self.requests.append(message)

    def dead_ranks(self):
        return {}

    def wait_exit(self, rank, timeout):
        return -15 if self.terminating else 0

    def collect_stacks(self):
        return {rank: f'File "train.py", line 7 in spin (rank {rank})' for rank in range(len(self.ranks))}

    def terminate(self, grace=0.0):
        if not self.terminating:
            self.terminating = True
            for rank in self.ranks:
                rank.connection.close()


class FakeSource:
    """A :class:`~flair_nbddp.engine.worker_source.WorkerSource` of :class:`FakeRanks`, recording what the run asked
    of it."""

    def __init__(self, world_size: int = 2) -> None:
        self.plan = DevicePlan("cpu", world_size, "gloo")
        self.jobs: list[Job] = []
        self.releases: list[tuple[bool, str]] = []
        self.ranks: FakeRanks | None = None
        self.preloads: list[tuple[str, ...]] = []

    def prepare(self, run_dir, preload):
        self.preloads.append(preload)

    def acquire(self, job):
        self.jobs.append(job)
        self.ranks = FakeRanks(self.plan.world_size)
        return self.ranks

    def release(self, clean, reason):
        self.releases.append((clean, reason))


def double(x):
    return 2 * x


@pytest.fixture
def source():
    return FakeSource()


def finish(source: FakeSource, value, written: bytes | None = None) -> None:
    """What the ranks of a finished job (the source's last) send; rank 0 writes the value where the job says (or,
    given ``written``, those bytes instead)."""
    job = source.jobs[-1]
    for rank, sender in enumerate(source.ranks.ranks):
        sender.send(Started(rank, pid=100 + rank, device="cpu"))
    if written is None:
        payload.write_result(job.result, value)
    else:
        Path(job.result).write_bytes(written)
    source.ranks.ranks[0].send(ResultReady(0, job.result))
    for rank, sender in enumerate(source.ranks.ranks):
        sender.send(Finished(rank))


def test_a_run_needs_nothing_of_its_source_but_the_protocol(source, tmp_path):
    run = Run(double, (21,), {}, source, RunOptions(seed=3, run_dir=tmp_path / "run", distributed_eval=False)).start()
    [job] = source.jobs
    assert (job.seed, job.run_dir, job.distributed_eval) == (3, str(tmp_path / "run"), False)
    assert payload.read_payload(job.payload)[1] == (21,)  # the call, packed once for every rank
    finish(source, 42)
    result = run.wait(timeout=10)
    assert (result.status, result.value, result.world_size, result.seed) == ("finished", 42, 2, 3)
    assert source.releases == [(True, "finished")]  # its ranks may take the next job
    assert result.log_files == {rank: tmp_path / "run" / f"rank{rank}.log" for rank in (0, 1)}
    assert not (tmp_path / "run" / "payload.pkl").exists() and not (tmp_path / "run" / "result.pkl").exists()


def test_ranks_sharing_a_gpu_say_so_once_and_the_ledger_records_it(source, capsys):
    source.plan = DevicePlan("cuda", 2, "gloo", (0,))
    run = Run(double, (1,), {}, source).start()
    finish(source, 2)
    result = run.wait(timeout=10)
    notice = "flair_nbddp: rehearsal: 2 ranks share GPU 0 over gloo; speed is not representative"
    assert capsys.readouterr().out.count(notice) == 1
    assert (result.device_type, result.backend) == ("cuda", "gloo")
    assert flair_nbddp.history(limit=1)[0].devices == "2 × cuda sharing GPU 0 (gloo)"


def test_a_run_started_with_restarts_starts_again_when_a_rank_fails_and_lists_its_attempts(source, capsys,
                                                                                            monkeypatch):  # fmt: skip
    packing = []
    monkeypatch.setattr(payload, "write_payload", lambda *call, pack=payload.write_payload: packing.append(1) or
                        pack(*call))  # fmt: skip
    run = RestartingRun(double, (21,), {}, RunOptions(max_restarts=1), source, None).start()
    first = run.current
    for rank, sender in enumerate(source.ranks.ranks):
        sender.send(Started(rank, pid=100 + rank, device="cpu"))
    source.ranks.ranks[1].send(Failed(1, "RuntimeError", "rank 1 failed", "Traceback (most recent call last): ..."))
    wait_for(lambda: len(source.jobs) == 2, 10, "the second attempt")  # the same call, not packed again
    assert len(packing) == 1 and payload.read_payload(source.jobs[1].payload)[1] == (21,)
    kept = run.restarts.payload.path
    assert kept.is_file() and os.path.samefile(kept, source.jobs[1].payload)  # the same file, linked
    assert run.current is not first and not first.active and run.active
    finish(source, 42)
    result = run.wait(timeout=10)
    assert (result.status, result.value) == ("finished", 42) and not run.active
    assert [attempt.status for attempt in result.attempts] == ["failed", "finished"]
    assert isinstance(result.attempts[0].error, WorkerError) and result.attempts[0].error.rank == 1
    assert "rank 1 failed (RuntimeError); restart 1 of 1 from the start" in capsys.readouterr().out
    assert not kept.parent.exists()  # the kept payload goes with the run


class KilledRanks(FakeRanks):
    """Rank 1 killed by SIGKILL (e.g. by the kernel's out-of-memory killer): its channel is closed at once, and rank 0
    has reported the collective that broke. Its exit code is known only once it is waited for (a forked rank's
    comes through the fork server)."""

    def __init__(self) -> None:
        super().__init__(2)
        for rank, sender in enumerate(self.ranks):
            sender.send(Started(rank, pid=100 + rank, device="cpu"))
        self.ranks[0].send(Failed(0, "RuntimeError", "Connection closed by peer [127.0.0.1]:9090", "Traceback: ..."))
        self.ranks[1].connection.close()

    def wait_exit(self, rank, timeout):
        return -9 if rank == 1 else super().wait_exit(rank, timeout)

    def describe_exit(self, rank, exit_code):
        return f"the worker process {describe_exit(exit_code)}"


def test_a_rank_killed_by_a_signal_is_blamed_not_the_peer_that_lost_it(source):
    source.acquire = lambda job: source.jobs.append(job) or setattr(source, "ranks", KilledRanks()) or source.ranks
    result = Run(double, (1,), {}, source).start().wait(timeout=10)
    assert (result.status, result.error.rank, result.error.exit_code) == ("failed", 1, -9)
    assert "killed by signal SIGKILL" in str(result.error)


def test_an_interrupted_run_with_restarts_stops_and_is_not_started_again(source, capsys):
    run = RestartingRun(double, (21,), {}, RunOptions(max_restarts=3, stop_timeout=0.5), source, None).start()
    threading.Timer(0.2, _thread.interrupt_main).start()  # the kernel's Interrupt while the cell waits
    result = run.wait(timeout=10)  # the ranks never answer the stop: ended after stop_timeout, no attempt follows
    assert "stopping after the current batch on every rank" in capsys.readouterr().out
    assert run.state.stop_requested and len(source.jobs) == 1 and not result.attempts and not run.active


def test_a_resumed_run_that_writes_no_checkpoint_of_its_own_is_resumed_from_where_it_began(source, tmp_path):
    import hashlib

    checkpoint = tmp_path / "checkpoint.pt"  # what rank 0 of the first run wrote, 5 batches into epoch 2
    checkpoint.write_bytes(b"state")
    sha256 = hashlib.sha256(b"state").hexdigest()
    first = Run(double, (1,), {}, source).start()
    source.ranks.ranks[0].send(CheckpointSaved(0, epoch=1, path=str(checkpoint), sha256=sha256, batch=5))
    finish(source, 2)
    stopped = first.wait(timeout=10)
    # a stop before its first own checkpoint (e.g. at its epoch's last batch, whose evaluation is still to come)
    resumed = Run(double, (1,), {}, source, RunOptions(resume=stopped)).start()
    finish(source, 2)
    again = Run(double, (1,), {}, source, RunOptions(resume=resumed.wait(timeout=10))).start()
    assert [(job.resume, job.resume_sha256) for job in source.jobs[1:]] == [(str(checkpoint), sha256)] * 2
    assert flair_nbddp.history(limit=1)[0].resumed_from == resumed.record_id
    finish(source, 2)
    assert again.wait(timeout=10).checkpoints == stopped.checkpoints


def test_several_threads_waiting_for_one_run_get_the_same_result(source):
    run = Run(double, (1,), {}, source).start()
    results = []
    waiters = [threading.Thread(target=lambda: results.append(run.wait(timeout=10))) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    finish(source, 2)
    for waiter in waiters:
        waiter.join()
    assert len(results) == 3 and all(result is results[0] for result in results)
    assert source.releases == [(True, "finished")]  # released once


def test_wait_before_start_is_refused_at_once(source):
    run = Run(double, (1,), {}, source)
    started = time.monotonic()
    with pytest.raises(RunStateError, match="not started: call run.start"):
        run.wait()
    assert time.monotonic() - started < 1 and source.jobs == []


def test_a_run_starts_once(source):
    run = Run(double, (1,), {}, source).start()
    with pytest.raises(RunStateError, match="started already"):
        run.start()
    finish(source, 2)
    run.wait(timeout=10)


def test_wait_with_a_timeout_leaves_the_run_going(source):
    run = Run(double, (1,), {}, source).start()
    with pytest.raises(StillRunningError, match="did not end within 0.2 s"):
        run.wait(timeout=0.2)
    assert run.active
    finish(source, 2)
    assert run.wait(timeout=10).value == 2


def test_an_impossible_dashboard_is_refused_before_the_source_is_asked(source):
    before = len(runs())
    with pytest.raises(DashboardUnavailableError, match="needs a Jupyter kernel"):
        flair_nbddp.launch(double, (1,), dashboard=True, pool=source)
    assert source.jobs == [] and len(runs()) == before


def test_the_log_of_a_run_nobody_waits_for_stays_bounded(source):
    run = Run(double, (1,), {}, source).start()
    limit = run.state.max_log_lines
    with open(run.log_files[0], "a") as log:
        log.writelines(f"line {i}\n" for i in range(limit + 5000))
    wait_for(lambda: run.state.log_since(0)[1] == limit + 5000, 20, "the supervisor to read the log")
    assert len(run.state.snapshot().log_lines) == limit
    lines, cursor = run.state.log_since(0)
    assert (lines[0], lines[-1], cursor) == ("line 5000", f"line {limit + 4999}", limit + 5000)
    finish(source, 2)
    assert run.wait(timeout=10).log.count("\n") == limit - 1


def test_the_hang_watchdog_ends_the_run_without_copying_snapshots(source):
    run = Run(double, (1,), {}, source, RunOptions(hang_timeout=0.5)).start()
    snapshots = []
    take_snapshot = run.state.snapshot
    run.state.snapshot = lambda: snapshots.append(1) or take_snapshot()
    for rank, sender in enumerate(source.ranks.ranks):
        sender.send(Started(rank, pid=100 + rank, device="cpu"))
    assert run._supervisor.done.wait(20), "the watchdog did not end the run"
    result = run.wait(timeout=10)
    assert snapshots == [1, 1]  # the failure's and the result's: of ten checks a second for 0.5 s, none copied them
    assert result.status == "failed" and isinstance(result.error, RunHangError)
    assert "line 7 in spin (rank 1)" in str(result.error) and source.ranks.terminating
    assert source.releases == [(False, "failed")]


def test_a_result_that_cannot_be_read_fails_the_run_and_frees_the_kernel(source):
    run = Run(double, (1,), {}, source).start()
    finish(source, 2, written=b"not a pickle")  # what rank 0 wrote cannot be read
    result = run.wait(timeout=10)
    assert result.status == "failed" and "could not be read back in the notebook" in str(result.error)
    assert source.releases == [(False, "failed")] and not run.active  # the next run may start


def test_kill_after_the_end_leaves_the_ranks_alone(source):
    run = Run(double, (1,), {}, source).start()
    finish(source, 2)
    result = run.wait(timeout=10)
    assert run.kill() is result and not source.ranks.terminating  # they may be a pool's, on its next job


def test_a_reused_run_directory_shows_only_this_runs_output(source, tmp_path):
    (tmp_path / "rank0.log").write_text("an earlier run's line\n")
    run = Run(double, (1,), {}, source, RunOptions(run_dir=tmp_path)).start()
    with open(run.log_files[0], "a") as log:
        log.write("this run's line\n")
    finish(source, 2)
    assert run.wait(timeout=10).log == "this run's line"


def test_new_workers_start_while_a_corpus_is_packed_and_go_if_packing_fails(source):
    from flair_nbddp.errors import ShippingError
    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(n_train=4, n_dev=1, n_test=1)
    run = Run(len, (corpus,), {}, source, RunOptions(hang_timeout=None)).start()
    assert source.preloads == [("torch", "flair")] and len(source.jobs) == 1
    finish(source, 6)
    assert run.wait(timeout=10).value == 6
    other = FakeSource()
    with pytest.raises(ShippingError):
        Run(len, (corpus, threading.Lock()), {}, other, RunOptions(hang_timeout=None)).start()
    assert other.preloads == [("torch", "flair")] and other.jobs == []  # prepared, never handed a job
    assert other.releases == [(True, "failed to start")]  # so what was started for it goes
    quick = Run(double, (2,), {}, other, RunOptions(hang_timeout=None)).start()  # a call that packs at once prepares nothing
    assert other.preloads == [("torch", "flair")]
    finish(other, 4)
    assert quick.wait(timeout=10).value == 4
