"""Runs as an HTML table: what ``%ddp_runs`` shows, and the panel's history of its runs.

Example:
    >>> from flair_nbddp.ledger.store import RunRecord
    >>> record = RunRecord(id=3, name="train", status="finished", devices="2 × cpu (gloo)", elapsed=30.0,
    ...                    params={"kwargs": {"lr": 0.005}}, scores={"test_score": 0.91})
    >>> table = runs_html([record])
    >>> "lr=0.005" in table and "0.9100" in table, "0.005" in runs_html([record], param_names=["lr"])
    (True, True)
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from typing import Any

from ..ledger.store import RunRecord
from .dashboard import BORDER_COLOR, MUTED_COLOR, STATUS_COLORS, format_duration

_CELL = f"padding:2px 12px 2px 0;border-bottom:1px solid {BORDER_COLOR};text-align:right;white-space:nowrap"
_HEAD = f"{_CELL};color:{MUTED_COLOR};font-weight:600"
MAX_PARAMS_TEXT = 80


def format_value(value: Any) -> str:
    """A param or score in a table cell: floats to 3 significant digits; a described corpus by its sizes.

    Example:
        >>> format_value(0.0050118), format_value(16), format_value({"type": "Corpus", "train": 8, "dev": 2})
        ('0.00501', '16', 'Corpus(train=8, dev=2)')
    """
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict) and "type" in value:
        inner = ", ".join(f"{key}={item}" for key, item in value.items() if key not in ("type", "sha256", "put_on_pool"))
        return f"{value['type']}({inner})"
    return str(value)


def params_text(params: dict[str, Any]) -> str:
    """Keyword arguments in one short line, e.g. ``lr=0.005, epochs=2``.

    Example:
        >>> params_text({"lr": 0.005, "epochs": 2})
        'lr=0.005, epochs=2'
    """
    text = ", ".join(f"{name}={format_value(value)}" for name, value in params.items())
    return text if len(text) <= MAX_PARAMS_TEXT else text[: MAX_PARAMS_TEXT - 1] + "…"


def status_badge(status: str) -> str:
    return f'<span style="color:{STATUS_COLORS.get(status, MUTED_COLOR)}">● {html.escape(status)}</span>'


def runs_html(
    records: Sequence[RunRecord], param_names: Sequence[str] | None = None, empty: str = "no runs recorded yet"
) -> str:
    """``records`` as a table, in the order given.

    With ``param_names`` (the panel): a column per parameter, then devices, status, elapsed and the scores.
    Without (``%ddp_runs``): the run's id, start, name, status, devices, elapsed, its keyword arguments in one
    column (the magic's: its notebook variables), then the scores.
    """
    if not records:
        return f'<span style="color:{MUTED_COLOR};font-size:12px">{html.escape(empty)}</span>'
    scores = list(dict.fromkeys(name for record in records for name in record.scores))
    if param_names is None:
        head = ["#", "started", "name", "status", "devices", "elapsed", "parameters", *scores]
    else:
        head = ["#", *param_names, "devices", "status", "elapsed", *scores]
    rows = []
    for record in records:
        kwargs = record.kwargs or record.params.get("variables", {})
        if param_names is None:
            started = time.strftime("%m-%d %H:%M", time.localtime(record.started_at))
            first = [html.escape(started), html.escape(record.name)]
            middle = [status_badge(record.status), html.escape(record.devices)]
            middle += [format_duration(record.elapsed), html.escape(params_text(kwargs))]
        else:
            first = [html.escape(format_value(kwargs[name])) if name in kwargs else "—" for name in param_names]
            middle = [html.escape(record.devices), status_badge(record.status), format_duration(record.elapsed)]
        numbers = [f"{record.scores[name]:.4f}" if name in record.scores else "—" for name in scores]
        rows.append([str(record.id if record.id is not None else "—"), *first, *middle, *numbers])
    header = "".join(f'<th style="{_HEAD}">{html.escape(cell)}</th>' for cell in head)
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{cell}</td>' for cell in row) + "</tr>" for row in rows)
    # an explicit line height: ipywidgets' HTML widget would give every row the height of a text box
    return f'<table style="border-collapse:collapse;font-size:12px;line-height:1.5"><tr>{header}</tr>{body}</table>'
