"""CPU workers forked from a server that imported torch and flair once (flair_nbddp/engine/forkserver.py)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import wait_for

from flair_nbddp import WorkerError, launch
from flair_nbddp.engine import forkserver
from flair_nbddp.engine.devices import resolve_devices, worker_environment
from flair_nbddp.engine.local_ranks import WorkerGroup
from flair_nbddp.engine.pending_worker import PendingWorker
from flair_nbddp.engine.rundir import RunDir

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_processes")]


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _who():
    import os

    import flair
    import psutil
    import torch

    return {
        "name": psutil.Process().name(),
        "pid": os.getpid(), "parent": os.getppid(), "session": os.getsid(0), "threads": torch.get_num_threads(),
        "rank": os.environ["RANK"], "cache_root": str(flair.cache_root), "marker": os.environ.get("FORKSERVER_TEST"),
        "cwd": os.getcwd(),
    }  # fmt: skip


def test_the_first_launch_forks_from_the_server_it_starts_as_a_fresh_rank_would_be(monkeypatch, tmp_path):
    monkeypatch.setenv("FORKSERVER_TEST", "new")  # an environment no server has yet
    group = WorkerGroup(resolve_devices("cpu", 2), RunDir.create())
    began = time.monotonic()
    group.start()
    try:  # the launch call goes on while the server imports torch and flair; its ranks wait for it
        assert time.monotonic() - began < 2.0 and group.dead_ranks() == {}
        assert all(isinstance(process, PendingWorker) for process in group.processes)
    finally:
        group.close()
    first = launch(_who, device="cpu", processes=2, dashboard=False)
    second = launch(_who, device="cpu", processes=2, dashboard=False)
    monkeypatch.chdir(tmp_path)  # the notebook changed its directory (%cd) since the server started
    third = launch(_who, device="cpu", processes=2, dashboard=False)
    server = first.value["parent"]
    assert server in forkserver.server_pids(ready=True) and server != os.getpid()
    assert second.value["parent"] == server and second.value["pid"] != first.value["pid"]
    assert psutil.Process(server).parent().pid == os.getpid() and psutil.Process(server).name() == "flair_nbddp fs"
    assert third.value["parent"] == server and third.value["pid"] != second.value["pid"]  # the same server
    for who in (first.value, second.value, third.value):
        _is_rank_0_as_a_fresh_one_is(who, "new")
    assert third.value["cwd"] == str(tmp_path) != second.value["cwd"]  # the launch's directory, not the server's
    # a variable read at import (flair's cache root) changed in the notebook: a new server, which reads it
    monkeypatch.setenv("FLAIR_CACHE_ROOT", str(tmp_path / "flair-cache"))
    assert forkserver.prepare()
    fourth = launch(_who, device="cpu", processes=2, dashboard=False)
    assert fourth.value["parent"] not in (server, os.getpid())
    assert fourth.value["cache_root"] == str(tmp_path / "flair-cache")
    # the earlier server had no worker left: it was let go, and is gone
    wait_for(lambda: _gone(server), 30, "the earlier server to exit")
    assert server not in forkserver.server_pids() and fourth.value["parent"] in forkserver.server_pids()


def _is_rank_0_as_a_fresh_one_is(who, marker):
    assert who["session"] == who["pid"]  # a session of its own: the parent ends it with killpg
    # its share of the cores, as OMP_NUM_THREADS says (the kit's, unless the user chose)
    assert who["threads"] == int(os.environ.get("OMP_NUM_THREADS", max(1, (os.cpu_count() or 1) // 2)))
    assert who["rank"] == "0" and who["name"] == "flair_nbddp r0"  # as ps and top show it
    assert who["marker"] == marker  # the notebook's environment


def _kill_rank_1(parent_file):
    import os
    import signal
    from pathlib import Path

    import torch.distributed as dist

    if dist.get_rank() == 1:
        Path(parent_file).write_text(str(os.getppid()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_forked_ranks_death_is_reported_with_its_signal(tmp_path):
    assert forkserver.prepare()
    with pytest.raises(WorkerError) as failure:
        launch(_kill_rank_1, args=(str(tmp_path / "parent"),), device="cpu", processes=2, dashboard=False, timeout=120)
    assert "rank 1" in str(failure.value) and "killed by signal SIGKILL" in str(failure.value)
    assert int((tmp_path / "parent").read_text()) in forkserver.server_pids()  # a forked rank, not a fresh one


def test_a_dead_server_ends_its_workers_and_the_next_run_gets_a_new_one():
    assert forkserver.prepare()
    group = WorkerGroup(resolve_devices("cpu", 2), RunDir.create()).start()
    try:
        server = psutil.Process(group.pids[0]).parent().pid
        assert server in forkserver.server_pids() and psutil.Process(group.pids[1]).parent().pid == server
        os.kill(server, signal.SIGKILL)
        wait_for(lambda: len(group.dead_ranks()) == 2, 30, "the server's workers to end")
        assert group.dead_ranks() == {0: -signal.SIGKILL, 1: -signal.SIGKILL}  # their parent-death signal
        assert all(_gone(pid) for pid in group.pids)  # ended (a zombie until init reaps it)
    finally:
        group.close()
    assert forkserver.prepare()  # the next one
    after = launch(_who, device="cpu", processes=2, dashboard=False)
    assert after.value["parent"] not in (server, os.getpid()) and after.value["parent"] in forkserver.server_pids()


def test_a_server_ends_with_its_parent_and_takes_its_workers():
    program = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, psutil, flair_nbddp\n"
            "assert flair_nbddp.engine.forkserver.prepare()\n"
            "pool = flair_nbddp.WorkerPool(2, 'cpu').warm_up()\n"
            "server = psutil.Process(pool.pids[0]).parent()\n"
            "assert server.name() == 'flair_nbddp fs', server.name()\n"
            "print(server.pid, *pool.pids, flush=True)\n"
            "sys.stdin.read()\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        server, *workers = map(int, program.stdout.readline().split())
    finally:
        program.kill()  # the notebook's kernel dies
        program.wait()
    for pid in (server, *workers):
        wait_for(lambda pid=pid: _gone(pid), 30, f"process {pid} to end with the program that started the pool")


def test_a_stop_before_the_server_is_ready_keeps_the_ranks_from_starting(monkeypatch):
    monkeypatch.setenv("FORKSERVER_TEST", "stopped")  # a server of its own, which takes its time
    monkeypatch.setattr(forkserver, "_SERVER_COMMAND", "import time; time.sleep(600)")
    group = WorkerGroup(resolve_devices("cpu", 2), RunDir.create()).start()
    began = time.monotonic()
    group.close()  # before the server was ready: the ranks never start, and nothing waits for them
    assert time.monotonic() - began < 1.0
    assert group.dead_ranks() == {0: -signal.SIGTERM, 1: -signal.SIGTERM} and group.pids == []


def test_an_idle_server_exits_and_one_that_cannot_start_leaves_workers_to_start_afresh(monkeypatch, tmp_path):
    monkeypatch.setattr(forkserver, "IDLE_SECONDS", 0.5)
    monkeypatch.setenv("FORKSERVER_TEST", "idle")  # a server of its own
    assert forkserver.prepare()
    first = launch(_who, device="cpu", processes=1, dashboard=False)
    server = first.value["parent"]
    assert server in forkserver.server_pids()
    wait_for(lambda: server not in forkserver.server_pids(), 30, "the idle server to exit")  # idle half a second
    # a server that exits before it is ready: the rank waiting for it starts afresh, and is what a forked one is
    monkeypatch.setattr(forkserver, "_SERVER_COMMAND", "import sys, time; time.sleep(1); sys.exit(3)")
    monkeypatch.setenv("FORKSERVER_TEST", "broken")
    fresh = launch(_who, device="cpu", processes=1, dashboard=False)
    assert fresh.value["parent"] == os.getpid()
    _is_rank_0_as_a_fresh_one_is(fresh.value, "broken")
    assert "the fork server exited or was not ready in time" in (fresh.run_dir / "rank0.log").read_text()
    assert not forkserver.prepare() and forkserver.server_for(worker_environment()) is None  # not started again
