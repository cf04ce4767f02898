"""Claims across processes, users and kernels of this machine: real processes holding claims, another user's
claims, and two real Jupyter kernels whose default runs meet."""

import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

import pytest

from flair_nbddp import RunActiveError, devices_in_use
from flair_nbddp.engine.claim_files import ClaimDir
from flair_nbddp.engine.claims import Claim, Holdings
from flair_nbddp.engine.devices import DevicePlan
from jupyter_kernel import running_kernel

HOLD = textwrap.dedent("""
    import sys, time
    from flair_nbddp.engine.claims import HOLDINGS, Claim
    HOLDINGS.take("script", "run 'held by a script'", Claim(gpus=frozenset({sys.argv[2]}), cpu=int(sys.argv[1]),
                                                            capacity=2))
    print("held", flush=True)
    time.sleep(600)
""")


def holding_process(cpu: int, gpu: str = "0", **popen) -> subprocess.Popen:
    """Another process of this machine (another user's with :func:`as_user`) that holds a GPU and ``cpu`` CPU
    slots."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(cpu), gpu], stdout=subprocess.PIPE, text=True, **popen)
    assert process.stdout.readline() == "held\n"
    return process


@pytest.mark.process
def test_a_holder_killed_with_sigkill_frees_its_claim_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAIR_NBDDP_CLAIMS", str(tmp_path / "claims"))
    holder = holding_process(cpu=2)
    [held] = devices_in_use()
    assert (held.holder, held.pid, held.gpus, held.cpu) == ("run 'held by a script'", holder.pid, ("0",), 2)
    assert held.where == "-c"
    with pytest.raises(RunActiveError, match=rf"GPU 0 is held by run 'held by a script' of \w+ \(pid {holder.pid}, "):
        Holdings().take("mine", "run", Claim(gpus=frozenset({"0"})))
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    desk = Holdings()
    desk.take("mine", "run", Claim(gpus=frozenset({"0"}), cpu=2, capacity=2))  # no stale lock, no wait
    assert [use.pid for use in devices_in_use()] == [os.getpid()]
    assert len(list((tmp_path / "claims").glob("claim-*.json"))) == 1  # the dead holder's file went as it was read
    desk.give_back("mine")


def as_user(uid: int) -> dict:
    """``subprocess`` arguments that run the command as user ``uid`` (this interpreter lives in root's home, which
    other users cannot reach: their commands are shell ones)."""

    def switch():
        os.setgid(uid)
        os.setuid(uid)

    return {"preexec_fn": switch}


# what another user tries on a claim file: remove it, rename it, write it
ATTACK = 'rm -f "$1" 2>/dev/null && echo removed; mv "$1" "$1.x" 2>/dev/null && echo renamed; ' \
         '(echo "{}" > "$1") 2>/dev/null && echo written; echo tried'  # fmt: skip


def attack(path: Path, uid: int) -> str:
    return subprocess.run(["/bin/sh", "-c", ATTACK, "sh", str(path)], capture_output=True, text=True, check=True,
                          **as_user(uid)).stdout.split()  # fmt: skip


@pytest.mark.process
@pytest.mark.skipif(os.getuid() != 0, reason="acting as other users needs root")
def test_one_user_cannot_remove_or_alter_another_users_claim(monkeypatch):
    base = Path(tempfile.mkdtemp(prefix="flair_nbddp-test-users-"))
    base.chmod(0o755)  # a place other users reach, as the default under /tmp is
    claims = base / "claims"
    monkeypatch.setenv("FLAIR_NBDDP_CLAIMS", str(claims))
    desk = Holdings()
    try:
        desk.take("mine", "run 'mine'", Claim(gpus=frozenset({"0"})))  # makes the directory, mode 1777
        [path] = claims.glob("claim-*.json")
        before = path.read_text()
        assert attack(path, 65534) == ["tried"] and path.read_text() == before
        assert [use.holder for use in devices_in_use()] == ["run 'mine'"]
        theirs = claims / "claim-nobody-1-1.json"  # another user's file there (its holder gone)
        subprocess.run(["/bin/sh", "-c", f"echo '{{}}' > {theirs}"], check=True, **as_user(65534))
        assert attack(theirs, 65533) == ["tried"] and theirs.read_text() == "{}\n"
        assert [use.holder for use in devices_in_use()] == ["run 'mine'"] and theirs.exists()  # passed by, kept
    finally:
        desk.give_back("mine")
        shutil.rmtree(base)


KERNEL_SETUP = """
import os, threading, time
from pathlib import Path
import flair_nbddp

def hold_until(flag):
    import os, time
    from pathlib import Path
    while not Path(flag).exists():
        time.sleep(0.05)
    return int(os.environ["WORLD_SIZE"])

def world_size():
    import os
    return int(os.environ["WORLD_SIZE"])

def started_at():
    import time
    return time.time()
"""


@pytest.mark.kernel
def test_two_kernels_share_the_cpu_slots_take_the_free_ones_refuse_or_queue_and_a_killed_kernel_frees_them(tmp_path):
    env = {"FLAIR_NBDDP_CLAIMS": str(tmp_path / "claims"), "FLAIR_NBDDP_PROCESSES": ""}  # the default: 2 slots
    flag = tmp_path / "flag"
    with running_kernel({**env, "JPY_SESSION_NAME": "first.ipynb"}) as first, \
            running_kernel({**env, "JPY_SESSION_NAME": "second.ipynb"}) as second:  # fmt: skip
        for kernel in (first, second):
            assert kernel.execute(KERNEL_SETUP).error is None
        pid = first.execute("print(os.getpid())").stdout.strip()
        # the first kernel holds one of the CPU's two slots
        first.execute(f"run = flair_nbddp.start(hold_until, ({str(flag)!r},), processes=1)")
        taken = second.execute("print(flair_nbddp.launch(world_size, dashboard=False).world_size)", timeout=120)
        assert taken.error is None, taken.error
        assert taken.stdout.strip().splitlines()[-1] == "1"  # the default run took the free slot only
        holder = rf"of {getpass.getuser()} \(pid {pid}, first.ipynb, since [\d:]+\)"
        said = r"1 of the CPU's 2 process slots is held \(1 by run #\d+ 'hold_until' "
        said += r"\(started [\d:]+, 1 × cpu \(gloo\)\) "
        assert re.search(rf"flair_nbddp: {said}{holder}\): this run takes 1 process", taken.stdout), taken.stdout
        # now both slots are held: the second kernel's run is refused, naming who holds them
        first.execute(f"run2 = flair_nbddp.start(hold_until, ({str(flag)!r},), processes=1)")
        refused = second.execute("flair_nbddp.launch(world_size, dashboard=False)")
        assert refused.error["ename"] == "RunActiveError"
        assert "every CPU process slot is held (1 by run #" in refused.error["evalue"]
        assert f"(pid {pid}, first.ipynb, since" in refused.error["evalue"]
        listed = second.execute("print(flair_nbddp.devices_in_use())").stdout
        assert listed.count("first.ipynb") == 2 and "hold_until" in listed
        # or it waits, and starts when the first kernel's runs end (a run of 2 processes: a default one would start
        # on the first slot freed, as the two runs of the first kernel do not end in the same instant)
        waiting = second.submit("result = flair_nbddp.launch(started_at, dashboard=False, processes=2, "
                                "wait_for_devices=120)\nprint('started', result.world_size, result.value)")
        second.printed(waiting, "waiting for devices (1st in the machine's queue, up to 120 s): ", timeout=60)
        ended = time.time()
        flag.write_text("")
        done = second.collect(waiting, timeout=120)
        assert done.error is None, done.error
        size, started = done.stdout.split("started")[-1].split()
        assert size == "2" and float(started) >= ended  # both slots, once the first kernel's runs had ended
        assert first.execute("print(run.wait().value, run2.wait().value)").stdout.strip() == "1 1"
        # a kernel killed while it holds: its claim is gone at once
        flag.unlink()
        first.execute(f"run = flair_nbddp.start(hold_until, ({str(flag)!r},), processes=2)")
        assert "first.ipynb" in second.execute("print(flair_nbddp.devices_in_use())").stdout
        kernel = psutil.Process(int(pid))
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(10)
        after = second.execute("print(flair_nbddp.devices_in_use()); "
                               "print(flair_nbddp.launch(world_size, dashboard=False).world_size)", timeout=120)
        assert after.error is None, after.error
        assert "first.ipynb" not in after.stdout and after.stdout.strip().splitlines()[-1] == "2"
        flag.write_text("")  # the killed kernel's workers end on their own
