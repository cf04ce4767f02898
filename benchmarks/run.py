"""The benchmark suite: flair_nbddp measured against flair's own launcher and against itself, as ratios in one run.

    python benchmarks/run.py --quick --json results.json          # ~10 minutes on a 2-core CPU machine
    python benchmarks/run.py --device cuda --json results.json    # the full suite, e.g. on a GPU machine

Each part runs in fresh processes (the scripts beside this one) and prints a JSON line; this script
collects them, prints a table and writes every figure with the machine, versions and date. Ratios:

* ``kit_vs_flair_throughput``: samples/s through ``flair_nbddp.launch_distributed`` (a function from a
  file-less ``__main__``, corpus built once in the parent) / through flair's own ``launch_distributed``
  from a script (target >= 0.98, >= 0.95 on the noisy CPU quick run); medians of interleaved runs;
* ``dashboard_throughput_ratio``: samples/s with the live dashboard / without, in a real kernel (>= 0.97);
* ``pack_speedup_vs_cloudpickle``: cloudpickle's time to pack a generated corpus / the codec's (>= 10);
* ``warm_vs_cold_first_batch``: time to the first batch on a warm pool / a cold launch (<= 0.2).

The throughput part also runs the job through HF accelerate's ``notebook_launcher`` and on a warm
``WorkerPool`` (``kit_vs_accelerate_throughput``; samples/s and time to the first batch, from the start of
the program and from the launch call, for every launcher).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = {
    "kit_vs_flair_throughput": (">=", 0.98),
    "dashboard_throughput_ratio": (">=", 0.97),
    "pack_speedup_vs_cloudpickle": (">=", 10.0),
    "warm_vs_cold_first_batch": ("<=", 0.2),
}


def script(name: str, *args: str) -> dict:
    """Run ``benchmarks/<name>.py`` with ``args`` and return the figures it wrote with ``--json``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [sys.executable, str(HERE / f"{name}.py"), *args, "--json", str(out)]
        print("$ " + " ".join(command[1:-2]), file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode or not out.exists():
            sys.exit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        figures = json.loads(out.read_text())
    print(json.dumps(figures), file=sys.stderr, flush=True)  # each part's figures as soon as they exist
    return figures


LAUNCHERS = ("flair", "kit", "kit-pool", "accelerate")


def throughput(device: str, size: str, docs: int, repeats: int) -> dict:
    """Interleaved runs of the same training through each launcher; medians and the ratios between them."""
    runs: dict[str, list[dict]] = {launcher: [] for launcher in LAUNCHERS}
    common = ["--device", device, "--size", size, "--docs", str(docs), "--batch", "32"]
    for _ in range(repeats):
        for launcher in LAUNCHERS:
            runs[launcher].append(script("throughput", "--launcher", launcher, *common))
    figures: dict = {"throughput_runs": runs}
    for launcher, measured in runs.items():
        name = launcher.replace("-", "_")
        for figure in ("samples_per_s", "first_batch_s", "launch_to_first_batch_s", "cpu_ms_per_sample"):
            figures[f"{name}_{figure}"] = statistics.median(run[figure] for run in measured)
    figures["kit_vs_flair_throughput"] = figures["kit_samples_per_s"] / figures["flair_samples_per_s"]
    figures["kit_vs_accelerate_throughput"] = figures["kit_samples_per_s"] / figures["accelerate_samples_per_s"]
    return figures


def versions() -> dict:
    import accelerate
    import flair
    import torch

    import flair_nbddp

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flair": flair.__version__,
        "flair_nbddp": flair_nbddp.__version__,
        "accelerate": accelerate.__version__,
        "cpus": os.cpu_count(),
        "gpus": gpus,
        "platform": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: ~10 minutes on a 2-core CPU machine")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["FLAIR_NBDDP_DEVICE"] = args.device
    size = "distilbert" if args.device == "cuda" else "tiny"
    quick = args.quick
    figures: dict = {"quick": quick, "device": args.device, **versions()}
    figures |= throughput(args.device, size, docs=800 if quick else 4000, repeats=3)
    figures |= script("dashboard_cost", "--docs", "600" if quick else "2000", "--epochs", "2", "--repeats", "2")
    shipping = script("corpus_shipping", "--docs", "5000" if quick else "50000")
    figures |= {"corpus_shipping": shipping, **shipping["ratios"]}
    figures |= script("first_batch", "--device", args.device, "--size", size, "--docs", "400" if quick else "2000")

    print(f"\nflair_nbddp benchmarks ({'quick, ' if quick else ''}{args.device}; {figures['date']})")
    for name, (direction, target) in TARGETS.items():
        if quick and name == "kit_vs_flair_throughput":
            target = 0.95
        value = figures[name]
        met = value >= target if direction == ">=" else value <= target
        print(f"  {name:<30} {value:8.3f}   target {direction} {target:<5} {'met' if met else 'MISSED'}")
    print(f"  {'kit_vs_accelerate_throughput':<30} {figures['kit_vs_accelerate_throughput']:8.3f}")
    print(f"\n  {'launcher':<12} {'samples/s':>10} {'CPU ms/sample':>14} {'first batch after start':>24}"
          f" {'after the launch call':>22}")
    for launcher in LAUNCHERS:
        name = launcher.replace("-", "_")
        print(f"  {launcher:<12} {figures[name + '_samples_per_s']:10.1f} {figures[name + '_cpu_ms_per_sample']:14.2f}"
              f" {figures[name + '_first_batch_s']:22.1f} s {figures[name + '_launch_to_first_batch_s']:20.1f} s")
    print()
    for name in ("dashboard_on_samples_per_s", "dashboard_off_samples_per_s", "size_ratio_vs_cloudpickle",
                 "cold_first_batch_s", "warm_first_batch_s", "trivial_job_cold_s", "trivial_job_warm_s"):
        print(f"  {name:<30} {figures[name]:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
