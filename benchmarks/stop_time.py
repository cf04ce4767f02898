"""A stop's cost: how long the cell waits after the kernel's interrupt, where that time goes, and that the stop's
checkpoint resumes.

    python benchmarks/stop_time.py --device cuda --size distilbert --at-batch 10 --runs 2

A TextClassifier on a DistilBERT-sized transformer fine-tunes (AdamW: the full checkpoint holds the model and both
of AdamW's moment estimates) on generated reviews, one process per GPU (2 CPU processes with ``--device cpu``).
Once rank 0 has trained ``--at-batch`` batches, this process sends itself SIGINT, as the kernel's Interrupt does.
From the interrupt, it times the events the notebook gets (the stop's model saved, its full checkpoint written,
each rank's process gone, the result back), and in rank 0 the parts of its stop: writing the full checkpoint
(``torch.save`` into the file, ``fsync``) and flair's ``final-model.pt``. Then a run resumed from the stop's
checkpoint trains the epoch to its end, which shows the checkpoint is complete. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def train(corpus, model_path: str, base_path: str, batch: int) -> dict:
    """One epoch of fine-tuning; in rank 0, the seconds each part of a stop took (``parts``)."""
    import os as worker_os

    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    from flair_nbddp.worker import checkpoint_files

    parts: dict[str, float] = {}

    def timed(name, call):
        def run(*args, **kwargs):
            started = time.monotonic()
            try:
                return call(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.monotonic() - started

        return run

    from flair_nbddp.worker import checkpoints

    checkpoints.write = timed("checkpoint_write_s", checkpoints.write)
    checkpoint_files.os.fsync = timed("fsync_s", worker_os.fsync)
    model = TextClassifier(
        TransformerDocumentEmbeddings(model_path, fine_tune=True), label_type="sentiment",
        label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
    )  # fmt: skip
    trainer = ModelTrainer(model, corpus)
    trainer._save_model = timed("final_model_save_s", trainer._save_model)
    scores = trainer.fine_tune(base_path, max_epochs=1, mini_batch_size=batch, learning_rate=5e-5, multi_gpu=True)
    return {"test_score": scores.get("test_score"), "parts": parts}


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stopped_run(corpus, args, base: str, run_index: int) -> dict:
    import flair_nbddp

    run = flair_nbddp.start(train, (corpus, args.model, base, args.batch), device=args.device, seed=run_index)
    seen: dict[str, float] = {}
    returned_event = threading.Event()

    def watch() -> None:
        written = None
        while not returned_event.is_set():
            snapshot = run.state.snapshot()
            now = time.monotonic()
            if "interrupt" not in seen and snapshot.ranks[0].step >= args.at_batch:
                written = len(snapshot.checkpoints)
                seen["interrupt"] = now
                os.kill(os.getpid(), signal.SIGINT)
            elif "interrupt" in seen:
                if snapshot.checkpoint and "model_saved" not in seen:
                    seen["model_saved"] = now
                if len(snapshot.checkpoints) > written and "checkpoint_written" not in seen:
                    seen["checkpoint_written"] = now
                if run.state.all_finished():
                    seen.setdefault("ranks_finished", now)
                if run.state.ended_at:
                    seen.setdefault("run_ended", now)
                for rank in snapshot.ranks:
                    if rank.pid is not None and f"rank{rank.rank}_exited" not in seen and not _running(rank.pid):
                        seen[f"rank{rank.rank}_exited"] = now
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = run.wait()
    returned = time.monotonic()
    returned_event.set()
    watcher.join()
    since = {name: round(at - seen["interrupt"], 3) for name, at in seen.items() if name != "interrupt"}
    since["result_returned"] = round(returned - seen["interrupt"], 3)
    checkpoint = result.checkpoints[-1] if result.checkpoints else None
    figures = {
        "status": result.status,
        "interrupted_at_batch": args.at_batch,
        "seconds_after_interrupt": since,
        "checkpoint_bytes": checkpoint.path.stat().st_size if checkpoint else 0,
        "checkpoint_batch": checkpoint.batch if checkpoint else None,
    }
    if result.value:
        figures["rank0_parts_s"] = {name: round(value, 3) for name, value in result.value["parts"].items()}
    if args.resume and checkpoint is not None:
        resumed = flair_nbddp.launch(train, (corpus, args.model, base, args.batch), device=args.device,
                                     seed=run_index, resume=result, dashboard=False)  # fmt: skip
        figures["resumed"] = {"status": resumed.status, "resumed_at": resumed.resumed_at,
                              "test_score": resumed.value["test_score"]}  # fmt: skip
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="distilbert")
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--at-batch", type=int, default=10)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-resume", dest="resume", action="store_false", help="skip the resumed run")
    parser.add_argument("--workdir", default="/tmp/flair_nbddp-bench")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from throughput import make_corpus

    from flair_nbddp.synthetic import tiny_transformer

    args.model = tiny_transformer(Path(args.workdir) / f"model-{args.size}", size=args.size)
    corpus = make_corpus(args.docs)
    runs = [stopped_run(corpus, args, f"{args.workdir}/stop-{index}", index) for index in range(args.runs)]
    figures = {"device": args.device, "size": args.size, "docs": args.docs, "batch": args.batch, "runs": runs}
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
