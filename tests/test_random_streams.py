"""The random streams shared evaluation keeps as flair's order leaves them (fast tier: one process)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from flair.data import Sentence
from flair.datasets import DataLoader, FlairDatapointDataset

from flair_nbddp.worker import random_streams


def test_a_restore_puts_every_stream_back():
    before = random_streams.snapshot()
    drawn = (random.random(), np.random.rand(), torch.rand(2).tolist())
    random_streams.restore(before)
    assert random_streams.snapshot() == before
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == drawn


@pytest.mark.parametrize("iterators", [0, 1, 3])
def test_the_draws_of_flairs_data_loaders_are_counted_and_replayed(iterators):
    def step() -> str:  # what SequenceTagger.predict does once per batch
        for _ in range(iterators):
            iter(DataLoader(FlairDatapointDataset([Sentence("a b")]), batch_size=4))
        return "predicted"

    before = random_streams.snapshot()
    assert random_streams.loader_draws(step) == ("predicted", iterators)
    after = random_streams.snapshot()  # left where the step left them
    random_streams.restore(before)
    step()
    assert random_streams.snapshot() == after

    random_streams.restore(before)
    random_streams.draw_loader_iterators(iterators)
    assert random_streams.snapshot() == after


@pytest.mark.parametrize(
    "draw",
    [
        random.random, np.random.rand, lambda: torch.rand(1), lambda: torch.randperm(10),
        lambda: torch.rand(2),  # as much of torch's generator as one loader's seed, yet not a loader's
        lambda: torch.nn.functional.dropout(torch.ones(8), 0.5, training=True),
        lambda: (iter(DataLoader(())), torch.rand(2)),  # a loader, and more
    ],
    ids=["python", "numpy", "one-word", "permutation", "a-seeds-worth", "dropout", "a-loader-and-more"],
)  # fmt: skip
def test_any_other_draw_is_found_out(draw):
    assert random_streams.loader_draws(lambda: None) == (None, 0)
    before = random_streams.snapshot()
    draw()
    after = random_streams.snapshot()
    random_streams.restore(before)
    assert random_streams.loader_draws(draw)[1] is None
    assert random_streams.snapshot() == after
