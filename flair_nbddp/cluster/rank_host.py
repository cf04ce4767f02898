"""A rank on a Dask cluster, on the Dask worker's side: the long-running task that keeps one rank's worker
process and relays between it and the notebook through Dask.

Each rank is one task, :func:`host_rank`, pinned to its Dask worker. It secedes from the worker's thread
pool (the worker can still run other tasks), starts the kit's own worker process
(:func:`flair_nbddp.worker.main.main`, exactly as on one machine) and then relays:

- down, from the notebook: the rank's :class:`distributed.Queue` carries jobs, STOP, EXIT, stack
  requests and terminations;
- up, to the notebook: one queue for the whole group carries batches of events and of the new bytes of the
  job's log files, about ten a second, and a :class:`~distributed.Future` of rank 0's result.

Everything travels over the Dask worker's own connection to the scheduler, so a notebook that reaches only the
scheduler (Dask Gateway, Coiled) works, and nothing listens on the notebook's side. The files a job reads
(its payload, the objects put on a pool) are stored once per node by :func:`store_file` under
:func:`node_home` and checked against their sha256 by every rank before it takes the job.

The task ends when its worker process exits: when the notebook says EXIT or terminate, or when the task is
cancelled, which is what Dask does to the tasks of a client that disconnects (a kernel that died). Rank 0
binds the rendezvous store on its Dask worker's own address and publishes it in a Dask ``Variable``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.devices import interface_of, rendezvous_socket
from ..errors import ClusterError
from ..engine.local_ranks import (
    RENDEZVOUS_TIMEOUT_SECONDS,
    TERMINATE_GRACE_SECONDS,
    spawn_worker,
)
from ..engine.pending_worker import PendingWorker, signal_group
from ..engine.rundir import RunDir, runs_root
from ..wire.events import (
    Failed,
    Job,
    CheckpointSaved,
    ModelsSaved,
    ResultReady,
    Started,
    Stopped,
    WorkerSpec,
)

RELAY_SECONDS = 0.1  # how often a rank's events and output go up
LISTEN_SECONDS = 0.2  # how often its down queue is read
KEEPALIVE_SECONDS = 2.0  # a rank host says it is there at least this often, also between jobs
JOB = "job"  # the notebook's request: (JOB, job, payload file name, its sha256)
STACKS = "stacks"  # the notebook's request: every rank's Python stacks (the hang watchdog)
TERMINATE = "terminate"  # the notebook's request: end the worker process now (SIGTERM, SIGKILL after a grace)


def names(group_id: str) -> dict[str, str]:
    """The Dask names a group uses: its up queue, the rendezvous variable, and the prefix of the down queues."""
    prefix = f"flair_nbddp-{group_id}"
    return {"up": f"{prefix}-up", "store": f"{prefix}-store", "down": f"{prefix}-down-"}


@dataclass(frozen=True)
class Site:
    """Where one rank runs: its Dask worker, that worker's host and node, and its device there.

    Attributes:
        rank: the rank.
        worker: the Dask worker's address (``tcp://10.0.0.7:40331``).
        hostname: its machine's name.
        host: the address the Dask worker is reached at, which rank 0's store binds to.
        node: the machine (host name, boot and ``runs_root``): ranks of one node share its files.
        device: ``cuda:<i>`` or ``cpu``, as the worker's process counts its GPUs.
        local_rank: its place among the ranks of its node (0 stores and removes the node's files).
        local_world_size: the number of ranks on its node.
    """

    rank: int
    worker: str
    hostname: str
    host: str
    node: str
    device: str
    local_rank: int = 0
    local_world_size: int = 1


@dataclass(frozen=True)
class Batch:
    """What a rank host sends up at once: the new bytes of the job's logs (``{"log": ..., "stderr": ...}``),
    then its worker process's events, and once that process exited, its exit code."""

    rank: int
    job_key: str | None = None
    logs: dict[str, bytes] = field(default_factory=dict)
    events: list = field(default_factory=list)
    exit_code: int | None = None
    stacks: str | None = None
    pid: int | None = None  # sent once the worker process started


def probe() -> dict[str, Any]:
    """What placement needs of a Dask worker (run there by ``client.run``): its machine and its GPUs, counted
    without importing torch (``CUDA_VISIBLE_DEVICES``, else the NVIDIA driver's list)."""
    visible, gpus = os.environ.get("CUDA_VISIBLE_DEVICES"), 0
    if visible is not None:
        gpus = len([entry for entry in visible.split(",") if entry.strip() and entry.strip() != "-1"])
    else:
        with contextlib.suppress(OSError):
            gpus = len(os.listdir("/proc/driver/nvidia/gpus"))
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {
        "hostname": socket.gethostname(),
        "node": f"{socket.gethostname()}/{boot}/{runs_root()}",
        "gpus": gpus,
        "visible": visible or "",
    }


def node_home(group_id: str) -> RunDir:
    """The group's directory on this node: the files stored for its jobs, each rank's start-up log and stacks."""
    return RunDir.create(runs_root() / f"cluster-{group_id}")


def store_file(group_id: str, name: str, data: bytes, digest: str) -> str:
    """Write ``data`` as ``name`` in the group's directory on this node (atomically, mode 0600) and return its
    path; it must match ``digest`` (its sha256), which every rank checks again before reading it."""
    if hashlib.sha256(data).hexdigest() != digest:
        raise ClusterError(f"{name} arrived damaged on {socket.gethostname()} (its sha256 differs from the notebook's)")
    path = node_home(group_id).path / name
    path.parent.mkdir(mode=0o700, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(temporary, path)
    return str(path)


def _check_file(path: Path, digest: str) -> None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ClusterError(f"{path} is not on {socket.gethostname()}: it was not stored there, or was removed") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise ClusterError(f"{path} on {socket.gethostname()} differs from the file packed in the notebook")


def rank_environment(site: Site, world_size: int, store: tuple[str, int], threads: int) -> dict[str, str | None]:
    """A cluster rank's variables (None: unset): torch's ``env://`` names; its process group kept on the
    interface of its Dask worker's own address (unless the cluster's environment chose one); on CPU, ``threads``
    (its Dask worker's) BLAS threads. What Dask's nanny set for its own task threads (one BLAS thread, glibc
    returning memory every 64 KB freed, which makes a big corpus's decoding and freeing twice as slow) does not
    reach the rank, unless the cluster's configuration changed it."""
    env: dict[str, str | None] = {
        "MASTER_ADDR": store[0],
        "MASTER_PORT": str(store[1]),
        "RANK": str(site.rank),
        "LOCAL_RANK": str(site.local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(site.local_world_size),
        "PYTHONUNBUFFERED": "1",
    }
    interface = interface_of(site.host)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface is not None and name not in os.environ:
            env[name] = interface
    for name, value in _nanny_environment().items():
        if os.environ.get(name) == str(value):
            env[name] = None
    if site.device == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, threads))
    return env


def _nanny_environment() -> dict[str, Any]:
    """The variables Dask's nanny sets in its worker processes before they start (``distributed.nanny.pre-spawn-
    environ``: ``MALLOC_TRIM_THRESHOLD_``, ``OMP_NUM_THREADS``...)."""
    import dask.config

    return dict(dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {})


class _FileTail:
    """The bytes appended to a file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, path.stat().st_size if path.exists() else 0

    def read(self) -> bytes:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        return data


class _RankHost:
    """One rank's worker process and its relay, inside the Dask task."""

    def __init__(self, group_id: str, site: Site, spec: WorkerSpec) -> None:
        from distributed import Queue, get_client, get_worker
        from distributed.worker import thread_state

        self.group_id, self.site = group_id, site
        self.dask_worker, self.key, self.client = get_worker(), thread_state.key, get_client()
        self.names = names(group_id)
        self.up = Queue(self.names["up"], client=self.client)
        self.down = Queue(f"{self.names['down']}{site.rank}", client=self.client)
        self.home = node_home(group_id)
        self.spec = dataclasses.replace(
            spec, stacks=str(self.home.stacks(site.rank)), shared_dir=str(self.home.path / "shared")
        )
        self.processes: list[subprocess.Popen] = []
        self.connection: Any = None
        self.job: Job | None = None  # the job the worker process runs, with this node's paths
        self.job_key: str | None = None  # its key as the notebook knows it
        self.tails: dict[str, _FileTail] = {}
        self.pending: list = []  # events read, to go up with the next batch
        self.stacks: str | None = None
        self.lock = threading.Lock()
        self.last_sent = 0.0
        self.pid_sent = False
        self.hostname = socket.gethostname()

    # -- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        from distributed import Variable

        store = Variable(self.names["store"], client=self.client)
        listener = None
        if self.site.rank == 0:
            listener = rendezvous_socket(self.site.host)
            address = (self.site.host, listener.getsockname()[1])
            store.set(list(address))
        else:
            address = tuple(store.get(timeout=RENDEZVOUS_TIMEOUT_SECONDS))
        try:
            spec = dataclasses.replace(self.spec, host=address[0], port=address[1])
            env = rank_environment(self.site, spec.world_size, address, self.dask_worker.state.nthreads)
            listen = listener.fileno() if listener else None
            self.connection = spawn_worker(spec, env, self.home.log(self.site.rank), self.processes, listen)
        finally:
            if listener is not None:
                listener.close()
        self._put(Batch(self.site.rank, pid=self._new_pid()))

    # -- down -------------------------------------------------------------------------------------
    def listen(self) -> None:
        """Take the notebook's requests from the rank's down queue, until the worker process exits (a
        non-blocking batch get every :data:`LISTEN_SECONDS`: a get that times out is an error in the scheduler's
        log)."""
        while self.processes[0].poll() is None:
            try:
                messages = self.down.get(batch=True)
            except Exception:  # noqa: BLE001 - the queue went with the group, or the client closed: the end is near
                if self.cancelled():
                    return
                messages = []
            for message in messages:
                self.handle(pickle.loads(message))
            time.sleep(LISTEN_SECONDS)

    def handle(self, message: Any) -> None:
        if isinstance(message, tuple) and message[0] == TERMINATE:
            self.terminate(message[1])
        elif message == STACKS:
            with contextlib.suppress(ProcessLookupError):
                self.processes[0].send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            with contextlib.suppress(FileNotFoundError):
                self.stacks = Path(self.spec.stacks).read_text()
        elif isinstance(message, tuple) and message[0] == JOB:
            self.take(*message[1:])
        else:
            with contextlib.suppress(OSError):
                self.connection.send(message)

    def take(self, job: Job, payload_name: str, digest: str, resume_name: str = "") -> None:
        """Check the job's payload on this node, point the job at this node's paths (its payload, the checkpoint it
        resumes from) and hand it over (a payload that is not the notebook's fails the job on this rank, as a
        damaged payload does on one machine; a damaged checkpoint is refused by the rank reading it)."""
        payload = self.home.path / payload_name
        try:
            _check_file(payload, digest)
        except ClusterError as error:
            with self.lock:
                self.pending.append(Failed(self.site.rank, type(error).__name__, str(error), ""))
            self.terminate(0.0)
            return
        run_dir = RunDir.create(self.home.path / Path(job.run_dir).name)
        local = dataclasses.replace(
            job, payload=str(payload), result=str(run_dir.result), run_dir=str(run_dir.path),
            resume=str(self.home.path / resume_name) if resume_name else "",
        )  # fmt: skip
        with self.lock:
            self.job, self.job_key = local, job.key
            self.tails = {
                "log": _FileTail(run_dir.log(self.site.rank)), "stderr": _FileTail(run_dir.stderr(self.site.rank))
            }
        with contextlib.suppress(OSError):
            self.connection.send(local)

    def terminate(self, grace: float) -> None:
        process = self.processes[0]
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, TERMINATE_GRACE_SECONDS)):
            signal_group(process, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait)
                return

    # -- up ---------------------------------------------------------------------------------------
    def cancelled(self) -> bool:
        """The notebook let the task go (its client disconnected: the kernel died or the group closed)."""
        task = self.dask_worker.state.tasks.get(self.key)
        return task is None or task.state not in ("executing", "long-running")

    def relay(self) -> int:
        """Send the worker process's events and output up until it exits; return its exit code."""
        process = self.processes[0]
        while True:
            exited = not self._read_events()
            if self.cancelled():
                self.terminate(0.0)
                exited = True
            self._send(final=exited)
            if exited:
                code = process.wait()
                self._put(Batch(self.site.rank, self.job_key, exit_code=code))
                return code
            time.sleep(RELAY_SECONDS)

    def _read_events(self) -> bool:
        """Read what the worker process sent; False once its channel closed (it is exiting)."""
        try:
            while self.connection.poll():
                event = self._localize(self.connection.recv())
                with self.lock:
                    self.pending.append(event)
        except (EOFError, OSError):
            return False
        return True

    def _localize(self, event: Any) -> Any:
        """Name this rank's worker and node in what the notebook sees, and ship rank 0's result up first."""
        if isinstance(event, Started):
            return dataclasses.replace(event, host=self.hostname, worker=self.dask_worker.address)
        if isinstance(event, Stopped):
            return dataclasses.replace(event, checkpoint=f"{self.hostname}:{event.checkpoint}")
        if isinstance(event, ModelsSaved):
            return dataclasses.replace(event, paths=tuple(f"{self.hostname}:{path}" for path in event.paths))
        if isinstance(event, CheckpointSaved):  # the notebook keeps it: this node's copy goes with the group
            self.up.put(self.client.scatter(Path(event.path).read_bytes(), hash=False))  # before the event, too
            return event
        if isinstance(event, ResultReady):
            path = Path(event.path)
            data = path.read_bytes()
            path.unlink()
            self.up.put(self.client.scatter(data, hash=False))  # before the event: the notebook fetches it first
        return event

    def _send(self, final: bool) -> None:
        with self.lock:
            logs = {name: data for name, tail in self.tails.items() if (data := tail.read())}
            events, self.pending = self.pending, []
            stacks, self.stacks = self.stacks, None
            key = self.job_key
        pid = self._new_pid()
        due = final or time.monotonic() - self.last_sent > KEEPALIVE_SECONDS
        if logs or events or stacks is not None or pid is not None or due:
            self._put(Batch(self.site.rank, key, logs, events, stacks=stacks, pid=pid))

    def _new_pid(self) -> int | None:
        """The worker process's id the first time it is known, else None, without waiting: a CPU rank forked from
        its node's fork server has none until the server is ready (up to minutes on a first launch), and meanwhile
        the relay must go on saying the rank is there."""
        if self.pid_sent:
            return None
        process = self.processes[0]
        pid = process.started_pid if isinstance(process, PendingWorker) else process.pid
        self.pid_sent = pid is not None
        return pid

    def _put(self, batch: Batch) -> None:
        self.up.put(pickle.dumps(batch))
        self.last_sent = time.monotonic()

    # -- end --------------------------------------------------------------------------------------
    def close(self) -> None:
        """End the worker process if it lives, and let the node's files go with the node's first rank."""
        if self.processes:
            self.terminate(0.0)
        if self.connection is not None:
            self.connection.close()
        for queue in (self.up, self.down):
            with contextlib.suppress(Exception):
                queue.close()
        if self.site.local_rank == 0:
            shutil.rmtree(self.home.path, ignore_errors=True)


def host_rank(group_id: str, site: Site, spec: WorkerSpec) -> int:
    """The Dask task of one rank: keep its worker process and relay for it until it exits; its exit code.

    ``spec`` is the rank's :class:`~flair_nbddp.wire.events.WorkerSpec` as the notebook sees it; the store's
    address, the stacks file and the shared directory are this node's.
    """
    from distributed import secede

    secede()  # a long-running task: the Dask worker's threads stay free for other tasks
    host = _RankHost(group_id, site, spec)
    try:
        host.start()
        threading.Thread(target=host.listen, name="flair_nbddp-down", daemon=True).start()
        return host.relay()
    finally:
        host.close()

