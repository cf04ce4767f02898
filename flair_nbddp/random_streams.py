"""A worker's random number streams, so that work done out of flair's order leaves them as flair's order would.

The streams are Python's ``random``, NumPy's global generator, torch's CPU generator and, once CUDA is in use,
the current GPU's. Training draws from them (dropout masks, shuffling), so a seeded run reproduces flair's only
if everything before a batch drew exactly what flair's own code draws there. Shared evaluation
(``distributed_eval.py``) computes a rank's share of the batches first and replays flair's ``evaluate`` after:
the share runs between a :func:`snapshot` and a :func:`restore`, and the replay makes the draws each batch step
made (:func:`loader_iterators_between`, :func:`draw_loader_iterators`).

The only draws flair's evaluation steps make are those of its data loaders: every iterator of a torch
``DataLoader`` takes one seed from torch's CPU generator (``SequenceTagger.predict`` makes one per batch,
``DefaultClassifier.predict`` none for a batch of at most ``mini_batch_size``). A step that draws anything
else is found out, and the caller evaluates as flair does.

Example:
    >>> import torch
    >>> before = snapshot()
    >>> _ = torch.rand(3)
    >>> restore(before)
    >>> snapshot() == before
    True
    >>> draw_loader_iterators(2)
    >>> loader_iterators_between(before, snapshot())
    2
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

MOST_ITERATORS = 64  # per step; more draws than this are not a few data loaders


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Every stream's state at one moment (compared with ``==``)."""

    python: tuple
    numpy: tuple
    torch: torch.Tensor
    cuda: torch.Tensor | None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Snapshot) and self.others_equal(other) and torch.equal(self.torch, other.torch)

    def others_equal(self, other: Snapshot) -> bool:
        """Whether every stream but torch's CPU generator is where ``other`` has it."""
        if self.python != other.python or (self.cuda is None) != (other.cuda is None):
            return False
        if self.cuda is not None and not torch.equal(self.cuda, other.cuda):
            return False
        mine, theirs = self.numpy, other.numpy
        return mine[0] == theirs[0] and np.array_equal(mine[1], theirs[1]) and mine[2:] == theirs[2:]


def snapshot() -> Snapshot:
    """Where every stream is now."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return Snapshot(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)


def restore(state: Snapshot) -> None:
    """Put every stream back where ``state`` has it."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda)


def draw_loader_iterators(count: int) -> None:
    """Draw what ``count`` data-loader iterators draw: one seed each from torch's CPU generator."""
    for _ in range(count):
        iter(DataLoader(()))


def loader_iterators_between(before: Snapshot, after: Snapshot) -> int | None:
    """How many data-loader iterators took the streams from ``before`` to ``after``; None if something else drew.

    Leaves the streams at ``after``.
    """
    found: Any = None
    if before.others_equal(after):
        restore(before)
        for count in range(MOST_ITERATORS + 1):
            if torch.equal(torch.get_rng_state(), after.torch):
                found = count
                break
            draw_loader_iterators(1)
    restore(after)
    return found
