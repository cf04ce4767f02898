import os
import sys
import time

import psutil
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests rehearse DDP on CPU with gloo and 2 processes, whatever the machine has.
os.environ.setdefault("FLAIR_NBDDP_DEVICE", "cpu")
os.environ.setdefault("FLAIR_NBDDP_PROCESSES", "2")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from flair_nbddp.synthetic import tiny_transformer

    return tiny_transformer(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def no_leftover_processes():
    """Fails the test if it leaves any child process of this one running."""
    yield
    children = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"processes left running: {[c.cmdline() for c in children]}"


def python_program(source: str, timeout: float = 300) -> str:
    """Run ``source`` with ``python -c`` (a file-less ``__main__``, like a notebook) and return its stdout."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s; fail the test naming ``what`` if it is not true within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
