"""A forked worker's exit as its parent sees it, between the worker's death and its server's report of it."""

import subprocess
import threading

from conftest import wait_for

from flair_nbddp.engine import forkserver
from flair_nbddp.engine.forkserver import ForkedWorker


def test_a_worker_that_died_is_waited_for_until_its_server_reports_its_exit_code():
    dead = subprocess.Popen(["true"])  # this process's child: a zombie until waited for, as a worker whose server
    wait_for(lambda: forkserver._gone(dead.pid), 10, "the child's exit")  # has not reaped it yet
    worker = ForkedWorker(dead.pid)
    threading.Timer(0.2, worker._ended, args=(-9,)).start()  # the server's report, on its way
    assert worker.poll() == -9
    dead.wait()


def test_a_running_worker_is_not_waited_for():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        worker = ForkedWorker(sleeper.pid)
        assert worker.poll() is None and not forkserver._gone(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
