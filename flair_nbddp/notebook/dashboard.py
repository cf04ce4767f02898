"""Live views of a run: a widget dashboard in notebooks, plain progress lines in scripts.

:func:`open_view` picks the view; :func:`~flair_nbddp.launch` drives it::

    view = open_view(run)            # Dashboard in a Jupyter kernel, TextView elsewhere
    view.start()                     # the dashboard displays itself in the current cell
    result = run.wait(on_tick=view.poll)
    view.finish(result, result.error)

The module has two halves. The rendering functions (``*_html``, ``*_text``, ``*_line``) are pure: a
:class:`~flair_nbddp.engine.state.Snapshot` in, a string out. The view classes only decide when to draw and
where to: the :class:`Dashboard` redraws from a background thread (widget traits may be set from any
thread; only ``display`` must happen on the cell's thread), the :class:`TextView` prints from the
waiting loop on the main thread.
"""

from __future__ import annotations

import html
import math
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from ..errors import DashboardUnavailableError, WorkerError
from ..result import RunResult
from ..engine.run import Run
from ..engine.state import MetricPoint, RankInfo, Snapshot, rank_health, step_at
from ..engine.watch import RunView

Series = dict[str, list[tuple[int, float]]]
Problem = tuple[str, str]  # a failure's headline and details; ("", "") for none
NO_PROBLEM: Problem = ("", "")

STATUS_COLORS = {
    "starting": "#6b7280",
    "running": "#2563eb",
    "finished": "#16a34a",
    "stopped": "#d97706",
    "failed": "#dc2626",
    "lost": "#7c3aed",  # in the run ledger: its kernel died while it ran
}
BAR_STYLES = {"finished": "success", "stopped": "warning", "failed": "danger"}
LOSS_METRICS = ("train/batch_loss", "train/loss")
LEARNING_RATE_METRICS = ("learning_rate", "learning_rate/0")
CURVE_METRICS = LOSS_METRICS[:1] + LEARNING_RATE_METRICS
EPOCH_COLUMNS = {"train/loss": "train loss", "dev/loss": "dev loss", "dev/score": "dev score"}
LOG_TAIL_LINES = 15
CELL_VIEW = -1  # the per-rank view's first choice: what the cell shows, not one rank's own output
MAX_CHART_POINTS = 300
REDRAW_INTERVAL = 0.2  # at most 5 redraws a second
CLOCK_INTERVAL = 1.0  # redraw this often even without news, so the elapsed time moves
TEXT_PROGRESS_INTERVAL = 10.0

MUTED_COLOR = "var(--jp-ui-font-color2, #6b7280)"
BORDER_COLOR = "var(--jp-border-color2, #e0e0e0)"
_PANEL = "var(--jp-layout-color2, #f5f5f5)"
_CELL = f"padding:2px 10px 2px 0;border-bottom:1px solid {BORDER_COLOR};text-align:right"
_HEAD = f"{_CELL};color:{MUTED_COLOR};font-weight:600"


# -- formatting -----------------------------------------------------------------------------------
def format_duration(seconds: float | None) -> str:
    """A short duration: ``42.3`` → ``"42 s"``, ``125`` → ``"2:05"``, ``3725`` → ``"1:02:05"``, None → ``"—"``."""
    if seconds is None:
        return "—"
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_bytes(count: int) -> str:
    """Memory in binary units: ``0`` → ``"—"``, ``300 * 2**20`` → ``"300 MB"``, ``5 * 2**29`` → ``"2.50 GB"``."""
    if count <= 0:
        return "—"
    if count < 2**30:
        return f"{count / 2**20:.0f} MB"
    return f"{count / 2**30:.2f} GB"


def _number(value: float) -> str:
    return f"{value:.3g}"


def _escape(text: Any) -> str:
    return html.escape(str(text))


# -- what the snapshot holds ----------------------------------------------------------------------
class Downsampled:
    """A curve kept at most ``limit`` points long: when full, neighbouring points are averaged pairwise.

    Every kept point is the mean of an equal run of consecutive inputs, so the curve is smoothed the
    same way everywhere and does not shift as it grows; adding is O(1) amortised, so the chart of a
    long run costs no more to draw than a short one's.

    Example:
        >>> curve = Downsampled(limit=4)
        >>> for step in range(1, 6):
        ...     curve.add(step, float(step))
        >>> curve.points
        [(1.5, 1.5), (3.5, 3.5), (5.0, 5.0)]
    """

    def __init__(self, limit: int = MAX_CHART_POINTS) -> None:
        self._limit, self._run_length = limit, 1
        self._full: list[tuple[float, float]] = []
        self._partial: list[tuple[float, float]] = []

    def add(self, x: float, y: float) -> None:
        self._partial.append((x, y))
        if len(self._partial) == self._run_length:
            self._full.append(_mean(self._partial))
            self._partial = []
            if len(self._full) == self._limit:
                self._full = [_mean(pair) for pair in zip(self._full[::2], self._full[1::2])]
                self._run_length *= 2

    @property
    def points(self) -> list[tuple[float, float]]:
        return self._full + ([_mean(self._partial)] if self._partial else [])


def _mean(points: list[tuple[float, float]] | tuple[tuple[float, float], ...]) -> tuple[float, float]:
    return sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)


def decimate(points: list[tuple[float, float]], limit: int = MAX_CHART_POINTS) -> list[tuple[float, float]]:
    """At most ``limit`` points, runs of consecutive points averaged (see :class:`Downsampled`)."""
    if len(points) <= limit:
        return list(points)
    curve = Downsampled(limit)
    for x, y in points:
        curve.add(x, y)
    return curve.points


class MetricHistory:
    """The metrics the dashboard shows, folded in incrementally: per-epoch values and downsampled curves.

    ``update`` reads only the metrics recorded since its last call, so redrawing stays cheap however
    long the run is.
    """

    def __init__(self) -> None:
        self._seen = 0
        self._epochs: Series = {}
        self._curves: dict[str, Downsampled] = {}

    def update(self, metrics: tuple[MetricPoint, ...]) -> Series:
        """Fold in the metrics past those seen before; returns ``{name: [(step, value), ...]}``."""
        for point in metrics[self._seen :]:
            if point.name in EPOCH_COLUMNS:
                self._epochs.setdefault(point.name, []).append((point.step, point.value))
            if point.name in CURVE_METRICS:
                self._curves.setdefault(point.name, Downsampled()).add(point.step, point.value)
        self._seen = len(metrics)
        return {**self._epochs, **{name: curve.points for name, curve in self._curves.items()}}


def metric_series(snapshot: Snapshot) -> Series:
    """The per-epoch metrics and the (downsampled) curves of ``snapshot``, by name."""
    return MetricHistory().update(snapshot.metrics)


def first_series(series: Series, names: tuple[str, ...]) -> tuple[str, list[tuple[int, float]]]:
    """The first of ``names`` that has points, and its points (``("", [])`` if none has)."""
    for name in names:
        if series.get(name):
            return name, series[name]
    return "", []


def final_scores(series: Series) -> dict[str, float]:
    """The last value of each per-epoch metric the table shows (``train/loss``, ``dev/loss``, ``dev/score``)."""
    return {name: series[name][-1][1] for name in EPOCH_COLUMNS if series.get(name)}


# -- HTML pieces ----------------------------------------------------------------------------------
def svg_chart(
    points: list[tuple[float, float]], title: str, color: str, width: int = 300, height: int = 120,
    resumed_at: float | None = None,
) -> str:  # fmt: skip
    """An inline SVG line chart of ``(x, y)`` points with its title, last value and axis ranges; a dashed line at
    ``resumed_at``, where a resumed run's own points follow the earlier run's.

    Example:
        >>> "<polyline" in svg_chart([(1, 0.9), (2, 0.5), (3, 0.4)], "loss", "#2563eb")
        True
        >>> "resumed" in svg_chart([(1, 0.9), (2, 0.5), (3, 0.4)], "loss", "#2563eb", resumed_at=2)
        True
    """
    font = 'font-family="sans-serif" font-size="10"'
    text = f'{font} style="fill:{MUTED_COLOR}"'  # CSS variables work in style, not in SVG attributes
    parts = [f'<text x="0" y="11" {text} font-weight="600">{_escape(title)}</text>']
    left, right, top, bottom = 48, width - 4, 18, height - 14  # the left gutter holds the y range
    if not points:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" {text}>no data yet</text>')
    else:
        points = decimate(points)
        xs, ys = [x for x, _ in points], [y for _, y in points]
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
        x_span, y_span = (x1 - x0) or 1.0, (y1 - y0) or 1.0
        y0 = y0 if y1 > y0 else y0 - 0.5  # a flat series sits mid-height

        def at(x: float, y: float) -> tuple[float, float]:
            return left + (x - x0) / x_span * (right - left), bottom - (y - y0) / y_span * (bottom - top)

        coordinates = [at(x, y) for x, y in points]
        polyline = " ".join(f"{x:.1f},{y:.1f}" for x, y in coordinates)
        parts += [
            f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
            f'fill="none" style="stroke:{BORDER_COLOR}"/>',
            f'<polyline points="{polyline}" fill="none" stroke="{color}" stroke-width="1.5"/>',
            f'<circle cx="{coordinates[-1][0]:.1f}" cy="{coordinates[-1][1]:.1f}" r="2.5" fill="{color}"/>',
            f'<text x="{right}" y="11" text-anchor="end" {font} fill="{color}">last {_number(ys[-1])}</text>',
            f'<text x="{left - 4}" y="{top + 8}" text-anchor="end" {text}>{_number(max(ys))}</text>',
            f'<text x="{left - 4}" y="{bottom}" text-anchor="end" {text}>{_number(min(ys))}</text>',
            f'<text x="{left}" y="{height - 2}" {text}>{x0:.0f}</text>',
            f'<text x="{right}" y="{height - 2}" text-anchor="end" {text}>{x1:.0f}</text>',
        ]
        if resumed_at is not None and x0 <= resumed_at <= x1:
            x = at(resumed_at, y0)[0]
            parts += [
                f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke-dasharray="3,3" '
                f'style="stroke:{MUTED_COLOR}"><title>resumed from a checkpoint here</title></line>',
                f'<text x="{x + 3:.1f}" y="{top + 9}" {text}>resumed</text>',
            ]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" style="margin-right:24px">{"".join(parts)}</svg>'
    )


def charts_html(series: Series, resumed_at: tuple[int, int] | None = None) -> str:
    """The loss curve (per batch, else per epoch) and the learning rate, side by side; a resumed run's
    ``(epoch, step)`` marked on each."""
    loss_name, loss = first_series(series, LOSS_METRICS)
    learning_rate_name, learning_rate = first_series(series, LEARNING_RATE_METRICS)
    loss_title = "loss per batch" if loss_name == "train/batch_loss" else "loss per epoch"

    def mark(name: str) -> int | None:
        return None if resumed_at is None else step_at(name, *resumed_at)

    return (
        '<div style="display:flex;flex-wrap:wrap">'
        + svg_chart(loss, loss_title, STATUS_COLORS["running"], resumed_at=mark(loss_name))
        + svg_chart(learning_rate, "learning rate", "#9333ea", resumed_at=mark(learning_rate_name))
        + "</div>"
    )


def _table(head: list[str], rows: list[list[str]]) -> str:
    header = "".join(f'<th style="{_HEAD}">{cell}</th>' for cell in head)
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{cell}</td>' for cell in row) + "</tr>" for row in rows)
    # an explicit line height: ipywidgets' HTML widget would give every row the height of a text box
    return f'<table style="border-collapse:collapse;font-size:12px;line-height:1.5"><tr>{header}</tr>{body}</table>'


def epoch_table_html(series: Series, resumed_at: tuple[int, int] | None = None) -> str:
    """One row per finished epoch: the train loss, and the dev loss and score where flair recorded them; a resumed
    run's first own epoch marked ↻.

    Example:
        >>> "3 ↻" in epoch_table_html({"train/loss": [(2, 0.7), (3, 0.6)]}, resumed_at=(2, 40))
        True
    """
    columns = [name for name in EPOCH_COLUMNS if series.get(name)]
    if not columns:
        return f'<span style="color:{MUTED_COLOR};font-size:12px">no epoch finished yet</span>'
    by_epoch: dict[int, dict[str, float]] = {}
    for name in columns:
        for epoch, value in series[name]:
            by_epoch.setdefault(epoch, {})[name] = value
    best = max((value for _, value in series.get("dev/score", [])), default=None)
    rows = []
    resumed_after = resumed_at[0] if resumed_at else None
    for epoch in sorted(by_epoch):
        first_own = resumed_after is not None and epoch == resumed_after + 1
        cells = [f'<span title="resumed from the checkpoint of epoch {resumed_after}">{epoch} ↻</span>'
                 if first_own else str(epoch)]  # fmt: skip
        for name in columns:
            value = by_epoch[epoch].get(name)
            text = "—" if value is None else f"{value:.4f}"
            cells.append(f"<b>{text}</b>" if name == "dev/score" and value == best else text)
        rows.append(cells)
    return _table(["epoch", *(EPOCH_COLUMNS[name] for name in columns)], rows)


def _rank_state(rank: RankInfo, run_ended: bool) -> str:
    """``alive``, ``ended`` (a pooled worker outlives the run it served) or ``exit <code>``."""
    if rank.alive and not run_ended:
        return "alive"
    return "ended" if rank.exit_code in (0, None) else f"exit {rank.exit_code}"


def _rank_state_html(state: str) -> str:
    color = {"alive": STATUS_COLORS["finished"], "ended": MUTED_COLOR}.get(state, STATUS_COLORS["failed"])
    return f'<span style="color:{color}">{"● " if state == "alive" else ""}{state}</span>'


RANK_COLUMNS = ["rank", "device", "pid", "state", "step", "samples/s", "host mem", "GPU mem", "GPU busy",
                "heartbeat", "health"]  # fmt: skip


def _rank_cells(rank: RankInfo, snapshot: Snapshot, health: dict[int, str]) -> list[str]:
    """A rank's figures as plain text, in ``RANK_COLUMNS`` order (state and health without their colour)."""
    now = snapshot.ended_at or time.time()
    return [
        str(rank.rank),
        rank.device or "—",
        str(rank.pid or "—"),
        _rank_state(rank, snapshot.ended_at is not None),
        str(rank.step),
        f"{rank.samples_per_second:.1f}",
        format_bytes(rank.host_memory_bytes) if rank.host_memory_bytes else "—",
        format_bytes(rank.gpu_memory_bytes) if rank.device.startswith("cuda") else "—",
        f"{rank.gpu_utilization} %" if rank.gpu_utilization is not None else "—",
        f"{max(0.0, now - rank.last_seen):.1f} s ago" if rank.pid else "—",
        f"⚠ {health[rank.rank]}" if rank.rank in health else "ok" if rank.pid else "—",
    ]


def ranks_table_html(snapshot: Snapshot) -> str:
    """One row per rank: device, pid, state, steps, samples/s, host and GPU memory, GPU utilisation (with NVML),
    the age of its last heartbeat, and a mark on a straggler or a silent rank."""
    health = rank_health(snapshot)
    rows = []
    for rank in snapshot.ranks:
        cells = [_escape(cell) for cell in _rank_cells(rank, snapshot, health)]
        cells[3] = _rank_state_html(cells[3])
        if rank.rank in health:
            cells[-1] = f'<b style="color:{STATUS_COLORS["stopped"]}">{cells[-1]}</b>'
        rows.append(cells)
    return _table(RANK_COLUMNS, rows)


def ranks_table_text(snapshot: Snapshot) -> str:
    """The ranks as a plain-text table, for scripts and the text a saved notebook keeps.

    Example:
        >>> from flair_nbddp.engine.state import RunState
        >>> print(ranks_table_text(RunState(world_size=1, device_type="cpu").snapshot()).splitlines()[0])
        rank  device  pid  state  step  samples/s  host mem  GPU mem  GPU busy  heartbeat  health
    """
    health = rank_health(snapshot)
    rows = [RANK_COLUMNS] + [_rank_cells(rank, snapshot, health) for rank in snapshot.ranks]
    widths = [max(len(row[column]) for row in rows) for column in range(len(RANK_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def rank_line(snapshot: Snapshot, rank: int) -> str:
    """One rank's figures in a line, above its log in the dashboard's per-rank view."""
    cells = dict(zip(RANK_COLUMNS, _rank_cells(snapshot.ranks[rank], snapshot, rank_health(snapshot))))
    figures = " · ".join(f"{name} {cells[name]}" for name in RANK_COLUMNS[4:])
    return f"rank {rank} on {cells['device']}, {cells['state']} · {figures}"


def log_html(snapshot: Snapshot, lines: int = LOG_TAIL_LINES, rank: int | None = None) -> str:
    """The last ``lines`` lines the cell shows (``rank`` None: rank 0's output and the other ranks' warnings), or of
    rank ``rank``'s own output under a line of its figures, escaped, in a monospace block."""
    shown = snapshot.log_lines if rank is None else snapshot.rank_logs[rank]
    tail = "\n".join(shown[-lines:]) or "(no output yet)"
    head = "" if rank is None else f'<div style="font-size:11px;color:{MUTED_COLOR}">{_escape(rank_line(snapshot, rank))}</div>'
    return (
        f'{head}<pre style="margin:0;padding:6px 8px;background:{_PANEL};font-size:11px;line-height:1.35;'
        f'white-space:pre;overflow-x:auto">{_escape(tail)}</pre>'
    )


def title_html(snapshot: Snapshot) -> str:
    """The heading: what runs where."""
    return (
        f'<b style="font-size:13px">flair_nbddp run</b> '
        f'<span style="color:{MUTED_COLOR}">· {snapshot.world_size} × {_escape(snapshot.device_type)}</span>'
    )


def status_html(snapshot: Snapshot) -> str:
    """The coloured status with the elapsed time, the ETA (or a pending stop) while running, and the throughput."""
    color = STATUS_COLORS.get(snapshot.status, STATUS_COLORS["starting"])
    parts = [f'<b style="color:{color}">● {_escape(snapshot.status)}</b>', f"{format_duration(snapshot.elapsed)}"]
    if snapshot.status == "running" and snapshot.stop_requested:
        parts.append("stopping after this batch")
    elif snapshot.status == "running" and snapshot.eta is not None:
        parts.append(f"ETA {format_duration(snapshot.eta)}")
    if snapshot.samples_per_second:
        parts.append(f"{snapshot.samples_per_second:.1f} samples/s")
    return '<span style="font-size:13px">' + " · ".join(parts) + "</span>"


def progress_text(snapshot: Snapshot) -> str:
    """Where training stands: ``"epoch 2/3 · batch 12/25 · 57%"``."""
    if not snapshot.total_batches:
        waiting = snapshot.status in ("starting", "running")
        return "waiting for the first batch" if waiting else "no training batches"
    return (
        f"epoch {snapshot.epoch}/{snapshot.max_epochs} · batch {snapshot.batch}/{snapshot.total_batches} · "
        f"{snapshot.fraction_done:.0%}"
    )


def describe_problem(error: BaseException | None) -> Problem:
    """A failure as ``(headline, details)``; ``("", "")`` for none.

    A :class:`WorkerError`'s details carry the remote traceback and the log path; an interrupt has none.

    Example:
        >>> describe_problem(ValueError("bad label"))
        ('ValueError: bad label', 'ValueError: bad label')
    """
    if error is None:
        return NO_PROBLEM
    if isinstance(error, KeyboardInterrupt):
        return "interrupted: every worker was ended", ""
    text = str(error) if isinstance(error, WorkerError) else f"{type(error).__name__}: {error}"
    return text.partition("\n")[0], text


def end_status(result: RunResult | None, error: BaseException | None) -> str:
    """The status a view ends on: the result's, else ``stopped`` for an interrupt and ``failed`` for an error."""
    if result is not None:
        return result.status
    return "stopped" if error is None or isinstance(error, KeyboardInterrupt) else "failed"


def outcome_notes(snapshot: Snapshot, problem: Problem = NO_PROBLEM) -> list[str]:
    """What a reader wants after the run, in plain text: final scores, the saved model, the failure."""
    notes = [f"{name} {value:.4f}" for name, value in final_scores(metric_series(snapshot)).items()]
    if snapshot.checkpoint:
        notes.append(f"model saved at {snapshot.checkpoint}")
    if problem[0]:
        notes.append(problem[0])
    return notes


def outcome_html(snapshot: Snapshot, problem: Problem = NO_PROBLEM) -> str:
    """The outcome line (scores, saved model, failure in the status colour) with the traceback folded under it."""
    notes = outcome_notes(snapshot, problem)
    if not notes:
        return ""
    color = STATUS_COLORS.get(snapshot.status, STATUS_COLORS["finished"])
    head = f'<b style="color:{color}">{_escape(" · ".join(notes))}</b>'
    if not problem[1]:
        return f'<div style="font-size:12px;margin:2px 0">{head}</div>'
    return (
        f'<details style="font-size:12px;margin:2px 0"><summary>{head}</summary>'
        f'<pre style="margin:4px 0 0;padding:6px 8px;background:{_PANEL};font-size:11px;white-space:pre-wrap">'
        f"{_escape(problem[1])}</pre></details>"
    )


def summary_text(snapshot: Snapshot, problem: Problem = NO_PROBLEM) -> str:
    """The run in one line, e.g. ``flair_nbddp: finished in 35 s on 2 × cpu · 84.2 samples/s · dev/score 0.8700``."""
    verb = "in" if snapshot.status in ("finished", "running") else "after"
    parts = [
        f"flair_nbddp: {snapshot.status} {verb} {format_duration(snapshot.elapsed)} "
        f"on {snapshot.world_size} × {snapshot.device_type}"
    ]
    if snapshot.status in ("starting", "running"):
        parts.append(progress_text(snapshot))
    if snapshot.samples_per_second:
        parts.append(f"{snapshot.samples_per_second:.1f} samples/s")
    return " · ".join(parts + outcome_notes(snapshot, problem))


def progress_bar_html(snapshot: Snapshot) -> str:
    """A static progress bar (for the saved notebook, where the widget may not render)."""
    color = STATUS_COLORS.get(snapshot.status, STATUS_COLORS["running"])
    return (
        f'<div style="display:flex;align-items:center;gap:10px;margin:6px 0">'
        f'<div style="flex:1;height:10px;background:{_PANEL};border:1px solid {BORDER_COLOR}">'
        f'<div style="width:{snapshot.fraction_done:.1%};height:100%;background:{color}"></div></div>'
        f'<span style="font-size:12px">{_escape(progress_text(snapshot))}</span></div>'
    )


def dashboard_html(snapshot: Snapshot, problem: Problem = NO_PROBLEM) -> str:
    """The whole dashboard as static HTML: what a saved notebook shows where the widget cannot render."""
    series = metric_series(snapshot)
    return (
        f'<div class="nbddp-summary" style="border:1px solid {BORDER_COLOR};padding:8px 12px;max-width:960px">'
        f'<div style="display:flex;justify-content:space-between">'
        f"<span>{title_html(snapshot)}</span>{status_html(snapshot)}</div>"
        f"{progress_bar_html(snapshot)}{outcome_html(snapshot, problem)}"
        f"{charts_html(series, snapshot.resumed_at)}"
        f'<div style="display:flex;flex-wrap:wrap;align-items:flex-start;gap:6px 40px;margin:6px 0">'
        f"{epoch_table_html(series, snapshot.resumed_at)}{ranks_table_html(snapshot)}</div>{log_html(snapshot)}</div>"
    )


def progress_line(snapshot: Snapshot) -> str:
    """One line of plain progress: ``flair_nbddp: epoch 2/3, batch 12/25, 57% done, 84.2 samples/s, ETA 0:13``."""
    return (
        f"flair_nbddp: epoch {snapshot.epoch}/{snapshot.max_epochs}, "
        f"batch {snapshot.batch}/{snapshot.total_batches}, {snapshot.fraction_done:.0%} done, "
        f"{snapshot.samples_per_second:.1f} samples/s, ETA {format_duration(snapshot.eta)}"
    )


# -- views ----------------------------------------------------------------------------------------
class NullView(RunView):
    """Shows rank 0's log lines and nothing else (``launch(..., dashboard=False)``), printed on the main thread."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._log_cursor = 0

    def poll(self) -> None:
        """Print rank 0's lines that arrived since the last poll."""
        lines, self._log_cursor = self._run.state.log_since(self._log_cursor)
        for line in lines:
            print(line, flush=True)


class TextView(NullView):
    """Plain progress lines for scripts and terminals, printed on the main thread.

    A line at the start (processes, device, backend, run directory), a progress line when an epoch
    begins or ``interval`` seconds after the last one, and a summary line at the end.

    Example::

        view = TextView(run)
        view.start()  # flair_nbddp: 2 × cpu processes (gloo), logs in /tmp/flair_nbddp-0/run-1a2b
    """

    def __init__(self, run: Run, interval: float = TEXT_PROGRESS_INTERVAL) -> None:
        super().__init__(run)
        self._interval = interval
        self._seen_version = -1
        self._printed_epoch = 0
        self._printed_at = -math.inf

    def start(self) -> None:
        """Print what runs where."""
        plan = self._run.plan
        print(
            f"flair_nbddp: {plan.world_size} × {plan.device_type} processes ({plan.backend}), "
            f"logs in {self._run.run_dir}",
            flush=True,
        )

    def poll(self) -> None:
        """Print rank 0's new lines, and a progress line when a new epoch began or ``interval`` seconds passed
        since the last one."""
        super().poll()
        state = self._run.state
        if state.version == self._seen_version:
            return
        self._seen_version = state.version
        snapshot, now = state.snapshot(), time.monotonic()
        if not snapshot.total_batches:
            return
        if snapshot.epoch == self._printed_epoch and now - self._printed_at < self._interval:
            return
        self._printed_epoch, self._printed_at = snapshot.epoch, now
        print(progress_line(snapshot), flush=True)

    def finish(self, result: RunResult | None, error: BaseException | None = None) -> None:
        """Print the summary line."""
        snapshot = self._run.state.snapshot()
        status = end_status(result, error)
        print(summary_text(replace(snapshot, status=status), describe_problem(error)), flush=True)
        print(ranks_table_text(snapshot), flush=True)


class Dashboard(RunView):
    """The live ipywidgets dashboard of a run, for JupyterLab 4 (and any frontend with ipywidgets 8).

    It shows the status with elapsed time and ETA, a progress bar over every epoch's batches, the loss
    and learning-rate curves, a table of per-epoch scores, one row per rank and the tail of rank 0's
    log. A background thread redraws it at most every ``interval`` seconds, and only when the run's
    state changed (or once a second, for the clock). ``finish`` freezes it and updates the cell's
    output so that its ``text/plain`` (a summary line) and ``text/html`` (the dashboard as static HTML)
    describe the final state: that is what a saved notebook shows where the widget cannot render
    (GitHub, nbconvert without widget state). nbval ignores display updates and compares the first
    ``text/plain``, so mark a training cell ``# NBVAL_IGNORE_OUTPUT`` (its timings differ anyway).

    The per-rank view (``rank_view``, CSS class ``nbddp-rank-view``) switches the log between what the cell
    shows (rank 0's output and every rank's warnings) and one rank's own output under a line of its figures;
    the ranks table marks a straggler or a silent rank.

    The widgets are attributes (``status``, ``bar``, ``progress``, ``charts``, ``epochs``, ``ranks``,
    ``rank_view``, ``log``, ``outcome``; ``widget`` is the root), with CSS classes ``nbddp-dashboard``,
    ``nbddp-status``, ``nbddp-progress``, ``nbddp-rank-view``, ``nbddp-log`` and ``nbddp-outcome`` (shown once
    finished).

    Example::

        view = Dashboard(run)
        view.start()                     # shows it in this cell; or view.follow() where it is shown elsewhere
    """

    def __init__(self, run: Run, interval: float = REDRAW_INTERVAL) -> None:
        import ipywidgets as widgets

        self._run, self._interval = run, interval
        self._on_redraw: Callable[[Snapshot], None] | None = None
        self._drawn_version = -1
        self._drawn_at = -math.inf
        self._final_status: str | None = None
        self._problem = NO_PROBLEM
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: Any = None
        self._history = MetricHistory()

        self.title = widgets.HTML()
        self.status = widgets.HTML()
        self.bar = widgets.FloatProgress(min=0.0, max=1.0, layout=widgets.Layout(flex="1 1 auto", width="auto"))
        self.progress = widgets.HTML(layout=widgets.Layout(margin="0 0 0 10px"))
        self.outcome = widgets.HTML(layout=widgets.Layout(display="none"))
        self.charts = widgets.HTML()
        self.epochs = widgets.HTML(layout=widgets.Layout(margin="0 40px 6px 0"))
        self.ranks = widgets.HTML()
        self.log = widgets.HTML(layout=widgets.Layout(width="100%", overflow="auto"))  # long lines scroll
        self.rank_view = widgets.ToggleButtons(
            options=[("cell", CELL_VIEW)] + [(f"rank {rank}", rank) for rank in range(run.plan.world_size)],
            value=CELL_VIEW, style={"button_width": "64px"},
            tooltips=["rank 0's output and every rank's warnings"] + ["this rank's own output"] * run.plan.world_size,
        )  # fmt: skip
        self.rank_view.observe(lambda _: self._draw_log(self._snapshot()), names="value")
        self.rank_view.add_class("nbddp-rank-view")
        self.status.add_class("nbddp-status")
        self.bar.add_class("nbddp-progress")
        self.log.add_class("nbddp-log")
        self.outcome.add_class("nbddp-outcome")
        row = {"align_items": "center", "width": "100%"}
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.title, self.status], layout=widgets.Layout(justify_content="space-between", **row)),
                widgets.HBox([self.bar, self.progress], layout=widgets.Layout(**row)),
                self.outcome,
                self.charts,
                widgets.HBox([self.epochs, self.ranks], layout=widgets.Layout(flex_flow="row wrap", width="100%")),
                self.rank_view,
                self.log,
            ],
            layout=widgets.Layout(border=f"1px solid {BORDER_COLOR}", padding="6px 12px", max_width="980px"),
        )
        self.widget.add_class("nbddp-dashboard")
        self.refresh()

    # -- drawing ----------------------------------------------------------------------------------
    def _snapshot(self) -> Snapshot:
        snapshot = self._run.state.snapshot()
        return replace(snapshot, status=self._final_status) if self._final_status else snapshot

    def _draw(self, snapshot: Snapshot) -> None:
        series = self._history.update(snapshot.metrics)
        self.title.value = title_html(snapshot)
        self.status.value = status_html(snapshot)
        self.bar.value = snapshot.fraction_done
        self.bar.bar_style = BAR_STYLES.get(snapshot.status, "")
        self.progress.value = _escape(progress_text(snapshot))
        if self._final_status:
            self.outcome.value = outcome_html(snapshot, self._problem)
            self.outcome.layout.display = None if self.outcome.value else "none"
        self.charts.value = charts_html(series, snapshot.resumed_at)
        self.epochs.value = epoch_table_html(series, snapshot.resumed_at)
        self.ranks.value = ranks_table_html(snapshot)
        self._draw_log(snapshot)

    def _draw_log(self, snapshot: Snapshot) -> None:
        chosen = self.rank_view.value
        self.log.value = log_html(snapshot, rank=None if chosen == CELL_VIEW else chosen)

    def refresh(self) -> bool:
        """Redraw if the state changed since the last redraw, or the clock is due; True if it redrew."""
        version, now = self._run.state.version, time.monotonic()
        if version == self._drawn_version and now - self._drawn_at < CLOCK_INTERVAL:
            return False
        # the version is read before the snapshot: a change in between only causes one more redraw
        self._drawn_version, self._drawn_at = version, now
        snapshot = self._snapshot()
        self._draw(snapshot)
        if self._on_redraw is not None:
            self._on_redraw(snapshot)
        return True

    def _update_loop(self) -> None:
        """Redraw until ``finish``, or until the run has ended and was drawn so (nobody may call ``finish``)."""
        while not self._stop.wait(self._interval):
            ended = self._run.state.ended_at is not None  # read first, so the last redraw shows the end
            self.refresh()
            if ended:
                return

    # -- showing ----------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        """The widget, with a ``text/plain`` and ``text/html`` description for frontends that cannot render it."""
        snapshot = self._snapshot()
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = f"{summary_text(snapshot, self._problem)}\n{ranks_table_text(snapshot)}"
        bundle["text/html"] = dashboard_html(snapshot, self._problem)
        return bundle

    def start(self) -> None:
        """Display the dashboard in the current cell and start the updater thread."""
        from IPython.display import display

        self._handle = display(self, display_id=True)
        self.follow()

    def follow(self, on_redraw: Callable[[Snapshot], None] | None = None) -> None:
        """Start the updater thread without displaying the dashboard (it is shown inside another widget).

        ``on_redraw`` is called with the drawn snapshot after each redraw, on the updater thread: whatever
        else shows the run (a panel's status line) redraws with the dashboard, never more often.
        """
        self._on_redraw = on_redraw
        self._thread = threading.Thread(target=self._update_loop, name="flair_nbddp-dashboard", daemon=True)
        self._thread.start()

    def finish(self, result: RunResult | None, error: BaseException | None = None) -> None:
        """Stop the updater, freeze the widgets on the final state, and update the cell's saved output."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._final_status = end_status(result, error)
        self._problem = describe_problem(error)
        self._draw(self._snapshot())
        if self._handle is not None:
            self._handle.update(self)


# -- choosing -------------------------------------------------------------------------------------
def widgets_usable() -> bool:
    """True inside a Jupyter kernel (not a plain IPython shell) where ipywidgets imports."""
    ipython = sys.modules.get("IPython")  # a kernel has imported it; a script need not pay for it
    if ipython is None or getattr(ipython.get_ipython(), "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def open_view(run: Run, dashboard: bool | None = None) -> RunView:
    """The view of ``run`` that fits where the code runs.

    Args:
        run: the run to show (it need not be started yet).
        dashboard: None: the widget :class:`Dashboard` inside a Jupyter kernel with ipywidgets, else a
            :class:`TextView`; True: the Dashboard, or an error outside a kernel; False: a :class:`NullView`.

    Raises:
        DashboardUnavailableError: ``dashboard=True`` outside a Jupyter kernel, or without ipywidgets.

    Example::

        view = open_view(run)
        type(view).__name__                       # in a notebook  # 'Dashboard'
    """
    if dashboard is False:
        return NullView(run)
    if widgets_usable():
        return Dashboard(run)
    if dashboard:
        raise DashboardUnavailableError(
            "dashboard=True needs a Jupyter kernel with ipywidgets installed; here there is none. "
            "Use dashboard=None for plain progress lines, or dashboard=False for rank 0's log only."
        )
    return TextView(run)
