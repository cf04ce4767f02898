"""The notebook's side of a predict call's results: chunks arrive in any order, predictions leave in input order.

A chunk's records wait until every input before them is done; then each goes, in order, where the call sends it:
onto the user's own data point (in place), onto a new ``Sentence`` made from the text (kept for the result), and
as a row of the JSON Lines file. ``done`` counts that finished prefix.

Example:
    >>> import numpy as np
    >>> from flair_nbddp.wire.predict_inputs import Texts
    >>> collector = Collector(Texts(["a b", "c"]), [np.array([1]), np.array([0])], "label", keep=False)
    >>> collector.take(0, [((("p", -1, -1, -1, -1, "POS", 0.9),), None)])
    >>> collector.done
    0
    >>> collector.take(1, [((("p", -1, -1, -1, -1, "NEG", 0.8),), None)])
    >>> collector.done
    2
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..wire import label_records
from ..wire.predict_inputs import Inputs


class Collector:
    """Puts each chunk's records in place, in input order, as the prefix they complete grows."""

    def __init__(
        self, inputs: Inputs, chunks: list[np.ndarray], label_name: str, keep: bool, output: IO[str] | None = None
    ) -> None:
        self.inputs, self.chunks, self.label_name = inputs, chunks, label_name
        self.output = output
        self.kept: list | None = [] if keep else None  # new Sentences, for inputs that were texts
        self.done = 0
        self._waiting: dict[int, Any] = {}

    def take(self, chunk: int, records: Any) -> None:
        """The records of chunk number ``chunk`` (in the chunk's order); the prefix moves on as far as it can."""
        self._waiting.update(zip(self.chunks[chunk].tolist(), records, strict=True))
        while self.done in self._waiting:
            self._put(self.done, self._waiting.pop(self.done))
            self.done += 1

    def _put(self, index: int, record: Any) -> None:
        if self.inputs.in_place:
            label_records.apply(self.inputs[index], record, self.label_name)  # type: ignore[index]
        elif self.kept is not None:
            sentence = self.inputs.points([index])[0]
            label_records.apply(sentence, record, self.label_name)
            self.kept.append(sentence)
        if self.output is not None:
            row = {"text": self.inputs.text(index), **label_records.as_json(record)}
            self.output.write(json.dumps(row, ensure_ascii=False) + "\n")


def open_output(path: str | Path) -> IO[str]:
    """The JSON Lines file a call writes, created or emptied; its folder must exist."""
    return open(Path(path), "w", encoding="utf-8")  # noqa: SIM115 - closed by the call when it ends
