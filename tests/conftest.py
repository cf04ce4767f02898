"""Shared fixtures, and the test tiers.

Every test belongs to one tier. ``process`` (starts worker processes), ``kernel`` (starts a Jupyter kernel),
``browser`` (JupyterLab in headless Chromium), ``cluster`` (a Dask scheduler and workers on 127.0.0.1) and ``docs``
(the documentation site built in strict mode) are marked in the test files; every other test is in the fast tier,
and a fast test that starts workers, ranks on a cluster or a kernel fails with the marker to add.
``make test-fast`` runs the fast tier (with the package's doctests), ``make test`` all of them.

The suite passes whatever the shell that runs it exports: before anything reads them, this file sets for the whole
test run (and for the workers, kernels and notebooks it starts, which inherit them) what every test depends on,
overriding the caller's value:

* ``FLAIR_NBDDP_DEVICE=cpu`` and ``FLAIR_NBDDP_PROCESSES=2``: tests rehearse DDP on CPU with gloo and 2 processes,
  whatever the machine has;
* ``HF_HUB_OFFLINE=1``: nothing is downloaded (the models are made on the spot);
* ``FLAIR_NBDDP_HOME``: a new temporary directory, so the run ledger and the sweeps' studies are never the user's own;
* ``FLAIR_NBDDP_CLAIMS``: a new temporary directory, so the devices a test's runs hold are claimed apart from the
  machine's other kernels (and from the other test process); the tests of claims across kernels share theirs;

and removes the variables whose mere presence changes what the kit does:

* every other ``FLAIR_NBDDP_*``: ``FLAIR_NBDDP_SEED`` (the seed of a run given none), ``FLAIR_NBDDP_RUNS`` (where
  run directories go), ``FLAIR_NBDDP_LEDGER`` (``0`` turns the ledger off), ``FLAIR_NBDDP_TEST_TIER`` (set below
  for the fast tier only);
* ``OMP_NUM_THREADS``: a CPU rank takes the user's value instead of its share of the cores;
* ``CUDA_VISIBLE_DEVICES``: chosen GPUs are named through it;
* ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``: ranks talk on another interface than loopback.

A test that depends on another value of one of these sets it with ``monkeypatch``;
``tests/test_caller_environment.py`` runs the tests that depend on them with all of them exported.
"""

import contextlib
import os
import signal
import sys
import tempfile
import time

# The test run's environment (see above), before anything (the kit, torch, huggingface_hub) is imported and reads it.
CALLER_VARIABLES = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
for _name in [name for name in os.environ if name.startswith("FLAIR_NBDDP_") or name in CALLER_VARIABLES]:
    del os.environ[_name]
os.environ.update(
    FLAIR_NBDDP_DEVICE="cpu",
    FLAIR_NBDDP_PROCESSES="2",
    HF_HUB_OFFLINE="1",
    FLAIR_NBDDP_HOME=tempfile.mkdtemp(prefix="flair_nbddp-test-home-"),
    FLAIR_NBDDP_CLAIMS=tempfile.mkdtemp(prefix="flair_nbddp-test-claims-"),
)

import psutil  # noqa: E402
import pytest  # noqa: E402

from flair_nbddp.cluster.ranks import ClusterGroup  # noqa: E402
from flair_nbddp.engine.local_ranks import WorkerGroup  # noqa: E402
from flair_nbddp.worker.process_name import RANK_PREFIX as WORKER_NAME_PREFIX  # noqa: E402

# A shell starts a background job (`make test &`, nohup) with SIGINT ignored, and every process it starts inherits
# that: the interrupt tests (interrupt_main here, SIGINT to programs and kernels) would interrupt nothing. Tests
# interrupt as the kernel's Interrupt does, so this process, and what it starts, take SIGINT as Python does.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
SLOW_TIERS = ("process", "kernel", "browser", "cluster", "docs")
TIER_ENV = "FLAIR_NBDDP_TEST_TIER"


@pytest.fixture(autouse=True)
def _fast_tests_start_nothing(request, monkeypatch):
    """A fast test may not start worker processes (nor, through ``jupyter_kernel``, a kernel)."""
    if any(request.node.get_closest_marker(tier) for tier in SLOW_TIERS):
        return

    def refuse(self, *preload):
        marker = "cluster" if isinstance(self, ClusterGroup) else "process"
        raise AssertionError(f"this fast-tier test started worker processes: mark it @pytest.mark.{marker}")

    monkeypatch.setattr(WorkerGroup, "start", refuse)
    monkeypatch.setattr(ClusterGroup, "start", refuse)
    monkeypatch.setenv(TIER_ENV, "fast")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from flair_nbddp.synthetic import tiny_transformer

    return tiny_transformer(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """The test run's one JupyterLab, started for the first browser test (``browser.lab`` hands it to each)."""
    from browser import jupyter_lab

    with jupyter_lab(tmp_path_factory.mktemp("lab")) as server:
        yield server


# `pytest -n 2` runs the suite in two processes (pytest-xdist), each taking the next unit of work when it runs
# low: a test file (its module fixtures are set up once), or all the browser tests (one JupyterLab). The units go
# longest first, so that neither process waits for the other at the end: the notebooks, the Binder build, then the
# tiers from the slowest to the fast one.
LONGEST_FIRST = ("tests/test_notebooks.py", "tests/test_binder.py")
TIERS_BY_LENGTH = ("kernel", "browser", "cluster", "process", "docs")  # then the fast tier
BROWSER_UNIT = "the browser tests"


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to."""
    path = nodeid.split("::", 1)[0]
    return BROWSER_UNIT if path.endswith("_browser.py") else path


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """The units of work longest first, each unit's tests in their own order."""
    ranks: dict[str, int] = {}
    for item in items:
        unit = work_unit(item.nodeid)
        if unit in LONGEST_FIRST:
            rank = LONGEST_FIRST.index(unit)
        else:
            tiers = [i for i, tier in enumerate(TIERS_BY_LENGTH) if item.get_closest_marker(tier)]
            rank = len(LONGEST_FIRST) + min(tiers, default=len(TIERS_BY_LENGTH))
        ranks[unit] = min(rank, ranks.get(unit, rank))
    items.sort(key=lambda item: ranks[work_unit(item.nodeid)])  # stable: the rest keeps the collection's order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out whole units of work, in the collection's order (above)."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return Units(config, log)


_WARM_POOLS = []  # the session's warm pool, once a test asked for it: its workers are nobody's leftovers


@pytest.fixture(scope="session")
def warm_pool():
    """Two warm CPU workers for the process tests that are about what a run does, not about starting workers: a
    cold launch costs each such test seconds (new interpreters importing torch and flair). A job that fails or is
    stopped makes the pool start its next job on fresh workers, as it does for users."""
    from flair_nbddp import WorkerPool

    with WorkerPool(2, "cpu") as pool:
        pool.warm_up()
        _WARM_POOLS.append(pool)
        yield pool
        _WARM_POOLS.remove(pool)


@pytest.fixture
def no_leftover_processes():
    """Fails the test if it leaves a child process of this one running (one that was there before it started,
    such as the test run's JupyterLab; nor is a worker of the session's warm pool, or a fork server that CPU workers
    come from)."""
    from flair_nbddp.engine import forkserver

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    yield
    others = before | {pid for pool in _WARM_POOLS for pid in pool.pids}
    others |= forkserver.server_pids()
    left = {}
    for child in psutil.Process().children(recursive=True):
        if child.pid not in others:
            with contextlib.suppress(psutil.NoSuchProcess):  # one may end while it is looked at
                if child.status() != psutil.STATUS_ZOMBIE:
                    left[child.pid] = child.cmdline()
    assert not left, f"processes left running: {list(left.values())}"


def python_program(source: str, timeout: float = 300) -> str:
    """Run ``source`` with ``python -c`` (a file-less ``__main__``, like a notebook) and return its stdout."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def is_kit_worker(process: psutil.Process) -> bool:
    """A kit worker process (forked from a fork server or a fresh interpreter, here or on a Dask worker): its name."""
    try:
        return process.name().startswith(WORKER_NAME_PREFIX)
    except psutil.NoSuchProcess:
        return False


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s; fail the test naming ``what`` if it is not true within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
