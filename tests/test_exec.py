"""``WorkerPool.exec``: code on every rank of a warm pool, each rank keeping its namespace (2 gloo processes)."""

import _thread
import threading
import time

import pytest

from flair_nbddp import WorkerPool, history
from flair_nbddp.errors import ConfigurationError

pytestmark = pytest.mark.process


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


def test_an_interrupt_stops_the_code_on_every_rank_and_keeps_the_workers(pool):
    recycled = pool.recycled
    threading.Timer(4.0, _thread.interrupt_main).start()
    results = pool.exec("import time\nticks = 0\nwhile True:\n    ticks += 1\n    time.sleep(0.01)")
    assert [result.error.exc_type for result in results] == ["KeyboardInterrupt", "KeyboardInterrupt"]
    assert all(value > 10 for value in (result.value for result in pool.exec("ticks")))
    assert pool.recycled == recycled
    assert history(limit=1)[0].name == "exec"  # every exec is a run in the ledger too


def test_restart_empties_the_namespaces(pool, capsys):
    pool.exec("survivor = 1")
    pool.restart()
    assert [result.value for result in pool.exec("'survivor' in globals()")] == [False, False]
    assert "recycled the pool's workers (it was restarted)" in capsys.readouterr().out and not pool.exec_names


def test_a_rank_blocked_in_a_collective_after_an_interrupt_ends_the_workers_and_says_so(pool, capsys):
    pool.exec("before = 1")
    threading.Timer(4.0, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt, match="workers ended"):
        pool.exec("import torch.distributed as dist\ndist.barrier()", ranks=[0], stop_timeout=2)
    assert "not every rank returned within stop_timeout=2 s" in capsys.readouterr().out
    assert [result.value for result in pool.exec("'before' in globals()")] == [False, False]
    assert "namespaces empty (before gone)" in capsys.readouterr().out


def _interrupt_once_training(timeout: float = 120) -> threading.Thread:
    """Interrupt the notebook's main thread once the active run has trained its first batch."""
    from flair_nbddp import runs

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            active = [run for run in runs() if run.active]
            if active and active[-1].state.snapshot().first_batch_at is not None:
                _thread.interrupt_main()
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_an_interrupt_cuts_a_sleep_short_and_stops_training_after_the_same_batch(pool, tmp_path, tiny_model_path):
    threading.Timer(3.0, _thread.interrupt_main).start()
    started = time.monotonic()
    slept = pool.exec("import time\ntime.sleep(120)")
    assert [result.error.exc_type for result in slept] == ["KeyboardInterrupt"] * 2 and time.monotonic() - started < 30

    recycled = pool.recycled
    _interrupt_once_training()
    code = (
        "from training_jobs import train_sentiment\n"
        f"scores = train_sentiment({str(tiny_model_path)!r}, {str(tmp_path)!r}, epochs=50, docs=64)"
    )
    results = pool.exec(code)
    errors = [result.error for result in results]
    assert [error.exc_type for error in errors] == ["KeyboardInterrupt"] * 2
    assert all("stopped after the same batch on every rank" in error.message for error in errors)
    assert (tmp_path / "final-model.pt").exists() and pool.recycled == recycled  # saved, and the workers kept
    assert [result.value for result in pool.exec("world_size")] == [2, 2]
