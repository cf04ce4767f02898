"""flair's own multi-GPU lifecycle, for parity checks: the test on CPU, ``benchmarks/parity.py`` on GPUs.

    python tests/flair_own_launcher.py DEVICE MODEL_PATH BASE_PATH KIND [KIND ...]

runs ``parity_jobs.flair_main`` through ``flair.distributed_utils.launch_distributed`` (spawned ranks; each seeds,
builds the corpus and trains, kind after kind) and prints rank 0's figures as one JSON line. DEVICE ``cuda`` is
flair's launcher as it is (one NCCL rank per GPU); ``cpu`` bends it only to 2 CPU processes over gloo.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks unpickle parity_jobs by reference

from flair.distributed_utils import launch_distributed  # noqa: E402
from parity_jobs import flair_main  # noqa: E402

from flair_nbddp.flair_compat import bend_flair_launcher_for_cpu  # noqa: E402

if sys.argv[1] == "cpu":
    bend_flair_launcher_for_cpu(2)  # at import: spawned ranks re-import this script

if __name__ == "__main__":
    print("FIGURES " + json.dumps(launch_distributed(flair_main, sys.argv[4:], *sys.argv[2:4])))
