"""Sweeps: trials side by side against the same trials one after the other, and a trial's overhead on a pool.

    python benchmarks/sweep.py --json results/cpu-sweep.json

- **Side by side.** 4 one-process trials of a small RNN ``TextClassifier`` (tests/training_jobs.py) on the 2 CPU
  process slots: ``sweep(..., trial_processes=1)`` runs 2 at a time; the same 4 trials with ``processes=2`` on the
  sweep run one at a time on the same devices (each trial still one process, with the same threads: a CPU process
  gets its slot's share of the cores either way). Ratio: sequential wall time / side-by-side wall time (goal >= 1.6).
- **Per-trial overhead on a pool slice.** ``WorkerPool(2, "cpu", job_processes=1)``, warmed up: each trial's time
  from its start to its first training batch (``RunResult.time_to_first_batch``), against a cold trial's.

``--device cuda`` instead runs one sweep of one-GPU trials on every GPU there (one GPU: one trial at a time) and
reports each trial's record: its state, value, devices, time to first batch and throughput.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
os.environ.setdefault("FLAIR_NBDDP_HOME", tempfile.mkdtemp(prefix="flair_nbddp-bench-"))
TRIALS = 4
EPOCHS = 6


def trial(corpus, base_path: str, lr: float) -> dict:
    from training_jobs import train_classifier_with

    return train_classifier_with(corpus, base_path, lr=lr, epochs=EPOCHS, hidden=32)


def timed_sweep(
    corpus, processes: int | None, trial_processes: int, name: str, pool=None, device: str = "cpu"
) -> tuple[float, object]:  # fmt: skip
    import optuna

    from flair_nbddp import sweep

    space = {"lr": optuna.distributions.CategoricalDistribution([0.05, 0.1, 0.2, 0.4])}
    options = {} if pool is not None else {"device": device, "processes": processes}
    began = time.perf_counter()
    result = sweep(trial, (corpus, tempfile.mkdtemp()), space=space, n_trials=TRIALS, trial_processes=trial_processes,
                   study=name, pool=pool, dashboard=False, pruner=optuna.pruners.NopPruner(), **options)  # fmt: skip
    return time.perf_counter() - began, result


def first_batches(result) -> list[float]:
    return [record.time_to_first_batch for record in result.records if record.time_to_first_batch is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    arguments = parser.parse_args()

    from flair_nbddp import WorkerPool
    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(n_train=600, n_dev=60, n_test=60, seed=3)
    stamp = time.strftime("%H%M%S")
    if arguments.device == "cuda":
        import torch

        wall, result = timed_sweep(corpus, None, 1, f"bench-gpu-{stamp}", device="cuda")
        report = {
            "gpus": [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())],
            "wall_s": round(wall, 2),
            "trials": [{"number": record.trial["number"], "state": record.trial["state"],
                        "value": record.trial["value"], "devices": record.devices, "status": record.status,
                        "time_to_first_batch_s": record.time_to_first_batch,
                        "samples_per_second": record.samples_per_second} for record in result.records],
        }  # fmt: skip
        return _report(report, arguments.json)
    sequential, _ = timed_sweep(corpus, 1, 1, f"bench-sequential-{stamp}")
    os.environ["FLAIR_NBDDP_PROCESSES"] = "1"  # one slot: each trial's process threads over every core
    whole_cpu, _ = timed_sweep(corpus, 1, 1, f"bench-whole-cpu-{stamp}")
    del os.environ["FLAIR_NBDDP_PROCESSES"]
    side_by_side, cold = timed_sweep(corpus, 2, 1, f"bench-side-by-side-{stamp}")
    with WorkerPool(2, "cpu", job_processes=1) as pool:
        pool.warm_up()
        on_pool, warm = timed_sweep(corpus, 2, 1, f"bench-pool-{stamp}", pool=pool)
    report = {
        "machine": f"{os.cpu_count()} cores",
        "trials": TRIALS, "epochs": EPOCHS, "train_sentences": len(corpus.train),
        "sequential_s": round(sequential, 2),
        "side_by_side_s": round(side_by_side, 2),
        "side_by_side_speedup": round(sequential / side_by_side, 3),
        "sequential_whole_cpu_s": round(whole_cpu, 2),
        "side_by_side_vs_whole_cpu": round(whole_cpu / side_by_side, 3),
        "on_pool_slices_s": round(on_pool, 2),
        "first_batch_cold_s": round(statistics.median(first_batches(cold)), 3),
        "first_batch_pool_slice_s": round(statistics.median(first_batches(warm)), 3),
    }
    _report(report, arguments.json)


def _report(report: dict, path: str | None) -> None:
    line = json.dumps(report)
    print(line)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(line + "\n")


if __name__ == "__main__":
    main()
