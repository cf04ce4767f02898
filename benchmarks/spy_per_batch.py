"""A training thread's time per batch, by phase of its loop, from py-spy's samples of it.

The stack sampler of ``BENCH_TRACE`` runs in the traced process and can only sample while the training thread
lets go of the GIL; py-spy samples from outside. With ``--gil`` it keeps just the samples of the thread that holds
the GIL: the Python a batch costs (torch lets go of the GIL inside its operators). With ``--idle`` it keeps every
sample: the thread's wall time, waits and operators included, each put on the Python line that called them.
Record a run with::

    py-spy record --gil --threads --subprocesses --nonblocking --rate 500 --format speedscope -o kit.json -- \\
        python benchmarks/throughput.py --launcher kit --device cuda --size distilbert --docs 4000 --words 230 \\
        --epochs 3 --precision bf16
    python benchmarks/spy_per_batch.py kit.json --batches 375

    py-spy record ... -o plain.json -- python benchmarks/plain_loop.py --precision bf16 --modes train --epochs 2
    python benchmarks/spy_per_batch.py plain.json --batches 250 --loop train

The training thread is the thread, of any process in the file, with the most samples inside the function
``--loop`` (its name as py-spy gives it: ``Class.method`` for a method; flair's ``ModelTrainer.train_custom`` by
default). Its samples inside that loop (its innermost call, where it calls itself), and inside none of the functions
``--skip`` (an epoch's evaluation and model saving, by default), are divided by ``--batches``. Printed: that total
in ms a batch, the call tree below the loop ``--depth`` levels deep (by function), the innermost frames (by line),
and every other thread of that process with its samples' ms a batch over the whole run (with ``--gil``: the threads
contending with the training for the GIL; with ``--idle``: their wall time, waits included). Each sample counts
py-spy's nominal interval (``--rate``): where py-spy fell behind, the times come out short. A recording may be
gzipped (``.json.gz``).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

SKIPPED = "evaluate,_save_model,save,_publish_eval_result"


def frame_name(frame: dict, line: bool = True) -> str:
    """``function (file:line)``, the file from its package's folder on (without the line: ``function (file)``)."""
    path = frame["file"].rsplit("site-packages/", 1)[-1]
    for folder in ("/flair_nbddp/", "/benchmarks/"):
        if folder in path:
            path = folder[1:] + path.rsplit(folder, 1)[-1]
    return f"{frame['name']} ({path}:{frame['line']})" if line else f"{frame['name']} ({path})"


def thread_samples(profile: dict) -> list[tuple[list[int], float]]:
    return list(zip(profile["samples"], profile["weights"], strict=True))


def report(path: Path, batches: int, loop: str, skip: set[str], rows: int, depth: int, least: float) -> str:
    data = json.loads(gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes())
    frames = data["shared"]["frames"]

    def inside_loop(stack: list[int]) -> int | None:
        """The index in ``stack`` of the innermost frame of ``loop``, None when the sample is outside it."""
        return next((index for index in reversed(range(len(stack))) if frames[stack[index]]["name"] == loop), None)

    def loop_seconds(profile: dict) -> float:
        return sum(weight for stack, weight in thread_samples(profile) if inside_loop(stack) is not None)

    training = max(data["profiles"], key=loop_seconds)
    if loop_seconds(training) == 0:
        raise SystemExit(f"{path}: no thread has samples inside a function named {loop!r}")
    tree: dict = {}  # frame name -> [seconds, subtree]
    innermost: collections.Counter = collections.Counter()
    for stack, weight in thread_samples(training):
        at = inside_loop(stack)
        if at is None or any(frames[frame]["name"].rsplit(".", 1)[-1] in skip for frame in stack[at:]):
            continue
        node = tree
        for frame in stack[at + 1 : at + 1 + depth] or stack[at:]:
            entry = node.setdefault(frame_name(frames[frame], line=False), [0.0, {}])
            entry[0] += weight
            node = entry[1]
        innermost[frame_name(frames[stack[-1]])] += weight
    per_batch = 1000 / batches

    def branches(node: dict, indent: str) -> list[str]:
        shown = [(name, entry) for name, entry in node.items() if entry[0] * per_batch >= least]
        return [
            line
            for name, (seconds, below) in sorted(shown, key=lambda item: -item[1][0])
            for line in (f"  {seconds * per_batch:8.3f} ms  {indent}{name}", *branches(below, indent + "  "))
        ]

    lines = [
        f"{training['name']}: {sum(entry[0] for entry in tree.values()) * per_batch:.2f} ms a batch in py-spy's samples"
        f" inside {loop} ({batches} batches; skipped: {', '.join(sorted(skip))})",
        f"  by the frames the loop called, {depth} deep (each at least {least} ms a batch):",
        *branches(tree, ""),
        "  by the innermost frame:",
        *(f"  {seconds * per_batch:8.3f} ms  {name}" for name, seconds in innermost.most_common(rows)),
        "other threads of that process, over the whole run:",
    ]
    process = training["name"].split(" Thread ")[0]
    for profile in data["profiles"]:
        if profile is not training and profile["name"].startswith(process + " "):
            seconds = sum(profile["weights"])
            lines.append(f"  {seconds * per_batch:8.3f} ms a batch  {profile['name']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("speedscope", type=Path, help="py-spy record --threads --format speedscope output")
    parser.add_argument("--batches", type=int, required=True, help="training batches the run made")
    parser.add_argument("--loop", default="ModelTrainer.train_custom", help="the training loop's function, as named")
    parser.add_argument("--skip", default=SKIPPED, help="comma-separated functions whose samples are not the loop's")
    parser.add_argument("--rows", type=int, default=25, help="innermost frames shown")
    parser.add_argument("--depth", type=int, default=1, help="levels of the call tree below the loop shown")
    parser.add_argument("--least", type=float, default=0.05, help="the call tree's smallest node shown, ms a batch")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(report(args.speedscope, args.batches, args.loop, skip, args.rows, args.depth, args.least))


if __name__ == "__main__":
    main()
