"""A real Dask cluster on loopback for the cluster tier and the benchmarks: ``dask scheduler`` and ``dask worker``
processes, everything bound to 127.0.0.1, each worker a "node" of its own (its own process tree and runs
directory, so files stored once per node are stored once per worker).

Example::

    with LoopbackCluster(workers=2) as cluster:
        client = cluster.client()
        cluster.kill_worker(1)        # a lost node: the worker's whole process tree, SIGKILL
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from flair_nbddp.worker.process_name import RANK_PREFIX

DASK = str(Path(sys.executable).with_name("dask"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackCluster:
    """A scheduler and ``workers`` single-threaded workers with nannies, on 127.0.0.1, logs in ``log_dir``."""

    def __init__(self, workers: int = 2, log_dir: str | os.PathLike | None = None) -> None:
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log_dir = Path(log_dir or os.environ.get("TMPDIR", "/tmp"))
        self.scheduler: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self._count = workers
        self._clients: list = []

    def _spawn(self, args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"dask-{name}-{self.port}.log", "ab")  # noqa: SIM115 - the process holds it
        # the tests' own modules import on the workers, as a project's code does where it is installed
        root = str(Path(__file__).resolve().parent)
        env = {
            **os.environ, **(env or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }  # fmt: skip
        return subprocess.Popen([DASK, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start(self) -> LoopbackCluster:
        self.scheduler = self._spawn(
            ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"], "scheduler"
        )
        for index in range(self._count):
            self.add_worker(index)
        self.client().wait_for_workers(self._count, timeout=60)
        return self

    def add_worker(self, index: int) -> None:
        """Start worker ``index``: a node of its own, with its own runs directory (``self.node_dir(index)``)."""
        self.workers.append(self._spawn([
            "worker", self.address, "--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard",
            "--name", f"node{index}", "--death-timeout", "30",
        ], f"worker{index}", {"FLAIR_NBDDP_RUNS": str(self.node_dir(index))}))  # fmt: skip

    def node_dir(self, index: int) -> Path:
        """Where worker ``index``'s node keeps the kit's files."""
        return self.log_dir / f"node{index}"

    def client(self):
        from distributed import Client

        client = Client(self.address, timeout=30, set_as_default=False)
        self._clients.append(client)
        return client

    def worker_tree(self, index: int) -> list[psutil.Process]:
        """Worker ``index``'s nanny and every process under it."""
        root = psutil.Process(self.workers[index].pid)
        return [root, *root.children(recursive=True)]

    def kill_worker(self, index: int) -> None:
        """A lost node: SIGKILL to worker ``index``'s nanny, its Dask worker and the rest of Dask's processes there
        at once; the kit's processes are left to notice (they must end themselves)."""
        kit = {process.pid for process in self.kit_processes()}
        for process in self.worker_tree(index):
            if process.pid not in kit:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGKILL)

    def kit_processes(self) -> list[psutil.Process]:
        """The kit's worker processes started by this cluster's Dask workers, wherever they are now (one whose
        Dask worker was killed belongs to init)."""
        found = []
        for process in psutil.process_iter(["name", "status"]):
            if not (process.info["name"] or "").startswith(RANK_PREFIX):
                continue
            with contextlib.suppress(psutil.Error):
                runs = process.environ().get("FLAIR_NBDDP_RUNS", "")
                if runs.startswith(str(self.log_dir)) and process.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(process)
        return found

    def leftover_files(self) -> list[Path]:
        """The kit's directories still on the nodes whose Dask worker is alive (a killed worker's node keeps its own)."""
        return [
            path for index, worker in enumerate(self.workers) if worker.poll() is None
            for path in self.node_dir(index).glob("cluster-*")
        ]  # fmt: skip

    def wait_no_kit_processes(self, timeout: float = 20.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while (left := self.kit_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def close(self) -> None:
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close(timeout=5)
        for process in [*self.workers, self.scheduler]:
            if process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in [*self.workers, self.scheduler]:
            if process is not None:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait()

    def __enter__(self) -> LoopbackCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
