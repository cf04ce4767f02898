"""The worker processes themselves: starting them, talking to them, ending them.

A :class:`WorkerGroup` is one ``python -m flair_nbddp.worker`` per rank, each in its own session (a
kernel interrupt reaches only the kernel), with a private socket pair to the parent, its output in
``rank<r>.log``, and rank 0 serving the rendezvous store on a loopback socket the parent bound. A
group runs one job and exits (a cold launch), or stays up for many (a :class:`~flair_nbddp.WorkerPool`).

Example:
    >>> group = WorkerGroup(resolve_devices("cpu", 2), run_dir).start(first_job)   # doctest: +SKIP
    >>> group.close()                                                             # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
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

from .devices import DevicePlan, rendezvous_socket
from .events import EXIT

TERMINATE_GRACE_SECONDS = 3.0
RENDEZVOUS_TIMEOUT_SECONDS = 600
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class WorkerGroup:
    """One worker process per rank of ``plan``, logging into ``run_dir``."""

    def __init__(self, plan: DevicePlan, run_dir: Path) -> None:
        self.plan, self.run_dir = plan, Path(run_dir)
        self.log_files = {rank: self.run_dir / f"rank{rank}.log" for rank in range(plan.world_size)}
        self.stack_files = {rank: self.run_dir / f"stacks-rank{rank}.txt" for rank in range(plan.world_size)}
        self.processes: list[subprocess.Popen] = []
        self.connections: list[Connection] = []
        self._terminate_lock = threading.Lock()
        self.terminating = False

    def start(self, first_job: dict[str, Any], stay: bool) -> WorkerGroup:
        """Start every rank with ``first_job``; with ``stay`` the workers then wait for more jobs."""
        with rendezvous_socket() as listener:
            try:
                for rank in range(self.plan.world_size):
                    self._spawn(rank, listener, first_job, stay)
            except BaseException:  # e.g. an interrupt mid-way: no worker and no channel may stay behind
                self.close(grace=0.0)
                raise
        return self

    def _spawn(self, rank: int, listener: socket.socket, first_job: dict[str, Any], stay: bool) -> None:
        port = listener.getsockname()[1]
        env = {**os.environ, **self.plan.rank_environment(rank, port)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        # from here on every descriptor is accounted for, even if an interrupt lands between two lines
        parent_end, child_end = socket.socketpair()
        try:
            spec = {
                "rank": rank,
                "world_size": self.plan.world_size,
                "device": self.plan.device_for(rank),
                "backend": self.plan.backend,
                "port": port,
                "listen_fd": listener.fileno() if rank == 0 else None,
                "rendezvous_timeout": RENDEZVOUS_TIMEOUT_SECONDS,
                "stacks": str(self.stack_files[rank]),
                "sys_path": [entry for entry in sys.path if entry],
                "fd": child_end.fileno(),
                "stay": stay,
                "job": first_job,
            }
            log_fd = os.open(self.log_files[rank], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "flair_nbddp.worker"],
                        stdin=subprocess.PIPE,
                        stdout=log_fd,
                        stderr=subprocess.STDOUT,
                        env=env,
                        pass_fds=[child_end.fileno()] + ([listener.fileno()] if rank == 0 else []),
                        start_new_session=True,
                    )
                )
            finally:
                os.close(log_fd)
            self.connections.append(Connection(parent_end.detach()))
        except BaseException:
            parent_end.close()  # a no-op once its descriptor went to the connection
            raise
        finally:
            child_end.close()
        with self.processes[-1].stdin as stdin:
            stdin.write(json.dumps(spec).encode())

    # -- talking ----------------------------------------------------------------------------------
    def send_all(self, message: Any) -> None:
        """Send ``message`` down every live rank's channel."""
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.send(message)

    def dead_ranks(self) -> dict[int, int]:
        """Ranks whose process has exited, with their exit codes."""
        return {rank: code for rank, p in enumerate(self.processes) if (code := p.poll()) is not None}

    def collect_stacks(self) -> dict[int, str]:
        """Every rank's Python stacks (faulthandler on ``SIGUSR1``), read back from their stacks files."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        stacks = {}
        for rank, path in self.stack_files.items():
            with contextlib.suppress(FileNotFoundError):
                stacks[rank] = path.read_text()
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
                self.close_channels()

    def close_channels(self) -> None:
        """Close the parent's end of every rank's channel (and stdin pipe not yet closed)."""
        for connection in self.connections:
            connection.close()
        for process in self.processes:
            if process.stdin is not None and not process.stdin.closed:
                with contextlib.suppress(OSError):
                    process.stdin.close()

    @property
    def alive(self) -> bool:
        """Every rank's process is running."""
        return bool(self.processes) and not self.dead_ranks()

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]
