"""Watching a run in a view until its result: what :func:`flair_nbddp.launch` and a pool's ``launch`` and
``exec`` do after building a :class:`~flair_nbddp.Run`.

A view is a :class:`RunView`. Which one fits (the widget dashboard in a kernel, text lines elsewhere) is decided
by the notebook package (:func:`flair_nbddp.notebook.dashboard.open_view`), which sits above this module: it
hands its chooser to :func:`show_runs_with` when it is imported, and the package's root imports it, so every
run started through the kit has its views while this module imports no notebook code.
"""

from __future__ import annotations

from typing import Callable

from ..ledger.provenance import Provenance
from ..options import RunOptions
from .restarts import RESTARTABLE, Restarts
from ..result import RunResult
from .run import Run
from .worker_source import WorkerSource


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
    """:func:`flair_nbddp.launch` once its options are checked: the run built on its source, then watched; a run
    whose rank failed or hung starts again as :class:`~flair_nbddp.engine.restarts.Restarts` decides (``max_restarts``,
    ``on_oom``), each attempt shown and recorded, the last error raised once they are spent."""
    restarts = Restarts(options)
    try:
        while True:
            run = restarts.attempt(fn, args, kwargs or {}, pool, provenance)
            try:
                result = watch(run, options.dashboard)
            except RESTARTABLE as error:
                if error.result is None:  # it never started: nothing to restart
                    raise
                line = restarts.after(error, error.result)
                if line is None:
                    raise
                print(f"flair_nbddp: {line}", flush=True)
                continue
            return restarts.finished(result)
    finally:
        restarts.close()


def watch(run: Run, dashboard: bool | None = None) -> RunResult:
    """Start ``run`` (built, not started), show it in the view that fits while it goes, and return its result;
    a failed run raises its error.

    Raises:
        DashboardUnavailableError: ``dashboard=True`` outside a Jupyter kernel (before anything starts).
        Whatever ``run.start()`` raises, and the run's error (:class:`~flair_nbddp.WorkerError`...) when it failed.
    """
    view = _chooser(run, dashboard)  # before any worker starts: an impossible view must not cost a start
    planned = run.plan.world_size
    shown = False  # a run that never started has nothing to show
    try:
        run.start()
        if run.plan.world_size != planned:  # it took the free devices: a view of its ranks
            view = _chooser(run, dashboard)
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
