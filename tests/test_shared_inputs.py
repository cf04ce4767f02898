"""Ranks share what they tokenized in exchanges of a bounded size, as many as the rank with the most needs."""

from __future__ import annotations

import numpy as np

from flair_nbddp.worker import fast_inputs, shared_inputs
from flair_nbddp.worker.kept_inputs import Store

NAME = ("tokenizer", b"settings")


def _store(first: int, count: int) -> Store:
    store = Store(500, [0, 1, 2, 3], word_ids=False)
    rng = np.random.default_rng(first)
    for number in range(first, first + count):
        store.add(number.to_bytes(16, "little"), [([2, *rng.integers(4, 500, size=98).tolist(), 3], None)])
    return store


def test_an_epochs_end_exchanges_pieces_until_no_rank_has_more_and_each_keeps_the_others(monkeypatch):
    here, there = _store(0, 30), _store(1000, 75)  # rank 0 (this worker) and rank 1
    monkeypatch.setattr(fast_inputs, "_STORES", {NAME: here})
    monkeypatch.setattr(fast_inputs, "_JOB", fast_inputs._Job(used={NAME}))
    monkeypatch.setattr(shared_inputs, "PIECE", 10 * (16 + 100 * 2 + 16))  # 10 sentences of 100 sub-tokens
    exchanged = []

    def gather(piece: tuple) -> list:
        theirs = ({NAME: there.ship(shared_inputs.PIECE)}, there.unshipped())
        exchanged.append((len(piece[0][NAME]), len(theirs[0][NAME])))
        return [piece, theirs]

    shared_inputs.SharingPlugin(0, gather).after_training_epoch()
    assert exchanged == [(10, 10), (10, 10), (10, 10), (0, 10), (0, 10), (0, 10), (0, 10), (0, 5)]
    assert len(here) == 105 and not here.unshipped()
    assert here.holds([number.to_bytes(16, "little") for number in range(1000, 1075)]) == [True] * 75
