"""Watching a run in a view until its result: what :func:`flair_nbddp.launch` and a pool's ``launch`` and
``exec`` do after building a :class:`~flair_nbddp.Run`.

A view is a :class:`RunView`. Which one fits (the widget dashboard in a kernel, text lines elsewhere) is decided
by the notebook package (:func:`flair_nbddp.notebook.dashboard.open_view`), which sits above this module: it
hands its chooser to :func:`show_runs_with` when it is imported, and the package's root imports it, so every
run started through the kit has its views while this module imports no notebook code.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from .errors import ClusterError, OutOfMemoryError, RunHangError, WorkerError, describe_exit
from .ledger.provenance import Provenance
from .options import RunOptions
from .result import Attempt, RunResult
from .run import Run
from .worker_source import WorkerSource, source_for


RESTART_POLL_SECONDS = 1.0  # how often a restart on a cluster looks for enough Dask workers


class RunView:
    """What :func:`watch` drives: ``start`` before waiting, ``poll`` while waiting, ``finish`` after."""

    def start(self) -> None:
        """Show the view; call on the cell's (main) thread."""

    def poll(self) -> None:
        """Called about ten times a second on the main thread while the run is waited for."""

    def finish(self, result: RunResult | None, error: BaseException | None = None) -> None:
        """Stop updating and show the outcome; ``result`` is None if ``wait`` raised."""


ViewChooser = Callable[[Run, "bool | None"], RunView]
_chooser: ViewChooser = lambda run, dashboard: RunView()  # noqa: E731 - replaced when the notebook package loads


def show_runs_with(chooser: ViewChooser) -> None:
    """Make ``chooser(run, dashboard)`` pick the view of every run watched from now on."""
    global _chooser
    _chooser = chooser


def launch_and_watch(
    fn: Callable, args: tuple, kwargs: dict | None, options: RunOptions, pool: WorkerSource | None,
    provenance: Provenance,
) -> RunResult:  # fmt: skip
    """:func:`flair_nbddp.launch` once its options are checked: the run built on its source, then watched; with
    ``max_restarts``, a run whose rank failed or hung is started again from its last full checkpoint (on a pool:
    its recycled workers; cold: new ones), up to that many times, each attempt shown and recorded, the last error
    raised once they are spent. With ``on_oom="halve_chunk"`` a rank out of memory restarts it with flair's
    ``mini_batch_chunk_size`` halved, down to 1, besides. An interrupt, a stop and a ``timeout`` are never
    restarted."""
    attempts: list[Attempt] = []
    resumed_from_epoch, restarts, chunk_size, where = 0, 0, None, "the start"
    while True:
        source = _restart_source(options, pool) if attempts else source_for(options, pool)
        run = Run(fn, args, kwargs or {}, source, options, provenance=provenance, chunk_size=chunk_size)
        try:
            result = watch(run, options.dashboard)
        except (WorkerError, RunHangError) as error:
            failed = error.result
            if failed is None:  # it never started: nothing to restart
                raise
            attempts.append(Attempt(failed.record_id, failed.status, error, resumed_from_epoch))
            smaller = _halved_chunk(error) if options.on_oom == "halve_chunk" else None
            if smaller is None and restarts == options.max_restarts:
                if len(attempts) > 1:
                    failed.attempts = attempts
                raise
            if failed.checkpoints:  # else from the start, or from where this attempt itself resumed
                options = replace(options, resume=failed)
                resumed_from_epoch, where = failed.checkpoints[-1].epoch, failed.checkpoints[-1].describe()
            if smaller is not None:
                chunk_size = smaller
                print(f"flair_nbddp: {_what_failed(error, failed)}; restarting from {where} with "
                      f"mini_batch_chunk_size={smaller}", flush=True)  # fmt: skip
            else:
                restarts += 1
                print(f"flair_nbddp: {_what_failed(error, failed)}; restart {restarts} of {options.max_restarts} "
                      f"from {where}", flush=True)  # fmt: skip
            continue
        if attempts:
            result.attempts = [*attempts, Attempt(result.record_id, result.status, None, resumed_from_epoch)]
        return result


def _restart_source(options: RunOptions, pool: WorkerSource | None) -> WorkerSource:
    """Where a restart's ranks come from: as the first attempt's; on a Dask cluster, the workers still there or
    new ones that join within ``restart_timeout`` seconds (a lost node leaves too few at first)."""
    deadline, waiting = time.monotonic() + options.restart_timeout, False
    while True:
        try:
            return source_for(options, pool)
        except ClusterError as error:
            if options.cluster is None or time.monotonic() >= deadline:
                raise
            if not waiting:
                print(f"flair_nbddp: waiting up to {options.restart_timeout:g} s for Dask workers to take the ranks "
                      f"({error})", flush=True)  # fmt: skip
                waiting = True
            time.sleep(RESTART_POLL_SECONDS)


def _halved_chunk(error: Exception) -> int | None:
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


def watch(run: Run, dashboard: bool | None = None) -> RunResult:
    """Start ``run`` (built, not started), show it in the view that fits while it goes, and return its result;
    a failed run raises its error.

    Raises:
        DashboardUnavailableError: ``dashboard=True`` outside a Jupyter kernel (before anything starts).
        Whatever ``run.start()`` raises, and the run's error (:class:`~flair_nbddp.WorkerError`...) when it failed.
    """
    view = _chooser(run, dashboard)  # before any worker starts: an impossible view must not cost a start
    shown = False  # a run that never started has nothing to show
    try:
        run.start()
        shown = True
        view.start()
        result = run.wait(on_tick=view.poll)
    except BaseException as error:
        if run.active:  # the view failed, or an interrupt came before the run was watched: end it here
            run.kill()
        if shown:
            view.finish(None, error)
        raise
    view.finish(result, result.error)
    if result.error is not None:
        raise result.error
    return result
