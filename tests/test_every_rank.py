"""Every rank visible: other ranks' warnings and stderr in the cell, output="all", per-rank tails, health marks,
exact final counts, and each rank's full text in the result."""

from __future__ import annotations

import tempfile
from dataclasses import replace

import pytest

from flair_nbddp import ConfigurationError, launch
from flair_nbddp.engine.rank_output import BURST_LINES, RankOutput
from flair_nbddp.engine.rundir import RunDir
from flair_nbddp.engine.state import RankInfo, RunState, rank_health
from flair_nbddp.wire.events import Heartbeat


def _files(world_size: int = 2) -> tuple[RunDir, RunState]:
    return RunDir.create(tempfile.mkdtemp()), RunState(world_size=world_size, device_type="cpu")


def _write(path, text: str) -> None:
    with open(path, "a") as handle:
        handle.write(text)


# -- without processes -------------------------------------------------------------------------------------
def test_the_cell_shows_rank_0_and_the_other_ranks_stderr_prefixed_without_their_progress_bars():
    run_dir, state = _files(3)
    output = RankOutput(run_dir, 3, "rank0")
    _write(run_dir.log(0), "epoch 1 - loss 0.5\n")
    _write(run_dir.log(2), "epoch 1 - loss 0.6\nRuntimeWarning: overflow\n")
    _write(run_dir.stderr(2), "RuntimeWarning: overflow\n 40%|████      | 4/10 [00:01<00:01]\n48it [00:00, 9.1it/s]\n")
    output.read(state)
    snapshot = state.snapshot()
    assert snapshot.log_lines == ("epoch 1 - loss 0.5", "[rank 2] RuntimeWarning: overflow")
    assert snapshot.rank_logs == (("epoch 1 - loss 0.5",), (), ("epoch 1 - loss 0.6", "RuntimeWarning: overflow"))


def test_output_all_shows_every_line_of_every_rank_prefixed():
    run_dir, state = _files()
    output = RankOutput(run_dir, 2, "all")
    _write(run_dir.log(0), "zero\n")
    _write(run_dir.log(1), "one\npartial")
    output.read(state)
    assert state.snapshot().log_lines == ("[rank 0] zero", "[rank 1] one")
    output.read(state, final=True)
    assert state.snapshot().log_lines[-1] == "[rank 1] partial"


def test_a_flood_is_cut_to_a_bounded_number_of_lines_naming_the_rest():
    run_dir, state = _files()
    output = RankOutput(run_dir, 2, "rank0")
    _write(run_dir.stderr(1), "Traceback (most recent call last):\n" * 30)
    output.read(state)
    assert len(state.snapshot().log_lines) == 30  # a burst, e.g. a traceback, shows whole
    _write(run_dir.stderr(1), "".join(f"warning {i}\n" for i in range(1000)))
    output.read(state, final=True)
    lines = state.snapshot().log_lines
    assert len(lines) == BURST_LINES + 1 and lines[-2] == f"[rank 1] warning {BURST_LINES - 31}"
    assert lines[-1] == f"[rank 1] ... {1000 - (BURST_LINES - 30)} more lines in {run_dir.log(1)}"


def test_each_rank_keeps_only_its_last_lines():
    state = RunState(world_size=1, device_type="cpu", rank_tail_lines=3)
    state.add_rank_lines(0, [str(i) for i in range(10)])
    assert state.snapshot().rank_logs == (("7", "8", "9"),)


def test_what_was_there_before_the_run_is_not_its_output():
    run_dir, state = _files(1)
    _write(run_dir.log(0), "an earlier run\n")
    output = RankOutput(run_dir, 1, "rank0")
    _write(run_dir.log(0), "this run\n")
    output.read(state)
    assert state.snapshot().log_lines == ("this run",) and output.log_starts == {0: len("an earlier run\n")}


def test_an_unknown_output_mode_is_refused_naming_the_modes():
    with pytest.raises(ConfigurationError, match="output='every' is not a mode: 'rank0' .* or 'all'"):
        launch(print, output="every")


def test_a_late_heartbeat_does_not_undo_a_newer_one():
    state = RunState(world_size=1, device_type="cpu")
    state.apply(Heartbeat(0, 3, 24, 8.0, 100, time=20.0))
    state.apply(Heartbeat(0, 2, 16, 8.0, 100, time=19.0))  # made before, arrived after
    assert (state.snapshot().ranks[0].step, state.snapshot().ranks[0].samples) == (3, 24)


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([(40, 10.0, 99.0), (40, 10.0, 99.0)], {}),
        ([(40, 10.0, 99.0), (36, 10.0, 99.0)], {1: "straggler"}),  # 4 steps behind: more than 3 and a tenth
        ([(40, 10.0, 99.0), (39, 10.0, 99.0)], {}),  # one step: DDP ranks wait for each other
        ([(40, 10.0, 99.0), (40, 10.0, 99.0), (40, 4.0, 99.0)], {2: "straggler"}),  # under half the median
        ([(40, 10.0, 99.0), (40, 10.0, 93.0)], {1: "silent"}),  # 7 s without a heartbeat
    ],
)
def test_stragglers_and_silent_ranks_are_marked(ranks, expected):
    infos = tuple(
        RankInfo(rank, pid=100 + rank, step=step, samples_per_second=rate, last_seen=seen)
        for rank, (step, rate, seen) in enumerate(ranks)
    )
    snapshot = replace(RunState(world_size=len(ranks), device_type="cpu").snapshot(), status="running", ranks=infos)
    assert rank_health(snapshot, now=100.0) == expected
    assert rank_health(replace(snapshot, status="finished"), now=100.0) == {}  # only while it runs


def test_a_pool_of_cpu_workers_takes_no_gpu_choice():
    from flair_nbddp.engine.devices import DevicePlan

    assert DevicePlan("cpu", 2, "gloo").mismatch(None, None, [0, 1]) == "2 × cpu (gloo), not GPUs 0,1"


# -- on 2 gloo ranks ---------------------------------------------------------------------------------------
def speaks_on_every_rank() -> int:
    """Rank 1 warns, logs a flair warning and writes to stderr; every rank prints an ordinary line."""
    import logging
    import sys
    import warnings

    import torch.distributed as dist

    rank = dist.get_rank()
    print(f"ordinary line of rank {rank}")
    if rank == 1:
        warnings.warn("rank 1: the loss is nan")
        logging.getLogger("flair").warning("rank 1: the learning rate is 0")
        print("rank 1 writes to stderr", file=sys.stderr)
    dist.barrier()
    return rank


@pytest.mark.process
@pytest.mark.parametrize("dashboard", [None, False])  # the text view (a script) and the bare lines
def test_another_ranks_warnings_and_stderr_reach_the_cell_prefixed(capsys, dashboard):
    result = launch(speaks_on_every_rank, processes=2, device="cpu", dashboard=dashboard)
    printed = capsys.readouterr().out
    for line in ("ordinary line of rank 0", "[rank 1] rank 1 writes to stderr", "[rank 1] WARNING: rank 1: the learning rate is 0"):
        assert line in printed.splitlines() and line in result.log.splitlines(), line
    assert "UserWarning: rank 1: the loss is nan" in printed and "ordinary line of rank 1" not in printed
    assert result.logs[1].startswith("ordinary line of rank 1\n") and "rank 1 writes to stderr" in result.logs[1]
    assert result.logs[0] == "ordinary line of rank 0\n"


@pytest.mark.process
def test_output_all_prints_every_rank_prefixed(capsys):
    launch(speaks_on_every_rank, processes=2, device="cpu", dashboard=False, output="all")
    printed = capsys.readouterr().out.splitlines()
    assert "[rank 0] ordinary line of rank 0" in printed and "[rank 1] ordinary line of rank 1" in printed
    assert "[rank 1] rank 1 writes to stderr" in printed


@pytest.mark.process
def test_final_step_and_sample_counts_are_exact(warm_pool, tmp_path, tiny_model_path):
    from training_jobs import train_sentiment

    # 24 documents, 4 per batch, 2 ranks: 3 batches of 4 on each rank, over in about a second
    result = warm_pool.launch(train_sentiment, (tiny_model_path, str(tmp_path / "out")), {"epochs": 1, "docs": 24},
                    processes=2, device="cpu", dashboard=False)  # fmt: skip
    assert [(rank.step, rank.samples) for rank in result.ranks] == [(3, 12), (3, 12)]
    assert all(rank.host_memory_bytes > 100 * 2**20 and rank.gpu_utilization is None for rank in result.ranks)


def train_then_warn(model_path: str, base_path: str) -> int:
    """A short training (flair silences its logger on ranks > 0 in it), then a flair warning on rank 1."""
    import logging

    import torch.distributed as dist
    from training_jobs import train_sentiment

    train_sentiment(model_path, base_path, epochs=1, docs=24)
    if dist.get_rank() == 1:
        logging.getLogger("flair").warning("rank 1 after training: the dev score fell")
    dist.barrier()
    return dist.get_rank()


@pytest.mark.process
def test_flair_warnings_of_other_ranks_reach_the_cell_after_training_and_on_every_warm_job(tmp_path, tiny_model_path):
    from flair_nbddp import WorkerPool

    with WorkerPool(2, "cpu") as pool:
        for job in range(2):
            result = pool.launch(train_then_warn, (tiny_model_path, str(tmp_path / f"out{job}")), dashboard=False)
            assert "[rank 1] WARNING: rank 1 after training: the dev score fell" in result.log.splitlines(), job
            assert "EPOCH 1 done" in result.logs[1]  # rank 1's own flair lines are in its log, too
