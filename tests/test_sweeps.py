"""Runs side by side on disjoint devices, and sweeps: the claims, lanes and studies (fast), and real sweeps of
one-process trials on 2 CPU processes (process tier)."""

from pathlib import Path

import optuna
import pytest
from conftest import python_program, wait_for
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from test_run import FakeSource, finish

import flair_nbddp
from flair_nbddp.engine.devices import DevicePlan
from flair_nbddp.errors import ConfigurationError, DeviceError, RunActiveError
from flair_nbddp.options import RunOptions
from flair_nbddp.pool import WorkerPool
from flair_nbddp.engine.run import Run
from flair_nbddp.sweeps import runner
from flair_nbddp.sweeps.lanes import lanes
from flair_nbddp.sweeps.study import journal_storage, open_study, space_names, study_file

LR = {"lr": optuna.distributions.CategoricalDistribution([0.05, 0.5, 50.0])}


def double(x):
    return 2 * x


def test_runs_on_disjoint_gpus_go_side_by_side_and_a_shared_gpu_is_refused_naming_its_run():
    first, second, third = FakeSource(), FakeSource(), FakeSource()
    first.plan, second.plan, third.plan = (DevicePlan("cuda", 2, "nccl", gpus) for gpus in ((0, 1), (2, 3), (1, 2)))
    runs = [Run(double, (1,), {}, source).start() for source in (first, second)]  # side by side
    held = r"GPU 1 is held by run (#\d+ )?'double' \(started .*2 × cuda 0,1 \(nccl\)\)"
    with pytest.raises(RunActiveError, match=held):
        Run(double, (1,), {}, third).start()
    assert third.jobs == []  # refused before anything was packed or started
    for source, run in zip((first, second), runs):
        finish(source, 2)
        assert run.wait(timeout=10).value == 2
    finish_third = Run(double, (1,), {}, third).start()  # the GPUs are free again
    finish(third, 2)
    assert finish_third.wait(timeout=10).status == "finished"


def test_cpu_runs_hold_process_slots_out_of_the_cpus_two():
    sources = [FakeSource(1), FakeSource(1), FakeSource(2)]
    first, second = Run(double, (1,), {}, sources[0]).start(), Run(double, (2,), {}, sources[1]).start()
    held = r"the CPU's 2 process slots are held: 1 by run (#\d+ )?'double'.*, 1 by run"
    with pytest.raises(RunActiveError, match=held):
        Run(double, (3,), {}, sources[2]).start()
    finish(sources[0], 2)
    first.wait(timeout=10)
    with pytest.raises(RunActiveError, match=r"1 by run (#\d+ )?'double'"):  # one slot free, two asked
        Run(double, (3,), {}, sources[2]).start()
    finish(sources[1], 4)
    second.wait(timeout=10)
    whole = Run(double, (3,), {}, sources[2]).start()
    finish(sources[2], 6)
    assert whole.wait(timeout=10).value == 6


def test_cpu_processes_get_a_slots_share_of_the_cores_alone_or_side_by_side(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the user's own count wins over the share (below)
    threads = {n: DevicePlan("cpu", n, "gloo").rank_environment(0, 1)["OMP_NUM_THREADS"] for n in (1, 2, 4)}
    assert threads == {1: "4", 2: "4", 4: "2"}  # a run alone or beside another: the same arithmetic
    sliced = WorkerPool(4, "cpu", job_processes=1)  # its four workers exist at once: a quarter each
    assert sliced.job_plan.rank_environment(0, 1)["OMP_NUM_THREADS"] == "2"
    sliced.close()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert DevicePlan("cpu", 1, "gloo").rank_environment(0, 1)["OMP_NUM_THREADS"] == "1"


def test_gpu_lanes_take_their_gpus_and_leave_the_sweeps_process_count(monkeypatch):
    monkeypatch.setattr("flair_nbddp.engine.devices.visible_gpu_count", lambda: 4)
    ways = lanes(RunOptions(processes=4, device="cuda"), 2)
    assert [(lane.label, lane.options) for lane in ways] == [
        ("GPUs 0,1", {"processes": None, "device": None, "gpus": (0, 1)}),
        ("GPUs 2,3", {"processes": None, "device": None, "gpus": (2, 3)}),
    ]  # fmt: skip
    assert RunOptions.of(ways[1].options, RunOptions(processes=4)).processes is None  # each trial: its GPUs
    assert [lane.label for lane in lanes(RunOptions(gpus=(1, 3)), 1)] == ["GPU 1", "GPU 3"]


def test_lanes_split_the_devices_and_refuse_what_cannot_be_split():
    assert [lane.label for lane in lanes(RunOptions(device="cpu"), 1)] == ["CPU"] * 2
    assert len(lanes(RunOptions(device="cpu"), 2)) == 1
    with pytest.raises(ConfigurationError, match="trial_processes=3, and the sweep has 2 CPU processes"):
        lanes(RunOptions(device="cpu"), 3)
    with pytest.raises(ConfigurationError, match="CPU has 2 process slots"):
        lanes(RunOptions(device="cpu", processes=4), 1)
    pool = WorkerPool(2, "cpu")
    with pytest.raises(ConfigurationError, match=r"WorkerPool\(..., job_processes=1\)"):
        lanes(RunOptions(), 1, pool)
    pool.close()
    sliced = WorkerPool(2, "cpu", job_processes=1)
    assert [lane.label for lane in lanes(RunOptions(), 1, sliced)] == ["pool slice"] * 2
    with pytest.raises(DeviceError, match="2 slices of 1 × cpu"):
        flair_nbddp.launch(double, (1,), pool=sliced, processes=2)
    with pytest.raises(ConfigurationError, match="exec\\(\\) runs code on every worker of one process group"):
        sliced.exec("1")
    sliced.close()
    with pytest.raises(ConfigurationError, match="does not divide"):
        WorkerPool(2, "cpu", job_processes=3)


def test_a_study_is_kept_by_name_and_refuses_the_other_direction():
    study = open_study("kept", "maximize")
    study.tell(study.ask(), 0.5)
    again = open_study("kept", "maximize")
    assert len(again.trials) == 1 and study_file("kept").exists()
    with pytest.raises(ConfigurationError, match="study 'kept' maximizes its metric, and direction='minimize'"):
        open_study("kept", "minimize")
    with pytest.raises(ConfigurationError, match="pruner= goes with a study's name"):
        open_study(again, "maximize", optuna.pruners.NopPruner())
    assert space_names(LR) == ["lr"]
    with pytest.raises(ConfigurationError, match=r"space\['lr'\] is not an Optuna distribution"):
        space_names({"lr": [0.1, 0.2]})
    with pytest.raises(ConfigurationError, match="return a dict of keyword arguments"):
        space_names(lambda trial: trial.suggest_float("lr", 0.1, 1.0))


def test_compare_ticks_whole_epochs():
    record = flair_nbddp.RunRecord(id=1, name="train", status="finished")
    axes = flair_nbddp.compare([record]).axes[0]
    assert axes.xaxis.get_major_locator()._integer


def test_ddp_sweep_names_a_missing_space_and_takes_the_spaces_names_as_the_cells():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "flair_nbddp")
    with pytest.raises(UsageError, match="--space nothing_here: no such notebook variable"):
        shell.run_cell_magic("ddp_sweep", "--space nothing_here --trials 1", "lr")
    shell.user_ns["space"] = LR
    with pytest.raises(UsageError, match="'undefined_thing', not defined in the notebook"):  # lr is not asked for
        shell.run_cell_magic("ddp_sweep", "--space space --trials 1 --no-dashboard", "lr * undefined_thing")
    InteractiveShell.clear_instance()


class PruneTheHighest(optuna.pruners.BasePruner):
    """Prunes the trial of the largest learning rate after its first epoch: a deterministic pruner."""

    def prune(self, study, trial):
        return trial.params["lr"] == 50.0 and bool(trial.intermediate_values)


@pytest.mark.process
def test_a_sweep_runs_two_trials_at_once_prunes_records_and_its_best_model_predicts(tmp_path, no_leftover_processes):
    from flair.data import Sentence
    from training_jobs import fails_when_told, train_classifier_with

    from flair_nbddp.synthetic import sentiment_corpus

    study = optuna.create_study(study_name="two-at-once", storage=journal_storage("two-at-once"),
                                direction="maximize", pruner=PruneTheHighest())  # fmt: skip
    for lr, fail in ((0.05, False), (50.0, False), (0.5, False), (0.05, True)):  # these trials, in this order
        study.enqueue_trial({"lr": lr, "fail": fail})
    def space(trial):
        return {"lr": trial.suggest_float("lr", 0.01, 100.0, log=True),
                "fail": trial.suggest_categorical("fail", [False, True])}  # fmt: skip

    corpus = sentiment_corpus(n_train=120, n_dev=30, n_test=30, seed=2)
    result = flair_nbddp.sweep(
        fails_when_told, (train_classifier_with, corpus, str(tmp_path)), space=space, n_trials=4, device="cpu",
        study=study, seed=1,
    )  # fmt: skip
    rows = {row.number: row for row in result.state.rows}
    records = {record.trial["number"]: record for record in result.records}
    assert sorted(records) == [0, 1, 2, 3] and [rows[n].lane for n in range(4)] == ["CPU"] * 4
    first, second = records[0], records[1]
    assert first.started_at < second.ended_at and second.started_at < first.ended_at  # side by side
    states = {n: (records[n].trial["state"], rows[n].state) for n in range(4)}
    assert states == {0: ("complete",) * 2, 1: ("pruned",) * 2, 2: ("complete",) * 2, 3: ("failed",) * 2}
    assert "told to fail" in rows[3].error  # and the sweep went on
    # pruned as epoch 1 was reported: stopped after the batch then running (epoch 2 may end first: ~0.1 s here)
    assert [step for step, _ in rows[1].curve][:1] == [1] and len(rows[1].curve) <= 2 and records[1].status == "stopped"
    assert records[0].trial["params"] == {"lr": 0.05, "fail": False} and records[0].origin == "sweep"
    completed = {t.number: t.value for t in result.study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert completed == {0: rows[0].value, 2: rows[2].value}
    best = result.best
    assert best is not None and best.record_id == result.best_record.id
    sentence = Sentence("a wonderful, moving film")
    best.value["model"].predict(sentence)
    assert sentence.get_label("sentiment").value in ("POSITIVE", "NEGATIVE")

    # the study goes on in a new process (as after a kernel restart), which adds its trial to the same journal
    program = f"""
import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
import optuna, flair_nbddp
from flair_nbddp.synthetic import sentiment_corpus
from training_jobs import fails_when_told, train_classifier_with
corpus = sentiment_corpus(n_train=60, n_dev=10, n_test=10, seed=2)
result = flair_nbddp.sweep(fails_when_told, (train_classifier_with, corpus, {str(tmp_path)!r}), {{"epochs": 1}},
    space={{"lr": optuna.distributions.FloatDistribution(0.01, 1.0, log=True)}}, n_trials=1, device="cpu", study="two-at-once",
    dashboard=False)
print("TRIALS", len(result.study.trials), result.state.rows[0].number, result.state.rows[0].state)
"""
    assert "TRIALS 5 4 complete" in python_program(program)


@pytest.mark.process
def test_stop_mid_sweep_stops_every_running_trial_and_leaves_nothing(tmp_path, no_leftover_processes):
    from training_jobs import train_classifier_with

    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(n_train=120, n_dev=30, n_test=30, seed=2)
    result = flair_nbddp.sweep(
        train_classifier_with, (corpus, str(tmp_path)), {"epochs": 20}, space=LR, n_trials=6, device="cpu", wait=False
    )  # fmt: skip
    assert not result.done  # the cell is free: the view's Stop button can act
    wait_for(lambda: sum(bool(row.curve) for row in result.state.rows) == 2, 120, "two trials to train an epoch")
    result.stop()  # what the Stop button does
    assert result.wait(timeout=60) is result and result.done
    assert [row.state for row in result.state.rows] == ["stopped", "stopped"]  # no trial started after the Stop
    assert all(record.status == "stopped" and record.checkpoint for record in result.records)  # their models saved
    assert [t.state for t in result.study.trials] == [optuna.trial.TrialState.FAIL] * 2
    assert not any(run.active for run in flair_nbddp.runs())


def test_the_sweep_widget_shows_every_trial_and_its_stop_ends_the_sweep(capsys):
    from flair_nbddp.notebook.sweep_view import SweepText, SweepWidget

    state = runner.SweepState("lr-search", "dev/score", "maximize", n_trials=3, lanes=2)
    state.rows += [
        runner.TrialRow(0, {"lr": 0.05}, "GPU 0", state="complete", value=0.81, curve=[(1, 0.7), (2, 0.81)],
                        ended_at=1e10),
        runner.TrialRow(1, {"lr": 50.0}, "GPU 1", state="pruned", curve=[(1, 0.2)], ended_at=1e10),
        runner.TrialRow(2, {"lr": 0.5}, "GPU 1", curve=[(1, 0.6)]),
    ]  # fmt: skip
    sweep = runner.Sweep(optuna.create_study(direction="maximize"), state)
    held = SweepWidget()
    held.start(sweep)  # the sweep holds the cell: a button could not act; the interrupt stops it
    assert held.stop_button.layout.display == "none" and "interrupt the kernel" in held.hint.value
    sweep.background = True
    widget = SweepWidget()
    widget.start(sweep)
    assert widget.hint.layout.display == "none" and widget.stop_button.layout.display != "none"
    assert "study &#x27;lr-search&#x27;: 1 running, 1 complete, 1 pruned of 3 (2 at a time); best #0 dev/score 0.81" in (
        widget.title.value)  # fmt: skip
    assert widget.table.value.count("<tr>") == 4 and "lr=50" in widget.table.value and "GPU 1" in widget.table.value
    assert widget.charts.value.count("<svg") == 2  # the best so far, and the running trial's curve
    widget.stop_button.click()
    assert state.stopping
    bundle = widget._repr_mimebundle_()  # a saved notebook's view of it: the headline, the table and the charts
    assert bundle["text/plain"].startswith("study 'lr-search'") and bundle["text/html"].count("<tr>") == 4
    assert "application/vnd.jupyter.widget-view+json" in bundle
    text = SweepText()
    text.start(sweep)
    text.poll()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("flair_nbddp: ")]
    assert "flair_nbddp: trial #1 pruned at epoch 1; lr=50; " in lines[3] and len(lines) == 5


@pytest.mark.process
def test_the_ddp_sweep_magic_runs_the_cell_with_the_spaces_parameters(tmp_path, no_leftover_processes):
    from flair_nbddp.synthetic import sentiment_corpus

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "flair_nbddp")
    shell.user_ns.update(corpus=sentiment_corpus(n_train=60, n_dev=20, n_test=20, seed=2), space=LR, out=str(tmp_path))
    shell.run_cell("import sys; sys.path.insert(0, " + repr(str(Path(__file__).parent)) + ")").raise_error()
    shell.run_cell("from training_jobs import train_classifier_with").raise_error()
    cell = "result = train_classifier_with(corpus, out, lr=lr, epochs=1)\nresult['test_score'], lr"
    sweep = shell.run_cell_magic("ddp_sweep", "--space space --trials 2 --out found --no-dashboard --device cpu", cell)
    assert shell.user_ns["found"] is sweep and len(sweep.state.rows) == 2
    assert [record.name for record in sweep.records] == ["%%ddp_sweep"] * 2
    for row, record in zip(sweep.state.rows, sweep.records):
        assert row.state == "complete" and record.trial["params"] == row.params and record.source == cell
    assert sweep.best.value[1] == sweep.state.best().params["lr"]  # the cell saw the trial's lr
    InteractiveShell.clear_instance()


def test_wait_all_stops_every_run_it_waits_for_at_the_first_interrupt(capsys):
    import _thread
    import sys
    import threading

    from flair_nbddp.wire.events import STOP

    sources = [FakeSource(1), FakeSource(1)]
    runs = [Run(double, (n,), {}, source).start() for n, source in enumerate(sources)]

    def waiting() -> bool:
        frame = sys._current_frames()[threading.main_thread().ident]
        while frame is not None and frame.f_code.co_name != "wait_all":
            frame = frame.f_back
        return frame is not None

    def interrupt_then_end():
        wait_for(waiting, 10, "wait_all to wait")
        _thread.interrupt_main()  # the kernel's Interrupt
        wait_for(lambda: all(STOP in source.ranks.requests for source in sources), 10, "both runs to be stopped")
        for source in sources:
            finish(source, 0)

    helper = threading.Thread(target=interrupt_then_end)
    helper.start()
    results = flair_nbddp.wait_all(runs, timeout=30)
    helper.join()
    assert [result.status for result in results] == ["stopped", "stopped"]
    assert "stopping every run after its current batch" in capsys.readouterr().out


def test_a_pools_workers_serve_one_run_at_a_time_and_a_sliced_pool_lends_a_free_slice():
    from flair_nbddp.engine.claims import HOLDINGS

    pool = WorkerPool(4, "cpu", job_processes=1)  # more slices than the CPU's 2 process slots: they hold none
    slices = []
    for holder in range(4):
        slices.append(pool.lease(None, None, None))
        HOLDINGS.take(holder, f"run 'trial {holder}'", slices[-1].claim)
    assert len(set(map(id, slices))) == 4
    refused = pool.lease(None, None, None)  # every slice is held: the first, whose run is refused as it starts
    with pytest.raises(RunActiveError, match=r"slice 0 of WorkerPool pool-\w+ is held by run 'trial 0'"):
        Run(double, (1,), {}, refused).start()
    for holder in range(4):
        HOLDINGS.give_back(holder)
    pool.close()
    whole = WorkerPool(1, "cpu")
    HOLDINGS.take("first", "run 'train'", whole.claim)
    with pytest.raises(RunActiveError, match=r"WorkerPool pool-\w+ is held by run 'train'"):
        flair_nbddp.start(double, (1,), pool=whole)  # refused before the pool's workers are touched
    HOLDINGS.give_back("first")
    whole.close()


def test_a_run_nobody_waited_for_gives_its_devices_back_once_it_has_ended():
    first, second = FakeSource(2), FakeSource(2)
    ended = Run(double, (1,), {}, first).start()
    finish(first, 2)
    wait_for(lambda: ended.ended, 10, "the first run to end")
    after = Run(double, (2,), {}, second).start()  # the first run's CPU slots came back without a wait()
    finish(second, 4)
    assert after.wait(timeout=10).value == 4 and ended.wait(timeout=1).value == 2
