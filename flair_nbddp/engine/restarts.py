"""Automatic restarts: when a run whose rank failed starts again, from where, and the run that does it by itself.

:class:`Restarts` is the one policy of :func:`flair_nbddp.launch`, :func:`flair_nbddp.start` and the panel: after an
attempt failed with a rank's error (:class:`~flair_nbddp.WorkerError`: an exception, a signal, out of memory, a lost
Dask worker) or hung (:class:`~flair_nbddp.RunHangError`), the run starts again from that attempt's last full checkpoint
(a resumed attempt's list starts with the one it began from; none: from the start), up to ``max_restarts`` times; with
``on_oom="halve_chunk"`` a rank out of memory starts it again with flair's ``mini_batch_chunk_size`` halved, down to 1,
besides. A stop, an interrupt and a ``timeout`` are never restarted. On a Dask cluster the next attempt takes the
workers still there, or new ones that join within ``restart_timeout`` seconds.

:func:`flair_nbddp.launch` applies it while it waits (:mod:`flair_nbddp.engine.watch`); :class:`RestartingRun` is what
:func:`flair_nbddp.start` returns when restarts are asked for: a thread waits for each attempt and starts the next.
Either way every attempt ships the call the first one packed (:meth:`Restarts.attempt`: its payload file, kept until
the run ends), so a corpus is packed once.

Example::

    run = start(train, (corpus,), max_restarts=2)     # a RestartingRun: returns at once
    run.current                                        # the attempt running now (a Run)
    result = run.wait()                                # the last attempt's result; result.attempts lists them all
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from .claims import HOLDINGS
from ..errors import ClusterError, RunStateError, OutOfMemoryError, RunHangError, WorkerError, describe_exit
from ..options import RunOptions
from ..result import Attempt, RunResult
from .run import Run, wait_for_end
from .rundir import runs_root
from ..wire.payload import SharedPayload
from .worker_source import ColdWorkers, WorkerSource, source_for

RESTART_POLL_SECONDS = 1.0  # how often a restart on a cluster looks for enough Dask workers
RESTARTABLE = (WorkerError, RunHangError)  # what another attempt may get past: a rank failed, died or was lost; a hang


class Restarts:
    """What the next attempt of a run is, after each failed one: its options (resuming from the failed attempt's
    last checkpoint), its ``mini_batch_chunk_size``, and the line that says so; and every attempt so far."""

    def __init__(self, options: RunOptions) -> None:
        self.options = options
        self.attempts: list[Attempt] = []
        self.chunk_size: int | None = None
        self._restarts = 0
        self._resumed_from_epoch = 0
        self._where = "the start"
        self.payload: SharedPayload | None = None  # the call as the first attempt packed it, for the next ones
        self._first: Run | None = None  # the first attempt: the next ones run on the devices it took
        self._last: Run | None = None  # the attempt before the next one

    def attempt(
        self, fn: Callable, args: tuple, kwargs: dict, pool: WorkerSource | None, provenance: Any,
        give_up: Callable[[], bool] = lambda: False,
    ) -> Run:  # fmt: skip
        """The next attempt, not started: on :meth:`source`'s ranks, with the options and chunk size decided so far,
        shipping the call the first attempt packed (a corpus is packed once)."""
        source = self.source(pool, give_up)
        if self.payload is None and (self.options.max_restarts or self.options.on_oom == "halve_chunk"):
            self.payload = SharedPayload(Path(tempfile.mkdtemp(prefix="packed-", dir=runs_root())) / "payload.pkl")
        try:
            run = Run(fn, args, kwargs, source, self.options, provenance=provenance, chunk_size=self.chunk_size,
                      shared_payload=self.payload)  # fmt: skip
        except BaseException:  # no attempt: the run ends here
            self.close()
            raise
        self._first, self._last = self._first or run, run
        on_cluster = self.options.cluster is not None or getattr(pool, "cluster", None) is not None
        if self.payload is not None and not on_cluster:  # its devices stay held until the next attempt takes them
            run.hand_over_to = self  # (on a cluster, the next is placed afresh on the workers there then)
        return run

    def close(self) -> None:
        """The run has ended: drop the packed call kept for its attempts, and give back the devices its last attempt
        held."""
        HOLDINGS.give_back(self)
        if self.payload is not None:
            shutil.rmtree(self.payload.path.parent, ignore_errors=True)

    def after(self, error: WorkerError | RunHangError, failed: RunResult) -> str | None:
        """Record ``failed``, an attempt that ended with ``error``; the line saying how the run starts again, or
        None when it does not (no restart left: ``failed.attempts`` then lists every attempt)."""
        self.attempts.append(Attempt(failed.record_id, failed.status, error, self._resumed_from_epoch))
        smaller = _halved_chunk(error) if self.options.on_oom == "halve_chunk" else None
        if smaller is None and self._restarts == self.options.max_restarts:
            if len(self.attempts) > 1:
                failed.attempts = self.attempts
            return None
        if failed.checkpoints:  # else from the start (a resumed attempt's list starts with where it resumed from)
            self.options = replace(self.options, resume=failed)
            self._resumed_from_epoch, self._where = failed.checkpoints[-1].epoch, failed.checkpoints[-1].describe()
        if smaller is not None:
            self.chunk_size = smaller
            return f"{_what_failed(error, failed)}; restarting from {self._where} with mini_batch_chunk_size={smaller}"
        self._restarts += 1
        restart = f"restart {self._restarts} of {self.options.max_restarts}"
        return f"{_what_failed(error, failed)}; {restart} from {self._where}"

    def finished(self, result: RunResult) -> RunResult:
        """``result``, the last attempt's, with every attempt listed (when there were several)."""
        if self.attempts and not result.attempts:
            result.attempts = [*self.attempts, Attempt(result.record_id, result.status, None, self._resumed_from_epoch)]
        return result

    def source(self, pool: WorkerSource | None, give_up: Callable[[], bool] = lambda: False) -> WorkerSource:
        """Where the next attempt's ranks come from: as the first attempt's; on a Dask cluster, after a failure,
        the workers still there or new ones that join within ``restart_timeout`` seconds (a lost node leaves too
        few at first), unless ``give_up()`` says the run was stopped meanwhile."""
        first, last = self._first, self._last
        if first is not None and isinstance(first.source, ColdWorkers) and first.source.fits and pool is None:
            return ColdWorkers(first.plan)  # it took the devices free then: a restart resumes on as many ranks
        if last is not None and last.hand_over_to is self and pool is not None:
            return last.source  # the pool, or the slice of it, whose devices it holds for this attempt
        deadline, waiting = time.monotonic() + self.options.restart_timeout, False
        while True:
            try:
                return source_for(self.options, pool)
            except ClusterError as error:
                on_cluster = self.options.cluster is not None or getattr(pool, "cluster", None) is not None
                if not self.attempts or not on_cluster or time.monotonic() >= deadline or give_up():
                    raise
                if not waiting:
                    print(f"flair_nbddp: waiting up to {self.options.restart_timeout:g} s for Dask workers to take "
                          f"the ranks ({error})", flush=True)  # fmt: skip
                    waiting = True
                time.sleep(RESTART_POLL_SECONDS)


class RestartingRun:
    """A run that starts itself again from its last checkpoint when a rank fails (what :func:`flair_nbddp.start`
    returns with ``max_restarts`` or ``on_oom="halve_chunk"``); the same use as a :class:`~flair_nbddp.Run`.

    ``current`` is the attempt running now; ``state``, ``plan``, ``run_dir``, ``log_files`` and ``record_id`` are
    its. ``stop()`` and ``kill()`` act on it and end the restarts; ``wait()`` returns the last attempt's result,
    with :attr:`~flair_nbddp.RunResult.attempts`. ``on_attempt(run, line)`` is called on the watching thread as
    each new attempt starts (the panel follows it with a new dashboard), ``line`` saying why.
    """

    def __init__(
        self, fn: Callable, args: tuple, kwargs: dict, options: RunOptions, pool: WorkerSource | None,
        provenance: Any,
    ) -> None:  # fmt: skip
        self._call, self._pool, self._provenance = (fn, tuple(args), dict(kwargs or {})), pool, provenance
        self.restarts = Restarts(options)
        self.current = self._attempt()  # its source checked: impossible devices raise here, as for a Run
        self.on_attempt: Callable[[Run, str], None] | None = None
        self._ending = False  # a stop or kill: no attempt after this one
        self._killing = False  # a kill: an attempt that starts meanwhile is ended at once
        self._done = threading.Event()
        self._result: RunResult | None = None

    def _attempt(self) -> Run:
        fn, args, kwargs = self._call
        return self.restarts.attempt(fn, args, kwargs, self._pool, self._provenance, give_up=lambda: self._ending)

    # -- as a Run ---------------------------------------------------------------------------------
    @property
    def state(self) -> Any:
        return self.current.state

    @property
    def plan(self) -> Any:
        return self.current.plan

    @property
    def run_dir(self) -> Path | None:
        return self.current.run_dir

    @property
    def log_files(self) -> dict[int, Path]:
        return self.current.log_files

    @property
    def record_id(self) -> int | None:
        return self.current.record_id

    @property
    def ledger_problem(self) -> str | None:
        return self.current.ledger_problem

    @property
    def stop_notice(self) -> str:
        return self.current.stop_notice

    @property
    def active(self) -> bool:
        """True from ``start()`` until the last attempt has ended and its result is kept."""
        return not self._done.is_set()

    @property
    def ended(self) -> bool:
        """True once the last attempt has ended and its result is kept."""
        return self._done.is_set()

    def start(self) -> RestartingRun:
        """Start the first attempt and the thread that watches the attempts; returns at once."""
        try:
            self.current.start()
        except BaseException:
            self.restarts.close()
            raise
        threading.Thread(target=self._watch, name="flair_nbddp-restarts", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop the current attempt gracefully (after the same batch on every rank); no attempt follows."""
        self._ending = True
        self.current.stop()

    def kill(self) -> RunResult:
        """End the current attempt's workers now; no attempt follows."""
        self._ending = self._killing = True
        self.current.stop()  # an attempt still waiting for its devices leaves the queue
        with contextlib.suppress(RunStateError):  # it never started
            self.current.kill()
        self._done.wait()
        return self._result

    def wait(self, timeout: float | None = None, on_tick: Callable[[], None] | None = None) -> RunResult:
        """Block until the last attempt has ended; its result, every attempt listed. Interrupts as for a Run."""
        wait_for_end(self, self._done, timeout, on_tick)
        return self._result

    # -- the watching thread -----------------------------------------------------------------------
    def _watch(self) -> None:
        run, result = self.current, None
        try:
            while True:
                result = run.wait()
                line = None
                if not self._ending and isinstance(result.error, RESTARTABLE):
                    line = self.restarts.after(result.error, result)
                if line is None or self._ending:
                    break
                print(f"flair_nbddp: {line}", flush=True)
                try:
                    run = self.current = self._attempt()  # stop() reaches it while it waits for its devices
                    run.start()
                except Exception as error:  # noqa: BLE001 - the next attempt could not start: the run ends failed
                    result.error, result.attempts = error, self.restarts.attempts
                    break
                if self._killing:  # ended, or stopped, while the attempt started
                    run.kill()
                elif self._ending:
                    run.stop()
                self._show(run, line)
            self._result = self.restarts.finished(result)
        except Exception as error:  # noqa: BLE001 - a waiter must get a result, whatever went wrong here
            self._result = result if result is not None else run.kill()
            self._result.error = self._result.error or error
        finally:
            self.restarts.close()
            self._done.set()

    def _show(self, run: Run, line: str) -> None:
        """Tell ``on_attempt`` of the new attempt; a failure of its own does not end the run."""
        if self.on_attempt is None:
            return
        try:
            self.on_attempt(run, line)
        except Exception as error:  # noqa: BLE001 - e.g. a widget that could not be drawn
            warnings.warn(f"flair_nbddp: the new attempt could not be shown ({error!r}); it runs", stacklevel=1)


def _halved_chunk(error: BaseException) -> int | None:
    """After running out of memory: half the chunk size the rank had (or of its batch, unchunked); None if it was
    1 already, or the error was another."""
    if not isinstance(error, OutOfMemoryError):
        return None
    size = error.memory.get("mini_batch_chunk_size") or error.memory.get("mini_batch_size")
    return size // 2 if size and size > 1 else None


def _what_failed(error: WorkerError | RunHangError, failed: RunResult) -> str:
    """``rank 1 died (was killed by signal SIGKILL) at step 17``, ``rank 0 failed (ValueError)``, ``the run hung``."""
    if isinstance(error, RunHangError):
        return "the run hung"
    if isinstance(error, OutOfMemoryError):
        return f"rank {error.rank} ran out of memory"
    step = next((rank.step for rank in failed.ranks if rank.rank == error.rank), None)
    what = f"failed ({error.exc_type})" if error.exc_type else f"died ({describe_exit(error.exit_code)})"
    return f"rank {error.rank} {what}" + (f" at step {step}" if step else "")
