"""A sweep's live view: one widget with the trials' table, the best-so-far curve, the running trials' curves and a
Stop button; a line per trial outside a kernel.

Example::

    result = sweep(train, (corpus,), space=space, n_trials=8)   # the widget appears in the cell
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import DashboardUnavailableError
from ..sweeps.runner import Sweep, SweepState, SweepView, TrialRow
from .dashboard import STATUS_COLORS, _escape, _number, _table, format_duration, svg_chart, widgets_usable

REDRAW_SECONDS = 0.5
MAX_CURVES = 8  # running trials drawn at once
STATE_COLORS = {"running": STATUS_COLORS["running"], "complete": STATUS_COLORS["finished"], "pruned": "#9ca3af",
                "failed": STATUS_COLORS["failed"], "stopped": STATUS_COLORS["stopped"]}  # fmt: skip


def params_text(params: dict) -> str:
    """``lr=0.0031, hidden=64``: a trial's parameters, numbers to 4 significant digits.

    Example:
        >>> params_text({"lr": 0.0031234, "hidden": 64, "cell": "lstm"})
        'lr=0.003123, hidden=64, cell=lstm'
    """
    return ", ".join(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                     for name, value in params.items())  # fmt: skip


def headline(state: SweepState) -> str:
    """``study 'lr-search': 2 running, 3 complete, 1 pruned of 8; best #4 dev/score 0.8120 (lr=0.003)``."""
    counts = [(name, sum(row.state == name for row in state.rows)) for name in STATE_COLORS]
    done = ", ".join(f"{count} {name}" for name, count in counts if count) or "starting"
    best = state.best()
    shown = f"; best #{best.number} {state.metric} {_number(best.value)} ({params_text(best.params)})" if best else ""
    stopping = "; stopping" if state.stopping and not state.done else ""
    return f"study {state.study!r}: {done} of {state.n_trials} ({state.lanes} at a time){shown}{stopping}"


def trials_table_html(state: SweepState) -> str:
    """One row per trial: number, parameters, state, the metric's last value, devices, time."""
    rows = []
    for row in state.rows:
        last = row.value if row.value is not None else row.curve[-1][1] if row.curve else None
        color = STATE_COLORS.get(row.state, "inherit")
        rows.append([
            f"#{row.number}", _escape(params_text(row.params)), f'<span style="color:{color}">{row.state}</span>',
            "" if last is None else _number(last), _escape(row.lane), format_duration(row.elapsed),
        ])  # fmt: skip
    return _table(["trial", "parameters", "state", state.metric, "devices", "time"], rows)


def charts_html(state: SweepState) -> str:
    """The best value so far (by trial) and each running trial's metric per epoch."""
    charts = [svg_chart(state.best_so_far(), f"best {state.metric} so far, by trial", STATE_COLORS["complete"])]
    running = [row for row in state.rows if row.state == "running"][:MAX_CURVES]
    charts += [svg_chart(row.curve, f"#{row.number} {state.metric} per epoch", STATE_COLORS["running"], 220)
               for row in running]  # fmt: skip
    return '<div style="display:flex;flex-wrap:wrap">' + "".join(charts) + "</div>"


def trial_line(row: TrialRow, metric: str) -> str:
    """What the text view prints as a trial ends: ``trial #3 pruned at epoch 1 (dev/score 0.41), lr=0.2, 6.1 s``."""
    what = {"complete": f"complete: {metric} {_number(row.value)}" if row.value is not None else "complete",
            "pruned": f"pruned at epoch {row.curve[-1][0]}" if row.curve else "pruned",
            "failed": f"failed: {row.error}", "stopped": "stopped"}.get(row.state, row.state)  # fmt: skip
    return f"trial #{row.number} {what}; {params_text(row.params)}; {format_duration(row.elapsed)} on {row.lane}"


class SweepText(SweepView):
    """A line as each trial starts and ends, and the outcome (in a script, or with ``dashboard=False``)."""

    def start(self, sweep: Sweep) -> None:
        self._sweep, self._said = sweep, {}

    def poll(self) -> None:
        for row in self._sweep.state.rows:
            said = self._said.get(row.number)
            if said is None:
                print(f"flair_nbddp: trial #{row.number} started on {row.lane}: {params_text(row.params)}", flush=True)
            if row.state not in ("running", said) and row.ended_at is not None:
                print(f"flair_nbddp: {trial_line(row, self._sweep.state.metric)}", flush=True)
            self._said[row.number] = row.state if row.ended_at is not None else "running"

    def finish(self, error: BaseException | None = None) -> None:
        self.poll()
        print(f"flair_nbddp: {headline(self._sweep.state)}", flush=True)


class SweepWidget(SweepView):
    """The sweep's ipywidgets view: headline, Stop, charts and the trials' table (CSS class ``nbddp-sweep``).

    A button acts only between cells (the kernel handles a widget's messages when no cell runs): Stop is shown for a
    sweep that leaves the cell free (``sweep(..., wait=False)``); a sweep that holds the cell says that the kernel's
    interrupt stops it. The widgets are attributes: ``title``, ``stop_button``, ``hint``, ``charts``, ``table``;
    ``widget`` is the root. ``finish`` updates the cell's output so that its ``text/plain`` (the headline) and
    ``text/html`` (headline, charts and table as static HTML) describe the ended sweep: what a saved notebook shows
    where the widget cannot render.
    """

    def __init__(self) -> None:
        import ipywidgets as widgets

        self.title = widgets.HTML()
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop",
                                          tooltip="end the sweep: running trials stop, their models saved")  # fmt: skip
        self.hint = widgets.HTML("<i>interrupt the kernel (■) to stop the sweep: running trials stop, their models "
                                 "saved</i>")  # fmt: skip
        self.charts = widgets.HTML()
        self.table = widgets.HTML()
        self.widget = widgets.VBox([widgets.HBox([self.title, self.stop_button, self.hint]), self.charts, self.table])
        self.widget.add_class("nbddp-sweep")
        self._drawn_at = 0.0
        self._sweep: Sweep | None = None
        self._handle: Any = None

    def start(self, sweep: Sweep) -> None:
        from IPython.display import display

        self._sweep = sweep
        self.stop_button.on_click(lambda _: sweep.stop())
        (self.hint if sweep.background else self.stop_button).layout.display = "none"
        self._draw()
        self._handle = display(self, display_id=True)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        """The widget, with a ``text/plain`` and ``text/html`` description for frontends that cannot render it."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = headline(self._sweep.state)
        bundle["text/html"] = self.title.value + self.charts.value + self.table.value
        return bundle

    def poll(self) -> None:
        if time.monotonic() - self._drawn_at >= REDRAW_SECONDS:
            self._draw()

    def finish(self, error: BaseException | None = None) -> None:
        self.stop_button.disabled = True
        self.hint.layout.display = "none"
        self._draw()
        if error is not None:
            self.title.value += f' <span style="color:{STATE_COLORS["failed"]}">{_escape(error)}</span>'
        if self._handle is not None:
            self._handle.update(self)

    def _draw(self) -> None:
        state = self._sweep.state
        self._drawn_at = time.monotonic()
        self.title.value = f"<b>{_escape(headline(state))}</b>"
        self.charts.value = charts_html(state)
        self.table.value = trials_table_html(state)


def open_sweep_view(sweep: Any, dashboard: bool | None = None) -> SweepView:
    """The widget inside a Jupyter kernel with ipywidgets (``dashboard`` None or True), else text lines.

    Raises:
        DashboardUnavailableError: ``dashboard=True`` outside a Jupyter kernel.
    """
    if dashboard is not False and widgets_usable():
        return SweepWidget()
    if dashboard:
        raise DashboardUnavailableError(
            "dashboard=True needs a Jupyter kernel with ipywidgets; here there is none. Leave dashboard out for a line "
            "per trial."
        )
    return SweepText()
