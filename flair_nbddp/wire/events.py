"""The messages between the parent and its workers, and the channel they travel on.

Each worker holds one end of a private socket pair created by the parent (no listening port, no
other process can connect). Down it go requests: the worker's :class:`WorkerSpec` first, then each
:class:`Job`, :data:`STOP` and :data:`EXIT`. Up it come events: small dataclasses; anything large (the
result) goes to a file in the run directory and only its path travels here.

Example:
    >>> import socket
    >>> from multiprocessing.connection import Connection
    >>> a, b = socket.socketpair()
    >>> sender, receiver = EventSender(Connection(a.detach())), Connection(b.detach())
    >>> sender.send(Metric(rank=0, name="train/loss", value=0.5, step=1))
    >>> receiver.recv().value
    0.5
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to join its group: the first message it receives."""

    rank: int
    world_size: int
    device: str  # "cuda:<i>" or "cpu"
    backend: str  # "nccl" or "gloo"
    port: int  # the rendezvous store's port
    rendezvous_timeout: float
    stacks: str  # where SIGUSR1 dumps every thread's stack
    sys_path: tuple[str, ...]  # the parent's import path, so notebook-local modules import
    preload: tuple[str, ...] = ()  # modules to import while the parent packs the first job (cold workers)
    host: str = "127.0.0.1"  # the rendezvous store's address: loopback, or rank 0's cluster worker's own address
    shared_dir: str | None = None  # on a cluster: where this host keeps the objects put on the pool


@dataclass(frozen=True)
class Job:
    """One run for a group of workers: its packed call, where rank 0 puts the result, the seed, the run
    directory each rank writes its output to (``rank<r>.log``) while the job runs, whether the ranks
    share out flair's evaluations (:mod:`flair_nbddp.worker.distributed_eval`), whether corpora stay compact until
    read (:mod:`flair_nbddp.wire.lazy_corpus`), whether transformer inputs are built once per sentence
    (:mod:`flair_nbddp.worker.fast_inputs`), whether a tagger takes its transformer's batch tensor
    (:mod:`flair_nbddp.worker.direct_embeddings`) and clean sentences' tokens are left alone when flair clears them
    (:mod:`flair_nbddp.worker.clean_tokens`), the arithmetic of training (:mod:`flair_nbddp.worker.precision`),
    whether its transformers are compiled (:mod:`flair_nbddp.worker.compiled`), the checkpoint it resumes from
    (:mod:`flair_nbddp.worker.checkpoints`), and the objects put on the pool that the workers may keep
    (:meth:`flair_nbddp.WorkerPool.put`)."""

    payload: str
    result: str
    seed: int
    run_dir: str
    distributed_eval: bool = True
    lazy_corpus: bool | None = None
    fast_inputs: bool = True
    direct_embeddings: bool = True
    skip_clean_tokens: bool = True
    precision: str = "fp32"
    compile_model: bool | str = False
    resume: str = ""  # a checkpoint its first training continues from ("": none), and the file's sha256
    resume_sha256: str = ""
    chunk_size: int | None = None  # flair's mini_batch_chunk_size, imposed on its trainings (on_oom="halve_chunk")
    checkpoint_every: int | None = None  # a full checkpoint every so many optimizer steps too (None: epochs' ends)
    shared: tuple[str, ...] = ()
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # names this job in the ranks' shared store


@dataclass(frozen=True)
class Event:
    """Base of all events: which rank sent it, and when (seconds since the epoch)."""

    rank: int
    time: float = field(default_factory=_now, kw_only=True)


@dataclass(frozen=True)
class Started(Event):
    """A rank took a job: its process group is up, the job's payload unpacked. On a cluster, ``worker`` is the
    address of the Dask worker the rank runs under (filled in on the notebook's side)."""

    pid: int
    device: str
    host: str = ""
    worker: str = ""


@dataclass(frozen=True)
class Progress(Event):
    """Rank 0 finished a training batch (``batch`` counts from 1 within ``epoch``)."""

    epoch: int
    max_epochs: int
    batch: int
    total_batches: int


@dataclass(frozen=True)
class Metric(Event):
    """A scalar flair recorded (``metric_recorded``): ``train/loss``, ``dev/score``, ``learning_rate``..."""

    name: str
    value: float
    step: int


@dataclass(frozen=True)
class Heartbeat(Event):
    """Sent by every rank about once a second: liveness and throughput of that rank."""

    step: int
    samples: int
    samples_per_second: float
    host_memory_bytes: int  # the process's resident memory
    gpu_memory_bytes: int = 0  # torch's allocated memory on its GPU (0 on CPU)
    gpu_utilization: int | None = None  # percent busy, where NVML (nvidia-ml-py) is there; else None
    activity: int = 0  # a hash of the main thread's call stack: unchanged for long means stuck


@dataclass(frozen=True)
class Stopped(Event):
    """The ranks agreed to stop at a batch boundary; rank 0 names where the model is saved."""

    checkpoint: str


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """Rank 0 wrote a full checkpoint at the end of ``epoch``, or ``batch`` batches into the next one (at a stop, or
    every ``checkpoint_every`` steps; :mod:`flair_nbddp.worker.checkpoints`): the file, its sha256, and flair's step
    count then (the step of its per-batch metrics)."""

    epoch: int
    path: str
    sha256: str
    batch: int = 0
    steps: int = 0


@dataclass(frozen=True)
class ModelsSaved(Event):
    """flair's training ended on rank 0 and left these model files (absolute paths): final, best, stopped."""

    paths: tuple[str, ...]


@dataclass(frozen=True)
class ResultReady(Event):
    """Rank 0 wrote the function's return value to ``path``."""

    path: str


@dataclass(frozen=True)
class Predicted(Event):
    """A rank predicted one chunk of a :func:`flair_nbddp.predict` call: the chunk's number and, for each of its inputs
    in the chunk's order, the labels as a compact record (:mod:`flair_nbddp.wire.label_records`)."""

    chunk: int
    records: tuple


@dataclass(frozen=True)
class Failed(Event):
    """A rank raised: the exception's type, message and formatted traceback; for an out-of-memory error,
    ``memory`` says what the rank was doing and what it held (:func:`flair_nbddp.worker.main.memory_report`)."""

    exc_type: str
    message: str
    traceback: str
    memory: dict | None = None


@dataclass(frozen=True)
class Finished(Event):
    """A rank is done with the job (rank 0's result is written); it waits for the next job or EXIT."""


STOP = "stop"  # the parent's request, sent down the same channel: stop gracefully at the next batch
EXIT = "exit"  # the parent's request: leave the process group and exit (the worker is idle)
STOP_REQUESTED = threading.Event()  # in a worker: set once the parent sent STOP


class EventSender:
    """The worker's end: thread-safe ``send`` (the heartbeat thread and the training loop share it)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()

    @property
    def connection(self) -> Connection:
        return self._connection

    def send(self, event: Event) -> None:
        with self._lock:
            self._connection.send(event)
