"""Which checkpoint a run resumes from, checked before any worker takes the job.

``launch(fn, args, resume=...)`` names an earlier run: its :class:`~flair_nbddp.RunResult`, its ledger record
(:class:`~flair_nbddp.RunRecord`) or that record's id, or ``"last"`` (the last run of a function of the same
name that wrote a checkpoint). A result the ledger did not record (it is off) is resumed from its own list of
checkpoints, unchecked for code and corpus. :func:`resume_point` finds that run's last full checkpoint in the ledger and
refuses, with :class:`~flair_nbddp.ResumeError` naming the cause and the fix, a run that wrote none, a file that
is gone or is not the one written (its sha256), another number of processes (each rank resumes its own random
generators), and, unless ``resume_force``, another function (its source's sha256) or another corpus (the sha256s of
the corpora shipped). The point carries the earlier run's curve up to the checkpoint: the resumed run shows it
first, so that its curve is one curve from the first epoch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ResumeError
from ..ledger.store import Ledger, RunRecord
from ..result import Checkpoint, RunResult
from .state import MetricPoint, step_at


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from: the run that wrote it, the last whole epoch before it, the file and its
    sha256, the batches of the next epoch it had trained (0: the epoch's end), flair's step count there, and the
    earlier run's metrics up to it (:func:`curve_until`)."""

    record_id: int | None
    epoch: int
    path: str
    sha256: str
    batch: int = 0
    steps: int = 0
    curve: tuple[MetricPoint, ...] = ()

    @property
    def checkpoint(self) -> tuple[int, str, str, int, int]:
        """The checkpoint as a run's state keeps it: ``(epoch, path, sha256, batch, steps)``."""
        return self.epoch, self.path, self.sha256, self.batch, self.steps

    def describe(self) -> str:
        """The line the cell shows as the run starts."""
        run = "" if self.record_id is None else f"run #{self.record_id} "
        where = Checkpoint(self.epoch, Path(self.path), self.sha256, self.batch).describe()
        return f"resuming {run}from {where} ({self.path})"


def resume_point(resume: Any, new: RunRecord, world_size: int, force: bool, ledger: Ledger | None) -> ResumePoint:
    """The checkpoint ``new`` (the run about to start, as the ledger will record it) continues from.

    Raises:
        ResumeError: see the module's description.
    """
    earlier = _earlier_run(resume, new.name, ledger)
    if not earlier.checkpoints:
        raise ResumeError(
            f"run #{earlier.id} ({earlier.name}, {earlier.status}) wrote no checkpoint: it ended before its first "
            "epoch did, or trained with flair_nbddp older than its checkpoints. Start the run afresh."
        )
    last = earlier.checkpoints[-1]
    node, colon, local = last["path"].partition(":")
    if colon and not Path(last["path"]).exists() and local.startswith("/"):  # "host:/path": a cluster node's file
        raise ResumeError(
            f"run #{earlier.id} ran on a Dask cluster with a flair_nbddp that left its checkpoint on node {node} "
            f"({local}); runs since keep them in the notebook. Copy the file here, or start afresh."
        )
    path = Path(last["path"])
    if not path.is_file():
        raise ResumeError(
            f"run #{earlier.id}'s checkpoint {path} is gone (its run directory was removed?): it cannot be resumed"
        )
    if _sha256(path) != last["sha256"]:
        raise ResumeError(
            f"{path} is not the checkpoint run #{earlier.id} wrote (its sha256 "
            "differs: changed or cut since); it is never read. Start the run afresh."
        )
    if earlier.world_size != world_size:
        raise ResumeError(
            f"run #{earlier.id} ran {earlier.world_size} processes and this one would run {world_size}: each rank "
            f"resumes its own random generators. Resume with processes={earlier.world_size}."
        )
    if not force and earlier.source_hash != _UNKNOWN:
        if earlier.source_hash != new.source_hash:
            raise ResumeError(
                f"the function's source differs from run #{earlier.id}'s ({earlier.name}): a resume continues the same "
                "training. Resume with the same function, or pass resume_force=True (--resume-force) to continue "
                "with this one."
            )
        if _corpus_digests(earlier.params) != _corpus_digests(new.params):
            raise ResumeError(
                f"the corpus differs from run #{earlier.id}'s (its sha256 as shipped): a resume continues the same "
                "training. Resume with the same corpus, or pass resume_force=True (--resume-force) to continue "
                "with this one."
            )
    epoch, steps = int(last["epoch"]), int(last.get("steps", 0))
    points = resume.metrics if isinstance(resume, RunResult) else earlier.metrics()
    return ResumePoint(earlier.id, epoch, str(path), last["sha256"], int(last.get("batch", 0)), steps,
                       curve_until(points, epoch, steps))  # fmt: skip


def curve_until(points: list[MetricPoint], epoch: int, steps: int) -> tuple[MetricPoint, ...]:
    """The points of a run's curve up to its checkpoint at ``epoch`` (the last whole one) and flair's step count
    ``steps``: what a run resumed from there does not record again.

    Example:
        >>> points = [MetricPoint("train/batch_loss", 0.9, 4, 0), MetricPoint("train/loss", 0.8, 1, 0),
        ...           MetricPoint("train/batch_loss", 0.7, 8, 0), MetricPoint("train/loss", 0.6, 2, 0)]
        >>> [(point.name, point.step) for point in curve_until(points, epoch=1, steps=4)]
        [('train/batch_loss', 4), ('train/loss', 1)]
    """
    return tuple(point for point in points if point.step <= step_at(point.name, epoch, steps))


def _earlier_run(resume: Any, name: str, ledger: Ledger | None) -> RunRecord:
    if isinstance(resume, RunRecord):
        return resume
    if isinstance(resume, RunResult):
        record = ledger.get(resume.record_id) if ledger is not None and resume.record_id is not None else None
        return record or _unrecorded(resume, name)
    if ledger is None:
        raise ResumeError("the run ledger is off (FLAIR_NBDDP_LEDGER=0): resume from the run's RunResult instead")
    if resume == "last":
        found = [record for record in ledger.records(limit=50, name=name) if record.checkpoints]
        if not found:
            raise ResumeError(f"no earlier run of {name} wrote a checkpoint (the ledger's last 50 of its runs)")
        return found[0]
    if isinstance(resume, str) and resume.isdigit():
        resume = int(resume)
    if not isinstance(resume, int) or isinstance(resume, bool):
        raise ResumeError(
            f"resume={resume!r} names no run: give a RunResult, a RunRecord, a ledger id, or 'last'"
        )
    record = ledger.get(resume)
    if record is None:
        raise ResumeError(f"the run ledger has no run #{resume}")
    return record


def _unrecorded(result: RunResult, name: str) -> RunRecord:
    """What a resume needs of a run the ledger did not record: its checkpoints, its size (its code and corpus went
    unrecorded, so they cannot be compared: the caller vouches for them)."""
    checkpoints = [{**checkpoint._asdict(), "path": str(checkpoint.path)} for checkpoint in result.checkpoints]
    return RunRecord(id=None, name=name, status=result.status, world_size=result.world_size, checkpoints=checkpoints,
                     source_hash=_UNKNOWN, params={"unrecorded": _UNKNOWN})  # fmt: skip


_UNKNOWN = "unrecorded"


def _corpus_digests(params: Any) -> list[str]:
    """The sha256s of the corpora a recorded call shipped, in order."""
    if isinstance(params, dict):
        own = [params["sha256"]] if isinstance(params.get("sha256"), str) else []
        return own + [digest for key, value in params.items() if key != "sha256" for digest in _corpus_digests(value)]
    if isinstance(params, list):
        return [digest for value in params for digest in _corpus_digests(value)]
    return []


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
