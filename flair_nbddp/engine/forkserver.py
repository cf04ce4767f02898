"""CPU workers forked from a server that imported torch and flair once, instead of each importing them again.

A worker started as a fresh interpreter spends about 6 CPU-seconds importing torch, transformers and flair before its
first job: on a 2-core machine, a CPU rehearsal's two ranks wait that long at every cold launch. On Linux, the first CPU
launch (``device="cpu"``) of a notebook starts a server process that imports torch and flair once, and forks that
launch's ranks as soon as it is ready (:mod:`~flair_nbddp.engine.pending_worker`: the launch call does not wait for it);
later CPU ranks are forked from it in a fraction of a second.

A forked worker runs the same program as a fresh one (:func:`flair_nbddp.worker.main.main`): in a session of its
own, with the parent's channel, its log as its output, the rank's environment (``os.environ`` as the parent has it,
with the rank's variables) and ``OMP_NUM_THREADS`` threads. Its exit code reaches the parent through the server,
as a fresh one's would (``-9``: killed by ``SIGKILL``). A change to the parent's environment calls for a new server,
so variables read at import (``HF_HUB_OFFLINE``, ``FLAIR_CACHE_ROOT``) hold as in a fresh process; the kit's own
(``FLAIR_NBDDP_*``) are read when used, and the worker has them as the parent has them at the launch. The server ends
with its parent, after ten idle minutes without workers, or when it is replaced; its workers end with it. A server
that exits before it is ready is not started again for that environment: its ranks start afresh, and their logs
say why.

GPU ranks are always fresh interpreters: a worker must meet CUDA for the first time after the fork.

Example::

    server = server_for(env)           # started in the background if there is none; None if it could not start
    server.wait_ready(timeout=120)
    worker, numbers = server.fork(env | rank_env, os.getcwd(), {"channel": fd, "log": log_fd})
    worker.wait(timeout=5)             # Popen's interface: pid, poll, wait, send_signal, returncode
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .devices import PACKAGE_ROOT, worker_environment
from ..errors import ForkServerError
from ..worker import process_name

IMPORTS = ("torch", "torch.distributed", "flair", "flair.models", "flair.embeddings", "flair.trainers",
           "flair_nbddp.worker.main")  # fmt: skip
IDLE_SECONDS = 600.0  # a server without workers or requests for this long exits (it holds torch and flair)
FORK_TIMEOUT_SECONDS = 60.0  # a ready server forks in milliseconds
EXIT_REPORT_SECONDS = 3.0  # a server reports a worker's exit as soon as it reaps it: milliseconds, seconds under load
# variables nothing reads at import, so a change to them calls for no new server: the kit's own (read when used)
# and pytest's mark of the test that runs
_KIT_PREFIX = "FLAIR_NBDDP_"
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})
SERVER_NAME = "flair_nbddp fs"  # what ps and top call a server (its workers: "flair_nbddp r0"...)
WORKER_NAME = "flair_nbddp wkr"  # a forked worker's name until it reads its rank
_MESSAGE_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1
_SERVER_COMMAND = (
    f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r}); from flair_nbddp.engine.forkserver import serve; serve()"
)


def available(device_type: str) -> bool:
    """Whether ranks on ``device_type`` are forked from a server: CPU ranks on Linux.

    Example:
        >>> available("cuda")
        False
    """
    return device_type == "cpu" and sys.platform.startswith("linux")


class ForkedWorker:
    """A worker forked by the server, with the part of :class:`subprocess.Popen`'s interface the kit uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        """Its exit code if it has exited. One that has died while its server's report is on its way (a peer may
        report the broken collective first) is waited for, at most ``EXIT_REPORT_SECONDS``."""
        if self.returncode is None and _gone(self.pid):
            self._exited.wait(EXIT_REPORT_SECONDS)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"flair_nbddp worker {self.pid}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """The parent's side of one server: its process, requests one at a time, and its workers' exits."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _SERVER_COMMAND, str(theirs.fileno()), repr(IDLE_SECONDS)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                pass_fds=[theirs.fileno()], start_new_session=True,  # a kernel interrupt does not reach it
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        self._request_lock = threading.Lock()
        self._lock = threading.Lock()
        self._replied = threading.Condition(self._lock)
        self._requests = 0  # the number of the last request; replies name theirs
        self._replies: dict[int, tuple[str, int, Any]] = {}  # request → ("started", pid, numbers) or ("failed", 0, why)
        self._workers: dict[int, ForkedWorker] = {}  # by pid, until they exit
        self._exits: dict[int, int] = {}  # workers that exited before their start was taken in, or nobody's
        self.ready = False  # it imported torch and flair and takes requests
        self.gone = False
        threading.Thread(target=self._read, name="flair_nbddp-forkserver", daemon=True).start()

    @property
    def busy(self) -> bool:
        """It has workers that are still running."""
        with self._lock:
            return bool(self._workers)

    def fork(self, env: dict[str, str], cwd: str, fds: dict[str, int]) -> tuple[ForkedWorker, dict[str, int]]:
        """A worker with environment ``env`` in directory ``cwd`` and the descriptors ``fds`` (by name), and their
        numbers in it."""
        names = list(fds)
        with self._request_lock:
            with self._lock:
                if self.gone:
                    raise ForkServerError("the fork server has exited")
                self._requests += 1
                request = self._requests
            socket.send_fds(self._socket, [pickle.dumps((request, env, cwd, names))], [fds[name] for name in names])
            with self._lock:
                if not self._replied.wait_for(lambda: request in self._replies or self.gone, FORK_TIMEOUT_SECONDS):
                    raise ForkServerError(f"the fork server did not start a worker in {FORK_TIMEOUT_SECONDS:.0f} s")
                kind, pid, detail = self._replies.pop(request, ("failed", 0, "it exited"))
                if kind == "failed":
                    raise ForkServerError(f"the fork server could not fork a worker: {detail}")
                if self.gone:  # its parent-death signal ends the worker: start it afresh instead
                    raise ForkServerError("the fork server exited as it started the worker")
                worker = self._workers[pid] = ForkedWorker(pid)
                if pid in self._exits:
                    worker._ended(self._exits.pop(pid))
                    del self._workers[pid]
        return worker, detail

    def wait_ready(self, timeout: float) -> None:
        """Until it is ready or has exited, at most ``timeout`` s."""
        with self._lock:
            self._replied.wait_for(lambda: self.ready or self.gone, timeout)

    def close(self) -> None:
        """Let the server exit (its workers end with it)."""
        with contextlib.suppress(OSError):  # shutdown, not close alone: it wakes the reader and reaches the server
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while message := self._socket.recv(_MESSAGE_BYTES):
                kind, number, detail = pickle.loads(message)
                with self._lock:
                    if kind == "ready":
                        self.ready = True
                    elif kind == "exited":  # number: the worker's pid; detail: its exit code
                        if number in self._workers:
                            self._workers.pop(number)._ended(detail)
                        else:
                            self._exits[number] = detail
                    else:  # "started" or "failed": number is the request's
                        self._replies[number] = (kind, *detail)
                    self._replied.notify_all()
        with self._lock:
            self.gone = True
            self._replied.notify_all()
        self.process.wait()
        with self._lock:  # after the fork requests that could still register a worker gave up (gone)
            orphans = list(self._workers.values())
            self._workers.clear()
        for worker in orphans:  # the server's death sent them SIGKILL (their parent-death signal)
            _wait_gone(worker.pid)
            worker._ended(-signal.SIGKILL)


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Until process ``pid`` (a worker whose server died; init reaps it) has disappeared or is a zombie, at most
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not _gone(pid):
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    """Process ``pid`` has exited: a zombie not reaped yet, or no longer there."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


_SERVERS: dict[frozenset, _Server] = {}
_FAILED: set[frozenset] = set()  # environments whose server exited before it was ready
_SERVERS_LOCK = threading.Lock()


def _key(env: dict[str, str]) -> frozenset:
    return frozenset(
        (name, value) for name, value in env.items() if name not in _VOLATILE and not name.startswith(_KIT_PREFIX)
    )


def server_for(env: dict[str, str]) -> _Server | None:
    """This process's server for ``env`` (the parent's environment, as workers get it), ready or still importing;
    one is started in the background if there is none. None if that environment's server exited before it was
    ready: it is not started again. Servers of other environments are let go once they have no worker left."""
    key = _key(env)
    with _SERVERS_LOCK:
        for other, server in list(_SERVERS.items()):
            if server.gone or (other != key and not server.busy):
                if server.gone and not server.ready:
                    _FAILED.add(other)
                server.close()
                del _SERVERS[other]
        server = _SERVERS.get(key)
        if server is None and key not in _FAILED:
            try:  # unbuffered output, as a rank's; torch asks NVML, not CUDA, whether there is a GPU (flair asks)
                _SERVERS[key] = _Server({**env, "PYTHONUNBUFFERED": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})
            except OSError:  # e.g. no process could be started: the ranks start afresh, or fail saying why
                _FAILED.add(key)
            server = _SERVERS.get(key)
        return server


def prepare(timeout: float = 120.0) -> bool:
    """Start this process's server for its current environment now, if there is none, and wait until it is ready
    (at most ``timeout`` s): the next CPU launch then forks its ranks. True once it is ready.

    Example::

        forkserver.prepare()  # in a set-up cell, before the first CPU launch
    """
    server = server_for(worker_environment())
    if server is None:
        return False
    server.wait_ready(timeout)
    return server.ready and not server.gone


def server_pids(ready: bool = False) -> set[int]:
    """The process ids of this process's fork servers that are running (with ``ready``: those ready to fork).

    Example:
        >>> isinstance(server_pids(), set)
        True
    """
    with _SERVERS_LOCK:
        return {server.process.pid for server in _SERVERS.values() if not server.gone and (server.ready or not ready)}


# -- the server's side ------------------------------------------------------------------------------------------
def serve() -> None:
    """The server's life (``sys.argv[1]``: its channel; ``sys.argv[2]``: the seconds it may idle): import torch and
    flair, then fork a worker for each request until the parent is gone or it idled too long. In a forked worker
    this runs the worker and returns."""
    process_name.set_name(SERVER_NAME)
    channel, idle_seconds = socket.socket(fileno=int(sys.argv[1])), float(sys.argv[2])
    for name in IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - each worker imports it again and reports the error to its run
            break
    if not _send(channel, ("ready", 0, None)):
        return
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([channel, wake_read], [], [], None if children else idle_seconds)
        if not ready:  # idle: no request and no worker for a while
            return
        if wake_read in ready:
            os.read(wake_read, 4096)
        if not _reap(channel, children):
            return
        if channel not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(channel, _MESSAGE_BYTES, 8)
        if not message:  # the parent is gone
            return
        request, env, cwd, names = pickle.loads(message)
        settled_read, settled_write = os.pipe()  # the worker closes its end once it has a session of its own
        try:
            pid = os.fork()
        except OSError as error:  # e.g. no memory for another process: that rank starts afresh
            pid, reply = -1, ("failed", request, (0, str(error)))
        if pid == 0:
            for fd in (wake_read, wake_write, settled_read):
                os.close(fd)
            channel.close()
            _become_worker(env, cwd, dict(zip(names, fds)), settled_write)
            return
        os.close(settled_write)
        if pid > 0:
            children.add(pid)
            os.read(settled_read, 1)  # until the worker has its session (killpg reaches it) or has died
            reply = ("started", request, (pid, dict(zip(names, fds))))
        os.close(settled_read)
        for fd in fds:
            os.close(fd)
        if not _send(channel, reply):
            return


def _send(channel: socket.socket, message: tuple) -> bool:
    try:
        channel.send(pickle.dumps(message))
    except OSError:  # the parent is gone
        return False
    return True


def _reap(channel: socket.socket, children: set[int]) -> bool:
    """Tell the parent of every worker that exited; False once the parent is gone."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        children.discard(pid)
        if not _send(channel, ("exited", pid, os.waitstatus_to_exitcode(status))):
            return False
    return True


def _become_worker(env: dict[str, str], cwd: str, fds: dict[str, int], settled: int) -> None:
    """In the forked child: the worker's session, output, directory, environment and threads, then the worker."""
    server = os.getppid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # a group of its own, as a fresh worker's: the parent ends it with os.killpg
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server died before the line above
        os._exit(1)
    os.close(settled)
    process_name.set_name(WORKER_NAME)  # until the worker's spec says its rank
    for stream in (1, 2):
        os.dup2(fds["log"], stream)
    os.close(fds["log"])
    os.chdir(cwd)  # the notebook's directory at the launch, as a fresh worker's
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch sized its pool from the server's environment
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = ["-c", *(str(fds[name]) for name in ("channel", "listen") if name in fds)]  # as a fresh worker's
    from ..worker.main import main

    main()
