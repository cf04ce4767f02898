"""What a rank that prints a lot costs the training: samples/s with rank 1 writing 1,000 lines a second vs quiet.

    python benchmarks/chatty_rank.py --device cpu --size tiny --docs 800

The same fine-tuning on a warm pool, alternating quiet jobs and jobs where a thread on rank 1 writes 1,000
lines a second to stderr, the costliest place: stderr goes through ``tee`` to the rank's log and its stderr
file, and the parent shows those lines in the cell (here: printed, ``dashboard=False``). Prints one JSON line
with the medians and

    chatty_rank_throughput_ratio = samples/s with the chatty rank / quiet    (target >= 0.95)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

LINES_PER_SECOND = 1000
WAYS = ("quiet", "to_devnull", "chatty")


def train_while_rank_1_chatters(way: str, *args, **kwargs):
    """flair_nbddp's demo training; rank 1 writes ``LINES_PER_SECOND`` lines a second to stderr (``way`` "chatty")
    or to /dev/null ("to_devnull": the cost of the writing alone), or nothing ("quiet")."""
    import sys
    import threading
    import time

    import torch.distributed as dist

    from flair_nbddp.demo import train_classifier

    done = threading.Event()
    target = sys.stderr if way == "chatty" else open("/dev/null", "w")  # noqa: SIM115 - closed with the process

    def chatter() -> None:
        written, started = 0, time.perf_counter()
        while not done.is_set():
            print(f"rank 1 says {written}: all is well", file=target, flush=True)
            written += 1
            time.sleep(max(0.0, started + written / LINES_PER_SECOND - time.perf_counter()))

    if way != "quiet" and dist.get_rank() == 1:
        threading.Thread(target=chatter, daemon=True).start()
    try:
        return train_classifier(*args, **kwargs)
    finally:
        done.set()


def measure(device: str, size: str, docs: int, repeats: int) -> dict:
    from flair_nbddp import WorkerPool
    from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

    with tempfile.TemporaryDirectory() as tmp:
        corpus = sentiment_corpus(n_train=docs, n_dev=16, n_test=16, words=(200, 260))
        model = tiny_transformer(Path(tmp) / f"model-{size}", size=size)
        kwargs = {"max_epochs": 1, "mini_batch_size": 16, "learning_rate": 5e-5, "return_model": False}
        rates: dict[str, list[float]] = {way: [] for way in WAYS}
        cell_lines: list[int] = []
        with WorkerPool(2, device) as pool:
            pool.launch(train_while_rank_1_chatters, ("quiet", corpus, model, str(Path(tmp) / "warm-up")), kwargs,
                        dashboard=False)  # fmt: skip
            for repeat in range(repeats):
                for way in WAYS if repeat % 2 == 0 else WAYS[::-1]:
                    result = pool.launch(
                        train_while_rank_1_chatters, (way, corpus, model, str(Path(tmp) / way)), kwargs, dashboard=False
                    )
                    rates[way].append(result.samples_per_second)
                    if way == "chatty":
                        cell_lines.append(sum(line.startswith("[rank 1] rank 1 says") for line in result.log.splitlines()))
    quiet, to_devnull, chatty = (statistics.median(rates[way]) for way in WAYS)
    return {
        "device": device, "size": size, "docs": docs, "repeats": repeats, "lines_per_second": LINES_PER_SECOND,
        "quiet_samples_per_s": quiet, "to_devnull_samples_per_s": to_devnull, "chatty_samples_per_s": chatty,
        "runs": rates, "chatty_lines_shown_in_the_cell": cell_lines,
        "chatty_rank_throughput_ratio": chatty / quiet, "writing_alone_throughput_ratio": to_devnull / quiet,
        "kit_relay_throughput_ratio": chatty / to_devnull,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--docs", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    figures = measure(args.device, args.size, args.docs, args.repeats)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
