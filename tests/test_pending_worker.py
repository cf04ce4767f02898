"""A CPU rank that waits for its fork server (flair_nbddp/engine/pending_worker.py), with a stand-in server and
processes."""

import signal
import subprocess
import threading

import pytest

from flair_nbddp.errors import ForkServerError
from flair_nbddp.engine.pending_worker import PendingWorker, signal_group


class _Server:
    """A fork server that becomes ready, or exits, when the test says."""

    def __init__(self):
        self.ready = False
        self._settled = threading.Event()

    def wait_ready(self, timeout):
        self._settled.wait(timeout)

    def settle(self, ready):
        self.ready = ready
        self._settled.set()


class _Process:
    def __init__(self, pid):
        self.pid, self.signals, self.code = pid, [], None

    def poll(self):
        return self.code

    def wait(self, timeout=None):
        return self.code

    def send_signal(self, sig):
        self.signals.append(sig)


class _Starts:
    """What the pending worker did: forked, started afresh, noted, released its descriptors."""

    def __init__(self, fork_error=None, fresh_error=None):
        self.forked, self.fresh, self.notes, self.released = [], [], [], threading.Event()
        self._fork_error, self._fresh_error = fork_error, fresh_error

    def worker(self, server):
        return PendingWorker(server, self.fork, self.start_afresh, self.notes.append, self.released.set)

    def fork(self):
        if self._fork_error:
            raise self._fork_error
        self.forked.append(_Process(101))
        return self.forked[-1]

    def start_afresh(self):
        if self._fresh_error:
            raise self._fresh_error
        self.fresh.append(_Process(202))
        return self.fresh[-1]


def test_it_counts_as_running_until_the_server_is_ready_then_is_the_forked_process():
    server, starts = _Server(), _Starts()
    worker = starts.worker(server)
    assert worker.poll() is None  # pending counts as running, as a process that imports would
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(timeout=0.05)
    worker.send_signal(signal.SIGUSR1)  # a stack dump asked of a rank not started yet: nothing to do
    server.settle(ready=True)
    assert worker.pid == 101 and starts.released.is_set() and not starts.fresh and not starts.notes
    worker.send_signal(signal.SIGUSR1)
    starts.forked[0].code = 0
    assert starts.forked[0].signals == [signal.SIGUSR1] and worker.poll() == 0 and worker.wait(1) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stop_before_the_server_is_ready_keeps_it_from_starting(sig):
    server, starts = _Server(), _Starts()
    worker = starts.worker(server)
    signal_group(worker, sig)
    assert worker.wait(timeout=1) == -sig and worker.poll() == -sig and worker.pid is None
    assert starts.released.is_set()  # its descriptors are closed at once, not when the server is ready
    server.settle(ready=True)
    assert not starts.forked and not starts.fresh


def test_cancel_leaves_a_started_process_alone():
    server, starts = _Server(), _Starts()
    server.settle(ready=True)
    worker = starts.worker(server)
    assert worker.pid == 101
    worker.cancel()
    assert starts.forked[0].signals == [] and worker.poll() is None


@pytest.mark.parametrize(
    ("ready", "fork_error", "said"),
    [
        (False, None, "the fork server exited or was not ready in time"),
        (True, ForkServerError("it did not answer"), "could not start this worker (it did not answer)"),
        (True, BrokenPipeError("the server's socket is closed"), "could not start this worker (the server's socket"),
    ],
)
def test_a_server_that_exits_or_cannot_fork_leaves_the_rank_to_start_afresh_saying_why(ready, fork_error, said):
    server, starts = _Server(), _Starts(fork_error=fork_error)
    worker = starts.worker(server)
    server.settle(ready=ready)
    assert worker.pid == 202 and not starts.forked and len(starts.notes) == 1 and said in starts.notes[0]


def test_a_rank_that_cannot_be_started_at_all_exits_with_1_and_says_why():
    server, starts = _Server(), _Starts(fresh_error=OSError("no more processes"))
    worker = starts.worker(server)
    server.settle(ready=False)
    assert worker.wait(timeout=1) == 1 and worker.pid is None and starts.released.is_set()
    assert "could not be started: no more processes" in starts.notes[-1]
