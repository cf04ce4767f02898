"""What a full checkpoint at every epoch's end costs a training.

    python benchmarks/checkpoint_cost.py --device cpu --size tiny --docs 800
    python benchmarks/checkpoint_cost.py --device cuda --size distilbert --docs 4000
    python benchmarks/checkpoint_cost.py --device cuda --size distilbert --docs 4000 --amp
    python benchmarks/checkpoint_cost.py --writer-stalls 800

One process fine-tunes the throughput benchmark's job (a ``TextClassifier`` on IMDB-length generated reviews,
batch 32) with the kit's checkpoint plugin, as every rank of a run has it, and times per epoch: the training
(first batch to last), the part of each checkpoint the training waits for (gathering the generators, copying the
states where they are, waiting for the previous file) with the pinned host memory blocks torch made meanwhile (on
CUDA, with a torch that has ``torch.cuda.host_memory_stats``), and the writer thread's ``torch.save`` and rename,
which overlap the next epoch. The cost to training is the first part over the epoch; the write must take less than
an epoch to stay out of the way.

``--writer-stalls MB`` measures instead what the writer takes from the training's thread on the host: it writes a
checkpoint of MB megabytes (100 float tensors, about DistilBERT's model and Adam states at 800) with the kit's
writer while another Python thread counts to 1,000 over and over, and sums the gaps between its rounds longer
than 4 ms (the GIL held by the writer). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def measure(args) -> dict:
    import flair
    import torch
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin
    from throughput import make_corpus

    from flair_nbddp.synthetic import tiny_transformer
    from flair_nbddp.worker.checkpoint_files import NAME
    from flair_nbddp.worker.checkpoints import Checkpointing

    flair.device = torch.device(args.device)
    flair.set_seed(42)
    workdir = Path(args.workdir)
    model_path = tiny_transformer(workdir / f"model-{args.size}", size=args.size)
    corpus = make_corpus(args.docs)
    model = TextClassifier(TransformerDocumentEmbeddings(model_path, fine_tune=True), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    epochs: list[dict] = []

    class Epochs(TrainerPlugin):
        @TrainerPlugin.hook
        def after_training_batch(self, **_):
            if args.device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            epochs[-1].setdefault("first_batch", now)
            epochs[-1]["last_batch"] = now

        @TrainerPlugin.hook
        def before_training_epoch(self, epoch, **_):
            epochs.append({"epoch": epoch})

    writes: dict[int, float] = {}
    plugin = Checkpointing(workdir / NAME, 0, lambda value: [value], lambda *_: None)
    write, write_file = plugin._write, plugin._write_file

    counted = args.device == "cuda" and hasattr(torch.cuda, "host_memory_stats")  # not in older torch

    def pinned_blocks_made():
        return torch.cuda.host_memory_stats()["num_host_alloc"] if counted else 0

    def timed_write(epoch):
        made, started = pinned_blocks_made(), time.perf_counter()
        write(epoch)
        epochs[epoch - 1]["checkpoint_wait_s"] = time.perf_counter() - started  # rows are epochs 1, 2...
        epochs[epoch - 1]["pinned_blocks_made"] = pinned_blocks_made() - made if counted else None

    def timed_write_file(epoch, *rest):
        started = time.perf_counter()
        write_file(epoch, *rest)
        writes[epoch] = time.perf_counter() - started

    plugin._write, plugin._write_file = timed_write, timed_write_file
    ModelTrainer(model, corpus).fine_tune(
        workdir / "train", max_epochs=args.epochs, mini_batch_size=args.batch, learning_rate=5e-5, use_amp=args.amp,
        plugins=[Epochs(), plugin], save_final_model=False, create_file_logs=False, create_loss_file=False,
    )  # fmt: skip
    rows = []
    for row in epochs:
        train_s = row["last_batch"] - row["first_batch"]
        wait_s = row.get("checkpoint_wait_s", 0.0)
        rows.append({"epoch": row["epoch"], "train_s": train_s, "checkpoint_wait_s": wait_s,
                     "pinned_blocks_made": row.get("pinned_blocks_made"), "write_s": writes.get(row["epoch"]),
                     "cost": wait_s / train_s})  # fmt: skip
    return {
        "device": args.device, "size": args.size, "docs": args.docs, "batch": args.batch, "amp": args.amp,
        "checkpoint_mb": (workdir / NAME).stat().st_size / 2**20, "epochs": rows,
        "cost_per_epoch": max(row["cost"] for row in rows),
        "write_over_epoch": max((row["write_s"] or 0) / row["train_s"] for row in rows),
    }  # fmt: skip


def writer_stalls(megabytes: int, workdir: Path) -> dict:
    """The gaps a counting Python thread sees while the kit's writer writes ``megabytes`` of tensors."""
    import threading

    import torch

    from flair_nbddp.worker.checkpoint_files import write

    checkpoint = {f"t{index}": torch.randn(megabytes * 2**20 // 400) for index in range(100)}
    done, gaps = threading.Event(), []

    def count() -> None:
        last = time.perf_counter()
        while not done.is_set():
            total = 0
            for step in range(1000):
                total += step
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.2)
    started = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    write(workdir / "stalls.pt", checkpoint)
    write_s = time.perf_counter() - started
    done.set()
    counter.join()
    stalls = [gap for gap in gaps if gap > 0.004]
    return {"megabytes": megabytes, "write_s": write_s, "stalls_over_4ms": len(stalls), "stalled_s": sum(stalls),
            "longest_gap_s": max(gaps)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="distilbert")
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--amp", action="store_true", help="flair's use_amp (the kit's fp16): a gradient scaler")
    parser.add_argument("--workdir", default="/tmp/flair_nbddp-checkpoint-cost")
    parser.add_argument("--writer-stalls", type=int, default=None, metavar="MB",
                        help="only the writer's stalls of another thread, for a checkpoint of MB megabytes")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.writer_stalls:
        figures = writer_stalls(args.writer_stalls, Path(args.workdir))
    else:
        figures = measure(args)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
