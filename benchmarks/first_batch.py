"""Cold launch vs warm pool: time to the first training batch, and the round trip of a trivial job.

    python benchmarks/first_batch.py --device cpu --size tiny --docs 400
    python benchmarks/first_batch.py --device cuda --size distilbert --docs 2000

Both runs train the same TextClassifier on the same corpus (built once, here, like in a notebook);
the cold one starts new workers, the warm one runs on a WorkerPool started (and used once) before,
launched 2 s after the previous job ended, as the next cell of a notebook would be.
Prints one JSON line with the absolute figures and ``warm_vs_cold_first_batch``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

# A notebook user runs the next cell seconds after the last one ends; warm workers free the last job's
# memory in that pause (~0.4 s of garbage collection on this machine), so the benchmark leaves one too.
BETWEEN_CELLS_S = 2.0


def nothing() -> None:
    return None


def measure(device: str | None, processes: int | None, size: str, docs: int, workdir: Path) -> dict:
    from flair_nbddp import WorkerPool, launch
    from flair_nbddp.demo import train_classifier
    from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

    corpus = sentiment_corpus(n_train=docs, n_dev=32, n_test=32, words=(200, 260))
    model = tiny_transformer(workdir / f"model-{size}", size=size)
    job = dict(
        args=(corpus, model, str(workdir / "training")),
        kwargs={"max_epochs": 1, "mini_batch_size": 32, "learning_rate": 5e-5, "return_model": False},
        dashboard=False,
    )
    started = time.perf_counter()
    launch(nothing, device=device, processes=processes, dashboard=False)
    trivial_cold = time.perf_counter() - started
    cold = launch(train_classifier, device=device, processes=processes, **job)
    with WorkerPool(processes, device) as pool:
        pool.warm_up()
        time.sleep(BETWEEN_CELLS_S)
        started = time.perf_counter()
        pool.launch(nothing, dashboard=False)
        trivial_warm = time.perf_counter() - started
        time.sleep(BETWEEN_CELLS_S)
        warm = pool.launch(train_classifier, **job)
    return {
        "cold_first_batch_s": cold.time_to_first_batch,
        "warm_first_batch_s": warm.time_to_first_batch,
        "warm_vs_cold_first_batch": warm.time_to_first_batch / cold.time_to_first_batch,
        "trivial_job_cold_s": trivial_cold,
        "trivial_job_warm_s": trivial_warm,
        "warm_vs_cold_trivial_job": trivial_warm / trivial_cold,
        "world_size": cold.world_size,
        "device": cold.device_type,
        "size": size,
        "docs": docs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="tiny")
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    figures = measure(args.device, args.processes, args.size, args.docs, Path(tempfile.mkdtemp()))
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
