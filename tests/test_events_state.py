import socket
import time
from multiprocessing.connection import Connection

import pytest

from flair_nbddp.engine.state import RunState
from flair_nbddp.wire.events import (
    EventSender,
    Failed,
    Finished,
    Heartbeat,
    Metric,
    Progress,
    Started,
)


def test_events_cross_a_socket_pair_intact():
    a, b = socket.socketpair()
    sender, receiver = EventSender(Connection(a.detach())), Connection(b.detach())
    sent = [Started(1, pid=42, device="cpu"), Progress(0, 1, 3, 2, 10), Failed(1, "ValueError", "x", "tb")]
    for event in sent:
        sender.send(event)
    assert [receiver.recv() for _ in sent] == sent


def test_state_follows_a_run_from_start_to_finish():
    state = RunState(world_size=2, device_type="cpu")
    assert state.snapshot().status == "starting"
    state.apply(Started(0, pid=1, device="cpu"))
    assert state.snapshot().status == "starting"
    state.apply(Started(1, pid=2, device="cpu"))
    assert state.snapshot().status == "running"
    state.apply(Progress(0, epoch=2, max_epochs=4, batch=5, total_batches=10))
    state.apply(Heartbeat(0, step=15, samples=150, samples_per_second=30.0, host_memory_bytes=10))
    state.apply(Heartbeat(1, step=15, samples=150, samples_per_second=20.0, host_memory_bytes=10))
    state.apply(Metric(0, "train/loss", 0.5, 1))
    snapshot = state.snapshot()
    assert snapshot.fraction_done == pytest.approx(15 / 40)
    assert snapshot.samples_per_second == 50.0
    assert snapshot.eta is not None and snapshot.eta >= 0
    assert [(m.name, m.value) for m in snapshot.metrics] == [("train/loss", 0.5)]
    state.apply(Finished(0))
    assert not state.all_finished()
    state.apply(Finished(1))
    assert state.all_finished()
    state.end("finished")
    ended = state.snapshot()
    assert ended.status == "finished" and ended.ended_at is not None
    time.sleep(0.01)
    assert state.snapshot().elapsed == ended.elapsed  # frozen once ended


def test_first_failure_is_kept():
    state = RunState(world_size=2, device_type="cpu")
    state.apply(Failed(1, "ValueError", "first", ""))
    state.apply(Failed(0, "RuntimeError", "second", ""))
    assert state.snapshot().failure.message == "first"


def test_log_is_bounded_in_memory():
    state = RunState(world_size=1, device_type="cpu", max_log_lines=3)
    state.add_log_lines([f"line {i}" for i in range(5)])
    assert state.snapshot().log_lines == ("line 2", "line 3", "line 4")


def test_end_rejects_a_non_final_status():
    with pytest.raises(ValueError):
        RunState(world_size=1, device_type="cpu").end("running")
