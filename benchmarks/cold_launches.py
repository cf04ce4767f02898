"""Cold launches one after another, as a notebook's cells make them: wall time and the machine's CPU time each.

    python benchmarks/cold_launches.py --device cpu --launches 4
    python benchmarks/cold_launches.py --device cpu --launches 2 --jobs training   # a notebook's first training

Each launch starts new workers (no pool): a trivial job, then a short training of the tiny model on a corpus built
once, here, like in a notebook (``--jobs`` picks either or both, in that order). On CPU the kit forks its workers from
a server that imported torch and flair once (``flair_nbddp/engine/forkserver.py``): the first launch starts it, and its
ranks are forked once it is ready (``flair_nbddp/engine/pending_worker.py``); the next launches fork from it (the
benchmark waits until it is ready after the first launch, as a notebook's next cell would find it; with a kit that has
no fork server it waits for nothing, so the same script compares kits with and without one). CPU time is the whole
machine's (user + system, every process: the workers, their server and this one), so run it on a quiet machine.
Prints one JSON line: per launch, its wall seconds, CPU seconds and (trainings) seconds to the first batch.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


JOBS = ("trivial", "training")


def nothing() -> None:
    return None


def _cpu_seconds() -> float:
    import psutil

    times = psutil.cpu_times()
    return times.user + times.system


def _server_ready() -> None:
    try:
        from flair_nbddp.engine import forkserver
    except ImportError:  # a kit without the fork server
        return
    forkserver.prepare()


def measure(device: str, processes: int | None, launches: int, docs: int, workdir: Path, jobs: list[str]) -> dict:
    from flair_nbddp import launch
    from flair_nbddp.demo import train_classifier
    from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

    corpus = sentiment_corpus(n_train=docs, n_dev=16, n_test=16, words=(20, 30))
    model = tiny_transformer(workdir / "model-tiny", size="tiny")
    job = {
        "args": (corpus, model, str(workdir / "training")),
        "kwargs": {"max_epochs": 1, "mini_batch_size": 16, "learning_rate": 5e-5, "return_model": False},
    }
    rows = []
    for index in range(launches):
        for kind in jobs:
            fn, extra = {"trivial": (nothing, {}), "training": (train_classifier, job)}[kind]
            cpu, wall = _cpu_seconds(), time.perf_counter()
            result = launch(fn, device=device, processes=processes, dashboard=False, **extra)
            rows.append({
                "launch": index, "job": kind, "wall_s": round(time.perf_counter() - wall, 3),
                "cpu_s": round(_cpu_seconds() - cpu, 3),
                "first_batch_s": round(result.time_to_first_batch, 3) if kind == "training" else None,
            })  # fmt: skip
            if index == 0 and kind == jobs[0]:
                _server_ready()
    later = [row for row in rows if row["launch"] > 0]
    return {
        "jobs": jobs,
        "launches": rows,
        "later_trivial_wall_s": sum(r["wall_s"] for r in later if r["job"] == "trivial") / max(1, launches - 1),
        "later_training_wall_s": sum(r["wall_s"] for r in later if r["job"] == "training") / max(1, launches - 1),
        "later_cpu_s_per_launch": sum(r["cpu_s"] for r in later) / max(1, len(later)),
        "device": device,
        "processes": processes,
        "docs": docs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--jobs", default="trivial,training", help="each launch's jobs, in order")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    jobs = args.jobs.split(",")
    if not jobs or any(kind not in JOBS for kind in jobs):
        parser.error(f"--jobs: a comma-separated list of {', '.join(JOBS)}, not {args.jobs!r}")
    figures = measure(args.device, args.processes, args.launches, args.docs, Path(tempfile.mkdtemp()), jobs)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
