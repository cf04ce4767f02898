"""Ranks share the encodings they keep: each sentence of a corpus is tokenized by one rank, once.

flair's distributed sampler deals each rank another share of the training set every epoch, so a rank's second
epoch holds sentences the other ranks tokenized in the first (half of them with 2 ranks, 7 in 8 with 8), and its
third some of the rest. At the end of every training epoch each rank ships the sentences it tokenized since the
last end (:meth:`.kept_inputs.Store.ship`: ~2 bytes a sub-token, 1.9 MB for 4,000 reviews of 230 words) to every
other rank over the CPU control group, and keeps theirs (:meth:`.kept_inputs.Store.absorb`): from the second epoch
on, no rank tokenizes a training sentence again. Evaluation splits go the same way at the next epoch's end.

A rank sends at most ``PIECE`` bytes in one exchange, and the exchanges go on until no rank has more: what an
exchange holds in a worker's memory is bounded by the world size times ``PIECE`` (pickled, and as arrays), whatever
the corpus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flair.trainers.plugins import TrainerPlugin

from . import fast_inputs

PIECE = 16 << 20  # bytes of encodings a rank sends in one exchange


class SharingPlugin(TrainerPlugin):
    """At each training epoch's end, every rank's new encodings to every other rank (all-gathers of ``PIECE`` bytes
    a rank, as many as the rank with the most needs).

    ``gather(value)`` returns every rank's value, by rank (a collective every rank joins at the same point).
    """

    def __init__(self, rank: int, gather: Callable[[Any], list]) -> None:
        super().__init__()
        self._rank, self._gather = rank, gather

    @TrainerPlugin.hook
    def after_training_epoch(self, **_: Any) -> None:
        more = True
        while more:
            piece = fast_inputs.shipments(at_most=PIECE)
            pieces = self._gather((piece, fast_inputs.unshipped()))
            fast_inputs.absorb([theirs for rank, (theirs, _) in enumerate(pieces) if rank != self._rank])
            more = any(left for _, left in pieces)
