"""The run ledger on its own: the SQLite file, lost runs, damage, concurrency, what a record describes, the
comparison figure and the TensorBoard export (no worker processes: fast tier)."""

import json
import math
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from flair_nbddp.engine.devices import DevicePlan
from flair_nbddp.errors import ConfigurationError, LedgerError, LedgerWarning
from flair_nbddp.ledger.provenance import Provenance, describe, describe_call, source_of
from flair_nbddp.ledger.store import (
    Ledger,
    RunRecord,
    _this_boot,
    history,
    ledger_path,
    owner_alive,
    process_identity,
)
from flair_nbddp.ledger.tensorboard_export import export_tensorboard
from flair_nbddp.notebook.compare import compare
from flair_nbddp.options import RunOptions
from flair_nbddp.engine.recorder import RunRecorder
from flair_nbddp.engine.state import MetricPoint, RunState
from flair_nbddp.synthetic import sentiment_corpus
from flair_nbddp.wire import codec, payload
from flair_nbddp.wire.events import Metric


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A ledger of its own for the test, at ``$FLAIR_NBDDP_HOME``."""
    monkeypatch.setenv("FLAIR_NBDDP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _record(name="train", status="running", **fields):
    mine = {"owner": process_identity(), "host": socket.gethostname()}
    return RunRecord(started_at=time.time(), name=name, status=status, **{**mine, **fields})


def _points(count, name="train/batch_loss"):
    return [MetricPoint(name, 1.0 / (step + 1), step, 1000.0 + step) for step in range(count)]


# -- the file -----------------------------------------------------------------------------------------
def test_the_ledger_lives_under_flair_nbddp_home_private_and_in_wal_mode(home):
    ledger = Ledger.default()
    assert ledger.path == home / "runs.sqlite"
    run_id = ledger.insert(_record())
    ledger.append_metrics(run_id, _points(3))
    assert oct(home.stat().st_mode & 0o777) == "0o700" and oct(ledger.path.stat().st_mode & 0o777) == "0o600"
    for sidecar in home.glob("runs.sqlite-*"):  # SQLite gives the WAL files the database's mode
        assert oct(sidecar.stat().st_mode & 0o777) == "0o600", sidecar
    with sqlite3.connect(ledger.path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_flair_nbddp_ledger_0_turns_recording_off(home, monkeypatch):
    monkeypatch.setenv("FLAIR_NBDDP_LEDGER", "0")
    assert ledger_path() is None and Ledger.default() is None
    with pytest.raises(LedgerError, match="the run ledger is off .FLAIR_NBDDP_LEDGER=0.: unset"):
        history()
    assert not home.exists()


def test_records_come_back_newest_first_filtered_with_their_metrics(home):
    ledger = Ledger.default()
    first = ledger.insert(_record("train", params={"kwargs": {"lr": 0.1}}))
    ledger.end(first, _points(2, "dev/score"), status="finished", ended_at=time.time(), scores={"dev/score": 0.5})
    second = ledger.insert(_record("tag"))
    ledger.end(second, status="failed", error="WorkerError: rank 1 failed")
    third = ledger.insert(_record("train"))
    assert [record.id for record in history()] == [third, second, first]
    assert [record.id for record in history(limit=1)] == [third]
    assert [record.id for record in history(name="train")] == [third, first]
    [failed] = history(status="failed")
    assert (failed.id, failed.error) == (second, "WorkerError: rank 1 failed")
    [done] = history(status="finished")
    assert done.history("dev/score") == [(0, 1.0), (1, 0.5)] and done.kwargs == {"lr": 0.1}
    assert done.scores == {"dev/score": 0.5} and "#1 train: finished" in repr(done)


def test_a_run_whose_process_died_is_marked_lost_when_the_ledger_is_next_opened(home):
    ledger = Ledger.default()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    identity = process_identity(child.pid)
    dead = ledger.insert(_record("orphan", owner=identity, updated_at=1234.0))
    alive = ledger.insert(_record("mine"))
    elsewhere = ledger.insert(_record("remote", owner=identity, host="another-host"))
    assert {record.id: record.status for record in history()}[dead] == "running"  # its process still lives
    child.kill()
    child.wait()
    statuses = {record.id: record for record in history()}
    assert statuses[dead].status == "lost" and statuses[dead].ended_at == 1234.0  # its last sign of life
    assert f"pid {child.pid}" in statuses[dead].error
    assert statuses[alive].status == "running" and statuses[elsewhere].status == "running"  # not ours to judge


def test_a_reused_pid_or_a_reboot_does_not_keep_a_dead_run_alive(home):
    ledger = Ledger.default()
    pid, boot = os.getpid(), _this_boot()
    reused = ledger.insert(_record(owner=f"{pid}:12345.00:{boot}"))  # this pid, a process started at another time
    rebooted = ledger.insert(_record(owner=f"{pid}:{process_identity().split(':')[1]}:another-boot/1"))
    namespace = boot.partition("/")[0] + "/999"  # this boot, another container's pids: not ours to judge
    elsewhere = ledger.insert(_record(owner=f"{pid}:12345.00:{namespace}"))
    statuses = {record.id: record.status for record in history()}
    assert (statuses[reused], statuses[rebooted], statuses[elsewhere]) == ("lost", "lost", "running")
    assert owner_alive(f"{pid}:12345.00:{namespace}") is None


def test_a_run_ends_once_in_the_ledger(home):
    ledger = Ledger.default()
    run_id = ledger.insert(_record())
    ledger.end(run_id, _points(2), status="finished", elapsed=3.0)
    ledger.end(run_id, _points(2), status="failed", elapsed=9.0)  # e.g. an interrupted end, written again
    [record] = history()
    assert (record.status, record.elapsed, len(record.metrics())) == ("finished", 3.0, 2)


def test_a_ledger_moved_aside_in_a_live_kernel_starts_anew_private(home):
    ledger = Ledger.default()
    ledger.insert(_record("before"))
    aside = home / "damaged"
    aside.mkdir()
    for path in home.glob("runs.sqlite*"):
        path.rename(aside / path.name)
    ledger.insert(_record("after"))  # this process had prepared the file before: it prepares the new one
    assert [record.name for record in history()] == ["after"]
    assert oct((home / "runs.sqlite").stat().st_mode & 0o777) == "0o600"


def test_a_damaged_file_is_a_clear_error_and_is_left_for_the_user(home):
    home.mkdir()
    damaged = home / "runs.sqlite"
    damaged.write_bytes(b"these are not the bytes of an SQLite database" * 100)
    with pytest.raises(LedgerError) as caught:
        history()
    message = str(caught.value)
    assert str(damaged) in message and "damaged or not an SQLite file" in message and f"mv {damaged}" in message
    assert "FLAIR_NBDDP_LEDGER=0" in message and "FLAIR_NBDDP_HOME" in message
    assert damaged.read_bytes().startswith(b"these are not")  # nothing of the user's is overwritten


def _fake_run(run_dir):
    plan = DevicePlan("cpu", 2, "gloo")
    return SimpleNamespace(
        options=RunOptions(), plan=plan, name="train", source=object(), seed=3,
        state=RunState(world_size=2, device_type="cpu"), run_dir=run_dir, chunk_size=None,
    )  # fmt: skip


@pytest.mark.parametrize("damage", ["a damaged file", "a home that is a file"])
def test_a_run_with_an_unusable_ledger_warns_once_and_goes_on_unrecorded(home, tmp_path, damage):
    if damage == "a damaged file":
        home.mkdir()
        (home / "runs.sqlite").write_bytes(b"\x00garbage" * 512)
    else:
        home.write_text("a file where the ledger's directory should be")
    recorder = RunRecorder(Provenance(), Ledger.default())
    run = _fake_run(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder.begin(run, recorder.describe(run, len, (), {}, {}))
        run.state.apply(Metric(0, "train/loss", 0.5, 1))
        recorder.flush(run.state)
        recorder.end(run, SimpleNamespace(metrics=[]))
    assert recorder.id is None
    [warning] = [item for item in caught if issubclass(item.category, LedgerWarning)]
    assert f"This run ({tmp_path}) goes on, unrecorded." in str(warning.message) and "FLAIR_NBDDP_HOME" in str(warning.message)


def test_two_writers_at_once_lose_nothing_and_corrupt_nothing(home):
    ledger = Ledger.default()
    ids = [ledger.insert(_record(f"writer{index}")) for index in range(4)]

    def write(run_id):
        for batch in range(25):
            ledger.append_metrics(run_id, [MetricPoint("train/loss", float(batch), batch, 0.0)] * 40)

    threads = [threading.Thread(target=write, args=(run_id,)) for run_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [len(ledger.metrics(run_id)) for run_id in ids] == [1000] * 4
    with sqlite3.connect(ledger.path) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_writer_finding_the_file_locked_waits_and_a_short_wait_says_busy(home):
    ledger = Ledger.default()
    run_id = ledger.insert(_record())
    holder = sqlite3.connect(ledger.path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another kernel in the middle of a write
    with pytest.raises(LedgerError) as caught:
        ledger.append_metrics(run_id, _points(1), busy=0.05)
    assert caught.value.busy
    threading.Timer(0.3, lambda: holder.execute("COMMIT")).start()
    ledger.append_metrics(run_id, _points(2))  # waits for the other writer, then writes
    holder.close()
    assert len(ledger.metrics(run_id)) == 2


def test_a_hundred_thousand_metric_rows_go_in_and_come_back(home):
    ledger = Ledger.default()
    run_id = ledger.insert(_record())
    for start in range(0, 100_000, 10_000):
        ledger.append_metrics(run_id, [MetricPoint("train/batch_loss", 0.5, step, 0.0) for step in range(start, start + 10_000)])
    steps = [step for step, _ in Ledger.default().records()[0].history("train/batch_loss")]
    assert steps == list(range(100_000))


def test_a_ledger_of_a_newer_schema_is_refused_with_the_way_out(home):
    home.mkdir()
    with sqlite3.connect(home / "runs.sqlite") as connection:
        connection.execute("PRAGMA user_version = 99")
    with pytest.raises(LedgerError, match="written by a newer flair_nbddp .schema 99.*upgrade flair_nbddp"):
        history()


# -- what a record describes ---------------------------------------------------------------------------
def test_parameters_are_described_corpora_by_size_and_hash_secrets_masked():
    corpus = sentiment_corpus(8, 2, 3)
    packed = payload.write_payload(os.devnull, len, (corpus,), {})
    described = describe_call((corpus, [1, 2.5], Path("/data")), {"lr": 0.1, "hf_token": "hf_xyz", "note": "x" * 600,
                              "nan": math.nan, "model_dir": None}, packed.digests)  # fmt: skip
    digest = __import__("hashlib").sha256(codec.encode(corpus)).hexdigest()
    assert described["args"] == [
        {"type": "Corpus", "train": 8, "dev": 2, "test": 3, "sha256": digest}, [1, 2.5], "/data"
    ]
    kwargs = described["kwargs"]
    assert kwargs["hf_token"] == "***" and kwargs["lr"] == 0.1 and kwargs["model_dir"] is None
    assert kwargs["nan"] == "nan" and kwargs["note"].endswith("... (600 characters)") and len(kwargs["note"]) < 530
    assert describe(list(range(100))) == {"type": "list", "len": 100} and describe(threading.Lock()) == {"type": "lock"}
    # secrets by their look, wherever they are: positional values, URLs
    assert describe_call(("ghp_abcdefghijklmnop1234", "postgres://me:s3cret@db/x"), {"private_key": "x", "author": "me"}) == {
        "args": ["***", "postgres://me:***@db/x"], "kwargs": {"private_key": "***", "author": "me"}
    }
    json.dumps(described)  # all of it goes into the ledger as JSON


def test_a_function_is_recorded_by_its_source_and_hash_and_a_builtin_by_neither():
    source, digest = source_of(_record)
    assert source.startswith("def _record(") and len(digest) == 64
    assert source_of(len) == (None, None)


def test_a_recorded_run_keeps_its_options_devices_versions_and_metrics_in_batches(home, tmp_path, monkeypatch):
    monkeypatch.setattr("flair_nbddp.engine.recorder.FLUSH_SECONDS", 0.0)
    recorder = RunRecorder(Provenance("launch"), Ledger.default())
    run = _fake_run(tmp_path)
    recorder.begin(run, recorder.describe(run, _record, (sentiment_corpus(4, 1, 1),), {"lr": 0.1}, {}))
    for epoch in (1, 2):
        run.state.apply(Metric(0, "dev/score", 0.5 * epoch, epoch))
        recorder.flush(run.state)
    [record] = history()
    assert (record.status, record.name, record.origin, record.devices) == ("running", "train", "launch", "2 × cpu (gloo)")
    assert record.history("dev/score") == [(1, 0.5), (2, 1.0)]  # already there while the run goes
    assert record.options["hang_timeout"] == 300.0 and record.seed == 3 and record.run_dir == str(tmp_path)
    assert set(record.versions) == {"python", "torch", "flair", "transformers", "flair_nbddp"}
    assert record.params["args"] == [{"type": "Corpus", "train": 4, "dev": 1, "test": 1}]


# -- comparing and exporting ---------------------------------------------------------------------------
def _three_runs():
    ledger = Ledger.default()
    for number, scores in enumerate(([0.5, 0.7, 0.8], [0.4, 0.6], [])):
        run_id = ledger.insert(_record("train", params={"kwargs": {"lr": 10.0**-number}}))
        points = [MetricPoint("dev/score", score, epoch + 1, 1000.0 + epoch) for epoch, score in enumerate(scores)]
        ledger.end(run_id, points, status="finished", scores={"dev/score": scores[-1]} if scores else {})
    return history()


def test_compare_draws_one_line_per_run_labelled(home):
    records = _three_runs()
    figure = compare(records)
    [axes] = figure.axes
    assert len(axes.lines) == 3
    assert [list(line.get_ydata()) for line in axes.lines] == [[], [0.4, 0.6], [0.5, 0.7, 0.8]]
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert labels[1] == "#2 train (finished) lr=0.1" and labels[0].endswith("— no dev/score")
    assert axes.get_ylabel() == "dev/score" and axes.get_xlabel() == "epoch"
    with pytest.raises(ConfigurationError, match="at least one run"):
        compare([])


def test_export_tensorboard_writes_event_files_that_read_back(home, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = _three_runs()
    directories = export_tensorboard(records, tmp_path / "tb")
    assert [directory.name for directory in directories] == ["run-3-train", "run-2-train", "run-1-train"]
    events = EventAccumulator(str(directories[2]))
    events.Reload()
    scalars = [(event.step, round(event.value, 6), event.wall_time) for event in events.Scalars("dev/score")]
    assert scalars == [(1, 0.5, 1000.0), (2, 0.7, 1001.0), (3, 0.8, 1002.0)]
    assert "run/text_summary" in events.Tags()["tensors"]
