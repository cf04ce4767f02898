"""What :func:`flair_nbddp.predict` returns: how far it got, where the predictions are, and how fast it went."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..result import RunResult


@dataclass
class Predictions:
    """The outcome of a :func:`flair_nbddp.predict` call.

    Attributes:
        status: ``"finished"``, or ``"stopped"`` (an interrupt, ``Stop``, or ``call.stop()``).
        done: the inputs predicted, from the first on: inputs ``0 .. done-1`` hold their predictions (in place, in
            ``sentences``, in the file), nothing after them was changed. ``done == total`` when finished.
        total: the inputs given.
        sentences: the predicted data points in input order: the very objects given (labels added in place), or new
            ``Sentence`` objects made from the texts. Empty when the texts' predictions went only to ``output``.
        output: the JSON Lines file written (one row per input, in input order), or None.
        label_name: the label type the predictions carry.
        texts_per_second: ``done`` over the call's time from its start to its end (workers' start-up included).
        elapsed: seconds the call took.
        world_size, device_type: the ranks it ran on.
        run: the run's :class:`~flair_nbddp.RunResult` (logs, per-rank figures, ``record_id`` in the run ledger).

    Example::

        predictions = predict(model, sentences)
        predictions.done, predictions.texts_per_second     # (20000, 5310.2)
        predictions[0].get_labels("sentiment")               # the first input's labels (the object given)
    """

    status: str
    done: int
    total: int
    label_name: str
    sentences: list = field(default_factory=list)
    output: Path | None = None
    elapsed: float = 0.0
    run: RunResult | None = field(default=None, repr=False)

    @property
    def texts_per_second(self) -> float:
        return self.done / self.elapsed if self.elapsed else 0.0

    @property
    def world_size(self) -> int:
        return self.run.world_size if self.run else 0

    @property
    def device_type(self) -> str:
        return self.run.device_type if self.run else ""

    def __len__(self) -> int:
        return len(self.sentences)

    def __getitem__(self, index: Any) -> Any:
        return self.sentences[index]

    def __iter__(self) -> Any:
        return iter(self.sentences)

    def describe(self) -> str:
        """``finished: 20,000 of 20,000 inputs in 3.8 s (5,310 texts/s) on 2 × cuda; labels 'sentiment'``."""
        where = f" on {self.world_size} × {self.device_type}" if self.run else ""
        written = f"; written to {self.output}" if self.output else ""
        return (
            f"{self.status}: {self.done:,} of {self.total:,} inputs in {self.elapsed:.1f} s "
            f"({self.texts_per_second:,.0f} texts/s){where}; labels {self.label_name!r}{written}"
        )

    def __repr__(self) -> str:
        return f"<Predictions {self.describe()}>"
