"""Big corpora: worker memory, time to the first batch and throughput, lazy corpora against built ones.

    python benchmarks/big_corpus.py --quick --json big.json                      # 2 CPU ranks, tiny model
    python benchmarks/big_corpus.py --device cuda --size distilbert --json big.json

Corpora are generated IMDB-length reviews (200-260 words), built once here, as in a notebook. Measured, each
in the same run so that the ratios compare like with like:

* memory: each worker's peak resident memory (the kernel's high-water mark of the worker process, VmHWM) after
  reading every training sentence twice (two epochs' worth), on fresh workers, for two corpus sizes; the growth
  per 1,000 documents, lazy (target <= 10 MB) and built (``lazy_corpus=False``, for comparison);
* first batch: from the launch call to rank 0's first finished training batch, with 50,000 documents and with
  1,000 (``--quick``: 20,000), cold (a plain ``launch``: packing and new workers included) and warm (a pool,
  the corpus given as a ``PoolRef`` from ``pool.put``, which an earlier job has used): medians of interleaved
  runs, ratios large / small (target <= 1.3). The training function gets the label dictionary built in the notebook: flair's
  ``make_label_dictionary`` in the function reads every sentence, whatever the kit does;
* throughput: samples/s over the same batches, lazy / built (target >= 0.97), medians of interleaved runs
  on one warm pool.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable


def peak_memory(corpus) -> int:
    """Read every training sentence twice, then this worker's peak resident memory (VmHWM: ``ru_maxrss`` would
    include the parent's at the fork)."""
    for _ in range(2):
        for sentence in corpus.train:
            assert len(sentence) > 0
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def train_briefly(corpus, model_path: str, labels, base_path: str, batches: int, batch_size: int) -> int:
    """Fine-tune a TextClassifier for ``batches`` batches (every rank stops after the same one)."""
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins.base import TrainerPlugin, TrainingInterrupt

    class Enough(TrainerPlugin):
        @TrainerPlugin.hook
        def after_training_batch(self, batch_no: int, **_):
            if batch_no + 1 >= batches:
                raise TrainingInterrupt(f"enough: {batches} batches")

    classifier = TextClassifier(
        TransformerDocumentEmbeddings(model_path, fine_tune=True), label_type="sentiment", label_dictionary=labels
    )
    ModelTrainer(classifier, corpus).fine_tune(
        base_path, max_epochs=1, mini_batch_size=batch_size, learning_rate=5e-5, multi_gpu=True,
        plugins=[Enough()], save_final_model=False,
    )  # fmt: skip
    return batches


def build(docs: int):
    from flair_nbddp.synthetic import sentiment_corpus

    small = max(8, docs // 500)
    return sentiment_corpus(n_train=docs, n_dev=small, n_test=small, words=(200, 260), seed=0)


def memory(device, processes, sizes: tuple[int, int], built_sizes: tuple[int, int]) -> dict:
    from flair_nbddp import WorkerPool

    figures: dict = {}
    for lazy, (small, large) in ((True, sizes), (False, built_sizes)):
        peaks = {}
        for docs in (small, large):
            corpus = build(docs)
            with WorkerPool(processes, device) as pool:  # fresh workers: a peak is a high-water mark
                peaks[docs] = pool.launch(peak_memory, (corpus,), dashboard=False, lazy_corpus=lazy).value
            del corpus
        name = "lazy" if lazy else "built"
        figures[f"{name}_peak_mb"] = {docs: peak / 2**20 for docs, peak in peaks.items()}
        figures[f"{name}_growth_mb_per_1000_docs"] = (peaks[large] - peaks[small]) / 2**20 / ((large - small) / 1000)
    return figures


def first_batch(device, processes, sizes: tuple[int, int], model: str, workdir: Path, repeats: int) -> dict:
    from flair_nbddp import WorkerPool, launch

    figures: dict = {}
    corpora = {docs: build(docs) for docs in sizes}
    labels = corpora[sizes[0]].make_label_dictionary("sentiment", add_unk=False)
    job = dict(kwargs={"batches": 3, "batch_size": 16}, dashboard=False)
    times: dict[str, list[float]] = {}
    for _ in range(repeats):  # interleaved: the machine's drift hits both sizes alike
        for docs, corpus in corpora.items():
            args = (corpus, model, labels, str(workdir / f"cold-{docs}"))
            result = launch(train_briefly, args, device=device, processes=processes, **job)
            times.setdefault(f"cold_{docs}", []).append(result.time_to_first_batch)
    with WorkerPool(processes, device) as pool:
        refs = {}
        for docs, corpus in corpora.items():
            began = time.perf_counter()
            refs[docs] = pool.put(corpus)
            figures[f"put_{docs}_s"] = time.perf_counter() - began
            pool.launch(train_briefly, (refs[docs], model, labels, str(workdir / "warm")), **job)  # workers read it
        for _ in range(repeats + 1):
            for docs, ref in refs.items():
                result = pool.launch(train_briefly, (ref, model, labels, str(workdir / f"warm-{docs}")), **job)
                times.setdefault(f"warm_{docs}", []).append(result.time_to_first_batch)
    for name, runs in times.items():
        figures[f"{name}_runs_s"] = runs
        figures[f"{name}_s"] = statistics.median(runs)
    small, large = sizes
    figures["cold_first_batch_ratio"] = figures[f"cold_{large}_s"] / figures[f"cold_{small}_s"]
    figures["warm_first_batch_ratio"] = figures[f"warm_{large}_s"] / figures[f"warm_{small}_s"]
    return figures


def interleaved_throughput(
    device, processes, docs: int, batches: int, repeats: int, model: str, workdir: Path,
    variants: dict[str, Callable[[], dict]], ratio: str,
) -> dict:  # fmt: skip
    """samples/s of the same fine-tuning job on one warm pool (the corpus put once), each of the two variants in
    turn for ``repeats`` rounds after a warm-up job; ``variants`` maps a name to a function called just before its
    job, which returns that job's launch options. Figures: each variant's rates, and ``ratio``, the first's median
    over the second's."""
    from flair_nbddp import WorkerPool

    corpus = build(docs)
    labels = corpus.make_label_dictionary("sentiment", add_unk=False)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    with WorkerPool(processes, device) as pool:
        ref = pool.put(corpus)
        args = (ref, model, labels, str(workdir / "throughput"))
        job = dict(kwargs={"batches": batches, "batch_size": 16}, dashboard=False)
        pool.launch(train_briefly, args, **{**job, "kwargs": {"batches": 2, "batch_size": 16}})  # warm up
        for _ in range(repeats):
            for name, prepare in variants.items():
                rates[name].append(pool.launch(train_briefly, args, **job, **prepare()).samples_per_second)
    first, second = (statistics.median(runs) for runs in rates.values())
    figures = {f"{name}_samples_per_s": runs for name, runs in rates.items()}
    return {**figures, ratio: first / second, "throughput_docs": docs, "throughput_batches": batches}


def throughput(device, processes, docs: int, batches: int, repeats: int, model: str, workdir: Path) -> dict:
    variants = {"lazy": lambda: {"lazy_corpus": True}, "built": lambda: {"lazy_corpus": False}}
    return interleaved_throughput(
        device, processes, docs, batches, repeats, model, workdir, variants, "lazy_vs_built_throughput"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="tiny")
    parser.add_argument("--quick", action="store_true", help="smaller corpora and fewer repeats (a 2-core CPU machine)")
    parser.add_argument("--parts", default="memory,first_batch,throughput")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flair_nbddp.synthetic import tiny_transformer

    workdir = Path(tempfile.mkdtemp())
    model = str(tiny_transformer(workdir / f"model-{args.size}", size=args.size))
    large = 20000 if args.quick else 50000
    figures: dict = {"device": args.device, "size": args.size, "quick": args.quick}
    parts = args.parts.split(",")
    if "memory" in parts:
        figures |= memory(args.device, args.processes, (1000, large), (1000, 10000 if args.quick else 20000))
    if "first_batch" in parts:
        figures |= first_batch(args.device, args.processes, (1000, large), model, workdir, 2 if args.quick else 3)
    if "throughput" in parts:
        docs, batches, repeats = (2000, 40, 3) if args.quick else (8000, 150, 5)
        figures |= throughput(args.device, args.processes, docs, batches, repeats, model, workdir)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
