"""What the parent knows about a run while it happens: filled by the reader thread, read by the UI.

Every method takes the state's lock, so the reader thread can write while the cell (or a dashboard)
reads a consistent ``snapshot()``.

Example:
    >>> from flair_nbddp.wire.events import Progress
    >>> state = RunState(world_size=2, device_type="cpu")
    >>> state.apply(Progress(rank=0, epoch=1, max_epochs=2, batch=5, total_batches=10))
    >>> state.snapshot().fraction_done
    0.25
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from ..errors import ConfigurationError
from ..wire.events import (
    Event,
    Failed,
    Finished,
    Heartbeat,
    Metric,
    CheckpointSaved,
    ModelsSaved,
    Predicted,
    Progress,
    ResultReady,
    Started,
    Stopped,
)  # fmt: skip

STATUSES = ("starting", "running", "finished", "stopped", "failed")


@dataclass(frozen=True)
class RankInfo:
    """One rank as last heard from."""

    rank: int
    pid: int | None = None
    device: str = ""
    host: str = ""  # the machine it runs on
    worker: str = ""  # on a cluster: the Dask worker it runs under
    alive: bool = True
    step: int = 0
    samples: int = 0
    samples_per_second: float = 0.0
    host_memory_bytes: int = 0
    gpu_memory_bytes: int = 0
    gpu_utilization: int | None = None  # percent, where NVML is there
    activity: int = 0
    heartbeat_at: float = 0.0  # when its last applied heartbeat was made (an older one arriving late is ignored)
    last_seen: float = 0.0
    last_progress: float = 0.0  # when its step or its call stack last changed
    exit_code: int | None = None


@dataclass(frozen=True)
class MetricPoint:
    """One recorded scalar: flair's metric name, its value, and the step (batch or epoch) it belongs to."""

    name: str
    value: float
    step: int
    time: float


# the metrics flair records at its step count (``batch_count``, which goes on across epochs); it records every other
# one at the epoch (train/loss, dev/score, dev/loss, test/...)
PER_STEP_METRICS = ("train/batch_loss", "train/gradient_norm", "learning_rate", "optimizer/")


def per_step(name: str) -> bool:
    """True for a metric flair records at every step, False for one it records at every epoch.

    Example:
        >>> per_step("train/batch_loss"), per_step("learning_rate/0"), per_step("dev/score")
        (True, True, False)
    """
    return name.startswith(PER_STEP_METRICS)


def step_at(name: str, epoch: int, steps: int) -> int:
    """Where a checkpoint at the end of ``epoch`` (the last whole one), after flair's ``steps`` steps, lies on metric
    ``name``'s axis: the step count for a per-step metric, the epoch for the others.

    Example:
        >>> step_at("train/batch_loss", 2, 40), step_at("dev/score", 2, 40)
        (40, 2)
    """
    return steps if per_step(name) else epoch


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of a run's state at one moment."""

    status: str
    world_size: int
    device_type: str
    started_at: float
    ended_at: float | None
    first_batch_at: float | None
    epoch: int
    max_epochs: int
    batch: int
    total_batches: int
    ranks: tuple[RankInfo, ...]
    metrics: tuple[MetricPoint, ...]
    log_lines: tuple[str, ...]  # what the cell shows: rank 0's output and every rank's stderr (or all output)
    rank_logs: tuple[tuple[str, ...], ...]  # the tail of each rank's own output, by rank
    failure: Failed | None
    stop_requested: bool
    checkpoint: str | None
    models: tuple[str, ...] = ()  # the model files flair saved on rank 0 (absolute paths)
    # (epoch, path, sha256, batch, steps) of each full checkpoint
    checkpoints: tuple[tuple[int, str, str, int, int], ...] = ()
    resumed_at: tuple[int, int] | None = None  # (epoch, step) of the checkpoint the run continued from

    @property
    def elapsed(self) -> float:
        """Seconds since the run started (until it ended, once it has)."""
        return (self.ended_at or time.time()) - self.started_at

    @property
    def fraction_done(self) -> float:
        """Share of all training batches done, 0.0 to 1.0 (0.0 before the first batch)."""
        if not self.max_epochs or not self.total_batches:
            return 1.0 if self.status == "finished" else 0.0
        done = (self.epoch - 1) * self.total_batches + self.batch
        return min(1.0, done / (self.max_epochs * self.total_batches))

    @property
    def eta(self) -> float | None:
        """Estimated seconds to the end of training, from the pace since the first batch."""
        fraction = self.fraction_done
        if self.first_batch_at is None or not 0.0 < fraction < 1.0:
            return None
        spent = (self.ended_at or time.time()) - self.first_batch_at
        return spent * (1.0 - fraction) / fraction

    @property
    def samples_per_second(self) -> float:
        """Training throughput of the whole run: the sum over ranks."""
        return sum(rank.samples_per_second for rank in self.ranks)


SILENT_SECONDS = 5.0  # ranks are heard from every second: this long without a word is silence
STRAGGLER_STEPS = 3  # steps behind the leading rank (and a tenth of its steps) that make a straggler
SLOW_SHARE = 0.5  # samples/s under this share of the ranks' median make a straggler too


def rank_health(snapshot: Snapshot, now: float | None = None) -> dict[int, str]:
    """The ranks that need a look while the run goes: ``"silent"`` (no heartbeat for ``SILENT_SECONDS``) or
    ``"straggler"`` (well behind the leading rank's steps, or far below the median samples/s).

    Example:
        >>> ranks = (RankInfo(0, pid=1, step=40, last_seen=99.0), RankInfo(1, pid=2, step=20, last_seen=99.0),
        ...          RankInfo(2, pid=3, step=40, last_seen=90.0))
        >>> snapshot = RunState(world_size=3, device_type="cpu").snapshot()
        >>> rank_health(replace(snapshot, status="running", ranks=ranks), now=100.0)
        {1: 'straggler', 2: 'silent'}
    """
    if snapshot.status != "running":
        return {}
    now = time.time() if now is None else now
    live = [rank for rank in snapshot.ranks if rank.alive and rank.pid is not None]
    leading = max((rank.step for rank in live), default=0)
    rates = [rank.samples_per_second for rank in live if rank.samples_per_second > 0]
    median = statistics.median(rates) if rates else 0.0
    health = {}
    for rank in live:
        if now - rank.last_seen > SILENT_SECONDS:
            health[rank.rank] = "silent"
        elif leading - rank.step >= max(STRAGGLER_STEPS, 0.1 * leading) or (
            0 < rank.samples_per_second < SLOW_SHARE * median
        ):
            health[rank.rank] = "straggler"
    return health


@dataclass
class RunState:
    """Mutable, locked state of one run; ``apply`` takes events, ``snapshot`` gives a frozen copy."""

    world_size: int
    device_type: str
    status: str = "starting"
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    first_batch_at: float | None = None
    epoch: int = 0
    max_epochs: int = 0
    batch: int = 0
    total_batches: int = 0
    result_path: str | None = None
    failure: Failed | None = None
    stop_requested: bool = False
    checkpoint: str | None = None
    models: tuple[str, ...] = ()
    checkpoints: tuple[tuple[int, str, str, int, int], ...] = ()
    resumed_at: tuple[int, int] | None = None
    max_log_lines: int = 20_000
    rank_tail_lines: int = 200

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks = [
            RankInfo(rank, last_seen=self.started_at, last_progress=self.started_at) for rank in range(self.world_size)
        ]
        self._metrics: list[MetricPoint] = []
        self._log: list[str] = []
        self._rank_logs = [deque(maxlen=self.rank_tail_lines) for _ in range(self.world_size)]
        self._log_total = 0  # lines ever added: a reader's cursor stays valid when old lines are dropped
        self._finished_ranks: set[int] = set()
        self._predicted: deque[Predicted] = deque()  # a predict call's chunks, until its collector takes them
        self.version = 0  # bumped on every change, so a UI can skip redraws when nothing happened

    def apply(self, event: Event) -> None:
        """Fold one worker event into the state."""
        with self._lock:
            self.version += 1
            rank = self._ranks[event.rank]
            if isinstance(event, Started):
                self._ranks[event.rank] = replace(
                    rank, pid=event.pid, device=event.device, host=event.host, worker=event.worker,
                    last_seen=event.time, last_progress=event.time,
                )  # fmt: skip
                if self.status == "starting" and all(r.pid is not None for r in self._ranks):
                    self.status = "running"
            elif isinstance(event, Heartbeat) and event.time >= rank.heartbeat_at:
                moved = (event.step, event.activity) != (rank.step, rank.activity)
                self._ranks[event.rank] = replace(
                    rank,
                    activity=event.activity,
                    last_progress=event.time if moved else rank.last_progress,
                    step=event.step,
                    samples=event.samples,
                    samples_per_second=event.samples_per_second,
                    host_memory_bytes=event.host_memory_bytes,
                    gpu_memory_bytes=event.gpu_memory_bytes,
                    gpu_utilization=event.gpu_utilization,
                    heartbeat_at=event.time,
                    last_seen=event.time,
                )
            elif isinstance(event, Progress):
                if self.first_batch_at is None:
                    self.first_batch_at = event.time
                self.epoch, self.max_epochs = event.epoch, event.max_epochs
                self.batch, self.total_batches = event.batch, event.total_batches
            elif isinstance(event, Metric):
                self._metrics.append(MetricPoint(event.name, event.value, event.step, event.time))
            elif isinstance(event, ResultReady):
                self.result_path = event.path
            elif isinstance(event, Failed):
                self.failure = self.failure or event
            elif isinstance(event, Stopped):
                self.checkpoint = event.checkpoint
            elif isinstance(event, CheckpointSaved):
                checkpoint = (event.epoch, event.path, event.sha256, event.batch, event.steps)
                self.checkpoints = (*self.checkpoints, checkpoint)
            elif isinstance(event, ModelsSaved):
                self.models = tuple(dict.fromkeys([*self.models, *event.paths]))
            elif isinstance(event, Finished):
                self._finished_ranks.add(event.rank)
            elif isinstance(event, Predicted):
                self._predicted.append(event)

    def take_predicted(self) -> list[Predicted]:
        """The chunks the ranks of a :func:`flair_nbddp.predict` call sent since the last call, in arrival order."""
        with self._lock:
            taken = list(self._predicted)
            self._predicted.clear()
            return taken

    def add_rank_lines(self, rank: int, lines: list[str]) -> None:
        """Append lines of ``rank``'s own output to its tail (the last ``rank_tail_lines``; its file keeps all)."""
        if lines:
            with self._lock:
                self.version += 1
                self._rank_logs[rank].extend(lines)

    def add_log_lines(self, lines: list[str]) -> None:
        """Append lines for the cell, keeping at most ``max_log_lines`` in memory (the files keep all)."""
        if not lines:
            return
        with self._lock:
            self.version += 1
            self._log.extend(lines)
            self._log_total += len(lines)
            overflow = len(self._log) - self.max_log_lines
            if overflow > 0:
                del self._log[:overflow]

    def continue_from(self, checkpoint: tuple[int, str, str, int, int], curve: tuple[MetricPoint, ...]) -> None:
        """The run continues an earlier one from ``checkpoint``: its curve so far (the earlier run's points up to the
        checkpoint) comes first, and the checkpoint is the run's own until it writes one (a stop before that resumes
        from it again)."""
        with self._lock:
            self.version += 1
            self._metrics[:0] = curve
            self.checkpoints, self.resumed_at = (checkpoint,), (checkpoint[0], checkpoint[4])

    def metrics_since(self, cursor: int) -> tuple[list[MetricPoint], int]:
        """The metric points recorded after the first ``cursor`` ones, and the cursor to pass next time.

        Example:
            >>> state = RunState(world_size=1, device_type="cpu")
            >>> state.apply(Metric(0, "train/loss", 0.5, 1))
            >>> [point.name for point in state.metrics_since(0)[0]], state.metrics_since(1)
            (['train/loss'], ([], 1))
        """
        with self._lock:
            return self._metrics[cursor:], len(self._metrics)

    def log_since(self, cursor: int) -> tuple[list[str], int]:
        """The log lines added after ``cursor`` that are still kept, and the cursor to pass next time (start at 0).

        Example:
            >>> state = RunState(world_size=1, device_type="cpu", max_log_lines=2)
            >>> state.add_log_lines(["a", "b", "c"])
            >>> state.log_since(0)
            (['b', 'c'], 3)
        """
        with self._lock:
            first_kept = self._log_total - len(self._log)
            return self._log[max(cursor, first_kept) - first_kept :], self._log_total

    def all_stalled(self, since: float) -> bool:
        """Every live rank made its last progress (a step, or a change of call stack) before ``since``;
        False when no rank is alive. Reads the ranks only (the hang watchdog asks ten times a second)."""
        with self._lock:
            alive = [rank for rank in self._ranks if rank.alive]
            return bool(alive) and all(rank.last_progress < since for rank in alive)

    def request_stop(self) -> None:
        """Record that a graceful stop was asked for."""
        with self._lock:
            self.version += 1
            self.stop_requested = True

    def rank_exited(self, rank: int, exit_code: int | None) -> None:
        """Record that a worker process is gone."""
        with self._lock:
            self.version += 1
            self._ranks[rank] = replace(self._ranks[rank], alive=False, exit_code=exit_code)

    def all_finished(self) -> bool:
        """Every rank sent ``Finished``."""
        with self._lock:
            return len(self._finished_ranks) == self.world_size

    def end(self, status: str) -> None:
        """Mark the run as ended with ``status`` (one of finished, stopped, failed)."""
        if status not in STATUSES[2:]:
            raise ConfigurationError(f"status={status!r} is not an end status (one of {', '.join(STATUSES[2:])})")
        with self._lock:
            self.version += 1
            self.status = status
            self.ended_at = self.ended_at or time.time()

    def snapshot(self) -> Snapshot:
        """A frozen copy of everything, safe to read without the lock."""
        with self._lock:
            return Snapshot(
                status=self.status,
                world_size=self.world_size,
                device_type=self.device_type,
                started_at=self.started_at,
                ended_at=self.ended_at,
                first_batch_at=self.first_batch_at,
                epoch=self.epoch,
                max_epochs=self.max_epochs,
                batch=self.batch,
                total_batches=self.total_batches,
                ranks=tuple(self._ranks),
                metrics=tuple(self._metrics),
                log_lines=tuple(self._log),
                rank_logs=tuple(tuple(tail) for tail in self._rank_logs),
                failure=self.failure,
                stop_requested=self.stop_requested,
                checkpoint=self.checkpoint,
                models=self.models,
                checkpoints=self.checkpoints,
                resumed_at=self.resumed_at,
            )
