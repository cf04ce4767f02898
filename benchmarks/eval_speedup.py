"""Distributed evaluation: one dev evaluation with the whole split on every rank vs with each rank's share.

    python benchmarks/eval_speedup.py --device cpu --size tiny --docs 800                # 2 gloo ranks
    python benchmarks/eval_speedup.py --device cuda --size distilbert --docs 2000 --processes 1

On a warm pool, the same model (same seed) evaluates the same dev split of IMDB-length generated reviews,
once as flair does (``distributed_eval=False``: every rank evaluates the whole split) and once shared out
(each rank predicts its share of the batches, then every rank replays flair's evaluate). Jobs alternate,
``--repeats`` of each; a job times ``--evaluations`` evaluations after one warm-up evaluation. An
evaluation's time is the slowest rank's (the ranks go on together). Prints one JSON line with

    eval_speedup = median seconds, whole split on every rank / median seconds, shared out   (target >= 1.6 on 2 ranks)

and, on one process, where nothing is shared out, the same ratio as the check that it costs nothing
(``world_size_1_ratio``, target >= 1, within noise). The main scores of both ways must be identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def timed_evaluations(model_path: str, docs: int, batch: int, evaluations: int) -> dict:
    """On every rank: build the model, warm up, then time ``evaluations`` dev evaluations."""
    import time

    import torch.distributed as dist
    from flair.data import Dictionary
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(n_train=0, n_dev=docs, n_test=0, words=(200, 260), seed=7)
    dev = list(corpus.dev)
    labels = Dictionary(add_unk=False)
    for value in ("POSITIVE", "NEGATIVE"):
        labels.add_item(value)
    model = TextClassifier(
        TransformerDocumentEmbeddings(model_path, fine_tune=True), label_type="sentiment", label_dictionary=labels
    )
    model.eval()
    model.evaluate(dev[: 2 * batch], "sentiment", mini_batch_size=batch)  # warm-up: kernels, caches
    seconds = []
    for _ in range(evaluations):
        dist.barrier()
        started = time.perf_counter()
        result = model.evaluate(dev, "sentiment", mini_batch_size=batch)
        seconds.append(time.perf_counter() - started)
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, seconds)
    return {
        "seconds": [max(rank[i] for rank in every_rank) for i in range(evaluations)],
        "main_score": result.main_score,
        "loss": result.scores["loss"],
    }


def measure(device: str, size: str, processes: int, docs: int, batch: int, repeats: int, evaluations: int) -> dict:
    from flair_nbddp import WorkerPool
    from flair_nbddp.synthetic import tiny_transformer

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_transformer(Path(tmp) / f"model-{size}", size=size)
        runs: dict[str, list] = {"whole": [], "shared": []}
        with WorkerPool(processes, device) as pool:
            for repeat in range(repeats):
                for way in ("whole", "shared") if repeat % 2 == 0 else ("shared", "whole"):
                    result = pool.launch(timed_evaluations, (model, docs, batch, evaluations), dashboard=False,
                                         seed=1, distributed_eval=way == "shared")  # fmt: skip
                    runs[way].append(result.value)
    scores = {(run["main_score"], run["loss"]) for way in runs for run in runs[way]}
    seconds = {way: statistics.median(s for run in runs[way] for s in run["seconds"]) for way in runs}
    ratio = seconds["whole"] / seconds["shared"]
    return {
        "device": device, "size": size, "processes": processes, "docs": docs, "batch": batch,
        "whole_split_s": seconds["whole"], "shared_out_s": seconds["shared"],
        "eval_speedup" if processes > 1 else "world_size_1_ratio": ratio,
        "identical_scores": len(scores) == 1, "scores": sorted(scores),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", default="tiny", help="tiny_transformer size: tiny or distilbert")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--docs", type=int, default=800, help="dev split size (IMDB-length reviews)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="jobs of each way, alternating")
    parser.add_argument("--evaluations", type=int, default=3, help="timed evaluations per job")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    figures = measure(args.device, args.size, args.processes, args.docs, args.batch, args.repeats, args.evaluations)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
