"""Keeping one run in the run ledger while it goes: its row when it starts, its metrics, its end.

A :class:`~flair_nbddp.Run` owns one :class:`RunRecorder`. The recorder never fails a run: when the ledger
cannot be written (a damaged file, no permission, a disk that is full) it warns once per run, with
:class:`~flair_nbddp.LedgerWarning` naming the cause and the fix, and the run goes on. A file that another
kernel keeps busy is waited for: seconds for the run's row and its end, a moment for a batch of metrics, which
then goes with the next one.
"""

from __future__ import annotations

import socket
import threading
import time
import warnings
from typing import Any, Callable

from ..errors import LedgerError, LedgerWarning
from ..ledger.provenance import (
    Provenance,
    describe,
    describe_call,
    sha256_text,
    source_of,
)
from ..ledger.store import Ledger, RunRecord, process_identity
from ..ledger.versions import package_versions
from ..result import RunResult
from .state import RunState

FLUSH_SECONDS = 1.0  # metrics reach the ledger in batches, at most this often
BUSY_FLUSH_SECONDS = 0.2  # a flush waits this long for a busy file (once), then leaves its points for the next
MAX_ERROR_CHARACTERS = 2000
RANK_FIELDS = (
    "rank", "pid", "device", "step", "samples", "samples_per_second", "host_memory_bytes", "gpu_memory_bytes",
    "gpu_utilization", "exit_code", "host", "worker",
)  # fmt: skip


def error_summary(error: BaseException) -> str:
    """``"WorkerError: ..."``, cut to ``MAX_ERROR_CHARACTERS``.

    Example:
        >>> error_summary(ValueError("bad label"))
        'ValueError: bad label'
    """
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= MAX_ERROR_CHARACTERS else text[:MAX_ERROR_CHARACTERS] + " ..."


class RunRecorder:
    """Writes one run to ``ledger`` (None: records nothing), described as ``provenance`` says.

    ``problem`` is the ledger's failure, once one happened (the warning's text): the run's row may lack its
    metrics (a failed flush stops the flushes; the end is still tried) or its end.

    Example::

        recorder = RunRecorder(Provenance("launch"), Ledger.default())
        recorder.begin(run, recorder.describe(run, fn, args, kwargs, digests))   # once the call is packed
        recorder.flush(run.state)                        # from the supervisor's loop
        recorder.end(run, result)
    """

    def __init__(self, provenance: Provenance, ledger: Ledger | None) -> None:
        self.provenance, self.ledger = provenance, ledger
        self.id: int | None = None
        self.problem: str | None = None
        self._run_dir = "?"  # names the run in a warning
        self._cursor = 0  # metric points of the run's state already written
        self._checkpoints_written = 0
        self._flushed_at = 0.0
        self._flushing = True  # until a flush fails for another cause than a busy file
        self._ended = False
        self._lock = threading.Lock()  # the supervisor's flushes and the end never interleave

    def begin(self, run: Any, record: RunRecord) -> None:
        """Add the run's row (:meth:`describe`'s record)."""
        self._run_dir = str(run.run_dir)

        def insert(ledger: Ledger) -> None:
            self.id = ledger.insert(record)

        self._write(insert)

    def describe(self, run: Any, fn: Callable, args: tuple, kwargs: dict, digests: dict[int, str]) -> RunRecord:
        """The run as its row begins: code, parameters (corpora by size and hash), options, devices, versions."""
        provenance = self.provenance
        if provenance.source is None:
            source, source_hash = source_of(fn)
        else:
            source, source_hash = provenance.source, sha256_text(provenance.source)
        params = describe_call(args, kwargs, digests) if provenance.params is None else describe(
            provenance.params, digests
        )
        options = {**run.options.ledger_view(), **provenance.options}
        if run.chunk_size is not None:  # a restart after running out of memory says with what it went on
            options["mini_batch_chunk_size"] = run.chunk_size
        plan = run.plan
        return RunRecord(
            started_at=run.state.started_at, updated_at=time.time(), status="running",
            name=run.name, origin=provenance.origin, workers=type(getattr(run.source, "pool", run.source)).__name__,
            source=source, source_hash=source_hash, params=params, options=options, seed=run.seed,
            world_size=plan.world_size, device_type=plan.device_type, backend=plan.backend, devices=str(plan),
            host=socket.gethostname(), owner=process_identity(), versions=package_versions(),
            run_dir=str(run.run_dir), trial=dict(provenance.trial),
        )  # fmt: skip

    def flush(self, state: RunState) -> None:
        """Append the metrics recorded since the last flush, if ``FLUSH_SECONDS`` have passed since it. A busy
        file is waited for briefly, once: its points go with the next flush (this runs on the thread that reads
        the ranks)."""
        if self.id is None or not self._flushing or time.monotonic() - self._flushed_at < FLUSH_SECONDS:
            return
        with self._lock:
            if self._ended:
                return
            self._flushed_at = time.monotonic()
            points, cursor = state.metrics_since(self._cursor)
            checkpoints = state.checkpoints  # a run whose kernel dies can be resumed from what was recorded
            new_checkpoints = _checkpoints(checkpoints) if len(checkpoints) > self._checkpoints_written else None
            if not points and new_checkpoints is None:
                return

            def append(ledger: Ledger) -> None:
                ledger.append_metrics(self.id, points, BUSY_FLUSH_SECONDS, attempts=1, checkpoints=new_checkpoints)

            outcome = self._write(append, busy_ok=True)
            if outcome:
                self._cursor, self._checkpoints_written = cursor, len(checkpoints)
            elif outcome is None:  # not busy: something else is wrong; the end is still tried
                self._flushing = False

    def end(self, run: Any, result: RunResult) -> None:
        """Write how the run ended: status, error, the remaining metrics, final figures, ranks, model files.
        Idempotent: the ledger keeps the first end written."""

        def write(ledger: Ledger) -> None:
            fields = {
                "status": result.status, "ended_at": run.state.ended_at or time.time(), "updated_at": time.time(),
                "error": None if result.error is None else error_summary(result.error),
                "final_metrics": result.final_metrics, "scores": result.scores,
                "ranks": [{name: getattr(rank, name) for name in RANK_FIELDS} for rank in result.ranks],
                "checkpoint": None if result.checkpoint is None else str(result.checkpoint),
                "models": [str(path) for path in result.models], "elapsed": result.elapsed,
                "checkpoints": _checkpoints(result.checkpoints),
                "samples_per_second": result.samples_per_second, "time_to_first_batch": result.time_to_first_batch,
            }  # fmt: skip
            ledger.end(self.id, result.metrics[self._cursor :], **fields)

        self._end(write)

    def start_failed(self, run: Any, call: tuple | None, error: BaseException) -> None:
        """Record a run that never got going (its call could not be packed, or its workers not started)."""
        if self.id is None and call is not None:
            self.begin(run, self.describe(run, *call, {}))
        self._end(lambda ledger: ledger.end(self.id, status="failed", updated_at=time.time(),
                                            error=error_summary(error)))  # fmt: skip

    def _end(self, write: Callable[[Ledger], None]) -> None:
        with self._lock:
            if self.id is not None and not self._ended:
                self._ended = bool(self._write(write))

    def _write(self, action: Callable[[Ledger], None], busy_ok: bool = False) -> bool | None:
        """True when ``action`` wrote; False for a busy file with ``busy_ok`` (left for the next try); None for
        any other failure, which warns once per run (bookkeeping never fails a run)."""
        if self.ledger is None:
            return None
        try:
            action(self.ledger)
            return True
        except LedgerError as error:
            if busy_ok and error.busy:
                return False
            cause = str(error)
        except Exception as error:  # noqa: BLE001 - a bug of the recorder must not cost the run
            cause = f"recording the run failed ({type(error).__name__}: {error}); please report it"
        if self.problem is None:
            missing = "unrecorded" if self.id is None else f"its record #{self.id} may lack metrics or its end"
            self.problem = f"{cause}. This run ({self._run_dir}) goes on, {missing}."
            warnings.warn(LedgerWarning(self.problem), stacklevel=3)
        return None


def _checkpoints(checkpoints: Any) -> list[dict]:
    """Full checkpoints as the ledger keeps them: ``[{"epoch", "path", "sha256", "batch", "steps"}]``."""
    return [
        {"epoch": epoch, "path": str(path), "sha256": sha256, "batch": batch, "steps": steps}
        for epoch, path, sha256, batch, steps in checkpoints
    ]
