"""Warm workers reused across jobs (2 CPU processes with gloo)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import is_kit_worker, wait_for
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from training_jobs import train_sentiment

from flair_nbddp import PoolClosedError, WorkerError, WorkerPool, start

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_processes")]
TESTS = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK_CELL = """
import os
COUNTER = {"calls": 0}

def identity_and_state():
    # what a job sees of its process: pid, rank, a global, the flair logger, the RNG
    import logging
    import random

    import torch.distributed as dist

    COUNTER["calls"] += 1
    flair_log = logging.getLogger("flair")
    seen = (os.getpid(), dist.get_rank(), COUNTER["calls"], flair_log.disabled, len(flair_log.handlers),
            random.random())
    flair_log.disabled = True  # a job that leaves the logger broken...
    flair_log.addHandler(logging.NullHandler())  # ...and a handler behind
    return seen
"""
_cell = {"__name__": "__main__"}  # like a notebook cell: a file-less __main__, so it travels by value
exec(NOTEBOOK_CELL, _cell)
_identity_and_state = _cell["identity_and_state"]


def _boom():
    raise ValueError("job failed")


def _say(word):
    import torch.distributed as dist

    print(f"{word}-{dist.get_rank()}", flush=True)
    return word


@pytest.fixture
def pool():
    with WorkerPool(processes=2, device="cpu") as pool:
        yield pool
    assert not pool.started


def test_jobs_reuse_the_same_processes_and_do_not_leak_into_each_other(pool):
    first = pool.launch(_identity_and_state, dashboard=False, seed=7)
    second = pool.launch(_identity_and_state, dashboard=False, seed=7)
    pid1, rank1, calls1, disabled1, handlers1, random1 = first.value
    pid2, rank2, calls2, disabled2, handlers2, random2 = second.value
    assert pid1 == pid2 and rank1 == rank2 == 0 and pool.pids[0] == pid1
    assert calls1 == calls2 == 1  # each job unpickles its own function and globals
    assert disabled2 is False and handlers2 == handlers1  # the flair logger was restored
    assert random1 == random2  # the seed is applied per job
    assert "WorkerPool: 2 × cpu (gloo), warm; 2 job(s) run, 0 recycle(s)" in pool.status()
    # a layout the pool does not have is refused before anything is sent, and the pool stays usable
    with pytest.raises(ValueError, match=r"the warm pool runs 2 × cpu \(gloo\), not 1 process: leave processes/device/gpus out"):
        pool.launch(_identity_and_state, dashboard=False, processes=1)
    assert pool.launch(_identity_and_state, dashboard=False, device="cpu", processes=2).value[0] == pid1


def test_each_job_on_a_pool_has_its_own_run_directory_and_logs(pool, tmp_path):
    first = pool.launch(_say, args=("first",), dashboard=False)
    second = pool.launch(_say, args=("second",), dashboard=False, run_dir=tmp_path / "mine")
    assert second.run_dir == tmp_path / "mine" and first.run_dir != second.run_dir != pool.run_dir
    assert second.log == "second-0"  # rank 0's output of this job only
    for rank in (0, 1):
        first_lines = first.log_files[rank].read_text().splitlines()
        assert f"first-{rank}" in first_lines and not any("second" in line for line in first_lines)
        assert second.log_files[rank].read_text().splitlines() == [f"second-{rank}"]
        assert second.log_files[rank].parent == tmp_path / "mine"


def test_failed_job_recycles_the_workers_and_says_so(pool, capsys):
    pool.warm_up()
    old = pool.pids
    with pytest.raises(WorkerError, match="job failed"):
        pool.launch(_boom, dashboard=False)
    result = pool.launch(_identity_and_state, dashboard=False)
    assert result.value[0] not in old and pool.recycled == 1
    assert "recycled the pool's workers (the last job failed)" in capsys.readouterr().out


def test_a_worker_killed_between_jobs_is_noticed_and_replaced(pool):
    pool.warm_up()
    victim = pool.pids[1]
    os.kill(victim, signal.SIGKILL)
    psutil.Process(victim).wait(10) if psutil.pid_exists(victim) else None
    result = pool.launch(_identity_and_state, dashboard=False)
    assert result.status == "finished" and victim not in pool.pids
    assert "worker(s) [1] had exited" in pool.notes[-1]


def test_training_twice_on_warm_workers_then_a_stopped_job_recycles_them(pool, tiny_model_path, tmp_path):
    first = pool.launch(train_sentiment, args=(tiny_model_path, str(tmp_path / "a")),
                        kwargs={"epochs": 2, "batch": 16, "docs": 96}, dashboard=False)
    pids = pool.pids
    second = pool.launch(train_sentiment, args=(tiny_model_path, str(tmp_path / "b")),
                         kwargs={"epochs": 2, "batch": 16, "docs": 96}, dashboard=False)
    assert first.status == second.status == "finished" and pool.pids == pids
    assert len(second.history("train/loss")) == 2 and "EPOCH 2 done" in second.log

    # a stopped job (Stop in the dashboard or panel) leaves its workers to be recycled
    run = start(train_sentiment, (tiny_model_path, str(tmp_path / "c")), {"docs": 96}, pool=pool)
    wait_for(lambda: run.state.snapshot().batch >= 2, 120, "training to start")
    run.stop()
    assert run.wait().status == "stopped"
    recycled = pool.recycled
    third = pool.launch(train_sentiment, args=(tiny_model_path, str(tmp_path / "d")),
                        kwargs={"epochs": 1, "batch": 16, "docs": 32}, dashboard=False)
    assert third.status == "finished" and pool.recycled == recycled + 1 and set(pool.pids).isdisjoint(pids)
    assert "recycled the pool's workers" in pool.notes[-1]


def test_closing_ends_the_workers():
    pool = WorkerPool(processes=2, device="cpu").warm_up()
    workers = [psutil.Process(pid) for pid in pool.pids]
    pool.close()
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    with pytest.raises(PoolClosedError, match="closed"):
        pool.launch(_boom)


def test_pool_workers_exit_when_the_kernel_dies():
    program = subprocess.Popen(
        [sys.executable, "-c", "import time, flair_nbddp\np = flair_nbddp.WorkerPool(2, 'cpu').warm_up()\n"
         "print('warm', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    assert program.stdout.readline().strip() == "warm"
    workers = [c for c in psutil.Process(program.pid).children(recursive=True) if is_kit_worker(c)]
    assert len(workers) == 2
    program.kill()
    program.wait()
    killed = time.monotonic()
    psutil.wait_procs(workers, timeout=10)
    assert time.monotonic() - killed < 10
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)


def test_ddp_pool_magic_starts_is_used_by_ddp_train_and_stops():
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "flair_nbddp")
        shell.run_line_magic("ddp_pool", "start 2 --device cpu")
        from flair_nbddp.pool import current_pool

        pool = current_pool()
        pids = pool.pids
        assert shell.run_cell_magic("ddp_train", "--no-dashboard", "import os\nos.getpid()") == pids[0]
        assert shell.run_cell_magic("ddp_train", "--no-dashboard", "import os\nos.getpid()") == pids[0]
        with pytest.raises(UsageError, match=r"the warm pool runs 2 × cpu \(gloo\)"):
            shell.run_cell_magic("ddp_train", "--processes 1", "1")
        with pytest.raises(UsageError, match="already started"):
            shell.run_line_magic("ddp_pool", "start")
        shell.run_line_magic("ddp_pool", "stop")
        assert current_pool() is None and not pool.started
    finally:
        from flair_nbddp.pool import current_pool

        if current_pool():
            current_pool().close()
        InteractiveShell.clear_instance()
