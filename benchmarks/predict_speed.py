"""Predicting with the kit against flair's own ``model.predict`` in one process, on the same reviews.

    python benchmarks/predict_speed.py --device cuda --size distilbert --docs 20000 --json FILE   # one GPU
    python benchmarks/predict_speed.py --device cpu --size tiny --docs 4000 --json FILE          # this 2-core CPU

A ``TextClassifier`` on a transformer built from a config (random weights: every class gets predicted), over
generated IMDB-length reviews, as ``Sentence`` objects built before timing. In rounds, each of:

* ``flair``: ``model.predict(sentences, mini_batch_size=32)`` in this process on ``--device`` (torch with every
  core on CPU), fp32;
* ``kit <precision>``: ``pool.predict(ref, sentences)`` on a warm pool (``--processes`` workers on ``--device``;
  the model put on the pool and loaded by one call before timing), for each of ``--precisions``. More processes than
  GPUs share them (``share_gpus=True``): several ranks, each paced by its own CPU core, predicting on one GPU.

Reported per mode and round: seconds, texts per second, the ratio to flair's same round, the GPU's busy share (NVML
every 0.1 s), the notebook process's CPU ms per 1,000 texts (what dealing, shipping and putting labels back cost
this process: the ceiling of the kit's rate over more GPUs); and from the first round, whether every label equals
flair's and the largest score difference. The first round is the fair one: from the second on, the pool's workers
find the reviews' encodings kept from the first (fast inputs), as a pool predicting the same texts again would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from throughput import IMDB_WORDS, word_range  # noqa: E402


class Busy:
    """The GPU's utilisation sampled every 0.1 s between ``start`` and ``stop`` (None on CPU)."""

    def __init__(self, device: str) -> None:
        self.handle = None
        if device == "cuda":
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)

    def __enter__(self) -> Busy:
        self.samples: list[int] = []
        self._done = threading.Event()
        if self.handle is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def __exit__(self, *_: object) -> None:
        self._done.set()

    @property
    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


def machine(device: str) -> dict:
    """The machine, as the Performance page names it."""
    import torch

    cores = os.cpu_count()
    if device != "cuda":
        return {"description": f"a {cores}-core x86-64 virtual machine, no GPU", "gpu": None, "gpus": 0,
                "cpu_cores": cores}  # fmt: skip
    gpu = torch.cuda.get_device_name(0)
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    return {"description": f"one {gpu}; host CPU {cpu}, {cores} cores", "gpu": gpu,
            "gpus": torch.cuda.device_count(), "cpu_cores": cores}  # fmt: skip


def publish(report: dict, path: Path | None) -> None:
    """Print the report, and write it to ``path`` if given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        path.write_text(text + "\n")


def labels(sentences: list) -> list[tuple[str, float]]:
    return [(s.get_labels("sentiment")[0].value, s.get_labels("sentiment")[0].score) for s in sentences]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="distilbert")
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--words", type=word_range, default=IMDB_WORDS)
    parser.add_argument("--processes", type=int, default=None, help="kit workers (default: 1 a GPU, 2 on CPU)")
    parser.add_argument("--precisions", default=None, help="kit precisions, comma-separated (default: fp32,bf16 on "
                        "GPU, fp32 on CPU)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/flair_nbddp-bench")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("FLAIR_NBDDP_LEDGER", "0")
    import flair
    import torch
    from flair.data import Sentence
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    import flair_nbddp
    from flair_nbddp.ledger.versions import versions
    from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

    processes = args.processes or (1 if args.device == "cuda" else 2)
    precisions = (args.precisions or ("fp32,bf16" if args.device == "cuda" else "fp32")).split(",")
    corpus = sentiment_corpus(n_train=args.docs, n_dev=1, n_test=1, words=args.words)
    texts = [sentence.to_plain_string() for sentence in corpus.train]
    path = tiny_transformer(Path(args.workdir) / f"model-{args.size}", size=args.size)
    torch.manual_seed(0)
    model = TextClassifier(TransformerDocumentEmbeddings(path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    model.eval()
    busy = Busy(args.device)
    modes: dict[str, dict] = {}

    def record(name: str, seconds: float, sentences: list, meter: Busy, cpu: float | None = None) -> None:
        figures = {"seconds": round(seconds, 3), "texts_per_second": round(len(sentences) / seconds, 1),
                   "gpu_busy_percent": meter.mean}  # fmt: skip
        if cpu is not None:
            figures["notebook_cpu_ms_per_1000_texts"] = round(cpu / len(sentences) * 1e6, 1)
        mode = modes.setdefault(name, {"rounds": []})
        mode["rounds"].append(figures)
        mode.setdefault("labels", labels(sentences))  # the first round's

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    with flair_nbddp.WorkerPool(processes, args.device, share_gpus=processes > gpus > 0) as pool:
        pool.warm_up()
        ref = pool.put(model)
        pool.predict(ref, texts[: 8 * args.batch], mini_batch_size=args.batch, dashboard=False)  # loads the model
        flair.device = torch.device(args.device)
        local = model.to(flair.device)
        for _ in range(args.rounds):
            sentences = [Sentence(text) for text in texts]
            with busy as meter:
                began = time.perf_counter()
                local.predict(sentences, mini_batch_size=args.batch)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                record("flair fp32", time.perf_counter() - began, sentences, meter)
            for precision in precisions:
                sentences = [Sentence(text) for text in texts]
                with busy as meter:
                    began, cpu = time.perf_counter(), time.process_time()
                    pool.predict(ref, sentences, mini_batch_size=args.batch, precision=precision, dashboard=False)
                    record(f"kit {precision}", time.perf_counter() - began, sentences, meter, time.process_time() - cpu)
    baseline = modes["flair fp32"]
    flair_labels = baseline.pop("labels")
    for name, figures in modes.items():
        if name.startswith("kit"):
            ours = figures.pop("labels")
            for round_, flairs in zip(figures["rounds"], baseline["rounds"]):
                round_["vs_flair"] = round(flairs["seconds"] / round_["seconds"], 2)
            figures["same_labels_as_flair"] = [value for value, _ in ours] == [value for value, _ in flair_labels]
            figures["largest_score_difference"] = max(abs(a[1] - b[1]) for a, b in zip(ours, flair_labels))
    report = {
        "measures": "Texts a second of flair_nbddp.predict on a warm pool against flair's model.predict in one "
        "process, on the same generated reviews (TextClassifier on a transformer built from a config).",
        "machine": machine(args.device),
        "versions": versions(),
        "command": f"python benchmarks/predict_speed.py --device {args.device} --size {args.size} --docs {args.docs} "
        f"--processes {processes} --precisions {','.join(precisions)} --rounds {args.rounds} --json FILE",
        "docs": args.docs, "words": list(args.words), "mini_batch_size": args.batch, "processes": processes,
        "modes": modes,
    }  # fmt: skip
    publish(report, args.json)


if __name__ == "__main__":
    main()
