"""Several processes of one GPU machine launching with the defaults: no two runs land on one GPU unasked.

    python benchmarks/claims_on_gpu.py --json benchmarks/results/claims-h100.json      # on a machine with a GPU

Four processes, each as a notebook's kernel would (``launch(busy, ...)`` with every device option left out), in a
claim directory of their own, while this process samples NVML every 0.1 s (which processes use each GPU):

1. ``first`` trains on the GPU (matrix products) for ``--hold`` seconds;
2. ``refused`` launches while it runs, with the defaults: refused with ``RunActiveError``, naming ``first``;
3. ``shared`` asks for the same GPU with ``gpus=[0], share_gpus=True`` while ``first`` runs: it runs beside it,
   sharing it on purpose, and says with whom;
4. ``waiting`` launches with ``wait_for_devices``: it waits in the machine's queue and starts once ``first`` and
   ``shared`` have ended.

The report gives each process's outcome and the lines the kit printed, when each run's work began and ended, and
from the samples the most kit workers seen on the GPU at once without ``share_gpus`` (1 means never two).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def busy(seconds: float, marker: str) -> dict:
    """A rank's work: matrix products on its GPU for ``seconds``; ``marker`` is written once it has begun."""
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    began = time.time()
    Path(marker).write_text(str(os.getpid()))
    while time.time() - began < seconds:
        x = torch.tanh(x @ x)
        torch.cuda.synchronize()
    return {"pid": os.getpid(), "began": began, "ended": time.time(), "gpu": torch.cuda.get_device_name(0)}


def role(name: str, hold: float, marker: str) -> None:
    """One process's launch, its outcome printed as a JSON line."""
    import contextlib
    import io

    import flair_nbddp

    options = {"share": {"gpus": [0], "share_gpus": True}, "waiting": {"wait_for_devices": 600.0}}.get(name, {})
    printed = io.StringIO()
    asked = time.time()
    try:
        with contextlib.redirect_stdout(printed):
            result = flair_nbddp.launch(busy, (hold, marker), dashboard=False, **options)
        plan = f"{result.world_size} × {result.device_type}"
        outcome = {"outcome": result.status, "value": result.value, "plan": plan}
    except flair_nbddp.RunActiveError as error:
        outcome = {"outcome": "refused", "error": str(error)}
    lines = [line for line in printed.getvalue().splitlines() if line.startswith("flair_nbddp:")]
    print(json.dumps({"role": name, "asked": asked, **outcome, "said": lines}), flush=True)


def start(name: str, hold: float, marker: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--role", name, "--hold", str(hold), "--marker", str(marker)],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip


def sample(nvml, handles) -> list[list[int]]:
    return [[entry.pid for entry in nvml.nvmlDeviceGetComputeRunningProcesses(handle)] for handle in handles]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--marker", help=argparse.SUPPRESS)
    parser.add_argument("--hold", type=float, default=20.0, help="seconds the first run keeps the GPU busy")
    parser.add_argument("--json", type=Path, help="write the report there")
    args = parser.parse_args()
    if args.role:
        return role(args.role, args.hold, args.marker)
    import pynvml
    import torch

    import flair_nbddp

    work = Path(tempfile.mkdtemp(prefix="claims-on-gpu-"))
    env = {**os.environ, "FLAIR_NBDDP_CLAIMS": str(work / "claims"), "PYTHONPATH": os.pathsep.join(
        filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    env.pop("FLAIR_NBDDP_PROCESSES", None), env.pop("FLAIR_NBDDP_DEVICE", None)
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    samples: list[tuple[float, list[list[int]]]] = []
    processes = {}

    def watch_until(condition, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("a role did not get there in time")
            samples.append((time.time(), sample(pynvml, handles)))
            time.sleep(0.1)

    markers = {name: work / f"{name}.began" for name in ("first", "refused", "share", "waiting")}
    processes["first"] = start("first", args.hold, markers["first"], env)
    watch_until(markers["first"].exists, 300)
    processes["refused"] = start("refused", 5.0, markers["refused"], env)
    processes["share"] = start("share", args.hold / 4, markers["share"], env)
    watch_until(lambda: processes["refused"].poll() is not None
                and (markers["share"].exists() or processes["share"].poll() is not None), 300)  # fmt: skip
    processes["waiting"] = start("waiting", args.hold / 4, markers["waiting"], env)
    watch_until(lambda: all(process.poll() is not None for process in processes.values()), 900)
    outcomes = {name: json.loads(process.stdout.read().strip().splitlines()[-1]) for name, process in processes.items()}
    ran = {name: (outcome["value"]["began"], outcome["value"]["ended"]) for name, outcome in outcomes.items()
           if outcome.get("value")}  # fmt: skip

    def most_processes(began: float, ended: float) -> int:
        """The most processes NVML saw on the GPU between ``began`` and ``ended``; -1: no sample there."""
        return max((sum(map(len, gpus)) for at, gpus in samples if began <= at <= ended), default=-1)
    report = {
        "measures": "Four processes of one GPU machine each launching a run as a notebook would, with the defaults "
        "(every free GPU), one asking to share, one to wait: what each got, and NVML's view of the GPU every 0.1 s.",
        "machine": {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                    "cpu_cores": os.cpu_count()},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "flair_nbddp": flair_nbddp.__version__},
        "command": f"python benchmarks/claims_on_gpu.py --hold {args.hold:g} --json FILE",
        "outcomes": outcomes,
        "samples": len(samples),
        "most_processes_on_the_gpu": {
            # from first's start until share was asked (refused starts no worker; share's takes seconds to start)
            "while first worked alone": most_processes(ran["first"][0], outcomes["share"]["asked"]),
            "while first and share worked": most_processes(*ran["share"]),
            "while waiting worked": most_processes(*ran["waiting"]),
        },
        "waiting_began_after_first_and_share_ended": "waiting" in ran
        and ran["waiting"][0] >= max(end for name, (_, end) in ran.items() if name != "waiting"),
    }  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
