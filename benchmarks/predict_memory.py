"""How much a predict call from a text file to a JSON Lines file grows the notebook process's memory.

    python benchmarks/predict_memory.py --texts 50000 --json FILE        # 2 CPU processes, a tiny transformer

Writes ``--texts`` generated IMDB-length reviews to a file, one a line, then calls ``flair_nbddp.predict(model, path,
output=...)`` while a thread samples this process's resident memory every 0.05 s. Reports the growth at its peak over
the memory before the call, the file sizes, and that the output has one row per line, in order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from predict_speed import machine, publish  # noqa: E402
from throughput import IMDB_WORDS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=50000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", default="/tmp/flair_nbddp-bench")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("FLAIR_NBDDP_LEDGER", "0")
    import psutil
    import torch
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier

    import flair_nbddp
    from flair_nbddp.ledger.versions import versions
    from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

    folder = Path(tempfile.mkdtemp(prefix="predict-memory-"))
    source, output = folder / "reviews.txt", folder / "reviews.jsonl"
    corpus = sentiment_corpus(n_train=args.texts, n_dev=1, n_test=1, words=IMDB_WORDS)
    with open(source, "w", encoding="utf-8") as handle:
        for sentence in corpus.train:
            handle.write(sentence.to_plain_string() + "\n")
    torch.manual_seed(0)
    model = TextClassifier(TransformerDocumentEmbeddings(tiny_transformer(Path(args.workdir) / "model-tiny")),
                           label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    del corpus
    import gc

    gc.collect()
    me = psutil.Process()
    before = me.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], me.memory_info().rss)

    threading.Thread(target=sample, daemon=True).start()
    began = time.perf_counter()
    predictions = flair_nbddp.predict(model, source, output=output, processes=args.processes, device=args.device,
                                      dashboard=False)  # fmt: skip
    seconds = time.perf_counter() - began
    done.set()
    peak[0] = max(peak[0], me.memory_info().rss)
    with open(source, encoding="utf-8") as texts, open(output, encoding="utf-8") as rows:
        in_order = all(json.loads(row)["text"] == text.rstrip("\n") for text, row in zip(texts, rows, strict=True))
    report = {
        "measures": "The growth of the notebook process's resident memory, at its peak, during a predict call from a "
        "text file to a JSON Lines file.",
        "machine": machine(args.device),
        "versions": versions(),
        "command": f"python benchmarks/predict_memory.py --texts {args.texts} --processes {args.processes} "
        f"--device {args.device} --json FILE",
        "texts": args.texts, "input_mb": round(source.stat().st_size / 1e6, 1),
        "output_mb": round(output.stat().st_size / 1e6, 1), "seconds": round(seconds, 1),
        "texts_per_second": round(predictions.texts_per_second, 1), "done": predictions.done,
        "rss_before_mb": round(before / 1e6, 1), "rss_growth_at_peak_mb": round((peak[0] - before) / 1e6, 1),
        "rows_in_input_order": in_order,
    }  # fmt: skip
    publish(report, args.json)


if __name__ == "__main__":
    main()
