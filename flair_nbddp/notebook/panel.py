"""A widget panel that trains by clicking: a form of hyperparameters, Train and Stop, the live dashboard below.

The panel never blocks the notebook: Train starts a :class:`~flair_nbddp.Run` (through
:func:`flair_nbddp.start`) and a background thread waits for it, so the cell returns at once and the kernel
stays free to receive the Stop click. That thread only sets widget values (it never prints: output from a
thread lands in whichever cell happens to run). The module has two halves, like
:mod:`~flair_nbddp.notebook.dashboard`: pure functions that turn ``params`` into widgets and records into HTML, and
the :class:`TrainingPanel` that wires them to runs.

Example::

    panel = TrainingPanel(train, corpus=corpus, params={"learning_rate": 5e-3})
    panel
"""

from __future__ import annotations

import contextlib
import html
import inspect
import math
import numbers
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..api import start
from ..engine.claims import queue_reports
from ..engine.devices import DevicePlan, cuda_plan, resolve_devices, visible_gpu_count
from ..errors import ConfigurationError, NotCallableError, ResumeError, RunActiveError, StillRunningError
from ..ledger.provenance import Provenance
from ..ledger.store import Ledger, RunRecord
from ..options import RunOptions, documented
from ..pool import WorkerPool, current_pool
from ..engine.restarts import RestartingRun
from ..result import RunResult
from ..engine.run import Run, wait_for_end
from ..engine.state import Snapshot
from ..wire.pool_ref import PoolRef, trackable
from .dashboard import (
    BORDER_COLOR,
    MUTED_COLOR,
    NO_PROBLEM,
    STATUS_COLORS,
    Dashboard,
    Problem,
    describe_problem,
    format_duration,
    progress_text,
)
from .run_table import runs_html

if TYPE_CHECKING:
    import ipywidgets

MAX_CPU_CHOICES = 8
MAX_SHARED_RANKS = 8  # with share_gpus, the selector offers up to this many ranks on the GPUs (an 8-GPU run)
HISTORY_ROWS = 50  # runs of the function the table shows, newest first
UI_BUSY_SECONDS = 0.5  # the table waits this long for a ledger another kernel is writing, then shows this panel's
CONTROL_WIDTH = "380px"  # every form control, so that the grid's columns line up
LOG_SLIDER_DECADES = 2  # a lone learning rate gets a slider this many decades either side
_FAILED = STATUS_COLORS["failed"]
_PANEL_DECIDES = {  # run options the panel takes none of
    "dashboard": "the panel shows its own",
}


# -- params → widgets -----------------------------------------------------------------------------
def is_learning_rate(name: str) -> bool:
    """True for names that hold a learning rate (they get a log-scale slider).

    Example:
        >>> [is_learning_rate(name) for name in ("learning_rate", "lr", "head_lr", "max_epochs")]
        [True, True, True, False]
    """
    lowered = name.lower()
    return "learning_rate" in lowered or "lr" in lowered


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_range(spec: Any) -> bool:
    return isinstance(spec, tuple) and 2 <= len(spec) <= 4 and all(_is_number(item) for item in spec)


def nice_step(span: float) -> float:
    """A slider step of 1, 2 or 5 × 10^k giving about a hundred positions over ``span``.

    Example:
        >>> nice_step(0.5), nice_step(1.0), nice_step(30.0)
        (0.005, 0.01, 0.5)
    """
    raw = span / 100
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(float(f"{m * magnitude:.1g}") for m in (1, 2, 5, 10) if m * magnitude >= raw * (1 - 1e-9))


def _decimals(step: float) -> int:
    return max(0, -math.floor(math.log10(step)))


def _range_parts(name: str, spec: tuple, middle: Callable[[float, float], float]) -> tuple[float, float, float, Any]:
    """``(min, max, value, step)`` of a range tuple, checked; the value defaults to ``middle(min, max)``."""
    low, high, *rest = spec
    value = rest[0] if rest else middle(low, high)
    step = rest[1] if len(rest) > 1 else None
    if not low < high:
        raise ConfigurationError(
            f"params[{name!r}]={spec!r}: a range needs min < max (it is (min, max[, value[, step]]))"
        )
    if not low <= value <= high:
        raise ConfigurationError(
            f"params[{name!r}]={spec!r}: the value {value} is outside [{low}, {high}]. A tuple of numbers is a "
            f"range (min, max[, value[, step]]); for a dropdown of numbers use a list, e.g. {list(spec)!r}"
        )
    if step is not None and not step > 0:
        raise ConfigurationError(f"params[{name!r}]={spec!r}: the step must be positive")
    return low, high, value, step


def _linear_slider(name: str, spec: tuple) -> ipywidgets.ValueWidget:
    import ipywidgets as widgets

    if all(isinstance(item, numbers.Integral) for item in spec):
        low, high, value, step = _range_parts(name, spec, lambda low, high: (low + high) // 2)
        return widgets.IntSlider(
            value=int(value), min=int(low), max=int(high), step=int(step or 1), description=name,
            continuous_update=False,
        )  # fmt: skip
    low, high, value, step = _range_parts(name, spec, lambda low, high: (low + high) / 2)
    step = step or nice_step(high - low)
    return widgets.FloatSlider(
        value=value, min=low, max=high, step=step, readout_format=f".{_decimals(step)}f", description=name,
        continuous_update=False,
    )  # fmt: skip


def _log_slider(name: str, spec: Any) -> ipywidgets.ValueWidget:
    """A FloatLogSlider (base 10, ten positions per decade) around a learning rate, or over a range of them."""
    import ipywidgets as widgets

    if _is_number(spec):
        if not spec > 0:
            raise ConfigurationError(
                f"params[{name!r}]={spec!r}: a learning rate must be positive (it gets a log scale)"
            )
        decade = math.floor(math.log10(spec))
        low, high, value = decade - LOG_SLIDER_DECADES, decade + LOG_SLIDER_DECADES, spec
    else:
        if len(spec) > 3 or not spec[0] > 0:
            raise ConfigurationError(
                f"params[{name!r}]={spec!r}: a learning-rate range is (min, max[, value]) with min > 0 (log scale)"
            )
        geometric_mean = lambda low, high: math.sqrt(low * high)  # noqa: E731
        low, high, value, _ = _range_parts(name, spec, geometric_mean)
        low, high = math.log10(low), math.log10(high)
    return widgets.FloatLogSlider(
        value=value, base=10, min=low, max=high, step=0.1, readout_format=".1e", description=name,
        continuous_update=False,
    )  # fmt: skip


def _number_box(name: str, value: numbers.Real) -> ipywidgets.ValueWidget:
    import ipywidgets as widgets

    if isinstance(value, numbers.Integral):
        return widgets.IntText(value=int(value), step=1, description=name)
    step = 10.0 ** math.floor(math.log10(abs(value))) if value else 0.1
    return widgets.FloatText(value=float(value), step=step, description=name)


def param_widget(name: str, spec: Any) -> ipywidgets.ValueWidget:
    """The widget for one entry of ``params`` (the rules are in :class:`TrainingPanel`'s docstring).

    Raises:
        ConfigurationError: ``spec`` makes no widget (the message names the param and says what would).

    Example:
        >>> type(param_widget("max_epochs", (1, 10, 4))).__name__, type(param_widget("lr", 5e-3)).__name__
        ('IntSlider', 'FloatLogSlider')
    """
    import ipywidgets as widgets

    if isinstance(spec, widgets.ValueWidget):
        return spec
    if isinstance(spec, bool):
        return widgets.Checkbox(value=spec, description=name)
    if isinstance(spec, list) or (isinstance(spec, tuple) and spec and not _is_range(spec)):
        if not spec:
            raise ConfigurationError(f"params[{name!r}]: an empty list of choices")
        return widgets.Dropdown(options=list(spec), description=name)
    if is_learning_rate(name) and (_is_number(spec) or _is_range(spec)):
        return _log_slider(name, spec)
    if _is_range(spec):
        return _linear_slider(name, spec)
    if _is_number(spec):
        return _number_box(name, spec)
    if isinstance(spec, str):
        return widgets.Text(value=spec, description=name)
    raise ConfigurationError(
        f"params[{name!r}]={spec!r}: cannot make a widget of a {type(spec).__name__}. Give a number, a bool, a "
        "string, a range (min, max[, value[, step]]), a list of choices, or an ipywidgets widget."
    )


def build_form(params: Mapping[str, Any]) -> dict[str, ipywidgets.ValueWidget]:
    """One widget per param, in order, their labels as wide as the longest name.

    Raises:
        ConfigurationError: a name is not a valid keyword argument, or a spec makes no widget.

    Example:
        >>> form = build_form({"max_epochs": (1, 10, 4), "shuffle": True})
        >>> {name: control.value for name, control in form.items()}
        {'max_epochs': 4, 'shuffle': True}
    """
    for name in params:
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigurationError(f"params key {name!r} is not a valid keyword argument name")
    form = {name: param_widget(name, spec) for name, spec in params.items()}
    for name, control in form.items():
        if control is not params[name]:  # a widget the user built keeps its own look
            control.style.description_width = f"{max(map(len, params)) + 2}ch"
            control.layout.width = CONTROL_WIDTH
    return form


def check_call(fn: Callable, with_corpus: bool, names: list[str]) -> None:
    """Check that ``fn`` accepts the keyword arguments ``names`` (after the corpus, if any).

    Raises:
        ConfigurationError: it does not (the message names the argument that does not fit).

    Example:
        >>> def train(corpus, max_epochs=4): ...
        >>> check_call(train, True, ["max_epochs", "shuffle"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        flair_nbddp.errors.ConfigurationError: the panel's call ... got an unexpected keyword argument 'shuffle'
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some callables have none: the run will tell
        return
    try:
        signature.bind(*((None,) if with_corpus else ()), **dict.fromkeys(names))
    except TypeError as error:
        call = f"{_name(fn)}({'corpus, ' if with_corpus else ''}**fixed, **params)"
        raise ConfigurationError(f"the panel's call {call} does not fit {_name(fn)}{signature}: {error}") from None


def device_choices(gpus: int, cpus: int, share_gpus: bool = False) -> list[tuple[str, tuple[str, int]]]:
    """The process/device selector's options: ``(label, (device, processes))``, every GPU count first (with
    ``share_gpus``, up to ``MAX_SHARED_RANKS`` ranks sharing the GPUs, over gloo).

    Example:
        >>> device_choices(0, 2)
        [('1 × cpu (gloo)', ('cpu', 1)), ('2 × cpu (gloo)', ('cpu', 2))]
        >>> [label for label, _ in device_choices(2, 2)][:2]
        ['2 × cuda (nccl)', '1 × cuda (nccl)']
        >>> [label for label, _ in device_choices(1, 2, share_gpus=True)][-5:-2]
        ['3 × cuda sharing GPU 0 (gloo)', '2 × cuda sharing GPU 0 (gloo)', '1 × cuda (nccl)']
    """
    most = max(gpus, MAX_SHARED_RANKS) if share_gpus and gpus else gpus
    plans = [cuda_plan(n, gpus) for n in range(most, 0, -1)]
    cpu_counts = range(1, max(2, min(cpus, MAX_CPU_CHOICES)) + 1)
    plans += [DevicePlan("cpu", n, "gloo") for n in cpu_counts]
    return [(str(plan), (plan.device_type, plan.world_size)) for plan in plans]


# -- records → HTML -------------------------------------------------------------------------------
@dataclass
class PanelRun:
    """One run started from the panel, as :attr:`TrainingPanel.runs` keeps it.

    Attributes:
        number: 1 for the panel's first run.
        params: the chosen values, as ``fn`` received them (``fixed`` ones excluded).
        devices: where it ran, e.g. ``"2 × cpu (gloo)"``.
        status: ``"running"`` while it runs, then ``"finished"``, ``"stopped"`` or ``"failed"``.
        elapsed: seconds from start to end (None while running).
        scores: the result's :attr:`~flair_nbddp.RunResult.scores` (the value's numbers, e.g. ``test_score``,
            and ``dev/score``, ``train/loss``).
        result: the :class:`~flair_nbddp.RunResult` once it ended.
        error: the failure, if it failed.
        record_id: its id in the run ledger (the table's ``#``), None when not recorded.
        started_at: when Train was pressed (a ``time.time()``).
        restarts: with ``max_restarts``, why and from where each restart started it again (the status says the last).
    """

    number: int
    params: dict[str, Any]
    devices: str
    status: str = "running"
    elapsed: float | None = None
    scores: dict[str, float] = field(default_factory=dict)
    result: RunResult | None = None
    error: BaseException | None = None
    record_id: int | None = None
    started_at: float = field(default_factory=time.time, compare=False)
    restarts: list[str] = field(default_factory=list)

    def as_record(self) -> RunRecord:
        """This run as a row of the history table, where the run ledger has none (its ``#`` shows "—")."""
        return RunRecord(
            started_at=self.started_at, status=self.status, devices=self.devices,
            elapsed=self.elapsed, params={"kwargs": self.params}, scores=self.scores,
        )  # fmt: skip


def panel_status_html(status: str, detail: str = "") -> str:
    """The coloured status next to the buttons, e.g. ``● running · run 2 · epoch 1/4 · batch 3/50 · 2%``."""
    color = STATUS_COLORS.get(status, MUTED_COLOR)
    text = f'<b style="color:{color}">● {html.escape(status)}</b>'
    return f'<span style="font-size:13px">{text}{" · " + html.escape(detail) if detail else ""}</span>'


def error_html(problem: Problem) -> str:
    """The red message area: the headline, and the details (e.g. a worker's traceback) folded under it."""
    headline, details = problem
    head = f'<b style="color:{_FAILED}">{html.escape(headline)}</b>'
    box = f"border-left:3px solid {_FAILED};background:rgba(220,38,38,0.07);padding:4px 10px;font-size:12px"
    if not details or details.strip() == headline.strip():
        return f'<div style="{box}">{head}</div>'
    return (
        f'<div style="{box}"><details><summary style="cursor:pointer">{head}</summary>'
        f'<pre style="margin:4px 0 2px;font-size:11px;white-space:pre-wrap">{html.escape(details)}</pre>'
        "</details></div>"
    )


def outcome_text(record: PanelRun) -> str:
    """What the status says after a run, e.g. ``run 2 (#57) · 35 s · model saved``: the panel's number, the run
    ledger's (the table's ``#``, where recorded); its scores are in the table below.

    Example:
        >>> outcome_text(PanelRun(2, {}, "2 × cpu (gloo)", "finished", 35.0, {"test_score": 0.86}, record_id=57))
        'run 2 (#57) · 35 s'
    """
    recorded = "" if record.record_id is None else f" (#{record.record_id})"
    parts = [f"run {record.number}{recorded}", format_duration(record.elapsed)]
    if record.result is not None and record.result.checkpoint is not None:
        parts.append("model saved")
    return " · ".join(parts)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


# -- the panel ------------------------------------------------------------------------------------
class TrainingPanel:
    """Train ``fn`` on every device by clicking: a form of hyperparameters, Train and Stop, the live dashboard.

    Each run calls ``fn(corpus, **fixed, **chosen)`` on every rank (``fn(**fixed, **chosen)`` when no
    corpus is given), where ``chosen`` maps each name of ``params`` to its widget's value when Train was
    pressed. Train returns at once and the run goes on in the background: a cell that waited for it could
    not receive the Stop click. The form is locked until the run ends; Stop ends it gracefully (every rank
    stops after the same batch and flair saves ``final-model.pt``, as with a kernel interrupt); then Train
    starts the next run. With a warm pool (``%ddp_pool start``) the runs use the pool's workers, and the
    corpus is put on the pool once (:meth:`~flair_nbddp.WorkerPool.put`): later runs use the workers' copy
    while ``panel.corpus`` is the same object with the same splits. Changes made inside its sentences are not
    seen: after such changes, assign it again (``panel.corpus = corpus``) and the next run puts it afresh.

    How ``params`` become widgets, [starting at]:

    - ``True``/``False``: a checkbox.
    - a list ``[8, 16, 32]``, or a tuple of non-numbers ``("adam", "sgd")``: a dropdown [the first item];
      ``(label, value)`` pairs show their labels.
    - a tuple of 2 to 4 numbers ``(min, max[, value[, step]])``: a slider [the middle]. Ints give an
      IntSlider (step 1), floats a FloatSlider (a 1-2-5 step of about 1/100 of the range). Unlike in
      ``interact``, the third number is where the slider starts, not its step.
    - a lone number ``4`` or ``0.1``: a number box (IntText; a FloatText stepping by the number's order of
      magnitude) [the number].
    - a learning rate (the name contains ``lr`` or ``learning_rate``): a FloatLogSlider, over two decades
      either side of a lone rate [the rate], or over a range ``(min, max[, value])`` [its geometric middle].
    - a string: a text box. An ipywidgets widget with a value: itself.

    So ``{"learning_rate": 5e-3, "max_epochs": (1, 10, 4), "mini_batch_size": [8, 16, 32], "shuffle": True}``
    gives a log slider from 1e-5 to 1e-1 at 5e-3, a slider from 1 to 10 at 4, a dropdown at 8 and a ticked box.

    Args:
        fn: the training function every rank runs (a notebook function is fine).
        corpus: passed first to ``fn``; None: ``fn`` gets keyword arguments only.
        params: the hyperparameters the form offers, by name (rules above).
        fixed: more keyword arguments every run passes unchanged (paths, ``return_model=False``...).
        options, run_options: the :class:`~flair_nbddp.RunOptions` of every run it starts (keywords win over
            ``options``), as for :func:`~flair_nbddp.launch`; ``processes`` and ``device`` are the device
            selector's first choice (default: every GPU, else 2 CPU processes; ``$FLAIR_NBDDP_PROCESSES`` and
            ``$FLAIR_NBDDP_DEVICE`` apply), and the selector's choice is what each run uses.

    Raises:
        ConfigurationError: (a ``ValueError``) a param makes no widget, or ``fn`` would not accept the
            arguments (named in the message).

    The widgets are attributes: ``widget`` (the root, CSS class ``nbddp-panel``), ``controls`` (one per
    param), ``devices``, ``train_button`` (``nbddp-train``), ``stop_button`` (``nbddp-stop``), ``resume_button``
    (``nbddp-resume``: enabled while the last run is stopped or failed with a full checkpoint), ``status``
    (``nbddp-panel-status``), ``message`` (``nbddp-panel-error``: errors, in red), ``history``
    (``nbddp-history``) and ``dashboard`` (the current run's :class:`~flair_nbddp.notebook.dashboard.Dashboard`).

    Example::

        from flair_nbddp import TrainingPanel
        from flair_nbddp.demo import train_classifier
        panel = TrainingPanel(
            train_classifier,
            corpus=corpus,
            params={"learning_rate": 5e-3, "max_epochs": (1, 10, 4), "mini_batch_size": [8, 16, 32]},
            fixed={"model_path": model_path, "base_path": "out", "return_model": False},
        )
        panel                   # the last expression of a cell shows it (or panel.display())
        panel.runs[-1].scores   # after a run: the numbers its row of the table shows
        # {'test_score': 0.87, 'dev/score': 0.9, 'train/loss': 0.21}
    """

    @documented(*_PANEL_DECIDES)
    def __init__(
        self,
        fn: Callable,
        corpus: Any = None,
        params: Mapping[str, Any] | None = None,
        *,
        fixed: Mapping[str, Any] | None = None,
        options: RunOptions | None = None,
        **run_options: Any,
    ) -> None:
        if not callable(fn):
            raise NotCallableError(f"fn must be callable (the training function), not {type(fn).__name__}")
        self.fn, self.fixed = fn, dict(fixed or {})
        self._shared: PoolRef | None = None  # the corpus put on the current pool, while it matches
        self.corpus = corpus
        self.options = RunOptions.of(run_options, options, where="TrainingPanel(): ", not_here=_PANEL_DECIDES)
        self.controls = build_form(dict(params or {}))
        self._check_arguments()
        self.runs: list[PanelRun] = []
        self.run: Run | None = None  # the current or last run
        self.dashboard: Dashboard | None = None
        self._done = threading.Event()  # set while no run is active
        self._done.set()
        self._leave_queue = threading.Event()  # Stop while a run waits for its devices
        self._queued = threading.Event()  # set while a run waits for its devices (Train with "wait s")
        self._default_plan = resolve_devices(self.options.device, self.options.processes, self.options.gpus,
                                             self.options.share_gpus)  # fmt: skip
        self._build_widgets()
        self._lock(False)

    def _check_arguments(self) -> None:
        given = set(self.fixed) | ({"corpus"} if self.corpus is not None else set())
        clash = sorted(set(self.controls) & given)
        if clash:
            raise ConfigurationError(
                f"params {clash} are also given in fixed (or as the corpus): give each argument once"
            )
        check_call(self.fn, self.corpus is not None, [*self.fixed, *self.controls])

    def _build_widgets(self) -> None:
        import ipywidgets as widgets

        self.devices = widgets.Dropdown(description="devices", layout=widgets.Layout(width="250px"))
        self.devices.style.description_width = "56px"
        self.wait_for = widgets.BoundedFloatText(
            value=self.options.wait_for_devices or 0.0, min=0.0, max=7 * 86400.0, step=60.0, description="wait s",
            layout=widgets.Layout(width="150px", margin="0 0 0 8px"),
        )  # fmt: skip
        self.wait_for.style.description_width = "48px"
        self.wait_for.tooltip = (
            "seconds to wait in the machine's queue when another run (any kernel, any user) holds the devices; "
            "0: refuse at once, naming the holder"
        )
        self.train_button = widgets.Button(description="Train", icon="play", button_style="success")
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="warning", disabled=True)
        self.resume_button = widgets.Button(description="Resume", icon="forward", disabled=True)
        self.train_button.tooltip = "start a run with these values; it trains in the background"
        self.stop_button.tooltip = "stop after the current batch on every rank; flair saves the model"
        self.resume_button.tooltip = "continue the last run, stopped or failed, from its last checkpoint, with its values"
        for button in (self.train_button, self.stop_button, self.resume_button):
            button.layout = widgets.Layout(width="96px", margin="0 0 0 8px")
        self.status = widgets.HTML(panel_status_html("ready"), layout=widgets.Layout(margin="0 0 0 14px"))
        self.message = widgets.HTML(layout=widgets.Layout(display="none", width="100%", margin="2px 0 6px"))
        self.history = widgets.HTML(self.history_html(), layout=widgets.Layout(width="100%", overflow="auto"))
        placeholder = f'<span style="color:{MUTED_COLOR};font-size:12px">the live dashboard of a run appears here</span>'
        self.dashboard_box = widgets.VBox([widgets.HTML(placeholder)], layout=widgets.Layout(margin="6px 0 0"))
        self.widget = self._layout(widgets)
        for control, css_class in [
            (self.widget, "nbddp-panel"), (self.train_button, "nbddp-train"), (self.stop_button, "nbddp-stop"),
            (self.resume_button, "nbddp-resume"), (self.status, "nbddp-panel-status"), (self.message, "nbddp-panel-error"), (self.history, "nbddp-history"),
        ]:  # fmt: skip
            control.add_class(css_class)
        self.train_button.on_click(self._on_train_click)
        self.stop_button.on_click(lambda _: self.stop())
        self.resume_button.on_click(self._on_resume_click)

    def _layout(self, widgets: Any) -> ipywidgets.VBox:
        call = f"{_name(self.fn)}({'corpus, ' if self.corpus is not None else ''}**params)"
        title = widgets.HTML(
            f'<b style="font-size:13px">flair_nbddp training panel</b> '
            f'<span style="color:{MUTED_COLOR}">· {html.escape(call)}</span>'
        )
        columns = f"repeat(auto-fill, {CONTROL_WIDTH})"
        form = widgets.GridBox(
            list(self.controls.values()), layout=widgets.Layout(grid_template_columns=columns, grid_gap="2px 24px")
        )
        buttons = widgets.HBox(
            [self.devices, self.wait_for, self.train_button, self.stop_button, self.resume_button, self.status],
            layout=widgets.Layout(align_items="center", flex_flow="row wrap", margin="8px 0 6px"),
        )
        heading = widgets.HTML(f'<span style="color:{MUTED_COLOR};font-size:12px;font-weight:600">runs</span>')
        return widgets.VBox(
            [title, form, buttons, self.message, heading, self.history, self.dashboard_box],
            layout=widgets.Layout(border=f"1px solid {BORDER_COLOR}", padding="8px 12px", max_width="1010px"),
        )

    # -- reading ----------------------------------------------------------------------------------
    @property
    def values(self) -> dict[str, Any]:
        """The form's values now, by param name (what the next Train passes to ``fn``)."""
        return {name: control.value for name, control in self.controls.items()}

    @property
    def active(self) -> bool:
        """True from Train until the run has ended and been recorded."""
        return not self._done.is_set()

    @property
    def resumable(self) -> PanelRun | None:
        """This panel's last run if it stopped or failed after writing a full checkpoint (what Resume continues)."""
        last = self.runs[-1] if self.runs else None
        if last is None or last.status not in ("stopped", "failed") or last.result is None:
            return None
        return last if last.result.checkpoints else None

    @property
    def result(self) -> RunResult | None:
        """The last ended run's :class:`~flair_nbddp.RunResult` (None before any ended)."""
        ended = [record.result for record in self.runs if record.result is not None]
        return ended[-1] if ended else None

    # -- acting -----------------------------------------------------------------------------------
    def train(self) -> Run | None:
        """What Train does: start a run with the form's values and return it at once (it runs in the background).
        With a ``wait s`` above 0 and its devices held by another run (of any kernel or user), it returns None and
        waits for them in the background, its place in the machine's queue shown beside the buttons (then
        :attr:`run` is the run once it starts, and :meth:`wait` waits for it); Stop leaves the queue.

        Raises:
            RunActiveError: a run is active (this panel's or another in this kernel).
            DeviceError, ShippingError: impossible devices, or ``fn``/an argument that cannot be shipped.

        Each is also shown in the panel's red message area.
        """
        try:
            if self.active:
                raise RunActiveError("this panel's run is still active: Stop it, or wait for it to end")
            if not self.wait_for.value:
                return self._start()
            try:
                return self._start()
            except RunActiveError:  # busy devices: it queues for them
                return self._queue()
        except Exception as error:
            self._show_problem(describe_problem(error))
            raise

    def resume(self) -> Run:
        """What Resume does: continue this panel's last run, stopped or failed, from its last full checkpoint (a stop
        writes one where it stopped, or, at an epoch's last batch, the epoch before stands), with that run's values (the form shows them again) and devices; returns at
        once. The run trains what the uninterrupted run would have (:func:`flair_nbddp.launch`'s ``resume=``).

        Raises:
            RunActiveError: a run is active.
            ResumeError: the last run finished or wrote no checkpoint, or it cannot be continued (the function's
                source or the corpus changed; the message says which). Each is also shown in the panel.
        """
        try:
            if self.active:
                raise RunActiveError("this panel's run is still active: Stop it, or wait for it to end")
            earlier = self.resumable
            if earlier is None:
                raise ResumeError(
                    "this panel's last run did not stop or fail after a full checkpoint, so there is nothing to "
                    "resume: Train starts a run (launch(..., resume=ID) continues a run of the ledger's table)"
                )
            for name, value in earlier.params.items():
                self.controls[name].value = value
            return self._start(earlier)
        except Exception as error:
            self._show_problem(describe_problem(error))
            raise

    def stop(self) -> None:
        """What Stop does: every rank stops after the current batch, flair saves ``final-model.pt``; returns at once.
        A run still waiting for its devices leaves the queue instead."""
        self._leave_queue.set()
        if self.run is None or not self.active or self._queued.is_set():
            return
        self.run.stop()
        self.stop_button.disabled = True
        self.status.value = panel_status_html("running", f"run {len(self.runs)} · stopping after this batch")

    def wait(self, timeout: float | None = None) -> RunResult | None:
        """Block until the current run has ended and is recorded; returns :attr:`result`.

        For code, and notebooks run top to bottom (a cell that waits cannot receive clicks). Interrupts work as
        for :func:`~flair_nbddp.launch` (the same :func:`~flair_nbddp.engine.run.wait_for_end`): the first stops the
        run gracefully, a second ends its workers at once.

        A run still waiting for its devices is waited for too; an interrupt then leaves the queue.

        Raises:
            StillRunningError: (a ``TimeoutError``) the run did not end within ``timeout`` seconds (it goes on).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        queued = self._queued.is_set()
        try:
            while self._queued.is_set():
                if deadline is not None and time.monotonic() > deadline:
                    raise StillRunningError(f"the panel's run still waits for its devices after {timeout:g} s; it goes "
                                            "on waiting (Stop leaves the queue)")  # fmt: skip
                time.sleep(0.05)
        except KeyboardInterrupt:
            self._leave_queue.set()
            raise
        if self.run is not None:  # the time left, after a wait in the queue
            left = max(0.0, deadline - time.monotonic()) if queued and deadline is not None else timeout
            wait_for_end(self.run, self._done, left)
        return self.result

    def history_html(self) -> str:
        """The table of runs, newest first, one column per param: every panel run of this function in the run
        ledger, those of earlier kernels too, and this panel's runs the ledger does not have (it is off, or
        could not be written: the message area says so)."""
        ledger, records = Ledger.default(), []
        if ledger is not None:
            with contextlib.suppress(Exception):  # whatever is wrong with the ledger, the table shows what it can
                records = ledger.records(
                    HISTORY_ROWS, name=_name(self.fn), origin="panel", busy=UI_BUSY_SECONDS, attempts=1
                )  # fmt: skip
        recorded = {record.id for record in records}
        records += [run.as_record() for run in self.runs if run.record_id is None or run.record_id not in recorded]
        records.sort(key=lambda record: record.started_at, reverse=True)
        return runs_html(records[:HISTORY_ROWS], list(self.controls), empty="no runs yet: press Train")

    def display(self) -> None:
        """Show the panel in the current cell (as does ending a cell with it)."""
        from IPython.display import display

        display(self)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        """The widget, with a text and HTML description for frontends that cannot render it (a saved notebook)."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        bundle["text/html"] = f"<div><b>{html.escape(repr(self))}</b>{self.history_html()}</div>"
        return bundle

    def __repr__(self) -> str:
        text = f"TrainingPanel({_name(self.fn)}: {len(self.runs)} run(s)"
        if self.runs:
            last = self.runs[-1]
            text += f"; last {last.status}" + "".join(f", {name} {value:.4f}" for name, value in last.scores.items())
        return text + ")"

    @property
    def corpus(self) -> Any:
        """The corpus every run gets; assigning it (even the same object) puts it on the pool afresh."""
        return self._corpus

    @corpus.setter
    def corpus(self, corpus: Any) -> None:
        self._corpus = corpus
        self._drop_shared()

    def _drop_shared(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.release()

    def _corpus_for(self, pool: WorkerPool | None) -> Any:
        """The corpus as a run ships it: on a pool, the workers' copy (put now unless the one put still matches)."""
        if pool is None or not trackable(self.corpus):  # a list: nothing could tell whether it changed
            return self.corpus
        if self._shared is None or self._shared not in pool.refs or not self._shared.matches(self.corpus):
            self._drop_shared()
            self._shared = pool.put(self.corpus)
        return self._shared

    # -- running ----------------------------------------------------------------------------------
    def _on_train_click(self, _: Any) -> None:
        try:
            self.train()
        except Exception:  # a click has no cell to raise into: train() showed it in the panel
            pass

    def _on_resume_click(self, _: Any) -> None:
        try:
            self.resume()
        except Exception:  # a click has no cell to raise into: resume() showed it in the panel
            pass

    def _queue(self) -> None:
        """Start the run from a background thread, which waits in the machine's queue for its devices while the
        panel shows where it stands."""
        self._done = threading.Event()  # wait() waits for the run it starts
        self._leave_queue = threading.Event()
        self._queued.set()
        leave = self._leave_queue
        self._lock(True)
        self.status.value = panel_status_html("waiting", "for devices")

        def report(line: str) -> None:
            self.status.value = panel_status_html("waiting", line.removeprefix("flair_nbddp: "))

        def start_when_free() -> None:
            try:
                with queue_reports(report, leave):
                    run = self._start(wait=self.wait_for.value)
                if leave.is_set():  # Stop came as the devices came free
                    run.stop()
            except Exception as error:  # noqa: BLE001 - no cell to raise into: shown in the panel
                self._done.set()
                self._show_problem(describe_problem(error))
                self.status.value = panel_status_html("ready")
                self._lock(False)
            finally:
                self._queued.clear()

        threading.Thread(target=start_when_free, name="flair_nbddp-panel-queue", daemon=True).start()

    def _start(self, earlier: PanelRun | None = None, wait: float | None = None) -> Run:
        """Start a run with the form's values, or continue ``earlier`` from its last checkpoint on its devices;
        ``wait``: seconds it may wait for them in the machine's queue."""
        chosen, pool = self.values, current_pool()
        self._sync_devices()
        device, processes = self.devices.value
        resume = None
        if earlier is not None:
            resume = earlier.result
            device, processes = resume.device_type, resume.world_size
        args = () if self.corpus is None else (self._corpus_for(pool),)
        run = start(
            self.fn, args, {**self.fixed, **chosen}, options=self.options, device=device, processes=processes,
            pool=pool, provenance=Provenance("panel"), resume=resume, wait_for_devices=wait,
        )  # fmt: skip
        self.run = run
        if self._done.is_set():  # else the queue's, which wait() may be waiting on already
            self._done = threading.Event()
        record = PanelRun(len(self.runs) + 1, chosen, str(run.plan), record_id=run.record_id)
        self.runs.append(record)
        self._show_problem(NO_PROBLEM)
        self.history.value = self.history_html()
        self.status.value = panel_status_html("starting", f"run {record.number}")
        if isinstance(run, RestartingRun):  # each new attempt gets the dashboard
            run.on_attempt = lambda attempt, line: self._follow(attempt, record, line)
        self._follow(run.current if isinstance(run, RestartingRun) else run, record)
        self._lock(True)  # Stop comes with the run's dashboard already in the panel
        watcher = threading.Thread(
            target=self._watch, args=(run, record, self._done), name="flair_nbddp-panel", daemon=True
        )
        watcher.start()
        return run

    def _follow(self, attempt: Run, record: PanelRun, restarted: str = "") -> None:
        """Show ``attempt`` of ``record``'s run in a new dashboard (after a restart: ``restarted`` says why)."""
        if restarted and self.dashboard is not None:
            self.dashboard.finish(None)  # the failed attempt's: its updater ends
        self.dashboard = dashboard = Dashboard(attempt)
        self.dashboard_box.children = (dashboard.widget,)
        if restarted:
            record.restarts.append(restarted)
            self.status.value = panel_status_html("starting", f"run {record.number} · {restarted}")
        dashboard.follow(on_redraw=lambda snapshot: self._show_progress(record, snapshot))

    def _watch(self, run: Run | RestartingRun, record: PanelRun, done: threading.Event) -> None:
        """The background thread of one run: wait for it (each attempt, with restarts), then record its end and
        unlock the form."""
        try:
            result = run.wait()
            self.dashboard.finish(result, result.error)
            record.status, record.elapsed, record.scores = result.status, result.elapsed, result.scores
            record.result, record.error = result, result.error
            self.status.value = panel_status_html(result.status, outcome_text(record))
            if result.error is not None:
                self._show_problem(describe_problem(result.error))
            elif run.ledger_problem is not None:  # warned too, but a click's warning reaches no cell
                self._show_problem(("this run is missing from the run ledger", run.ledger_problem))
        except Exception as error:  # a bug here must show, not die with the thread
            record.status, record.error = "failed", error
            self.status.value = panel_status_html("failed", f"run {record.number}")
            self._show_problem((f"the panel lost track of run {record.number}: {error!r}", traceback.format_exc()))
            with contextlib.suppress(Exception):  # its updater thread ends; the problem above is what the user sees
                self.dashboard.finish(None, error)
        finally:
            self.history.value = self.history_html()
            self._lock(False)
            done.set()

    def _show_progress(self, record: PanelRun, snapshot: Snapshot) -> None:
        """The status line of a running run, redrawn with its dashboard."""
        if snapshot.ended_at is None:
            detail = "stopping after this batch" if snapshot.stop_requested else progress_text(snapshot)
            if record.restarts:
                detail = f"restart {len(record.restarts)} · {detail}"
            self.status.value = panel_status_html(snapshot.status, f"run {record.number} · {detail}")

    # -- showing ----------------------------------------------------------------------------------
    def _lock(self, locked: bool) -> None:
        """Lock the form while a run is active (its values are what the run got); Stop only works then."""
        for control in [*self.controls.values(), self.wait_for]:
            control.disabled = locked
        self.train_button.disabled = locked
        self.stop_button.disabled = not locked
        self.resume_button.disabled = locked or self.resumable is None
        if not locked:
            self._sync_devices()
        self.devices.disabled = locked or current_pool() is not None

    def _sync_devices(self) -> None:
        """Offer every device choice, or only the warm pool's while one is started (a pool's size is fixed)."""
        pool: WorkerPool | None = current_pool()
        if pool is not None:
            plan = pool.plan
            self.devices.options = [(f"{plan}, warm pool", (plan.device_type, plan.world_size))]
            return
        default = (self._default_plan.device_type, self._default_plan.world_size)
        choices = device_choices(visible_gpu_count(), os.cpu_count() or 1, self.options.share_gpus)
        if default not in [value for _, value in choices]:
            choices.append((str(self._default_plan), default))
        chosen = self.devices.value if self.devices.value in [value for _, value in choices] else default
        self.devices.options, self.devices.value = choices, chosen

    def _show_problem(self, problem: Problem) -> None:
        self.message.value = error_html(problem) if problem[0] else ""
        self.message.layout.display = None if problem[0] else "none"
