"""flair's own multi-GPU lifecycle, for parity checks: the test on CPU, ``benchmarks/parity.py`` on GPUs.

:func:`figures` runs this file as a script,

    python tests/flair_own_launcher.py DEVICE MODEL_PATH BASE_PATH KIND [KIND ...]

which runs ``parity_jobs.flair_main`` through ``flair.distributed_utils.launch_distributed`` (spawned ranks; each
seeds, builds the corpus and trains, kind after kind) and prints rank 0's figures as one JSON line. DEVICE ``cuda``
is flair's launcher as it is (one NCCL rank per GPU); ``cpu`` bends it only to 2 CPU processes over gloo, each with
the share of the cores the kit gives a CPU rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CPU_PROCESSES = 2
PREFIX = "FIGURES "


def figures(device: str, model_path: str, base_path: str, kinds: list[str]) -> dict:
    """Rank 0's figures for each of ``kinds``, trained by flair's own launcher in a fresh interpreter."""
    env = dict(os.environ)
    if device == "cpu":  # the kit gives each CPU rank its share of the cores: so must flair's ranks
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // CPU_PROCESSES)))
    command = [sys.executable, __file__, device, model_path, base_path, *kinds]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode or not lines:
        raise RuntimeError(f"flair's own launcher failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(PREFIX) :])


if __name__ in ("__main__", "__mp_main__"):  # the script, and its spawned ranks, which re-import it
    sys.path.insert(0, str(HERE))  # spawned ranks unpickle parity_jobs by reference
    from flair.distributed_utils import launch_distributed
    from parity_jobs import flair_main

    from flair_nbddp.worker.flair_compat import bend_flair_launcher_for_cpu

    if sys.argv[1] == "cpu":
        bend_flair_launcher_for_cpu(CPU_PROCESSES)

if __name__ == "__main__":
    print(PREFIX + json.dumps(launch_distributed(flair_main, sys.argv[4:], *sys.argv[2:4])))
