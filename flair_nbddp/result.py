"""What a finished run gives back to the cell."""

from __future__ import annotations

import html
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .engine.state import MetricPoint, RankInfo


class Checkpoint(NamedTuple):
    """A full checkpoint rank 0 wrote: the last whole epoch before it, the file, the file's sha256 when it was
    written, the batches of the next epoch it had trained too (0: it is the epoch's end; more after a stop, or
    with ``checkpoint_every``), and flair's step count then (the step of its per-batch metrics)."""

    epoch: int
    path: Path
    sha256: str
    batch: int = 0
    steps: int = 0

    def describe(self) -> str:
        """``"the end of epoch 2"``, or ``"epoch 3, batch 5"``.

        Example:
            >>> Checkpoint(2, Path("c.pt"), "", 5).describe()
            'epoch 3, batch 5'
        """
        return f"epoch {self.epoch + 1}, batch {self.batch}" if self.batch else f"the end of epoch {self.epoch}"


class Attempt(NamedTuple):
    """One attempt of a run that ``max_restarts`` allowed to start again: its ledger id (None: unrecorded), its
    status, its error (None for the last, finished one) and the epoch whose checkpoint it resumed from (0: none)."""

    record_id: int | None
    status: str
    error: Exception | None
    resumed_from_epoch: int


SCORE_METRICS = ("dev/score", "train/loss")


def run_scores(value: object, final_metrics: dict[str, float]) -> dict[str, float]:
    """What :attr:`RunResult.scores` gives: ``value``'s numeric entries (if it is a dict) that are not NaN, then
    ``final_metrics``' ``dev/score`` and ``train/loss``.

    Example:
        >>> run_scores({"test_score": 0.8, "model": None}, {"dev/score": 0.7, "learning_rate": 0.1})
        {'test_score': 0.8, 'dev/score': 0.7}
        >>> run_scores({"test_score": float("nan")}, {"dev/score": 0.7})
        {'dev/score': 0.7}
    """
    entries = value.items() if isinstance(value, dict) else ()
    scores = {
        str(key): float(item)
        for key, item in entries
        if isinstance(item, numbers.Real) and not isinstance(item, bool) and not math.isnan(item)
    }
    return {**scores, **{name: final_metrics[name] for name in SCORE_METRICS if name in final_metrics}}


@dataclass
class RunResult:
    """The outcome of :func:`flair_nbddp.launch`.

    Attributes:
        value: rank 0's return value (a returned flair model arrives on CPU, ready to ``predict``).
        status: ``"finished"``, ``"stopped"`` or ``"failed"``.
        world_size: number of processes that ran.
        device_type: ``"cuda"`` or ``"cpu"``.
        backend: ``"nccl"`` or ``"gloo"``.
        elapsed: seconds from launch to the end of the run.
        time_to_first_batch: seconds from launch to rank 0's first finished training batch (None if none).
        samples_per_second: training throughput summed over ranks (0.0 if nothing trained).
        log: the lines the cell showed: rank 0's output and every other rank's stderr and warnings, prefixed
            ``[rank r]`` (every line of every rank with ``output="all"``); ``logs`` has each rank's full text.
        metrics: every scalar flair recorded on rank 0, in order (``history`` filters by name). A run that resumed
            (``resume=``, or a restart) has the whole curve: the earlier run's points up to the checkpoint it
            continued from (``resumed_at``), then its own.
        ranks: the last word from each rank (pid, device, steps, samples, throughput, host and GPU memory, exit
            code); steps and samples are exact (a final heartbeat precedes each rank's end).
        seed: the seed every rank was given.
        run_dir: the run's private directory (on a warm pool too); ``log_files`` maps rank → its full output
            during this run there; ``log_starts`` where this run's output begins in each.
        checkpoint: where the model was saved when the run was stopped (``status == "stopped"``).
        models: every model file flair saved on rank 0 (``final-model.pt``, ``best-model.pt``...), absolute.
        checkpoints: every full checkpoint rank 0 wrote, in order: one per finished epoch, one at a stop and, with
            ``checkpoint_every``, one every N steps (each replaced the one before in the same file); a later run
            continues from the last with ``launch(..., resume=result)``. A resumed run's list starts with the
            checkpoint it resumed from.
        attempts: with ``max_restarts``, every attempt of the run, the first included, each with its error (this
            result is the last attempt's); empty for a run that was not restarted.
        resumed_at: ``(epoch, step)`` of the checkpoint the run continued from: the last whole epoch before it, and
            flair's step count (the step of its per-batch metrics) there; None for a run from the start.
        error: the failure (WorkerError, RunTimeoutError, RunHangError) when ``status == "failed"``.
        record_id: the run's id in the run ledger (:func:`flair_nbddp.history`); None when it was not recorded.

    Example::

        result = launch(train, args=(corpus,))
        result.value["test_score"], result.elapsed
        result.history("dev/score")  # [(1, 0.71), (2, 0.86)]
    """

    value: Any
    status: str
    world_size: int
    device_type: str
    backend: str
    elapsed: float
    time_to_first_batch: float | None
    samples_per_second: float
    log: str
    metrics: list[MetricPoint]
    ranks: list[RankInfo]
    seed: int
    run_dir: Path
    log_files: dict[int, Path] = field(default_factory=dict)
    checkpoint: Path | None = None
    error: Exception | None = None
    log_starts: dict[int, int] = field(default_factory=dict)
    models: list[Path] = field(default_factory=list)
    record_id: int | None = None
    checkpoints: list[Checkpoint] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    resumed_at: tuple[int, int] | None = None

    @classmethod
    def from_run(cls, run: Any, value: Any, error: Exception | None) -> RunResult:
        """The result of an ended :class:`~flair_nbddp.Run`, from its final state."""
        snapshot, plan = run.state.snapshot(), run.plan
        return cls(
            value=value,
            status=snapshot.status,
            world_size=plan.world_size,
            device_type=plan.device_type,
            backend=plan.backend,
            elapsed=snapshot.elapsed,
            time_to_first_batch=(
                None if snapshot.first_batch_at is None else snapshot.first_batch_at - snapshot.started_at
            ),
            samples_per_second=snapshot.samples_per_second,
            log="\n".join(snapshot.log_lines),
            metrics=list(snapshot.metrics),
            ranks=list(snapshot.ranks),
            seed=run.seed,
            run_dir=run.run_dir,
            log_files=run.log_files,
            log_starts=run.log_starts,
            checkpoint=Path(snapshot.checkpoint) if snapshot.checkpoint else None,
            error=error,
            models=[Path(path) for path in snapshot.models],
            record_id=run.record_id,
            checkpoints=[Checkpoint(epoch, Path(path), *rest) for epoch, path, *rest in snapshot.checkpoints],
            resumed_at=snapshot.resumed_at,
        )

    @property
    def logs(self) -> dict[int, str]:
        """``{rank: the full text it printed during this run}``, read from the rank logs in ``run_dir``."""
        texts = {}
        for rank, path in self.log_files.items():
            try:
                with open(path, "rb") as handle:
                    handle.seek(self.log_starts.get(rank, 0))
                    texts[rank] = handle.read().decode("utf-8", "replace")
            except FileNotFoundError:
                texts[rank] = ""
        return texts

    def history(self, name: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs of one metric, e.g. ``"train/loss"`` (per epoch) or ``"dev/score"``."""
        return [(point.step, point.value) for point in self.metrics if point.name == name]

    @property
    def final_metrics(self) -> dict[str, float]:
        """The last recorded value of every metric."""
        return {point.name: point.value for point in self.metrics}

    @property
    def scores(self) -> dict[str, float]:
        """The numbers of the run worth comparing: the value's numeric entries, then flair's last ``dev/score``
        and ``train/loss``. A NaN is no score (a stopped run's ``test_score``: flair skipped the test
        evaluation) and is left out."""
        return run_scores(self.value, self.final_metrics)

    def _summary_lines(self) -> list[str]:
        lines = [
            f"{self.status} on {self.world_size} × {self.device_type} ({self.backend}) in {self.elapsed:.1f} s",
        ]
        if self.time_to_first_batch is not None:
            lines.append(f"first batch after {self.time_to_first_batch:.1f} s, {self.samples_per_second:.1f} samples/s")
        scores = {k: v for k, v in self.final_metrics.items() if k.endswith("score") or k == "train/loss"}
        if scores:
            lines.append(", ".join(f"{k} {v:.4f}" for k, v in sorted(scores.items())))
        if self.checkpoint is not None:
            lines.append(f"model saved at {self.checkpoint}")
        lines.append(f"value: {type(self.value).__name__}; logs: {self.run_dir}")
        return lines

    def __repr__(self) -> str:
        return "RunResult(" + "; ".join(self._summary_lines()) + ")"

    def _repr_html_(self) -> str:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self._summary_lines())
        return f"<div class='nbddp-result'><b>flair_nbddp run</b><ul>{items}</ul></div>"
