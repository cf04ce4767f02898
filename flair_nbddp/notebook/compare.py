"""Runs from the ledger side by side: one metric's curves in a matplotlib figure.

Example::

    from flair_nbddp import compare, history
    compare(history(limit=4, name="train"))                 # dev/score per epoch, one line per run
    compare(history(limit=4), metric="train/loss")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..engine.state import per_step, step_at
from ..errors import ConfigurationError
from ..ledger.store import RunRecord
from .run_table import params_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MARKERS_UP_TO = 40  # points per line drawn with markers (an epoch metric); longer series as plain lines


def run_label(record: RunRecord) -> str:
    """A run's name in a legend: ``#12 train (finished) lr=0.005, max_epochs=4``.

    Example:
        >>> run_label(RunRecord(id=12, name="train", status="finished", params={"kwargs": {"lr": 0.005}}))
        '#12 train (finished) lr=0.005'
    """
    arguments = params_text(record.kwargs)
    return f"#{record.id} {record.name} ({record.status})" + (f" {arguments}" if arguments else "")


def compare(records: Sequence[RunRecord], metric: str = "dev/score") -> Figure:
    """One line per run of ``metric`` against its step (the epoch, for flair's per-epoch metrics).

    A run that did not record ``metric`` still gets its (empty) entry in the legend, marked so. A run that resumed
    from a checkpoint (``resume=``, or a restart) shows its whole curve, the earlier run's part included, with a
    dotted line in its colour where it continued.

    Args:
        records: runs from :func:`flair_nbddp.history`.
        metric: any metric flair recorded, e.g. ``"dev/score"``, ``"train/loss"``, ``"dev/loss"``.

    Raises:
        LedgerError: the ledger cannot be read.
        ConfigurationError: (a ``ValueError``) ``records`` is empty.
    """
    if not records:
        raise ConfigurationError("compare() needs at least one run: pass records from flair_nbddp.history()")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(7.5, 4.2))
    plt.close(figure)  # returned, not also drawn by pyplot at the end of the cell
    for record in records:
        points = record.history(metric)
        resumed_at = record.resumed_at
        label = run_label(record) + ("" if points else f" — no {metric}")
        if resumed_at is not None:
            label += f", resumed from #{record.resumed_from} after epoch {resumed_at[0]}"
        steps, values = [step for step, _ in points], [value for _, value in points]
        (line,) = axes.plot(steps, values, marker="o" if len(points) <= MARKERS_UP_TO else None, label=label)
        if resumed_at is not None and points:
            axes.axvline(step_at(metric, *resumed_at), color=line.get_color(), linestyle=":")
    axes.set_xlabel("step" if per_step(metric) else "epoch")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs (and steps), never 1.25
    axes.set_ylabel(metric)
    axes.set_title(f"{metric}, {len(records)} run(s)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    return figure
