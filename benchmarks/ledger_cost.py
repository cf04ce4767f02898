"""What the run ledger costs: training throughput recorded against unrecorded, and writing metric rows.

    python benchmarks/ledger_cost.py --device cpu --json ledger.json
    python benchmarks/ledger_cost.py --device cuda --size distilbert --processes 1 --json ledger.json

* throughput: samples/s of the same fine-tuning job on one warm pool, every job recorded in a fresh ledger
  against ``FLAIR_NBDDP_LEDGER=0``; medians of interleaved jobs, ratio ``ledger_throughput_ratio`` (target
  >= 0.98: recording costs no more than 2 %). Every batch records flair's ``train/batch_loss`` and learning
  rate, so the ledger takes a batch of metric rows about every second;
* rows: 100,000 metric rows written as the recorder writes them (one transaction per flush of 1,000 rows),
  ``ledger_100k_rows_s`` in seconds (target < 1), and in one transaction.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from big_corpus import (
    interleaved_throughput,  # this script's folder is on sys.path: it runs as a script
)


def ledger(switch: str) -> dict:
    """Turn the run ledger on ("1") or off ("0") for the next job; it takes no launch option."""
    os.environ["FLAIR_NBDDP_LEDGER"] = switch
    return {}


def throughput(device, processes, docs: int, batches: int, repeats: int, model: str, workdir: Path) -> dict:
    from flair_nbddp import history

    os.environ["FLAIR_NBDDP_HOME"] = str(workdir / "home")
    variants = {"recorded": lambda: ledger("1"), "unrecorded": lambda: ledger("0")}
    figures = interleaved_throughput(
        device, processes, docs, batches, repeats, model, workdir, variants, "ledger_throughput_ratio"
    )
    os.environ.pop("FLAIR_NBDDP_LEDGER")
    rows = [len(record.metrics()) for record in history(limit=None)]  # the warm-up job's too
    return {**figures, "metric_rows_per_recorded_job": rows}


def rows(workdir: Path) -> dict:
    from flair_nbddp.ledger.store import Ledger, RunRecord, process_identity
    from flair_nbddp.engine.state import MetricPoint

    figures = {}
    for name, batch in (("ledger_100k_rows_s", 1000), ("ledger_100k_rows_one_transaction_s", 100_000)):
        ledger = Ledger(workdir / f"rows-{batch}" / "runs.sqlite")
        run_id = ledger.insert(RunRecord(started_at=time.time(), name="rows", owner=process_identity()))
        points = [MetricPoint("train/batch_loss", 0.5, step, time.time()) for step in range(100_000)]
        began = time.perf_counter()
        for start in range(0, len(points), batch):
            ledger.append_metrics(run_id, points[start : start + batch])
        figures[name] = time.perf_counter() - began
        assert len(ledger.metrics(run_id)) == 100_000
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="tiny")
    parser.add_argument("--quick", action="store_true", help="fewer batches and repeats (a 2-core CPU machine)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flair_nbddp.synthetic import tiny_transformer

    workdir = Path(tempfile.mkdtemp())
    model = str(tiny_transformer(workdir / f"model-{args.size}", size=args.size))
    figures: dict = {"device": args.device, "size": args.size, "quick": args.quick}
    figures |= rows(workdir)
    batches, repeats = (60, 4) if args.quick else (150, 5)
    figures |= throughput(args.device, args.processes, 2000, batches, repeats, model, workdir)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
