"""What flair's per-token bookkeeping costs a step, and what the kit's paths around it give: kit against plain loop.

    python benchmarks/bookkeeping.py --device cuda --json results/bookkeeping-h100.json      # one GPU, ~7 minutes
    python benchmarks/bookkeeping.py --device cpu --rounds 2 --json results/bookkeeping-cpu.json

Two jobs, each through ``throughput.py`` (fresh processes; the kit from a notebook-like program) and, on a GPU,
``plain_loop.py`` (a plain PyTorch loop on inputs tokenized before it: the device's pace without flair):

* ``classify``: a TextClassifier fine-tuning the transformer on generated reviews (on a GPU the DistilBERT-shaped
  model, 4,000 reviews of 230 words, 3 epochs; on CPU the tiny one, 800 reviews of 200-260 words on 2 ranks);
* ``tag``: a SequenceTagger (linear) fine-tuning the transformer's word embeddings, each word's first sub-token, on
  generated sentences of 40 words with names (on CPU, 800 of them on 2 ranks).

Each round runs, one after another: flair's own launcher (fp32); on CPU the kit with every default and with its
per-token paths off (``--no-direct-embeddings --no-skip-clean-tokens``); on a GPU the kit in fp32 (the classifier),
in bf16 with every default and with those paths off, in bf16 held to 2 cores (the classifier; ``taskset -c 0,1``,
an 8-GPU host's share) and the plain loop in bf16. Every run's figures
(samples/s, per epoch, each epoch's median batch, the pauses between epochs, CPU ms a sample, GPU busy) are written
after each run, so a run cut short keeps what came before it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OFF = ["--no-direct-embeddings", "--no-skip-clean-tokens"]


JOBS = {  # each job's arguments to throughput.py, by device, and plain_loop.py's for the same model and batches
    "cuda": {"classify": ["--size", "distilbert", "--docs", "4000", "--words", "230"],
             "tag": ["--task", "tag", "--size", "distilbert", "--docs", "4000", "--words", "40"]},
    "cpu": {"classify": ["--size", "tiny", "--docs", "800"],
            "tag": ["--task", "tag", "--size", "tiny", "--docs", "800", "--words", "40"]},
}  # fmt: skip


def runs(device: str, job: str) -> list[tuple[str, list[str]]]:
    """(label, command) of one round of ``job``."""
    arguments = JOBS[device][job]
    python = [sys.executable, str(HERE / "throughput.py"), "--device", device, *arguments, "--epochs", "3"]
    listed = [("flair fp32", [*python, "--launcher", "flair"])]
    if device == "cpu":
        return [*listed, ("kit fp32", [*python, "--launcher", "kit"]),
                ("kit fp32, flair's bookkeeping", [*python, "--launcher", "kit", *OFF])]  # fmt: skip
    bf16 = [*python, "--launcher", "kit", "--precision", "bf16"]
    if job == "classify":  # the figures the targets name: fp32 against flair's, and bf16 on 2 cores
        listed.append(("kit fp32", [*python, "--launcher", "kit"]))
    listed += [("kit bf16", bf16), ("kit bf16, flair's bookkeeping", [*bf16, *OFF])]
    if job == "classify" and shutil.which("taskset") and (os.cpu_count() or 1) > 2:
        listed.append(("kit bf16, 2 cores", ["taskset", "-c", "0,1", *bf16]))
    plain = [sys.executable, str(HERE / "plain_loop.py"), "--device", "cuda", *arguments]
    return [*listed, ("plain loop bf16", [*plain, "--modes", "train", "--epochs", "2", "--precision", "bf16"])]


def shown(command: list[str]) -> str:
    """The command as a reader runs it from the repository's root."""
    prefix = "OMP_NUM_THREADS=2 " if command[0] == "taskset" else ""
    return prefix + " ".join("python" if part == sys.executable else
                             f"benchmarks/{Path(part).name}" if part.endswith(".py") else part for part in command)


def measure(command: list[str]) -> dict:
    """The figures a run prints; a run held to 2 cores (``taskset``) gets 2 OpenMP threads too."""
    env = {**os.environ, **({"OMP_NUM_THREADS": "2"} if command[0] == "taskset" else {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"failed": done.stderr[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--jobs", default="classify,tag")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from predict_speed import machine

    from flair_nbddp.ledger.versions import versions

    record = {
        "measures": "Training throughput of two fine-tuning jobs (a classifier on document embeddings, a tagger on "
                    "word embeddings): flair's own launcher, the kit with every default, the kit with its per-token "
                    "paths off (direct_embeddings, skip_clean_tokens), and on a GPU the kit in bf16 held to 2 "
                    "cores and a plain PyTorch loop on inputs tokenized before it. Runs one after another, in "
                    "rounds.",
        "machine": machine(args.device), "versions": versions(), "started": time.strftime("%Y-%m-%d %H:%M"),
        "command": f"python benchmarks/bookkeeping.py --device {args.device} --rounds {args.rounds}",
        "jobs": {name: " ".join(arguments) for name, arguments in JOBS[args.device].items()}, "runs": [],
    }  # fmt: skip
    for round_ in range(1, args.rounds + 1):
        for job in args.jobs.split(","):
            for label, command in runs(args.device, job):
                figures = measure(command)
                record["runs"].append({"round": round_, "job": job, "run": label, **figures, "command": shown(command)})
                print(json.dumps(record["runs"][-1])[:400], flush=True)
                args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
