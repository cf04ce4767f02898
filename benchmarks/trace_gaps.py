"""Where a traced training's device waits, and where its threads' time goes.

    python benchmarks/trace_gaps.py DIR      # DIR: what throughput.py wrote with BENCH_TRACE=DIR

Prints, from ``DIR/trace.json.gz`` (``torch.profiler``, each batch a ``batch#N`` range) and ``DIR/stacks.txt``
(every thread's Python stack sampled each millisecond):

* per traced batch, its wall time and the device's busy share (the union of its kernels, copies and fills);
* the device's idle time by the operator the training's thread was running meanwhile ("Python" when none);
* per thread, the share of its samples inside each phase of flair's training loop, and by the innermost frame of
  flair, flair_nbddp or transformers beside the innermost frame of all (what that code was calling).

Without a device in the trace (a CPU run) every batch counts as idle.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
OWN_CODE = ("flair/", "flair_nbddp/", "transformers/")
PHASES = (
    "forward_loss", "_backward", "store_embeddings", "step", "zero_grad", "dispatch", "__next__",
    "_TransformerBaseEmbeddings__build_transformer_model_inputs", "_TransformerBaseEmbeddings__gather_flair_tokens",
    "_add_embeddings_internal", "_forward_tensors", "clip_grad_norm_", "_scale_gradients", "_prepare_label_tensor",
)  # fmt: skip
SAMPLE_US = 10.0


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def innermost(ops: list[dict]) -> tuple[list[float], list[str]]:
    """One thread's operators as a timeline: segment starts, and the innermost operator's name in each."""
    starts: list[float] = []
    names: list[str] = []
    stack: list[dict] = []

    def close_until(at: float) -> None:  # the operators ended by ``at``: each end starts its caller's segment again
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= at:
            ended = stack.pop()
            starts.append(ended["ts"] + ended["dur"])
            names.append(stack[-1]["name"] if stack else "Python")

    for op in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        close_until(op["ts"])
        stack.append(op)
        starts.append(op["ts"])
        names.append(op["name"])
    close_until(float("inf"))
    return starts, names


def gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    found, at = [], start
    for a, b in busy:
        if b <= start or a >= end:
            continue
        if a > at:
            found.append((at, a))
        at = max(at, b)
    if at < end:
        found.append((at, end))
    return found


def device_report(folder: Path) -> None:
    with gzip.open(folder / "trace.json.gz") as trace:
        events = json.load(trace)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    batches = sorted((e for e in spans if str(e.get("name", "")).startswith("batch#")), key=lambda e: e["ts"])
    if not batches:
        sys.exit("no batch#N range in the trace")
    main_tid = batches[0]["tid"]
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in DEVICE_CATEGORIES])
    print(f"{'batch':>8} {'wall ms':>9} {'device busy':>12}")
    walls = busy_total = 0.0
    for batch in batches:
        start, end = batch["ts"], batch["ts"] + batch["dur"]
        inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
        walls, busy_total = walls + batch["dur"], busy_total + inside
        print(f"{batch['name'][6:]:>8} {batch['dur'] / 1000:9.2f} {100 * inside / batch['dur']:11.1f}%")
    print(f"{'mean':>8} {walls / len(batches) / 1000:9.2f} {100 * busy_total / walls:11.1f}%\n")

    ops = [e for e in spans if e.get("tid") == main_tid and e.get("cat") in ("cpu_op", "user_annotation")]
    ops = [e for e in ops if not e["name"].startswith("batch#")]
    starts, names = innermost(ops)
    idle: dict[str, float] = defaultdict(float)
    for batch in batches:
        for a, b in gaps(busy, batch["ts"], batch["ts"] + batch["dur"]):
            t = a
            while t < b:
                at = bisect.bisect_right(starts, t) - 1
                idle[names[at] if at >= 0 else "Python"] += min(SAMPLE_US, b - t)
                t += SAMPLE_US
    print(f"device idle {sum(idle.values()) / len(batches) / 1000:.2f} ms a batch; the training thread meanwhile:")
    for name, us in sorted(idle.items(), key=lambda item: -item[1])[:25]:
        print(f"  {us / len(batches) / 1000:8.2f} ms  {name}")
    print()


def stacks_report(folder: Path) -> None:
    threads: dict[str, Counter] = defaultdict(Counter)
    for line in (folder / "stacks.txt").read_text().splitlines():
        thread, stack, count = line.split("\t")
        threads[thread][stack] += int(count)
    for thread, stacks in threads.items():
        total = sum(stacks.values())
        phases: Counter = Counter()
        own: Counter = Counter()
        for stack, count in stacks.items():
            frames = stack.split(";")
            for phase in {frame.rsplit(":", 1)[1] for frame in frames} & set(PHASES):
                phases[phase] += count
            mine = [frame for frame in frames if any(part in frame for part in OWN_CODE)]
            own[f"{mine[-1] if mine else '-'}  ->  {frames[-1]}"] += count
        print(f"thread {thread}: {total} samples")
        for phase, count in phases.most_common():
            print(f"  {100 * count / total:5.1f}%  {phase}")
        print("  innermost own frame -> innermost frame:")
        for name, count in own.most_common(25):
            print(f"  {100 * count / total:5.1f}%  {name}")
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="what throughput.py wrote with BENCH_TRACE=DIR")
    folder = parser.parse_args().folder
    device_report(folder)
    stacks_report(folder)


if __name__ == "__main__":
    main()
