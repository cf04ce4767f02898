"""A predict call's live view: a progress bar with texts done of all, texts per second, the time left, and Stop; a
line every few seconds outside a kernel.

A kernel reads a widget's messages only between cells. A call that holds its cell (the default) says that the
kernel's interrupt stops it; a call made with ``wait=False`` leaves the cell free and shows a Stop button.

Example::

    predictions = predict(tagger, "texts.txt", output="tags.jsonl")   # the bar appears in the cell
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import DashboardUnavailableError
from ..predicting.result import Predictions
from ..predicting.runner import PredictCall, PredictView
from .dashboard import STATUS_COLORS, _escape, format_duration, widgets_usable

REDRAW_SECONDS = 0.25
TEXT_EVERY_SECONDS = 10.0


def progress_text(call: PredictCall) -> str:
    """``1,024 / 20,000 texts · 812 texts/s · 23 s left · 2 × cpu``."""
    parts = [f"{call.received:,} / {call.total:,} texts"]
    rate = call.texts_per_second
    if rate:
        parts += [f"{rate:,.0f} texts/s", f"{format_duration(call.eta)} left"]
    plan = call.run.plan
    parts.append(f"{plan.world_size} × {plan.device_type}")
    if call.run.state.stop_requested and call.status == "running":
        parts.append("stopping after the chunks in hand")
    return " · ".join(parts)


def outcome_text(call: PredictCall, predictions: Predictions | None, error: BaseException | None) -> str:
    """The view's last line: the call's outcome, or its error."""
    if predictions is not None:
        return predictions.describe()
    if isinstance(error, KeyboardInterrupt):
        return f"interrupted: every worker was ended after {call.received:,} of {call.total:,} texts"
    return f"failed: {type(error).__name__}: {error}"


class PredictText(PredictView):
    """A progress line every few seconds and the outcome (in a script, or with ``dashboard=False``)."""

    def start(self, call: PredictCall) -> None:
        self._said_at = time.monotonic()

    def poll(self, call: PredictCall) -> None:
        if time.monotonic() - self._said_at >= TEXT_EVERY_SECONDS:
            self._said_at = time.monotonic()
            print(f"flair_nbddp: {progress_text(call)}", flush=True)

    def finish(self, call: PredictCall, predictions: Predictions | None, error: BaseException | None = None) -> None:
        print(f"flair_nbddp: {outcome_text(call, predictions, error)}", flush=True)


class PredictWidget(PredictView):
    """The ipywidgets view (CSS class ``nbddp-predict``): ``bar`` (an ``IntProgress``), ``label`` (the figures),
    ``stop_button`` (shown for a call made with ``wait=False``) or ``hint`` (the kernel's interrupt stops a call that
    holds its cell); ``widget`` is the root. ``finish`` leaves the bar full or where the call stopped, and the
    cell's ``text/plain`` the outcome (what a saved notebook shows where the widget cannot render)."""

    def __init__(self) -> None:
        import ipywidgets as widgets

        self.bar = widgets.IntProgress(value=0, min=0, max=1, description="predict", bar_style="info")
        self.label = widgets.HTML()
        self.stop_button = widgets.Button(
            description="Stop", button_style="danger", icon="stop",
            tooltip="stop every rank after the chunk in hand; the call returns what is done",
        )  # fmt: skip
        self.hint = widgets.HTML("<i>interrupt the kernel (■) to stop: every rank stops after the chunk in hand, and "
                                 "the call returns what is done</i>")  # fmt: skip
        self.widget = widgets.HBox([self.bar, self.label, self.stop_button, self.hint])
        self.widget.add_class("nbddp-predict")
        self._handle: Any = None
        self._drawn_at = 0.0
        self._text = ""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        """The widget, with a ``text/plain`` and a static ``text/html`` rendering for frontends that cannot show it."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = self._text
        bundle["text/html"] = (
            f'<div class="nbddp-predict"><progress value="{self.bar.value}" max="{self.bar.max}"></progress> '
            f"{self.label.value}</div>"
        )
        return bundle

    def start(self, call: PredictCall) -> None:
        from IPython.display import display

        self.bar.max = call.total
        self.stop_button.on_click(lambda _: self._stop(call))
        (self.hint if call.background else self.stop_button).layout.display = "none"
        self._draw(call)
        self._handle = display(self, display_id=True)

    def _stop(self, call: PredictCall) -> None:
        self.stop_button.disabled = True
        call.stop()

    def poll(self, call: PredictCall) -> None:
        if time.monotonic() - self._drawn_at >= REDRAW_SECONDS:
            self._draw(call)

    def finish(self, call: PredictCall, predictions: Predictions | None, error: BaseException | None = None) -> None:
        self.stop_button.disabled = True
        self.stop_button.layout.display = self.hint.layout.display = "none"
        self._draw(call)
        color = STATUS_COLORS["finished" if predictions is not None and predictions.status == "finished"
                              else "stopped" if predictions is not None else "failed"]  # fmt: skip
        self.bar.bar_style = "success" if predictions is not None and predictions.status == "finished" else "warning"
        self._text = outcome_text(call, predictions, error)
        self.label.value = f'<span style="color:{color}">{_escape(self._text)}</span>'
        if self._handle is not None:
            self._handle.update(self)

    def _draw(self, call: PredictCall) -> None:
        self._drawn_at = time.monotonic()
        self.bar.value = min(call.received, call.total)
        self._text = progress_text(call)
        self.label.value = _escape(self._text)


def open_predict_view(dashboard: bool | None = None) -> PredictView:
    """The widget inside a Jupyter kernel with ipywidgets (``dashboard`` None or True), else progress lines; nothing
    with ``dashboard=False``.

    Raises:
        DashboardUnavailableError: ``dashboard=True`` outside a Jupyter kernel.
    """
    if dashboard is False:
        return PredictView()
    if widgets_usable():
        return PredictWidget()
    if dashboard:
        raise DashboardUnavailableError(
            "dashboard=True needs a Jupyter kernel with ipywidgets; here there is none. Leave dashboard out for a "
            "progress line every few seconds"
        )
    return PredictText()
