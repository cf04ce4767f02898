"""Claims on the machine, in one process: free devices, GPUs held elsewhere or used by other programs, the queue,
the claim directory's files. Other processes' claims are files written and locked here as theirs would be
(tests/foreign_claims.py); tests/test_claims_machine.py uses real processes and kernels."""

import os
import re
import stat
import threading
import warnings

import pytest
from conftest import wait_for
from foreign_claims import ForeignClaim

import flair_nbddp
from flair_nbddp import RunActiveError, WorkerPool
from flair_nbddp.engine import claims
from flair_nbddp.engine.claim_files import ClaimDir
from flair_nbddp.engine.claims import HOLDINGS, Claim, Holdings
from flair_nbddp.engine.devices import DevicePlan
from flair_nbddp.engine.gpu_use import GpuUse
from flair_nbddp.engine.worker_source import new_workers
from flair_nbddp.errors import ConfigurationError
from flair_nbddp.options import RunOptions

GB = 1 << 30


@pytest.fixture(autouse=True)
def own_claims(tmp_path, monkeypatch):
    """Each test's claims in a directory of its own."""
    monkeypatch.setenv("FLAIR_NBDDP_CLAIMS", str(tmp_path / "claims"))
    return ClaimDir(tmp_path / "claims")


@pytest.fixture
def four_gpus(monkeypatch):
    """This process sees 4 GPUs (no NVML: each is named by its number)."""
    monkeypatch.setattr("flair_nbddp.engine.devices.visible_gpu_count", lambda: 4)
    monkeypatch.delenv("FLAIR_NBDDP_DEVICE")
    monkeypatch.delenv("FLAIR_NBDDP_PROCESSES")


def someone_else(files: ClaimDir, kind: str = "claim", user: str = "alice", **fields) -> ForeignClaim:
    """A live claim (or place in the queue) of another process of the machine."""
    return ForeignClaim(files, kind, user, **fields)


def test_a_default_run_takes_the_free_gpus_and_says_which_it_left_out_and_why(own_claims, four_gpus):
    someone_else(own_claims, gpus=["1"])
    holder = own_claims.live("claim")[0].holder()
    assert holder.startswith("run #7 'tagger' (started 09:00:00) of alice (pid 424242, ner/tagger.ipynb, since ")
    source, lines, desk = new_workers(None, None, None), [], Holdings()
    desk.take("mine", "run 'train'", source.claim, fit=source.fit, say=lines.append)
    assert source.plan == DevicePlan("cuda", 3, "nccl", (0, 2, 3)) and source.claim.gpus == {"0", "2", "3"}
    assert lines == [f"flair_nbddp: GPU 1 is held by {holder}: this run takes GPUs 0,2,3"]
    desk.give_back("mine")
    two = new_workers(2, None, None)  # a count, no GPUs named: the first two free ones
    desk.take("mine", "run 'train'", two.claim, fit=two.fit, say=lines.append)
    assert two.plan == DevicePlan("cuda", 2, "nccl", (0, 2))
    three = new_workers(3, None, None)
    with pytest.raises(RunActiveError, match=r"^only 1 GPU is free: GPU 0 is held by run 'train'.*GPU 1 is held by "
                                             r"run #7 'tagger'.*GPU 2 is held by run 'train'"):
        desk.take("more", "run 'more'", three.claim, fit=three.fit)
    desk.give_back("mine")


def test_a_named_gpu_another_holds_is_refused_naming_the_holder_unless_shared_on_purpose(own_claims, four_gpus):
    someone_else(own_claims, gpus=["3"])
    named = Claim.of(DevicePlan("cuda", 1, "nccl", (3,)))
    desk = Holdings()
    with pytest.raises(RunActiveError, match=r"GPU 3 is held by run #7 'tagger' .* of alice \(pid 424242, "
                                             r"ner/tagger.ipynb, since .*share them on purpose \(share_gpus=True\)"):
        desk.take("mine", "run 'train'", named)
    assert not desk.holds("mine") and [record.pid for record in own_claims.live("claim")] == [424242]
    lines = []
    desk.take("mine", "run 'train'", named, share=True, say=lines.append)
    assert lines == [f"flair_nbddp: shares GPU 3 with {own_claims.live('claim')[0].holder()} (share_gpus=True)"]
    [mine] = [record for record in own_claims.live("claim", include_own=True) if record.pid == os.getpid()]
    assert mine.shared and mine.gpus == ("3",)
    desk.give_back("mine")


def test_gpus_are_named_by_uuid_and_one_another_program_uses_is_left_out(own_claims, monkeypatch):
    machine = [GpuUse(index, f"GPU-{index}aaa", "H100", 0, 80 * GB, 0, ()) for index in range(4)]
    machine[2] = GpuUse(2, "GPU-2aaa", "H100", 11 * GB, 80 * GB, 93, ((1, 10 * GB), (os.getpid(), GB)))
    monkeypatch.setattr(claims, "machine_gpus", lambda: machine)
    monkeypatch.setattr("flair_nbddp.engine.devices.visible_gpu_count", lambda: 2)
    monkeypatch.delenv("FLAIR_NBDDP_DEVICE")
    monkeypatch.delenv("FLAIR_NBDDP_PROCESSES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # this kernel's GPUs 0 and 1 are the machine's 2 and 3
    source, lines = new_workers(None, None, None), []
    HOLDINGS.take("mine", "run 'train'", source.claim, fit=source.fit, say=lines.append)
    try:
        assert source.plan == DevicePlan("cuda", 1, "nccl", (1,)) and source.claim.gpus == {"GPU-3aaa"}
        [line] = lines  # this process's own use of GPU 2 (1 GB) is not another program's
        assert re.fullmatch(r"flair_nbddp: GPU 0 \(the machine's GPU 2\) is used by 1 other process \(pid 1: .+; "
                            r"10.0 GB\): this run takes GPU 1", line), line
        assert own_claims.live("claim", include_own=True)[0].gpus == ("GPU-3aaa",)
        with pytest.raises(RunActiveError, match=r"GPU 2 is used by 1 other process \(pid 1: "):
            HOLDINGS.take("named", "run 'x'", Claim.of(DevicePlan("cuda", 1, "nccl", (0,))))
    finally:
        HOLDINGS.give_back("mine")


def test_with_no_gpu_free_the_run_is_refused_with_every_holder_and_the_ways_out(own_claims, four_gpus):
    for gpu in "0123":
        someone_else(own_claims, gpus=[gpu], user=f"user{gpu}")
    source = new_workers(None, None, None)
    with pytest.raises(RunActiveError) as refused:
        Holdings().take("mine", "run 'train'", source.claim, fit=source.fit)
    message = str(refused.value)
    assert message.startswith("no GPU is free: GPU 0 is held by run #7 'tagger' (started 09:00:00) of user0")
    assert all(f"of user{gpu} (pid 424242" in message for gpu in "0123")
    assert "wait_for_devices=SECONDS" in message and "share_gpus=True" in message


def test_a_gpu_two_runs_share_is_refused_naming_both(own_claims, four_gpus):
    for gpu in "0123":
        someone_else(own_claims, gpus=[gpu], user=f"user{gpu}")
    someone_else(own_claims, gpus=["0"], user="sharer", shared=True)
    source = new_workers(None, None, None)
    with pytest.raises(RunActiveError) as refused:
        Holdings().take("mine", "run 'train'", source.claim, fit=source.fit)
    first_gpu = str(refused.value).split("; ")[0]
    assert "of user0 (pid" in first_gpu and " and held by run #7 'tagger' (started 09:00:00) of sharer" in first_gpu


def test_a_default_cpu_run_takes_the_free_slots_and_a_counted_one_is_refused(own_claims):
    someone_else(own_claims, cpu=1, capacity=2)
    source = new_workers(None, "cpu", None)  # the tests' FLAIR_NBDDP_PROCESSES=2 gives a count
    assert not source.fits
    with pytest.raises(RunActiveError, match=r"the CPU's 2 process slots are held: 1 by run #7 'tagger' .* of alice"):
        Holdings().take("mine", "run", source.claim)
    os.environ.pop("FLAIR_NBDDP_PROCESSES")
    try:
        source, lines = new_workers(None, "cpu", None), []
        Holdings().take("mine", "run", source.claim, fit=source.fit, say=lines.append)
    finally:
        os.environ["FLAIR_NBDDP_PROCESSES"] = "2"
    assert source.plan.world_size == 1
    assert lines[0].startswith("flair_nbddp: 1 of the CPU's 2 process slots is held (1 by run #7 'tagger' ")
    assert lines[0].endswith("this run takes 1 process")


def test_more_cpu_processes_than_cores_warn():
    with pytest.warns(RuntimeWarning, match=rf"{os.cpu_count() + 1} CPU processes on {os.cpu_count()} cores"):
        new_workers(os.cpu_count() + 1, "cpu", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_workers(os.cpu_count(), "cpu", None)


def test_waiting_runs_start_in_the_order_they_asked_and_a_newcomer_does_not_jump_the_queue(own_claims):
    blocker = someone_else(own_claims, cpu=2, capacity=2)
    desk, started, lines = Holdings(), [], {"first": [], "second": []}
    cpu = Claim.of(DevicePlan("cpu", 2, "gloo"), slots=2)

    def wait_in_queue(name):
        desk.take(name, f"run '{name}'", cpu, wait=30, say=lines[name].append)
        started.append(name)

    first = threading.Thread(target=wait_in_queue, args=("first",))
    first.start()
    wait_for(lambda: lines["first"], 10, "the first waiter's place")
    second = threading.Thread(target=wait_in_queue, args=("second",))
    second.start()
    wait_for(lambda: lines["second"], 10, "the second waiter's place")
    assert "1st in the machine's queue" in lines["first"][0] and "the CPU's 2 process slots are held: 2 by run #7" in \
        lines["first"][0]  # fmt: skip
    assert "2nd in the machine's queue" in lines["second"][0] and "ahead: run 'first' of" in lines["second"][0]
    with pytest.raises(RunActiveError, match="held"):
        desk.take("newcomer", "run 'newcomer'", cpu)
    blocker.end()
    first.join(10)
    assert started == ["first"]
    with pytest.raises(RunActiveError, match=r"^the CPU's 2 process slots are held: 2 by run 'first'"):
        desk.take("newcomer", "run 'newcomer'", cpu, wait=0)
    desk.give_back("first")
    second.join(10)
    assert started == ["first", "second"] and own_claims.live("wait", include_own=True) == []
    desk.give_back("second")


def test_free_devices_go_to_the_run_that_waits_before_a_newcomer(own_claims):
    someone_else(own_claims, kind="wait", cpu=2)
    with pytest.raises(RunActiveError, match=r"1 run waiting for these devices asked first \(run #7 'tagger' .*"
                                             r"wait_for_devices=SECONDS to queue behind them"):
        Holdings().take("mine", "run", Claim.of(DevicePlan("cpu", 2, "gloo"), slots=2))
    Holdings().take("gpu", "run", Claim(gpus=frozenset({"0"})))  # it waits for CPU slots, not for GPUs


def test_a_stop_or_an_elapsed_wait_leaves_the_queue(own_claims):
    someone_else(own_claims, cpu=2, capacity=2)
    leave, outcome = threading.Event(), []
    cpu = Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2)

    def wait():
        with pytest.raises(RunActiveError, match=r"^after waiting [0-5] s: ") as refused:  # the time it waited
            Holdings().take("mine", "run", cpu, wait=60, say=lambda line: None, cancelled=leave)
        outcome.append(refused.value)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_for(lambda: own_claims.live("wait", include_own=True), 10, "the place in the queue")
    leave.set()
    thread.join(5)
    assert outcome and own_claims.live("wait", include_own=True) == []
    assert "s: the CPU's 2 process slots are held: 2 by run #7 'tagger'" in str(outcome[0])
    assert "wait_for_devices" not in str(outcome[0])  # it waited already


def test_foreign_and_malformed_files_are_ignored_with_a_warning_and_a_dead_holders_file_goes(own_claims):
    import fcntl

    own_claims.ensure()
    (own_claims.path / "notes.txt").write_text("mine")
    broken = own_claims.path / "claim-bob-77-1.json"
    broken.write_text("{not json")
    fd = os.open(broken, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live holder wrote it
    dead = own_claims.path / "claim-root-78-1.json"
    dead.write_text('{"format": 1}')  # nobody holds it: its holder died
    with pytest.warns(RuntimeWarning) as caught:
        assert own_claims.live("claim") == []
    messages = sorted(str(warning.message) for warning in caught)
    assert "claim-bob-77-1.json is not a readable flair_nbddp claim (JSONDecodeError:" in messages[0]
    assert "notes.txt is not a flair_nbddp claim; it is ignored" in messages[1]
    assert not dead.exists() and broken.exists()
    os.close(fd)
    Holdings().take("mine", "run", Claim.of(DevicePlan("cpu", 2, "gloo"), slots=2))  # none of them holds a slot


def test_the_claim_directory_is_shared_sticky_and_an_unusable_one_names_the_fix(tmp_path, monkeypatch):
    files = ClaimDir(tmp_path / "shared" / "claims")
    assert stat.S_IMODE(files.ensure().stat().st_mode) == 0o1777
    with files.mutex():
        held = files.publish("claim", {"label": "run", "cpu": 1})
    assert stat.S_IMODE(held.path.stat().st_mode) == 0o644
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FLAIR_NBDDP_CLAIMS", str(tmp_path / "file"))
    with pytest.raises(ConfigurationError, match=r"claim directory .*/file is unusable: .*Set \$FLAIR_NBDDP_CLAIMS"):
        Holdings().take("mine", "run", Claim())
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="writable by every user without the sticky bit"):
        ClaimDir(loose).ensure()


def test_a_warm_pool_on_gpus_holds_them_until_it_is_closed(own_claims, four_gpus):
    pool = WorkerPool(gpus=[1, 2])
    with pytest.raises(RunActiveError, match=r"GPU 2 is held by WorkerPool pool-\w+ \(warm, 2 × cuda 1,2 \(nccl\)\)"):
        HOLDINGS.take("cold", "run 'cold'", Claim.of(DevicePlan("cuda", 1, "nccl", (2,))))
    assert pool.claim.gpus == frozenset()  # its jobs hold the pool's workers; the pool holds the GPUs
    default = new_workers(None, None, None)
    HOLDINGS.take("cold", "run 'cold'", default.claim, fit=default.fit, say=lambda line: None)
    assert default.plan.gpus == (0, 3)
    HOLDINGS.give_back("cold")
    pool.close()
    HOLDINGS.take("cold", "run 'cold'", Claim.of(DevicePlan("cuda", 1, "nccl", (2,))))
    HOLDINGS.give_back("cold")


def test_devices_in_use_lists_every_holder_with_its_age(own_claims, four_gpus):
    someone_else(own_claims, gpus=["1"])
    someone_else(own_claims, kind="wait", gpus=["any"], user="carol")
    pool = WorkerPool(2, "cpu")
    listed = flair_nbddp.devices_in_use()
    assert [(use.holder.split(" (")[0], use.state, use.user) for use in listed] == [
        ("run #7 'tagger'", "holds", "alice"), (f"WorkerPool {pool.run_dir.name}", "holds", listed[1].user),
        ("run #7 'tagger'", "waits", "carol"),
    ]  # fmt: skip
    assert listed[0].gpus == ("1",) and listed[0].where == "ner/tagger.ipynb" and 0 <= listed[0].age < 60
    assert listed[2].gpus == ("any",) and listed[1].pid == os.getpid()
    text = repr(listed)
    assert text.splitlines()[0].split() == ["holder", "state", "user", "pid", "where", "age", "GPUs"]
    assert "<table class='flair-nbddp-devices'>" in listed._repr_html_() and "ner/tagger.ipynb" in text
    pool.close()


def test_wait_for_devices_is_a_number_of_seconds():
    assert RunOptions(wait_for_devices=600).wait_for_devices == 600
    with pytest.raises(ConfigurationError, match=r"wait_for_devices=-1 is not a number of seconds: give e.g. 600"):
        RunOptions(wait_for_devices=-1)
    with pytest.raises(ConfigurationError, match="wait_for_devices='10'"):
        RunOptions(wait_for_devices="10")


def test_a_default_run_takes_free_gpus_that_no_waiting_run_asked_for(own_claims, four_gpus):
    someone_else(own_claims, gpus=["1"])
    carol = someone_else(own_claims, kind="wait", gpus=["0"], user="carol")  # GPU 0 has just freed up for her
    source, desk, lines = new_workers(None, None, None), Holdings(), []
    desk.take("mine", "run", source.claim, fit=source.fit, say=lines.append)
    assert source.plan.gpus == (2, 3)
    [line] = lines
    assert line.startswith("flair_nbddp: GPU 0 is waited for by run #7 'tagger' (started 09:00:00) of carol (")
    assert "; GPU 1 is held by run #7 'tagger' (started 09:00:00) of alice (" in line and line.endswith("GPUs 2,3")
    with pytest.raises(RunActiveError, match=r"1 run waiting for these devices asked first \(.* of carol"):
        desk.take("named", "run", Claim(gpus=frozenset({"0"})), fit=None)  # GPU 0 goes to carol first...
    carol.end()
    someone_else(own_claims, kind="wait", gpus=["any"], user="dan")
    desk.give_back("mine")
    with pytest.raises(RunActiveError, match=r"waiting for these devices asked first \(.* of dan"):
        desk.take("mine", "run", source.claim, fit=new_workers(None, None, None).fit)  # ...and free ones to dan


def test_a_restarts_next_attempt_takes_over_the_devices_of_the_failed_one_with_no_gap(own_claims):
    desk, gpu = Holdings(), Claim(gpus=frozenset({"0"}))
    desk.take("attempt 1", "run 'train'", gpu)
    desk.hand_over("attempt 1", "restarts")  # the attempt ended: its devices stay held for the next
    assert not desk.holds("attempt 1") and desk.holds("restarts")
    with pytest.raises(RunActiveError, match="GPU 0 is held by run 'train'"):
        desk.take("another run", "run 'other'", gpu)
    desk.take("attempt 2", "run 'train'", gpu, inherit="restarts")
    assert desk.holds("attempt 2") and not desk.holds("restarts")
    assert len(own_claims.live("claim", include_own=True)) == 1
    desk.give_back("attempt 2")


def test_what_another_user_leaves_in_the_directory_can_neither_hang_nor_break_a_run(own_claims, monkeypatch):
    own_claims.ensure()
    os.mkfifo(own_claims.path / "claim-mallory-5-1.json")  # opening it for reading would wait for a writer
    someone_else(own_claims, user="mallory", since=float("inf"), cpu=2)
    same_pid = someone_else(own_claims, user="bob", pid=os.getpid(), cpu=2)  # another container's kernel
    with pytest.warns(RuntimeWarning) as caught:
        with pytest.raises(RunActiveError, match=rf"2 by run #7 'tagger' .* of bob \(pid {os.getpid()}, "):
            Holdings().take("mine", "run", Claim.of(DevicePlan("cpu", 2, "gloo"), slots=2))
    assert sorted(str(warning.message).split(" is ")[1][:10] for warning in caught) == ["not a read", "not a regu"]
    same_pid.end()
    monkeypatch.setattr("flair_nbddp.engine.claim_files.LOCK_TIMEOUT_SECONDS", 0.2)
    import fcntl

    stuck = os.open(own_claims.path, os.O_RDONLY)  # a process stopped while it held the directory's lock
    fcntl.flock(stuck, fcntl.LOCK_EX)
    with pytest.raises(RunActiveError, match=r"held the lock of the machine's claim directory .* for 0.2 s .*fuser"):
        Holdings().take("mine", "run", Claim.of(DevicePlan("cpu", 2, "gloo"), slots=2))
    os.close(stuck)
    Holdings().take("mine", "run", Claim.of(DevicePlan("cpu", 2, "gloo"), slots=2))


def test_a_restart_keeps_its_devices_though_runs_wait_for_them(own_claims):
    desk, gpu = Holdings(), Claim(gpus=frozenset({"0"}))
    desk.take("attempt 1", "run 'train'", gpu)
    desk.hand_over("attempt 1", "restarts")
    someone_else(own_claims, kind="wait", gpus=["0"], user="carol")  # asked for GPU 0 while the attempt ran
    someone_else(own_claims, kind="wait", gpus=["any"], user="dan")
    desk.take("attempt 2", "run 'train'", gpu, inherit="restarts")  # its own: no one ahead of it for them
    assert desk.holds("attempt 2") and [use.holder for use in flair_nbddp.devices_in_use()][0] == "run 'train'"
    desk.give_back("attempt 2")
