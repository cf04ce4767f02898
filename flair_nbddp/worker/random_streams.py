"""A worker's random number streams, so that work done out of flair's order leaves them as flair's order would.

The streams are Python's ``random``, NumPy's global generator, torch's CPU generator and, once CUDA is in use,
every GPU's. Training draws from them (dropout masks, shuffling), so a seeded run reproduces flair's only if
everything before a batch drew exactly what flair's own code draws there. Shared evaluation
(``distributed_eval.py``) computes a rank's share of the batches first and replays flair's ``evaluate`` after:
the share runs between a :func:`snapshot` and a :func:`restore`, each batch's step through :func:`loader_draws`,
and the replay makes the draws each step made (:func:`draw_loader_iterators`).

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
    >>> loader_draws(lambda: iter(DataLoader(())))[1]
    1
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Every stream's state at one moment (compared with ``==``)."""

    python: tuple
    numpy: tuple
    cpu: torch.Tensor
    gpus: tuple[torch.Tensor, ...]  # one state per GPU; none before CUDA is in use

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot) or self.python != other.python or len(self.gpus) != len(other.gpus):
            return False
        mine, theirs = self.numpy, other.numpy
        return (
            mine[0] == theirs[0] and np.array_equal(mine[1], theirs[1]) and mine[2:] == theirs[2:]
            and torch.equal(self.cpu, other.cpu) and all(map(torch.equal, self.gpus, other.gpus))
        )  # fmt: skip


def snapshot() -> Snapshot:
    """Where every stream is now (reading a GPU's state does not wait for the GPU)."""
    gpus = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
    return Snapshot(random.getstate(), np.random.get_state(), torch.get_rng_state(), gpus)


def restore(state: Snapshot) -> None:
    """Put every stream back where ``state`` has it."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.cpu)
    if state.gpus:
        torch.cuda.set_rng_state_all(state.gpus)


def draw_loader_iterators(count: int) -> None:
    """Draw what ``count`` data-loader iterators draw: one seed each from torch's CPU generator."""
    for _ in range(count):
        iter(DataLoader(()))


def loader_draws(step: Callable[[], T]) -> tuple[T, int | None]:
    """``step()``'s value, and how many data-loader iterators it drew; None if it drew anything else.

    The count is of the iterators ``step`` made, checked: drawing that many from where the streams were must
    leave them where ``step`` left them. The streams are left where ``step`` left them.
    """
    before = snapshot()
    with _counting_loader_iterators() as made:
        value = step()
    after = snapshot()
    if not made:
        return value, 0 if after == before else None
    restore(before)
    draw_loader_iterators(len(made))
    replayed = snapshot() == after
    restore(after)
    return value, len(made) if replayed else None


@contextlib.contextmanager
def _counting_loader_iterators() -> Iterator[list[Any]]:
    """A list that gets an entry for every data-loader iterator made inside the block (in this process)."""
    made: list[Any] = []
    original = _BaseDataLoaderIter.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(None)
        original(self, *args, **kwargs)

    _BaseDataLoaderIter.__init__ = counted
    try:
        yield made
    finally:
        _BaseDataLoaderIter.__init__ = original
