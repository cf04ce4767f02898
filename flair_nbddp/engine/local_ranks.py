"""The worker processes of this machine: starting them, talking to them, ending them.

A :class:`WorkerGroup` is one worker process (:func:`flair_nbddp.worker.main.main`) per rank, each in its own session (a
kernel interrupt reaches only the kernel), with a private socket pair to the parent, its start-up output
in ``rank<r>.log`` of the directory it started in, and rank 0 serving the rendezvous store on a loopback
socket the parent bound. Every message, the worker's spec included, travels over the socket pair; the
workers take jobs until they are told to exit.

Example::

    group = WorkerGroup(resolve_devices("cpu", 2), RunDir.create()).start()
    group.submit(job)
    group.close()
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from . import forkserver
from .devices import PACKAGE_ROOT, DevicePlan, rendezvous_socket, worker_environment
from ..errors import describe_exit
from .pending_worker import PendingWorker, signal_group
from .rundir import RunDir
from ..wire.events import EXIT, Job, WorkerSpec

TERMINATE_GRACE_SECONDS = 3.0
RENDEZVOUS_TIMEOUT_SECONDS = 600
# not `python -m`, which puts the working directory first: a folder named flair_nbddp there (a checkout of
# another version) would give the workers another kit than the notebook's
_WORKER_COMMAND = f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r}); from flair_nbddp.worker.main import main; main()"
_ARGUMENTS = ("channel", "listen")  # the descriptors a worker's arguments name: its channel, rank 0's store socket


def spawn_worker(
    spec: WorkerSpec, env: dict[str, str | None], log: Path, started: list[Any], listen: int | None = None
) -> Connection:
    """Start one worker process for ``spec`` in a session of its own, with ``env`` over this process's
    environment (a None value unsets that variable) and its output appended to ``log``; append the process to
    ``started`` at once, send it ``spec``, and return the parent's end of the private socket pair it listens on.
    Rank 0 inherits ``listen``, its store's socket.

    A CPU rank on Linux is forked from :mod:`~flair_nbddp.engine.forkserver`'s server, which imports torch and flair
    once: a :class:`~flair_nbddp.engine.pending_worker.PendingWorker`, forked as soon as the server is ready, without
    waiting for it here. Other ranks, and those whose server could not start, are fresh interpreters.

    Every descriptor and process is accounted for, even if an interrupt lands between two lines: an
    interrupted spawn leaves no channel open, and a process that started is in ``started`` for the caller to end.
    """
    base = worker_environment()
    full = {name: value for name, value in {**base, **env}.items() if value is not None}
    server = None
    if forkserver.available(spec.device):
        # what the rank unsets, its server has never had (glibc and BLAS read some at a process's start)
        server = forkserver.server_for({name: value for name, value in base.items() if env.get(name, "") is not None})
        if server is None:
            _note(log, "the fork server exited before it was ready: this worker starts afresh, importing torch and "
                       "flair")
    cwd = os.getcwd()

    def fresh(fds: dict[str, int]) -> subprocess.Popen:
        arguments = [fds[name] for name in _ARGUMENTS if name in fds]
        return subprocess.Popen(
            [sys.executable, "-c", _WORKER_COMMAND, *map(str, arguments)], stdin=subprocess.DEVNULL,
            stdout=fds["log"], stderr=subprocess.STDOUT, env=full, cwd=cwd, pass_fds=arguments,
            start_new_session=True,
        )  # fmt: skip

    parent_end, child_end = socket.socketpair()
    fds: dict[str, int] = {}
    try:
        fds["channel"] = child_end.detach()
        fds["log"] = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if listen is not None:
            fds["listen"] = os.dup(listen)
        if server is None:
            started.append(fresh(fds))
        else:
            own, fds = fds, {}  # the pending worker closes them once its process has them
            started.append(PendingWorker(
                server, fork=lambda: server.fork(full, cwd, own)[0], fresh=lambda: fresh(own),
                note=lambda text: _note(log, text), release=lambda: _close(own),
            ))  # fmt: skip
        connection = Connection(parent_end.detach())
    except BaseException:
        parent_end.close()  # a no-op once its descriptor went to the connection
        raise
    finally:
        _close(fds)
    connection.send(spec)
    return connection


def _close(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)


def _note(log: Path, text: str) -> None:
    with open(log, "a") as out:
        print(f"flair_nbddp: {text}", file=out)


class WorkerGroup:
    """One worker process per rank of ``plan``; their start-up output and stack dumps go to ``home``."""

    def __init__(self, plan: DevicePlan, home: RunDir) -> None:
        self.plan, self.home = plan, home
        self.processes: list[Any] = []  # Popen, ForkedWorker or PendingWorker
        self.connections: list[Connection] = []
        self._terminate_lock = threading.Lock()
        self.terminating = False

    def start(self, preload: tuple[str, ...] = ()) -> WorkerGroup:
        """Start every rank; each imports ``preload`` and waits for its first job (on which it joins the
        process group)."""
        with rendezvous_socket() as listener:
            try:
                for rank in range(self.plan.world_size):
                    self._spawn(rank, listener, preload)
            except BaseException:  # e.g. an interrupt mid-way: no worker and no channel may stay behind
                self.close(grace=0.0)
                raise
        return self

    def _spawn(self, rank: int, listener: socket.socket, preload: tuple[str, ...]) -> None:
        port = listener.getsockname()[1]
        spec = WorkerSpec(
            rank=rank,
            world_size=self.plan.world_size,
            device=self.plan.device_for(rank),
            backend=self.plan.backend,
            port=port,
            rendezvous_timeout=RENDEZVOUS_TIMEOUT_SECONDS,
            stacks=str(self.home.stacks(rank)),
            sys_path=tuple(entry for entry in sys.path if entry),
            preload=preload,
        )
        env = self.plan.rank_environment(rank, port)
        listen = listener.fileno() if rank == 0 else None
        self.connections.append(spawn_worker(spec, env, self.home.log(rank), self.processes, listen))

    # -- talking ----------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Hand ``job`` to every rank."""
        self.send_all(job)

    def send_all(self, message: Any) -> None:
        """Send ``message`` down every live rank's channel."""
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.send(message)

    def dead_ranks(self) -> dict[int, int]:
        """Ranks whose process has exited, with their exit codes."""
        return {rank: code for rank, p in enumerate(self.processes) if (code := p.poll()) is not None}

    def wait_exit(self, rank: int, timeout: float) -> int | None:
        """Rank ``rank``'s exit code once its process has exited, waiting up to ``timeout`` s (None: still alive)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.processes[rank].wait(timeout=timeout)
        return None

    def describe_exit(self, rank: int, exit_code: int | None) -> str:
        """What became of rank ``rank``'s process: ``"the worker process was killed by signal SIGKILL"``."""
        return f"the worker process {describe_exit(exit_code)}"

    def collect_stacks(self) -> dict[int, str]:
        """Every rank's Python stacks (faulthandler on ``SIGUSR1``), read back from their stacks files."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        stacks = {}
        for rank in range(self.plan.world_size):
            with contextlib.suppress(FileNotFoundError):
                stacks[rank] = self.home.stacks(rank).read_text()
        return stacks

    # -- ending -----------------------------------------------------------------------------------
    def terminate(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left after ``grace`` seconds."""
        with self._terminate_lock:
            self.terminating = True
            alive = [p for p in self.processes if p.poll() is None]
            for process in alive:
                signal_group(process, signal.SIGTERM)
            end = time.monotonic() + grace
            try:
                for process in alive:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=max(0.0, end - time.monotonic()))
            finally:  # an interrupt while waiting must not spare anyone
                for process in self.processes:
                    # the whole group: a worker's own children (e.g. data loader processes) go too
                    signal_group(process, signal.SIGKILL)
                for process in self.processes:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=grace)

    def close(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """Ask the workers to leave their process group and exit, terminate those that do not, and
        close the channels (the group is done), even if an interrupt comes meanwhile."""
        try:
            self.send_all(EXIT)
            for process in self.processes:
                if isinstance(process, PendingWorker):
                    process.cancel()  # one still waiting for its fork server never reads the EXIT: it never starts
            end = time.monotonic() + grace
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.0, end - time.monotonic()))
        finally:
            try:
                self.terminate(grace=1.0)
            finally:
                for connection in self.connections:
                    connection.close()

    @property
    def alive(self) -> bool:
        """Every rank's process is running."""
        return bool(self.processes) and not self.dead_ranks()

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (a rank whose fork server is still importing is waited for; one that never
        started has none)."""
        return [pid for process in self.processes if (pid := process.pid) is not None]
