"""Typed events that workers send to the parent, and the channel they travel on.

Each worker holds one end of a private socket pair created by the parent (no listening port, no
other process can connect). Events are small dataclasses; anything large (the result) goes to a
file in the run directory and only its path travels here.

Example:
    >>> import socket
    >>> a, b = socket.socketpair()
    >>> sender, receiver = EventSender.from_fd(a.detach()), open_receiver(b.detach())
    >>> sender.send(Metric(rank=0, name="train/loss", value=0.5, step=1))
    >>> receiver.recv().value
    0.5
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class Event:
    """Base of all events: which rank sent it, and when (seconds since the epoch)."""

    rank: int
    time: float = field(default_factory=_now, kw_only=True)


@dataclass(frozen=True)
class Started(Event):
    """A rank took a job: its process group is up, the job's payload unpacked."""

    pid: int
    device: str


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
    memory_bytes: int
    activity: int = 0  # a hash of the main thread's call stack: unchanged for long means stuck


@dataclass(frozen=True)
class Stopped(Event):
    """The ranks agreed to stop at a batch boundary; rank 0 names where the model is saved."""

    checkpoint: str


@dataclass(frozen=True)
class ResultReady(Event):
    """Rank 0 wrote the function's return value to ``path``."""

    path: str


@dataclass(frozen=True)
class Failed(Event):
    """A rank raised: the exception's type, message and formatted traceback."""

    exc_type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Finished(Event):
    """A rank returned from the function and left its process group."""


STOP = "stop"  # the parent's request, sent down the same channel: stop gracefully at the next batch
EXIT = "exit"  # the parent's request: leave the process group and exit (the worker is idle)
STOP_REQUESTED = threading.Event()  # in a worker: set once the parent sent STOP


class EventSender:
    """The worker's end: thread-safe ``send`` (the heartbeat thread and the training loop share it)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()

    @classmethod
    def from_fd(cls, fd: int) -> EventSender:
        return cls(Connection(fd))

    @property
    def connection(self) -> Connection:
        return self._connection

    def send(self, event: Event) -> None:
        with self._lock:
            self._connection.send(event)


def open_receiver(fd: int) -> Connection:
    """The parent's end of a worker's channel, usable with ``multiprocessing.connection.wait``."""
    return Connection(fd)
