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
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from . import forkserver
from .devices import PACKAGE_ROOT, DevicePlan, rendezvous_socket, worker_environment
from .errors import describe_exit
from .forkserver import ForkedWorker
from .rundir import RunDir
from .wire.events import EXIT, Job, WorkerSpec

TERMINATE_GRACE_SECONDS = 3.0
RENDEZVOUS_TIMEOUT_SECONDS = 600
# not `python -m`, which puts the working directory first: a folder named flair_nbddp there (a checkout of
# another version) would give the workers another kit than the notebook's
_WORKER_COMMAND = f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r}); from flair_nbddp.worker.main import main; main()"


def spawn_worker(
    spec: WorkerSpec, env: dict[str, str | None], log: Path, started: list[subprocess.Popen | ForkedWorker]
) -> Connection:
    """Start one worker process for ``spec`` in a session of its own, with ``env`` over this process's
    environment (a None value unsets that variable) and its output appended to ``log``; append the process to
    ``started`` at once, send it ``spec``, and return the parent's end of the private socket pair it listens on.
    Rank 0 inherits ``spec.listen_fd``, its store's socket.

    A CPU rank on Linux is forked from :mod:`~flair_nbddp.forkserver`'s server, which imported torch and flair
    already, once one is ready (until then, and for any other rank, a fresh interpreter).

    Every descriptor and process is accounted for, even if an interrupt lands between two lines: an
    interrupted spawn leaves no channel open, and a process that started is in ``started`` for the caller to end.
    """
    base = worker_environment()
    full = {name: value for name, value in {**base, **env}.items() if value is not None}
    if forkserver.available(spec.device):
        # what the rank unsets, its server has never had (glibc and BLAS read some at a process's start)
        base = {name: value for name, value in base.items() if env.get(name, "") is not None}
        server = forkserver.ready_server(base)
        if server is not None:

            def fork(channel: int, log_fd: int) -> WorkerSpec:
                fds = {"channel": channel, "log": log_fd}
                if spec.listen_fd is not None:
                    fds["listen"] = spec.listen_fd
                worker, numbers = server.fork(full, os.getcwd(), fds)
                started.append(worker)
                return dataclasses.replace(spec, listen_fd=numbers.get("listen"))  # its number in the worker

            try:
                connection, sent = _open_channel(log, fork)
            except OSError as error:
                _note(log, f"the fork server could not start this worker ({error}): it starts afresh")
            else:
                connection.send(sent)
                return connection
        elif forkserver.failed(base):
            _note(log, "the fork server exited before it was ready: this worker starts afresh, importing torch and flair")

    def fresh(channel: int, log_fd: int) -> WorkerSpec:
        started.append(subprocess.Popen(
            [sys.executable, "-c", _WORKER_COMMAND, str(channel)],
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            env=full,
            pass_fds=[channel] + ([spec.listen_fd] if spec.listen_fd is not None else []),
            start_new_session=True,
        ))
        return spec

    connection, sent = _open_channel(log, fresh)
    connection.send(sent)
    return connection


def _open_channel(log: Path, start: Callable[[int, int], WorkerSpec]) -> tuple[Connection, WorkerSpec]:
    """A worker's private socket pair and its log (appended to), for ``start(channel_fd, log_fd)``, which starts the
    worker process and returns the spec to send it; the parent's end of the channel and that spec. The child's end
    and the log are closed here once the worker has them, and nothing stays open if anything fails."""
    parent_end, child_end = socket.socketpair()
    try:
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            sent = start(child_end.fileno(), log_fd)
        finally:
            os.close(log_fd)
        connection = Connection(parent_end.detach())
    except BaseException:
        parent_end.close()  # a no-op once its descriptor went to the connection
        raise
    finally:
        child_end.close()
    return connection, sent


def _note(log: Path, text: str) -> None:
    with open(log, "a") as out:
        print(f"flair_nbddp: {text}", file=out)


class WorkerGroup:
    """One worker process per rank of ``plan``; their start-up output and stack dumps go to ``home``."""

    def __init__(self, plan: DevicePlan, home: RunDir) -> None:
        self.plan, self.home = plan, home
        self.processes: list[subprocess.Popen] = []
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
            listen_fd=listener.fileno() if rank == 0 else None,
            rendezvous_timeout=RENDEZVOUS_TIMEOUT_SECONDS,
            stacks=str(self.home.stacks(rank)),
            sys_path=tuple(entry for entry in sys.path if entry),
            preload=preload,
        )
        env = self.plan.rank_environment(rank, port)
        self.connections.append(spawn_worker(spec, env, self.home.log(rank), self.processes))

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
    @staticmethod
    def _kill_group(process: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)

    def terminate(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left after ``grace`` seconds."""
        with self._terminate_lock:
            self.terminating = True
            alive = [p for p in self.processes if p.poll() is None]
            for process in alive:
                self._kill_group(process, signal.SIGTERM)
            end = time.monotonic() + grace
            try:
                for process in alive:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=max(0.0, end - time.monotonic()))
            finally:  # an interrupt while waiting must not spare anyone
                for process in self.processes:
                    # the whole group: a worker's own children (e.g. data loader processes) go too
                    self._kill_group(process, signal.SIGKILL)
                for process in self.processes:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=grace)

    def close(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """Ask the workers to leave their process group and exit, terminate those that do not, and
        close the channels (the group is done), even if an interrupt comes meanwhile."""
        try:
            self.send_all(EXIT)
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
        return [process.pid for process in self.processes]
