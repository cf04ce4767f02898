"""``WorkerPool.exec``: code on every rank of a warm pool, each rank keeping its namespace (2 gloo processes)."""

import _thread
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flair_nbddp import WorkerPool, history
from flair_nbddp.errors import ConfigurationError

pytestmark = pytest.mark.process


MARK = "import pathlib, time\npathlib.Path(marks, f'running-{rank}').touch()"  # a cell's first line: it runs
GUARD = 300  # seconds: a run whose interrupt never reached it ends by its timeout, and the test fails, not hangs


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, "cpu") as pool:
        yield pool


def _total_of_ranks():
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    return int(total)


@contextlib.contextmanager
def _interrupt_when(ready: Callable[[], bool], settle: float = 1.0, timeout: float = 120) -> Iterator[None]:
    """Interrupt the notebook's main thread once ``ready()`` holds and ``settle`` seconds more have passed: the
    interrupt reaches the ranks' code, not their start-up, however loaded the machine is. Never after the block."""
    done = threading.Event()

    def watch():
        deadline = time.monotonic() + timeout
        while not ready():
            if done.wait(0.1) or time.monotonic() > deadline:
                return  # the block ended, or the code never got there: its run's own timeout fails the test
        if not done.wait(settle):
            _thread.interrupt_main()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _marked(directory: Path, *ranks: int) -> Callable[[], bool]:
    """Whether every one of ``ranks`` has run :data:`MARK` in ``directory``."""
    return lambda: all((directory / f"running-{rank}").exists() for rank in ranks)


def _training() -> bool:
    """Whether the active run has trained its first batch."""
    from flair_nbddp import runs

    active = [run for run in runs() if run.active]
    return bool(active) and active[-1].state.snapshot().first_batch_at is not None


def test_code_and_functions_run_on_every_rank_with_its_own_namespace(pool, capsys):
    results = pool.exec("base = rank * 100 + shift\nprint('rank', rank, 'of', world_size, 'on', device)\nbase",
                        variables={"shift": 7}, reset=True)  # fmt: skip
    assert [(result.rank, result.ok, result.value) for result in results] == [(0, True, 7), (1, True, 107)]
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 of 2 on cpu" in out and "[rank 1] rank 1 of 2 on cpu" in out
    assert [result.value for result in pool.exec("base + 1")] == [8, 108]  # kept from the cell before
    assert [result.value for result in pool.exec(_total_of_ranks)] == [3, 3]  # a function; collectives work
    assert pool.exec_names >= {"base"}
    assert [result.value for result in pool.exec("'base' in globals()", reset=True)] == [False, False]


def test_a_subset_of_ranks_runs_alone_and_wrong_ranks_are_refused(pool):
    results = pool.exec("rank * 2", ranks=[1])
    assert [(result.ran, result.value) for result in results] == [(False, None), (True, 2)]
    with pytest.raises(ConfigurationError, match=r"ranks \[2\]: the pool has ranks 0 to 1"):
        pool.exec("rank", ranks=[2])


def test_an_error_stays_with_its_rank_and_the_pool_goes_on(pool):
    recycled = pool.recycled
    pool.exec("kept = 'still here'")
    results = pool.exec("if rank == 1:\n    raise ValueError(f'bad on {rank}')\nkept")
    assert results[0].ok and results[0].value == "still here"
    error = results[1].error
    assert (error.rank, error.exc_type, error.message) == (1, "ValueError", "bad on 1")
    assert 'File "<ddp_exec cell>", line 2' in error.remote_traceback
    assert [result.value for result in pool.exec("kept")] == ["still here"] * 2
    unsendable = pool.exec("import threading\nthreading.Lock()")
    assert {result.error.exc_type for result in unsendable} == {"ShippingError"}
    assert pool.recycled == recycled  # no worker was replaced


def test_an_interrupt_stops_the_code_on_every_rank_and_keeps_the_workers(pool, tmp_path):
    recycled = pool.recycled
    with _interrupt_when(_marked(tmp_path, 0, 1)):
        code = f"{MARK}\nticks = 0\nwhile True:\n    ticks += 1\n    time.sleep(0.01)"
        results = pool.exec(code, variables={"marks": str(tmp_path)}, timeout=GUARD)
    assert [result.error.exc_type for result in results] == ["KeyboardInterrupt", "KeyboardInterrupt"]
    assert all(value > 10 for value in (result.value for result in pool.exec("ticks")))
    assert pool.recycled == recycled
    assert history(limit=1)[0].name == "exec"  # every exec is a run in the ledger too


def test_restart_empties_the_namespaces(pool, capsys):
    pool.exec("survivor = 1")
    pool.restart()
    assert [result.value for result in pool.exec("'survivor' in globals()")] == [False, False]
    assert "recycled the pool's workers (it was restarted)" in capsys.readouterr().out and not pool.exec_names


def test_a_rank_blocked_in_a_collective_after_an_interrupt_ends_the_workers_and_says_so(pool, capsys, tmp_path):
    pool.exec("before = 1")
    code = f"{MARK}\nimport torch.distributed as dist\ndist.barrier()"
    with _interrupt_when(_marked(tmp_path, 0)), pytest.raises(KeyboardInterrupt, match="workers ended"):
        pool.exec(code, variables={"marks": str(tmp_path)}, ranks=[0], stop_timeout=2, timeout=GUARD)
    assert "not every rank returned within stop_timeout=2 s" in capsys.readouterr().out
    assert [result.value for result in pool.exec("'before' in globals()")] == [False, False]
    assert "namespaces empty (before gone)" in capsys.readouterr().out


def test_an_interrupt_cuts_a_sleep_short_and_stops_training_after_the_same_batch(pool, tmp_path, tiny_model_path):
    started = time.monotonic()
    with _interrupt_when(_marked(tmp_path, 0, 1), settle=0.5):
        slept = pool.exec(f"{MARK}\ntime.sleep(120)", variables={"marks": str(tmp_path)}, timeout=GUARD)
    assert [result.error.exc_type for result in slept] == ["KeyboardInterrupt"] * 2 and time.monotonic() - started < 30

    recycled = pool.recycled
    code = (
        "from training_jobs import train_sentiment\n"
        f"scores = train_sentiment({str(tiny_model_path)!r}, {str(tmp_path)!r}, epochs=50, docs=64)"
    )
    with _interrupt_when(_training, settle=0.0):
        results = pool.exec(code, timeout=GUARD)
    errors = [result.error for result in results]
    assert [error.exc_type for error in errors] == ["KeyboardInterrupt"] * 2
    assert all("stopped after the same batch on every rank" in error.message for error in errors)
    assert (tmp_path / "final-model.pt").exists() and pool.recycled == recycled  # saved, and the workers kept
    assert [result.value for result in pool.exec("world_size")] == [2, 2]
