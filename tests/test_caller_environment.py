"""The suite passes whatever the shell that runs it exports (``OMP_NUM_THREADS=1`` in a job script,
``CUDA_VISIBLE_DEVICES`` on a shared server, the kit's own ``FLAIR_NBDDP_*`` from a user's profile).

``tests/conftest.py`` sets what the whole test run depends on and removes what would change what the kit does; this
runs the fast tests that depend on those variables in a pytest of their own, with all of them exported at once.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the fast tests (and doctests) that read these variables, and what each depends on
ENVIRONMENT_SENSITIVE = (
    # OMP_NUM_THREADS unset; FLAIR_NBDDP_PROCESSES=2
    "tests/test_sweeps.py::test_cpu_processes_get_a_slots_share_of_the_cores_alone_or_side_by_side",
    # FLAIR_NBDDP_PROCESSES=2
    "tests/test_sweeps.py::test_cpu_runs_hold_process_slots_out_of_the_cpus_two",
    "tests/test_sweeps.py::test_lanes_split_the_devices_and_refuse_what_cannot_be_split",
    "flair_nbddp/engine/devices.py::flair_nbddp.engine.devices.cpu_slots",
    "flair_nbddp/sweeps/lanes.py::flair_nbddp.sweeps.lanes",
    # FLAIR_NBDDP_DEVICE=cpu (no GPU here)
    "tests/test_magic.py::test_unpicklable_variable_is_named_with_its_path_and_the_fix",
    "tests/test_panel.py::test_the_fixed_run_options_reach_every_run",
)


def caller_environment(tmp_path: Path) -> dict[str, str]:
    """What a user's shell might export, every variable the kit or the suite reads set otherwise than they need."""
    return {
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "0",
        "GLOO_SOCKET_IFNAME": "no-such-interface",
        "NCCL_SOCKET_IFNAME": "no-such-interface",
        "FLAIR_NBDDP_PROCESSES": "4",
        "FLAIR_NBDDP_DEVICE": "cuda",
        "FLAIR_NBDDP_SEED": "3",
        "FLAIR_NBDDP_RUNS": str(tmp_path / "runs"),
        "FLAIR_NBDDP_LEDGER": "0",
        "FLAIR_NBDDP_HOME": str(tmp_path / "home"),
        "FLAIR_NBDDP_TEST_TIER": "fast",
        "HF_HUB_OFFLINE": "0",
    }


@pytest.mark.process  # a pytest of its own: seconds of imports
def test_the_tests_that_read_the_environment_pass_whatever_the_caller_exports(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTEST_", "FLAIR_NBDDP_"))}
    env.update(caller_environment(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ENVIRONMENT_SENSITIVE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    assert f"{len(ENVIRONMENT_SENSITIVE)} passed" in done.stdout, done.stdout[-2000:]
    assert not (tmp_path / "home").exists() and not (tmp_path / "runs").exists()  # the user's own: left alone
