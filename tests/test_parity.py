"""Parity: a seeded run through the kit, every default on, trains bit for bit what flair's own launcher trains.

flair's side is its own lifecycle (``flair_own_launcher.py``: ``launch_distributed``, spawned ranks, each seeding
and building its corpus), bent only to gloo on 2 CPU processes with the kit's share of the cores each. The kit's
side is ``launch`` with the seed and every default (on 2 CPU processes, whatever the machine has): the corpus
built once here and shipped (lazy), every evaluation shared out. Per epoch: train loss, dev loss, dev score and learning rate; then the test score and the weights.
A feature that changes what flair trains fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flair_nbddp import launch
from parity_jobs import EPOCHS, KINDS, SEED, build_corpus, kit_train

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_processes")]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def flairs_own(tiny_model_path, tmp_path_factory) -> dict[str, dict]:
    """Every kind trained by flair's own launcher, in one script run."""
    base = tmp_path_factory.mktemp("flair")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))  # as the kit shares the cores
    done = subprocess.run(
        [sys.executable, str(HERE / "flair_own_launcher.py"), "cpu", tiny_model_path, str(base), *KINDS],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
    assert done.returncode == 0 and lines, f"flair's own launcher failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][len("FIGURES ") :])


@pytest.mark.parametrize("kind", KINDS)
def test_a_seeded_run_trains_bit_for_bit_what_flairs_own_launcher_trains(flairs_own, tiny_model_path, tmp_path, kind):
    job = (build_corpus(kind), kind, tiny_model_path, str(tmp_path))
    value = launch(kit_train, job, seed=SEED, device="cpu", processes=2).value

    # the kit's defaults were in play: a lazy corpus, and every evaluation shared out (2 ranks, 5 dev batches of
    # 8 per epoch and 4 test batches: 3 + 2 per epoch and 2 + 2 at the end)
    assert value["lazy"]
    assert value["batches_computed"] == [3 * EPOCHS + 2, 2 * EPOCHS + 2]
    kit, flair = value["figures"], flairs_own[kind]
    assert len(flair["dev/score"]) == EPOCHS
    differing = {name: (flair[name], kit[name]) for name in flair if kit[name] != flair[name]}
    assert not differing, f"{kind}: the kit trained otherwise than flair (flair, kit): {differing}"
