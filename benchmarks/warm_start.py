"""The warm path taken apart: from the launch call on a warm pool to the first training batch.

    python benchmarks/warm_start.py --device cpu --size tiny --docs 4000
    python benchmarks/warm_start.py --device cuda --size distilbert --docs 4000

What a notebook's next cell costs on a warm ``WorkerPool``: the parent packs the call (the corpus through
the codec) and writes it once; every rank reads and unpacks it, checks its process group and runs the
function, which builds the model and starts flair's training. The pack and the unpack of the very same
call are also timed apart (the unpack in a fresh interpreter that has imported flair, as a warm worker
has), so that

    warm_first_batch_s = pack_s + unpack_s + rest_s    (rest: dispatch, health check, model and trainer set-up)

Medians of ``--repeats`` warm jobs, each launched 2 s after the last ended, as the next cell would be.
Prints one JSON line. Runs on any version of the kit that has ``WorkerPool`` and ``wire.payload``, so the same
script measures the code before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BETWEEN_CELLS_S = 2.0
UNPACK_PROGRAM = """
import sys, time
import flair.trainers  # a warm worker has imported flair
from flair_nbddp.wire import payload
times = []
for _ in range({repeats}):
    started = time.perf_counter()
    payload.read_payload(sys.argv[1])
    times.append(time.perf_counter() - started)
print(sorted(times)[len(times) // 2])
"""


def measure(device: str | None, size: str, docs: int, repeats: int, workdir: Path) -> dict:
    from flair_nbddp import WorkerPool
    from flair_nbddp.demo import train_classifier
    from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer
    from flair_nbddp.wire import payload

    corpus = sentiment_corpus(n_train=docs, n_dev=32, n_test=32, words=(200, 260))
    model = tiny_transformer(workdir / f"model-{size}", size=size)
    args = (corpus, model, str(workdir / "training"))
    kwargs = {"max_epochs": 1, "mini_batch_size": 32, "learning_rate": 5e-5, "return_model": False}

    packs = []
    for _ in range(repeats):
        started = time.perf_counter()
        size_bytes = payload.write_payload(workdir / "payload.pkl", train_classifier, args, kwargs).nbytes
        packs.append(time.perf_counter() - started)
    unpack = subprocess.run(
        [sys.executable, "-c", UNPACK_PROGRAM.format(repeats=repeats), str(workdir / "payload.pkl")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip

    firsts = []
    with WorkerPool(device=device) as pool:
        pool.warm_up()
        for _ in range(repeats):
            time.sleep(BETWEEN_CELLS_S)
            firsts.append(pool.launch(train_classifier, args, kwargs, dashboard=False))
        world_size = pool.plan.world_size
    warm = statistics.median(result.time_to_first_batch for result in firsts)
    pack, unpack_s = statistics.median(packs), float(unpack.stdout.split()[-1])
    return {
        "warm_first_batch_s": warm,
        "warm_first_batch_runs_s": [result.time_to_first_batch for result in firsts],
        "pack_s": pack,
        "unpack_s": unpack_s,
        "rest_s": warm - pack - unpack_s,
        "payload_mb": size_bytes / 2**20,
        "world_size": world_size,
        "docs": docs,
        "size": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="tiny")
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    figures = measure(args.device, args.size, args.docs, args.repeats, Path(tempfile.mkdtemp()))
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
