"""A sweep: trials of ``fn`` with the parameters Optuna suggests, several at once on disjoint devices, pruned as
their epochs' metric comes in.

Each trial is an ordinary run (:func:`flair_nbddp.start`): its own process group, run directory, dashboard state
and ledger record, which also carries the study, the trial's number, parameters and state. The cell's thread
schedules: it starts a trial on every free lane (:mod:`~flair_nbddp.sweeps.lanes`), reports rank 0's ``metric`` to
the trial at every epoch, stops a trial Optuna prunes (gracefully: after the same batch on every rank), and tells
Optuna how each ended. A trial that fails is recorded failed, with its error, and the sweep goes on.

Example::

    from flair_nbddp import sweep
    result = sweep(train, (corpus,), space=lambda t: {"lr": t.suggest_float("lr", 1e-4, 1e-2, log=True)},
                   n_trials=8, study="lr-search")
    result.best.value["model"], result.study.best_params
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..api import start
from ..errors import ClusterError, ConfigurationError, RunActiveError, StillRunningError
from ..ledger.provenance import Provenance
from ..ledger.store import Ledger, RunRecord
from ..options import RunOptions, documented
from ..result import RunResult
from . import study as studies
from .lanes import Lane, lanes

TICK_SECONDS = 0.1
STATES = ("running", "complete", "pruned", "failed", "stopped")
SWEEP_DECIDES = {
    "run_dir": "each trial has its own run directory",
    "resume": "each trial starts afresh (a trial's restarts resume it)",
    "resume_force": "each trial starts afresh",
}


@dataclass
class TrialRow:
    """One trial of this sweep, as the live view and :class:`Sweep` show it."""

    number: int
    params: dict
    lane: str
    state: str = "running"
    value: float | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (epoch, metric) as reported to Optuna
    record_id: int | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None

    @property
    def elapsed(self) -> float:
        """Seconds since it started, or that it ran."""
        return (self.ended_at or time.time()) - self.started_at


@dataclass
class SweepState:
    """What the view reads while the sweep goes (written by the cell's thread only)."""

    study: str
    metric: str
    direction: str
    n_trials: int
    lanes: int
    rows: list[TrialRow] = field(default_factory=list)
    stopping: bool = False
    done: bool = False

    def best(self) -> TrialRow | None:
        """The best complete trial of this sweep so far."""
        complete = [row for row in self.rows if row.state == "complete" and row.value is not None]
        if not complete:
            return None
        pick = max if self.direction == "maximize" else min
        return pick(complete, key=lambda row: row.value)

    def best_so_far(self) -> list[tuple[int, float]]:
        """``(trial number, best value up to it)`` over the complete trials, in the order they ended."""
        curve, best = [], None
        better = (lambda a, b: a > b) if self.direction == "maximize" else (lambda a, b: a < b)
        for row in sorted((row for row in self.rows if row.state == "complete"), key=lambda row: row.ended_at):
            if row.value is not None and (best is None or better(row.value, best)):
                best = row.value
            if best is not None:
                curve.append((row.number, best))
        return curve


class SweepView:
    """What a sweep drives: ``start`` before, ``poll`` about ten times a second, ``finish`` after (cell thread)."""

    def start(self, sweep: Sweep) -> None:
        """Show the view."""

    def poll(self) -> None:
        """Redraw what changed."""

    def finish(self, error: BaseException | None = None) -> None:
        """Show the outcome."""


_chooser: Callable[[Sweep, "bool | None"], SweepView] = lambda sweep, dashboard: SweepView()  # noqa: E731


def show_sweeps_with(chooser: Callable[[Sweep, "bool | None"], SweepView]) -> None:
    """Make ``chooser(sweep, dashboard)`` pick the view of every sweep from now on (the notebook package's)."""
    global _chooser
    _chooser = chooser


class Sweep:
    """A sweep's outcome (and, while it goes, its handle: :meth:`stop`).

    Attributes:
        study: the ``optuna.Study`` (Optuna's plots work on it: ``optuna.visualization.matplotlib``).
        state: the trials of this call as the view shows them (:class:`SweepState`).
        best: the best complete trial of this call, as its :class:`~flair_nbddp.RunResult` (its ``value``, the
            model included); None if none completed. The other trials' values are not kept (their models are in
            their run directories: ``records``).
    """

    def __init__(self, study: Any, state: SweepState) -> None:
        self.study, self.state = study, state
        self.best: RunResult | None = None
        self.background = False  # sweep(..., wait=False): the trials go on while the cell is free
        self._running: dict[int, tuple[Any, threading.Thread, dict]] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def name(self) -> str:
        """The study's name (``sweep(..., study=name)`` continues it)."""
        return self.study.study_name

    @property
    def records(self) -> list[RunRecord]:
        """Every trial's run record in the ledger, this call's and earlier ones', by trial number."""
        ledger = Ledger.default()
        if ledger is None:
            return []
        found = []
        for trial in sorted(self.study.get_trials(deepcopy=False), key=lambda trial: trial.number):
            record_id = trial.user_attrs.get("record_id")
            record = ledger.get(record_id) if record_id is not None else None
            if record is not None:
                found.append(record)
        return found

    @property
    def best_record(self) -> RunRecord | None:
        """The run record of the study's best trial (maybe of an earlier call): ``models`` lists its model files."""
        try:
            record_id = self.study.best_trial.user_attrs.get("record_id")
        except ValueError:  # no complete trial yet
            return None
        ledger = Ledger.default()
        return ledger.get(record_id) if ledger is not None and record_id is not None else None

    def stop(self) -> None:
        """End the sweep: no new trial starts, the running ones stop gracefully (their models saved)."""
        self.state.stopping = True
        for run, _, _ in list(self._running.values()):
            run.stop()

    @property
    def done(self) -> bool:
        """True once every trial has ended (and the sweep's view shows the outcome)."""
        return self.state.done

    def wait(self, timeout: float | None = None) -> Sweep:
        """Block until a sweep started with ``wait=False`` has ended; return it (at once for any other).

        Raises:
            StillRunningError: it did not end within ``timeout`` seconds (it goes on).

        Otherwise it raises whatever ended the sweep with an error, as :func:`sweep` raises it.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise StillRunningError(f"the sweep did not end within {timeout} s; it goes on")
        if self._error is not None:
            raise self._error
        return self

    def __repr__(self) -> str:
        counts = {state: sum(row.state == state for row in self.state.rows) for state in STATES}
        done = ", ".join(f"{count} {state}" for state, count in counts.items() if count)
        best = self.state.best()
        shown = f"; best #{best.number} {self.state.metric}={best.value:.4f} {best.params}" if best else ""
        return f"<Sweep {self.name!r}: {done or 'no trial'}{shown}>"


@documented(*SWEEP_DECIDES)
def sweep(
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    space: Callable[[Any], Mapping] | Mapping,
    n_trials: int,
    trial_processes: int = 1,
    metric: str = "dev/score",
    direction: str = "maximize",
    pruner: Any = None,
    study: Any = None,
    pool: Any = None,
    wait: bool = True,
    options: RunOptions | None = None,
    provenance: Provenance | None = None,
    **run_options: Any,
) -> Sweep:
    """Run ``n_trials`` trials of ``fn(*args, **kwargs, **params)``, the ``params`` suggested by Optuna from ``space``,
    ``processes // trial_processes`` at a time on disjoint devices, and return the :class:`Sweep`.

    Every trial's rank 0 reports ``metric`` at each epoch to its Optuna trial; a trial the ``pruner`` prunes stops
    at once (gracefully), freeing its devices for the next. A finished trial's value is ``metric``'s last value
    (or, for a name flair never recorded, that entry of the value ``fn`` returned, e.g. ``"test_score"``). A trial
    that fails is recorded failed, with its error, and the sweep goes on. The kernel's interrupt (or the view's
    Stop) ends the sweep: running trials stop gracefully, their models kept; a second interrupt ends their workers.

    Args:
        fn, args, kwargs: the training, as for :func:`~flair_nbddp.launch`; ``params`` are added to ``kwargs``.
        space: Optuna's define-by-run function (``lambda trial: {"lr": trial.suggest_float(...)}``) or a dict of
            Optuna distributions.
        n_trials: how many trials this call adds to the study.
        trial_processes: processes (GPUs) per trial: 8 GPUs and 2 -> 4 trials at once; 2 CPU processes and 1 -> 2.
        metric, direction: what Optuna optimises (``"dev/score"``, ``"dev/loss"`` with ``"minimize"``...).
        pruner: an ``optuna.pruners`` pruner (default Optuna's ``MedianPruner``).
        study: a name (kept in ``$FLAIR_NBDDP_HOME/studies/``; an existing one is continued, across kernels), an
            ``optuna.Study``, or None for a new name.
        pool: run the trials on a warm pool lent in slices (``WorkerPool(N, job_processes=trial_processes)``).
        wait: True: return once every trial has ended (the kernel's interrupt stops the sweep). False: return the
            :class:`Sweep` at once while its trials go on, the cell free, so that the view's **Stop** button works
            (ipywidgets' buttons act only between cells); ``.wait()`` blocks for the outcome.
        options, provenance: as for :func:`~flair_nbddp.launch`: ``processes``/``device``/``gpus`` are the devices
            the whole sweep may use, ``cluster`` a Dask cluster whose workers it may use (``trial_processes`` each).

    Run options (keywords, or ``options=RunOptions(...)``; keywords win):
        {run_options}

    Raises:
        ConfigurationError: a wrong ``space``, ``direction``, ``trial_processes``, or a study of the other direction.
        MissingDependencyError: Optuna is not installed (``pip install 'flair_nbddp[sweep]'``).
        KeyboardInterrupt: a second interrupt while the trials stop (their workers were ended).

    It also raises whatever starting a trial raises that is not the trial's own failure (e.g. a
    :class:`ShippingError`), once the running trials are stopped.

    Example::

        space = lambda trial: {"lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True)}
        result = sweep(train, (corpus,), space=space, n_trials=4, trial_processes=1, study="lr-search")
        result.best.value, result.study.best_params
    """
    options = RunOptions.of(run_options, options, where="sweep(): ", not_here=SWEEP_DECIDES)
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigurationError(f"n_trials={n_trials!r} must be a positive integer (the trials this call adds)")
    studies.check_space(space)
    ways = lanes(options, trial_processes, pool)[:n_trials]
    fn_name = provenance.name if provenance is not None and provenance.name else getattr(fn, "__name__", "sweep")
    with studies.quiet_optuna():  # the view tells of each trial, not Optuna's log lines
        opened = studies.open_study(study, direction, pruner, fn_name)
        lost = studies.fail_lost_trials(opened, Ledger.default())
    if lost:
        print(f"flair_nbddp: study {opened.study_name!r}: trial(s) {lost} were left running by a kernel that ended; "
              "marked failed", flush=True)  # fmt: skip
    state = SweepState(opened.study_name, metric, direction, n_trials, len(ways))
    result = Sweep(opened, state)
    call = _Call(fn, tuple(args), dict(kwargs or {}), space, options, provenance or Provenance("sweep"))
    view = _chooser(result, options.dashboard)
    result.background = not wait
    view.start(result)
    if wait:
        _run(result, call, ways, view)
        return result
    result._thread = threading.Thread(target=_run, args=(result, call, ways, view, True), daemon=True,
                                      name=f"flair_nbddp-sweep-{opened.study_name}")  # fmt: skip
    result._thread.start()
    return result


def _run(result: Sweep, call: _Call, ways: list[Lane], view: SweepView, keep_error: bool = False) -> None:
    """The sweep from its first trial to its outcome in the view; an error is raised (``keep_error``: kept for
    :meth:`Sweep.wait`, the sweep running on a thread of its own)."""
    try:
        with studies.quiet_optuna():
            _schedule(result, call, ways, view)
    except BaseException as error:
        result._error = error
        result.state.done = True
        view.finish(error)
        if not keep_error:
            raise
        return
    result.state.done = True
    view.finish()


@dataclass(frozen=True)
class _Call:
    fn: Callable
    args: tuple
    kwargs: dict
    space: Callable[[Any], Mapping] | Mapping
    options: RunOptions
    provenance: Provenance


def _schedule(result: Sweep, call: _Call, ways: list[Lane], view: SweepView) -> None:
    """The sweep's loop: fill free lanes, report and prune, collect. On the cell's thread, interrupts as a run's: the
    first stops every running trial gracefully, a second ends their workers."""
    free, started, interrupted = list(range(len(ways))), 0, False
    while True:
        try:
            while free and started < result.state.n_trials and not result.state.stopping:
                lane = free.pop(0)
                started += 1
                if not _start_trial(result, call, ways, lane) and not free and not result._running:
                    raise RunActiveError(f"no lane of the sweep can start a trial: {result.state.rows[-1].error}")
            _follow(result)
            for number in [number for number, (_, thread, _) in result._running.items() if not thread.is_alive()]:
                free.append(_conclude(result, number))
            view.poll()
            if not result._running and (started >= result.state.n_trials or result.state.stopping or not free):
                return
            time.sleep(TICK_SECONDS)
        except KeyboardInterrupt:
            if interrupted:
                for run, _, _ in list(result._running.values()):
                    run.kill()
                _conclude_all(result)
                raise
            interrupted = True
            print("flair_nbddp: stopping the sweep: every running trial stops after its current batch, its model saved "
                  "(interrupt again to end their workers now)", flush=True)  # fmt: skip
            result.stop()
        except BaseException:
            result.stop()
            _conclude_all(result)
            raise


def _conclude_all(result: Sweep) -> None:
    """Wait for every running trial to end, and tell Optuna how each did."""
    for number in list(result._running):
        result._running[number][1].join()
        _conclude(result, number)


def _start_trial(result: Sweep, call: _Call, ways: list[Lane], lane_index: int) -> bool:
    """Start the next trial on lane ``lane_index``; False when the lane's devices cannot take it (held by a run of
    this kernel, a Dask worker gone...): the trial is failed, the lane left out from now on.

    Raises:
        Whatever else starting raises (a ``ShippingError``...): every trial would fail so.
    """
    study, state = result.study, result.state
    trial, params = studies.ask(study, call.space)
    lane = ways[lane_index]
    row = TrialRow(trial.number, params, lane.label)
    state.rows.append(row)
    described = {"study": study.study_name, "number": trial.number, "params": params, "state": "running"}
    provenance = replace(call.provenance, origin="sweep", trial=described)
    try:
        run = start(call.fn, call.args, {**call.kwargs, **params}, options=RunOptions.of(lane.options, call.options),
                    pool=lane.pool, provenance=provenance)  # fmt: skip
    except BaseException as error:
        row.state, row.error, row.ended_at = "failed", f"{type(error).__name__}: {error}", time.time()
        trial.set_user_attr("error", row.error[:2000])
        study.tell(trial, state=studies.optuna().trial.TrialState.FAIL)
        if isinstance(error, (RunActiveError, ClusterError)):
            print(f"flair_nbddp: trial #{trial.number} could not start on {lane.label} ({error}); the sweep goes on "
                  "without that lane", flush=True)  # fmt: skip
            return False
        raise
    holder: dict = {"trial": trial, "row": row, "lane": lane_index, "cursor": (None, 0)}
    thread = threading.Thread(target=_watch, args=(run, holder), daemon=True, name=f"flair_nbddp-trial-{trial.number}")
    result._running[trial.number] = (run, thread, holder)  # at once: whatever comes next, the run is followed
    thread.start()
    row.record_id = run.record_id
    if run.record_id is not None:
        trial.set_user_attr("record_id", run.record_id)
    return True


def _watch(run: Any, holder: dict) -> None:
    """A trial's thread: wait for its run's result (or keep what went wrong waiting)."""
    try:
        while True:
            try:
                holder["result"] = run.wait(timeout=3600)
                return
            except StillRunningError:
                continue
    except BaseException as error:  # noqa: BLE001 - the scheduler reports it as the trial's failure
        holder["error"] = error


def _follow(result: Sweep) -> None:
    """Report each running trial's new epochs of the metric; stop those Optuna prunes."""
    for run, _, holder in list(result._running.values()):
        _report(result, run, holder, may_prune=True)


def _report(result: Sweep, run: Any, holder: dict, may_prune: bool) -> None:
    """Report one trial's new points of the metric to Optuna (each epoch once, across restarts); with
    ``may_prune``, stop the trial when Optuna prunes it."""
    state, (seen, cursor) = run.state, holder["cursor"]
    points, cursor = state.metrics_since(cursor if seen is state else 0)  # a restart's attempt: a new state
    holder["cursor"] = (state, cursor)
    row, trial = holder["row"], holder["trial"]
    reported = {step for step, _ in row.curve}
    for point in points:
        if point.name != result.state.metric or point.step in reported:
            continue
        trial.report(point.value, point.step)
        row.curve.append((point.step, point.value))
        reported.add(point.step)
        if may_prune and row.state == "running" and not result.state.stopping and trial.should_prune():
            row.state = "pruned"
            run.stop()


def _conclude(result: Sweep, number: int) -> int:
    """Tell Optuna how trial ``number`` ended, record it, keep its result if it is the best; return its lane."""
    module = studies.optuna()
    run, thread, holder = result._running[number]
    try:
        thread.join()
        row, trial = holder["row"], holder["trial"]
        if row.state == "running":  # the metric's last points may have come after the last tick
            _report(result, run, holder, may_prune=False)
        outcome: RunResult | None = holder.get("result")
        error = holder.get("error") if outcome is None else outcome.error
        row.ended_at = time.time()
        value, told = None, module.trial.TrialState.FAIL
        if row.state == "pruned" and error is None:
            told = module.trial.TrialState.PRUNED
        elif error is not None:
            row.state, row.error = "failed", f"{type(error).__name__}: {error}"
        elif outcome.status == "stopped":
            row.state = "stopped"
        else:
            value = _objective(outcome, result.state.metric, row)
            row.state, row.value = ("failed", None) if value is None else ("complete", value)
            told = module.trial.TrialState.FAIL if value is None else module.trial.TrialState.COMPLETE
        attempts = [attempt.record_id for attempt in outcome.attempts] if outcome is not None else []
        if outcome is not None and outcome.record_id is not None:  # with restarts: the last attempt's
            row.record_id = outcome.record_id
            trial.set_user_attr("record_id", outcome.record_id)
            trial.set_user_attr("attempts", attempts)
        trial.set_user_attr("state", row.state)
        if row.error:
            trial.set_user_attr("error", row.error[:2000])
        result.study.tell(trial, value, state=told, skip_if_finished=True)
    finally:
        result._running.pop(number)
    _keep_if_best(result, row, outcome)
    _record_state(row, result.study.study_name, attempts or [row.record_id])
    return holder["lane"]


def _keep_if_best(result: Sweep, row: TrialRow, outcome: RunResult | None) -> None:
    """One value (a model) kept in memory: the best trial's; the others' models are in their run directories."""
    if outcome is None:
        return
    if result.state.best() is row:
        if result.best is not None:
            result.best.value = None
        result.best = outcome
    else:
        outcome.value = None


def _objective(outcome: RunResult, metric: str, row: TrialRow) -> float | None:
    """A finished trial's value: the metric's last point, else the value's entry of that name; None (and the
    row's error) if neither."""
    if row.curve:
        return row.curve[-1][1]
    points = outcome.history(metric)
    if points:
        return points[-1][1]
    if isinstance(outcome.value, Mapping) and isinstance(outcome.value.get(metric), (int, float)):
        return float(outcome.value[metric])
    recorded = sorted({point.name for point in outcome.metrics})
    row.error = (
        f"the trial finished without {metric!r}: it recorded {', '.join(recorded) or 'no metric'}"
        + (f" and returned {sorted(outcome.value)}" if isinstance(outcome.value, Mapping) else "")
        + "; pass metric= one of them"
    )
    return None


def _record_state(row: TrialRow, study_name: str, record_ids: list[int | None]) -> None:
    """The trial's verdict on its run records (every attempt's, with restarts)."""
    ledger = Ledger.default()
    if ledger is None:
        return
    trial = {"study": study_name, "number": row.number, "params": row.params, "state": row.state, "value": row.value}
    for record_id in record_ids:
        if record_id is not None:
            ledger.update(record_id, trial=trial)
