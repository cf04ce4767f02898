"""Stopping, faults and hostile input (2 CPU processes with gloo). Kernel-level cases: test_kernel.py."""

import errno
import math
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import is_kit_worker, wait_for
from training_jobs import train_sentiment, train_then_return_a_generator

from flair_nbddp import RunActiveError, RunHangError, WorkerError, launch, start
from flair_nbddp.engine.local_ranks import TERMINATE_GRACE_SECONDS
from flair_nbddp.wire import payload

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_processes")]
TESTS = os.path.dirname(os.path.abspath(__file__))


def test_stop_ends_every_rank_after_the_same_batch_and_saves_the_model(tmp_path, tiny_model_path):
    run = start(train_sentiment, (tiny_model_path, str(tmp_path / "out")))
    wait_for(lambda: run.state.snapshot().batch >= 3, 120, "training to start")
    stopped_at = time.monotonic()
    run.stop()
    result = run.wait()
    freed_after, left_after = time.monotonic() - stopped_at, time.time() - run.state.ended_at
    assert result.status == "stopped", result.error
    assert result.checkpoint == tmp_path / "out" / "final-model.pt" and result.checkpoint.exists()
    # flair returned normally, without its final test evaluation (minutes on a real test split): no test score
    assert math.isnan(result.value["test_score"])
    assert "final test evaluation is skipped" in result.log and not (tmp_path / "out" / "test.tsv").exists()
    assert freed_after < 10, f"the cell was busy for {freed_after:.1f} s after Stop"
    assert "stopped from the notebook" in result.log
    assert run.state.snapshot().epoch == 1  # stopped early, not after 20 epochs
    # the workers left as soon as they were done, not after the interpreter's teardown (which frees every object the
    # training left, one by one: seconds), for which the notebook waited until its grace ran out
    assert left_after < TERMINATE_GRACE_SECONDS, f"the workers took {left_after:.1f} s to leave after the run ended"


def test_a_stop_while_the_workers_start_up_is_kept_until_training(tmp_path, tiny_model_path):
    run = start(train_sentiment, (tiny_model_path, str(tmp_path / "out")), stop_timeout=60)
    run.stop()  # the workers are still importing torch and joining their process group
    result = run.wait()
    assert result.status == "stopped" and result.checkpoint.exists(), result.error
    assert run.state.snapshot().batch == 1  # stopped after the first batch, not ended after stop_timeout


def _program(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )


def _read_until(process: subprocess.Popen, marker: str, timeout: float) -> str:
    seen = []
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            seen.append(line)
            if marker in line:
                return "".join(seen)
    finally:
        timer.cancel()
    raise AssertionError(f"{marker!r} never appeared:\n{''.join(seen)[-3000:]}")


def _workers_of(process: subprocess.Popen) -> list[psutil.Process]:
    return [c for c in psutil.Process(process.pid).children(recursive=True) if is_kit_worker(c)]


LAUNCHING_PROGRAM = """
import flair_nbddp
from training_jobs import train_sentiment
result = flair_nbddp.launch(train_sentiment, args=({model!r}, {base!r}), dashboard=False)
print("STATUS", result.status, result.checkpoint)
"""


def test_interrupt_stops_gracefully_and_returns_a_stopped_result(tmp_path, tiny_model_path):
    program = _program(LAUNCHING_PROGRAM.format(model=tiny_model_path, base=str(tmp_path / "out")))
    _read_until(program, "- iter ", 120)
    interrupted = time.monotonic()
    program.send_signal(signal.SIGINT)
    out = _read_until(program, "STATUS", 60)
    assert program.wait(30) == 0
    assert time.monotonic() - interrupted < 10
    assert "stopping after the current batch" in out
    assert f"STATUS stopped {tmp_path / 'out' / 'final-model.pt'}" in out
    assert (tmp_path / "out" / "final-model.pt").exists()


NAPPING_PROGRAM = """
import flair_nbddp
from training_jobs import nap
flair_nbddp.launch(nap, args=(600,), dashboard=False, stop_timeout={stop_timeout})
"""


def test_second_interrupt_ends_the_workers_at_once():
    # a stop request the function never honours (it never reaches a batch boundary)
    program = _program(NAPPING_PROGRAM.format(stop_timeout=300))
    _read_until(program, "napping", 60)  # every rank is in the function: the run has started
    workers = _workers_of(program)
    assert len(workers) == 2
    program.send_signal(signal.SIGINT)
    first = _read_until(program, "stopping after the current batch", 30)
    second = time.monotonic()
    program.send_signal(signal.SIGINT)
    out, _ = program.communicate(timeout=30)
    assert time.monotonic() - second < 5
    assert "interrupt again to end the workers now" in first and "KeyboardInterrupt" in out
    assert not any(worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE for worker in workers)


def test_workers_exit_when_the_kernel_dies():
    program = _program(NAPPING_PROGRAM.format(stop_timeout=30))
    _read_until(program, "napping", 60)
    workers = _workers_of(program)
    assert len(workers) == 2
    program.kill()
    program.wait()
    killed = time.monotonic()
    psutil.wait_procs(workers, timeout=10)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    assert time.monotonic() - killed < 10


def _spin_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        while True:  # an endless loop: rank 0 waits for it in the barrier below
            pass
    dist.barrier()


def test_hang_watchdog_ends_the_run_and_shows_every_stack():
    started = time.monotonic()
    with pytest.raises(RunHangError) as caught:
        launch(_spin_on_rank_one, hang_timeout=5, dashboard=False)
    message = str(caught.value)
    assert "no rank made progress for 5 s" in message
    assert "--- rank 0 ---" in message and "--- rank 1 ---" in message
    assert "_spin_on_rank_one" in message.split("--- rank 1 ---")[1]
    assert time.monotonic() - started < 60


def test_unpicklable_return_still_reports_the_saved_model(tmp_path, tiny_model_path):
    with pytest.raises(WorkerError) as caught:
        launch(train_then_return_a_generator, args=(tiny_model_path, str(tmp_path / "out")), dashboard=False)
    saved = tmp_path / "out" / "final-model.pt"
    assert "returned a generator that cannot be sent back" in str(caught.value)
    assert f"The trained model is safe: rank 0 saved {saved}" in str(caught.value) and saved.exists()


def _sleep_and_report_port(seconds):
    import os
    import time

    time.sleep(seconds)
    return os.environ["MASTER_PORT"]


def test_a_second_launch_on_the_devices_of_a_running_one_is_refused_and_the_first_continues():
    first = start(_sleep_and_report_port, (4,))
    held = r"the CPU's 2 process slots are held: 2 by run (#\d+ )?'_sleep_and_report_port'"
    with pytest.raises(RunActiveError, match=held):
        launch(_sleep_and_report_port, args=(0,), dashboard=False)
    result = first.wait()
    assert result.status == "finished" and result.value.isdigit()


def test_stop_of_a_function_outside_training_ends_it_after_stop_timeout():
    run = start(_sleep_and_report_port, (600,), stop_timeout=2)
    wait_for(lambda: run.state.snapshot().status == "running", 60, "workers")
    asked = time.monotonic()
    run.stop()
    result = run.wait()
    assert result.status == "stopped" and result.value is None
    assert 2 <= time.monotonic() - asked < 10


def test_full_disk_is_reported_before_any_worker_starts(monkeypatch):
    def no_space(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(payload, "_write_private", no_space)
    before = {child.pid for child in psutil.Process().children()}  # the test run's JupyterLab may be there
    with pytest.raises(OSError, match="cannot write the run's payload .* No space left on device"):
        launch(print, dashboard=False)
    assert {child.pid for child in psutil.Process().children()} <= before


def test_rendezvous_listens_on_loopback_only():
    run = start(_sleep_and_report_port, (15,))
    try:
        wait_for(lambda: run.state.snapshot().status == "running", 60, "workers")
        pids = {rank.pid for rank in run.state.snapshot().ranks}
        listening = [c for c in psutil.net_connections("tcp") if c.pid in pids and c.status == psutil.CONN_LISTEN]
        assert listening, "rank 0 serves the rendezvous store"
        assert {c.laddr.ip for c in listening} <= {"127.0.0.1"}, listening
    finally:
        run.kill()  # a stop would wait for the sleep to end: the function never reaches a batch boundary


@pytest.mark.process
def test_a_rank_out_of_memory_ends_every_rank_in_seconds_with_an_error_naming_the_batch_and_the_fix(
    tiny_model_path, tmp_path
):
    from training_jobs import fine_tune_running_out_of_memory

    from flair_nbddp import OutOfMemoryError, WorkerError
    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(n_train=32, n_dev=4, n_test=4, seed=3)
    run = start(fine_tune_running_out_of_memory, (corpus, tiny_model_path, str(tmp_path)), processes=2, device="cpu")
    wait_for(lambda: run.state.snapshot().batch >= 1, 120, "training to start")
    started = time.monotonic()
    result = run.wait(timeout=60)
    assert time.monotonic() - started < 10  # rank 0 was not left waiting in its collective
    error = result.error
    assert isinstance(error, OutOfMemoryError) and isinstance(error, WorkerError) and isinstance(error, MemoryError)
    assert error.rank == 1 and error.memory["mini_batch_size"] == 4 and error.memory["mini_batch_chunk_size"] == 2
    text = str(error)
    assert "rank 1 ran out of memory on cpu in epoch 1, batch 2, with mini_batch_size=4 and mini_batch_chunk_size=2" in text
    assert "GiB were in use" in text and "Fix: pass mini_batch_chunk_size=1" in text
    assert not [pid for pid in (rank.pid for rank in result.ranks) if psutil.pid_exists(pid)]


def test_a_worker_leaves_without_the_interpreters_teardown_but_runs_what_was_registered_at_exit():
    """The notebook waits for its workers to be gone; the interpreter's teardown frees every object a training left,
    one by one (seconds after a real one), so a worker done with its jobs leaves at once: what was registered to run
    at exit runs (logging's files, a W&B run's finish), objects are not torn down."""
    code = (
        "import atexit\n"
        "class Torn:\n"
        "    def __del__(self): print('torn down', flush=True)\n"
        "kept = Torn()\n"
        "atexit.register(print, 'at exit', flush=True)\n"
        "from flair_nbddp.worker.main import _leave\n"
        "_leave()\n"
        "print('after', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.split("\n")) == (0, ["at exit", ""]), done.stderr[-2000:]
