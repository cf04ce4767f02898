"""Parity: a seeded run of the kit, every default on, trains bit for bit what flair's own launcher trains.

flair's side is its own lifecycle (``flair_own_launcher.py``: ``launch_distributed``, spawned ranks, each seeding
and building its corpus), bent only to gloo on 2 CPU processes with the kit's share of the cores each. The kit's
side is ``launch`` with the seed and every default (on 2 CPU processes, whatever the machine has): the corpus
built once here and shipped (built up front in the workers: it is small), every evaluation shared out. Compared: every epoch's train loss, dev loss,
dev score and learning rate, then the test score and the weights. A feature that changes what flair trains
fails here.
"""

from __future__ import annotations

import pytest
from flair_own_launcher import figures
from parity_jobs import EPOCHS, KINDS, SEED, build_corpus, kit_train

from flair_nbddp import launch

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_processes")]


@pytest.fixture(scope="module")
def flairs_own(tiny_model_path, tmp_path_factory) -> dict[str, dict]:
    """Every kind trained by flair's own launcher, in one script run."""
    return figures("cpu", tiny_model_path, str(tmp_path_factory.mktemp("flair")), list(KINDS))


@pytest.mark.parametrize("kind", KINDS)
def test_a_seeded_run_trains_bit_for_bit_what_flairs_own_launcher_trains(flairs_own, tiny_model_path, tmp_path, kind):
    job = (build_corpus(kind), kind, tiny_model_path, str(tmp_path))
    result = launch(kit_train, job, seed=SEED, device="cpu", processes=2)

    # the kit's defaults were in play: a small corpus built up front (a lazy one trains the same, bit for bit:
    # tests/test_big_corpus.py), and every evaluation shared out and replayed (2 ranks, 5 dev batches of 8 per
    # epoch and 4 test batches: 3 + 2 per epoch and 2 + 2 at the end), none evaluated whole
    assert not result.value["lazy"]
    assert result.value["batches_computed"] == [3 * EPOCHS + 2, 2 * EPOCHS + 2]
    assert "on the whole split" not in result.log
    kit, flair = result.value["figures"], flairs_own[kind]
    assert all(len(flair[name]) == EPOCHS for name in flair if isinstance(flair[name], list))
    differing = {name: (flair[name], kit[name]) for name in flair if kit[name] != flair[name]}
    assert not differing, f"{kind}: the kit trained otherwise than flair (flair, kit): {differing}"
