"""The training panel: params → widgets, run bookkeeping on a fake run, a real failing run, Train/Stop in a kernel."""

import html
import re
import threading
from pathlib import Path

import ipywidgets as widgets
import pytest
from conftest import wait_for
from foreign_claims import ForeignClaim
from jupyter_kernel import running_kernel

from flair_nbddp.engine.devices import resolve_devices
from flair_nbddp.errors import ResumeError, WorkerError
from flair_nbddp.notebook import panel as panel_module
from flair_nbddp.notebook.panel import (
    PanelRun,
    TrainingPanel,
    build_form,
    check_call,
    device_choices,
    nice_step,
    param_widget,
)
from flair_nbddp.notebook.run_table import runs_html
from flair_nbddp.options import RunOptions
from flair_nbddp.pool import WorkerPool, set_current_pool
from flair_nbddp.result import Checkpoint, RunResult
from flair_nbddp.engine.state import MetricPoint, RunState


# -- params → widgets -----------------------------------------------------------------------------
def test_a_boolean_becomes_a_checkbox():
    box = param_widget("shuffle", True)
    assert type(box) is widgets.Checkbox and box.value is True and box.description == "shuffle"


def test_lists_and_tuples_of_non_numbers_become_dropdowns_starting_at_the_first_item():
    sizes = param_widget("mini_batch_size", [8, 16, 32])
    assert type(sizes) is widgets.Dropdown and sizes.options == (8, 16, 32) and sizes.value == 8
    assert param_widget("optimizer", ("adam", "sgd")).value == "adam"
    labelled = param_widget("embeddings", [("tiny", "path/tiny"), ("distilbert", "distilbert-base-uncased")])
    assert labelled.label == "tiny" and labelled.value == "path/tiny"


@pytest.mark.parametrize(
    "spec, value, low, high, step",
    [((1, 10, 4), 4, 1, 10, 1), ((1, 10), 5, 1, 10, 1), ((0, 100, 50, 10), 50, 0, 100, 10)],
)
def test_an_int_range_becomes_an_int_slider(spec, value, low, high, step):
    slider = param_widget("max_epochs", spec)
    assert type(slider) is widgets.IntSlider
    assert (slider.value, slider.min, slider.max, slider.step) == (value, low, high, step)
    assert not slider.continuous_update  # the value is read when Train is pressed: no traffic while dragging


def test_a_float_range_becomes_a_float_slider_with_a_round_step_and_matching_readout():
    slider = param_widget("dropout", (0.0, 0.5, 0.1))
    assert type(slider) is widgets.FloatSlider
    assert (slider.value, slider.min, slider.max, slider.step) == (0.1, 0.0, 0.5, 0.005)
    assert slider.readout_format == ".3f"
    assert param_widget("dropout", (0.0, 0.5)).value == 0.25
    assert param_widget("dropout", (0.0, 0.5, 0.1, 0.05)).step == 0.05


@pytest.mark.parametrize("span, step", [(0.5, 0.005), (1.0, 0.01), (30.0, 0.5), (3.0, 0.05), (700.0, 10.0)])
def test_slider_steps_are_one_two_or_five_times_a_power_of_ten(span, step):
    assert nice_step(span) == step


def test_lone_numbers_become_number_boxes_stepping_by_their_magnitude():
    epochs = param_widget("max_epochs", 4)
    assert type(epochs) is widgets.IntText and epochs.value == 4 and epochs.step == 1
    dropout = param_widget("dropout", 0.25)
    assert type(dropout) is widgets.FloatText and dropout.value == 0.25 and dropout.step == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["learning_rate", "lr", "head_lr", "LR"])
def test_a_learning_rate_gets_a_log_slider_two_decades_either_side(name):
    slider = param_widget(name, 5e-3)
    assert type(slider) is widgets.FloatLogSlider
    assert (slider.value, slider.base, slider.min, slider.max, slider.step) == (5e-3, 10, -5, -1, 0.1)


def test_a_learning_rate_range_spans_its_own_decades_and_starts_at_its_geometric_middle():
    slider = param_widget("learning_rate", (1e-5, 1e-1))
    assert type(slider) is widgets.FloatLogSlider
    assert (slider.min, slider.max) == (-5, -1) and slider.value == pytest.approx(1e-3)
    assert param_widget("learning_rate", (1e-5, 1e-1, 5e-3)).value == 5e-3


def test_strings_become_text_boxes_and_widgets_stay_themselves():
    assert type(param_widget("optimizer", "adam")) is widgets.Text
    mine = widgets.IntSlider(3, min=0, max=5)
    assert param_widget("depth", mine) is mine


def test_the_form_keeps_the_order_and_aligns_the_labels():
    form = build_form(
        {"learning_rate": 5e-3, "max_epochs": (1, 10, 4), "mini_batch_size": [8, 16, 32], "shuffle": True}
    )
    assert list(form) == ["learning_rate", "max_epochs", "mini_batch_size", "shuffle"]
    assert {control.style.description_width for control in form.values()} == {"17ch"}  # mini_batch_size + 2


@pytest.mark.parametrize(
    "params, message",
    [
        ({"dropout": None}, r"params\['dropout'\]=None: cannot make a widget of a NoneType"),
        ({"sizes": []}, r"params\['sizes'\]: an empty list of choices"),
        ({"max_epochs": (10, 1)}, r"params\['max_epochs'\]=\(10, 1\): a range needs min < max"),
        ({"batch": (8, 16, 32)}, r"params\['batch'\].*outside \[8, 16\].*use a list, e\.g\. \[8, 16, 32\]"),
        ({"dropout": (0.0, 0.5, 0.1, 0.0)}, r"params\['dropout'\].*the step must be positive"),
        ({"learning_rate": -1e-3}, r"params\['learning_rate'\]=-0.001: a learning rate must be positive"),
        ({"lr": (0, 1e-1)}, r"params\['lr'\]=\(0, 0.1\): a learning-rate range is .* with min > 0"),
        ({"max-epochs": 3}, r"params key 'max-epochs' is not a valid keyword argument name"),
    ],
)
def test_bad_params_raise_a_value_error_naming_the_param(params, message):
    with pytest.raises(ValueError, match=message):
        build_form(params)


def _train(corpus, model_path, max_epochs=4, learning_rate=5e-3):
    return {"test_score": 0.5}


def test_params_the_function_does_not_take_are_refused_by_name():
    with pytest.raises(ValueError, match="got an unexpected keyword argument 'shuffle'"):
        check_call(_train, True, ["model_path", "shuffle"])
    with pytest.raises(ValueError, match="missing a required argument: 'model_path'"):
        TrainingPanel(_train, corpus="corpus", params={"max_epochs": 3})
    with pytest.raises(ValueError, match=r"params \['max_epochs'\] are also given in fixed"):
        TrainingPanel(_train, corpus="corpus", params={"max_epochs": 3}, fixed={"model_path": "m", "max_epochs": 2})
    check_call(max, False, ["anything"])  # no signature to check: the run will say


def test_device_choices_offer_every_gpu_count_then_cpu_processes():
    assert device_choices(0, 2) == [("1 × cpu (gloo)", ("cpu", 1)), ("2 × cpu (gloo)", ("cpu", 2))]
    eight_cpu_choices = [("cpu", n) for n in range(1, 9)]
    assert [value for _, value in device_choices(2, 64)] == [("cuda", 2), ("cuda", 1), *eight_cpu_choices]


# -- run bookkeeping on a fake run ------------------------------------------------------------------
class FakeRun:
    """Stands in for the :class:`~flair_nbddp.Run` that :func:`flair_nbddp.start` returns: keeps how it was
    started, ends when the test says."""

    def __init__(self, fn, args, kwargs, *, options=None, pool=None, provenance=None, **run_options):
        self.fn, self.args, self.kwargs, self.pool = fn, args, kwargs, pool
        self.options = RunOptions.of(run_options, options)
        self.plan = pool.plan if pool is not None else resolve_devices(self.options.device, self.options.processes)
        self.state = RunState(world_size=self.plan.world_size, device_type=self.plan.device_type)
        self.stopped = False
        self.record_id = None  # not in the run ledger: the panel's table shows it from its own list
        self.ledger_problem = None
        self._ended = threading.Event()
        self._outcome = None

    def stop(self):
        self.stopped = True
        self.state.request_stop()

    def wait(self, timeout=None, on_tick=None):
        self._ended.wait()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        self.state.end(self._outcome.status)
        return self._outcome

    def end(self, status="finished", value=None, error=None, checkpoint=None, metrics=(), checkpoints=()):
        points = [MetricPoint(name, value, 1, 0.0) for name, value in metrics]
        self._end(RunResult(
            value=value, status=status, world_size=2, device_type="cpu", backend="gloo", elapsed=42.0,
            time_to_first_batch=None, samples_per_second=0.0, log="", metrics=points, ranks=[], seed=1,
            run_dir=Path("."), checkpoint=checkpoint, error=error, checkpoints=list(checkpoints),
        ))  # fmt: skip

    def crash(self, error):
        self._end(error)

    def _end(self, outcome):
        self._outcome = outcome
        self._ended.set()


@pytest.fixture
def fake_runs(monkeypatch):
    made = []

    def make(*args, **kwargs):
        made.append(FakeRun(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(panel_module, "start", make)
    return made


@pytest.fixture
def panel():
    return TrainingPanel(
        _train, corpus="the corpus", params={"learning_rate": 5e-3, "max_epochs": (1, 10, 4)},
        fixed={"model_path": "tiny"}, seed=7,
    )  # fmt: skip


def _locked(panel):
    return (
        all(control.disabled for control in panel.controls.values()),
        panel.devices.disabled, panel.train_button.disabled, panel.stop_button.disabled,
    )  # fmt: skip


def test_the_panel_carries_its_css_classes_and_displays_as_a_widget(panel):
    names = ("widget", "train_button", "stop_button", "resume_button", "status", "history")
    classes = {name: getattr(panel, name)._dom_classes for name in names}
    assert classes == {
        "widget": ("nbddp-panel",), "train_button": ("nbddp-train",), "stop_button": ("nbddp-stop",),
        "resume_button": ("nbddp-resume",), "status": ("nbddp-panel-status",), "history": ("nbddp-history",),
    }  # fmt: skip
    bundle = panel._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == panel.widget.model_id
    assert bundle["text/plain"] == "TrainingPanel(_train: 0 run(s))" and "no runs yet" in bundle["text/html"]
    assert _locked(panel) == (False, False, False, True)
    assert panel.devices.value == ("cpu", 2) and "ready" in panel.status.value


def test_train_passes_the_chosen_values_locks_the_form_and_returns_at_once(panel, fake_runs):
    panel.controls["max_epochs"].value = 7
    panel.train_button.click()
    [run] = fake_runs
    assert run.args == ("the corpus",) and run.kwargs == {"model_path": "tiny", "learning_rate": 5e-3, "max_epochs": 7}
    assert run.plan.world_size == 2 and run.pool is None and run.options.seed == 7
    assert panel.active and _locked(panel) == (True, True, True, False)
    assert panel.runs == [PanelRun(1, {"learning_rate": 5e-3, "max_epochs": 7}, "2 × cpu (gloo)")]
    assert "● running" in panel.history.value and panel.dashboard_box.children == (panel.dashboard.widget,)
    run.end()
    panel.wait(timeout=5)


def test_with_wait_s_train_queues_in_the_background_showing_its_place_and_stop_leaves_the_queue(
    panel, fake_runs, monkeypatch, tmp_path
):  # fmt: skip
    from flair_nbddp.engine.claim_files import ClaimDir
    from flair_nbddp.engine.claims import HOLDINGS, Claim

    monkeypatch.setenv("FLAIR_NBDDP_CLAIMS", str(tmp_path / "claims"))
    make, files = panel_module.start, ClaimDir()

    def start_when_free(*args, **kwargs):  # a real wait in the machine's queue, then the fake run
        HOLDINGS.take("panel", "run '_train'", Claim(cpu=2, capacity=2), wait=kwargs["wait_for_devices"])
        return make(*args, **kwargs)

    def another_kernels_run():
        return ForeignClaim(files, label="run 'other'", cpu=2)

    monkeypatch.setattr(panel_module, "start", start_when_free)
    other = another_kernels_run()
    panel.wait_for.value = 60
    assert panel.train() is None and panel.active and _locked(panel) == (True, True, True, False)
    waiter = threading.Thread(target=panel.wait)  # wait() waits for the run the queue starts
    waiter.start()
    wait_for(lambda: "1st in the machine" in panel.status.value, 10, "the queue's place in the panel")
    shown = html.unescape(panel.status.value)
    assert "● waiting" in shown and not fake_runs
    assert "the CPU's 2 process slots are held: 2 by run 'other' of" in shown
    other.end()  # the devices free up: the run starts
    wait_for(lambda: fake_runs, 10, "the run to start")
    assert fake_runs[0].options.wait_for_devices == 60 and panel.run is fake_runs[0]
    assert waiter.is_alive()
    fake_runs[0].end()
    waiter.join(5)
    assert not waiter.is_alive() and panel.result.status == "finished"
    HOLDINGS.give_back("panel")
    assert panel.train() is fake_runs[1]  # free devices: the run starts at once, queue or not
    fake_runs[1].end()
    panel.wait(timeout=5)
    HOLDINGS.give_back("panel")
    other = another_kernels_run()
    panel.train()
    wait_for(lambda: "1st in the machine" in panel.status.value, 10, "the queue's place in the panel")
    panel.stop_button.click()  # leaves the queue
    wait_for(lambda: not panel.active, 10, "the panel to leave the queue")
    assert "2 by run 'other' of" in html.unescape(panel.message.value) and "ready" in panel.status.value
    assert _locked(panel) == (False, False, False, True) and len(fake_runs) == 2 and not HOLDINGS.holds("panel")
    other.end()


def test_a_finished_run_is_recorded_with_its_scores_and_unlocks_the_form(panel, fake_runs):
    panel.train()
    fake_runs[0].end(value={"test_score": 0.875, "model": object()}, metrics=[("dev/score", 0.9), ("train/loss", 0.2)])
    result = panel.wait(timeout=5)
    assert result is panel.result and result.status == "finished"
    [record] = panel.runs
    assert (record.status, record.elapsed, record.result) == ("finished", 42.0, result)
    assert record.scores == {"test_score": 0.875, "dev/score": 0.9, "train/loss": 0.2}
    assert not panel.active and _locked(panel) == (False, False, False, True)
    assert "● finished" in panel.status.value and "run 1 · 42 s" in panel.status.value
    assert "0.8750" in panel.history.value and "42 s" in panel.history.value
    assert panel.message.layout.display == "none"
    assert repr(panel) == (
        "TrainingPanel(_train: 1 run(s); last finished, test_score 0.8750, dev/score 0.9000, train/loss 0.2000)"
    )


def test_stop_asks_the_run_to_stop_gracefully_and_a_second_train_works(panel, fake_runs):
    panel.train()
    panel.stop_button.click()
    assert fake_runs[0].stopped and panel.stop_button.disabled and "stopping after this batch" in panel.status.value
    fake_runs[0].end("stopped", value={"test_score": 0.6}, checkpoint=Path("out/final-model.pt"))
    panel.wait(timeout=5)
    assert "● stopped" in panel.status.value and "model saved" in panel.status.value

    panel.controls["learning_rate"].value = 1e-3
    panel.train_button.click()
    assert len(fake_runs) == 2 and fake_runs[1].kwargs["learning_rate"] == 1e-3
    fake_runs[1].end()
    panel.wait(timeout=5)
    assert [record.status for record in panel.runs] == ["stopped", "finished"]
    history = panel.history.value
    assert history.index("0.001") < history.index("0.005")  # newest first


def test_resume_continues_the_last_stopped_run_from_its_checkpoint_with_its_values(panel, fake_runs):
    assert panel.resume_button.disabled  # no run yet
    panel.controls["max_epochs"].value = 6
    panel.train()
    fake_runs[0].end("stopped", checkpoints=[Checkpoint(1, Path("run/checkpoint.pt"), "ab", 3)])
    stopped = panel.wait(timeout=5)
    assert not panel.resume_button.disabled and panel.resumable is panel.runs[0]
    panel.controls["max_epochs"].value = 9  # changed since: Resume continues the run as it was
    panel.resume_button.click()
    resumed = fake_runs[1]
    assert resumed.options.resume is stopped and resumed.kwargs["max_epochs"] == 6
    assert (resumed.options.device, resumed.options.processes) == ("cpu", 2)  # the stopped run's devices
    assert panel.controls["max_epochs"].value == 6 and panel.resume_button.disabled  # locked while it runs
    resumed.end()
    panel.wait(timeout=5)
    assert panel.resume_button.disabled  # the last run finished: nothing to resume
    with pytest.raises(ResumeError, match="nothing to resume"):
        panel.resume()
    assert "nothing to resume" in panel.message.value


def test_the_fixed_run_options_reach_every_run(fake_runs):
    panel = TrainingPanel(_train, corpus="the corpus", params={"learning_rate": 5e-3}, fixed={"model_path": "tiny"},
                          seed=7, hang_timeout=60, distributed_eval=False)  # fmt: skip
    panel.train()
    options = fake_runs[0].options
    assert (options.seed, options.hang_timeout, options.distributed_eval) == (7, 60, False)
    fake_runs[0].end()
    panel.wait(timeout=5)


def test_a_stopped_run_shows_no_test_score_rather_than_a_zero(panel, fake_runs):
    panel.train()
    fake_runs[0].end("stopped", value={"test_score": float("nan")}, metrics=[("dev/score", 0.7)])
    panel.wait(timeout=5)
    panel.train()
    fake_runs[1].end(value={"test_score": 0.8})
    panel.wait(timeout=5)
    assert panel.runs[0].scores == {"dev/score": 0.7}
    rows = panel.history.value.split("<tr")[2:]  # newest first: the finished run, then the stopped one
    assert "0.8000" in rows[0] and "● stopped" in rows[1]
    # "—" for the missing test score, and for "#": the fake runs are not in the run ledger
    assert "0.0000" not in rows[1] and "nan" not in rows[1].lower() and rows[1].count("—") == 2


def test_a_worker_failure_shows_in_red_with_the_traceback_folded(panel, fake_runs):
    panel.train()
    traceback = 'Traceback:\n  File "train.py"\nValueError: <bad>'
    error = WorkerError(1, "ValueError", "bad label", traceback, exit_code=1, log_path="/runs/rank1.log")
    fake_runs[0].end("failed", error=error)
    panel.wait(timeout=5)
    assert panel.runs[0].status == "failed" and panel.runs[0].error is error
    assert panel.message.layout.display is None
    assert "rank 1 failed: ValueError: bad label" in panel.message.value and "<details" in panel.message.value
    assert "ValueError: &lt;bad&gt;" in panel.message.value  # the remote traceback, escaped
    assert "● failed" in panel.status.value and _locked(panel) == (False, False, False, True)

    panel.train()  # the next run clears the message
    assert panel.message.layout.display == "none"
    fake_runs[1].end()
    panel.wait(timeout=5)


def test_a_run_that_cannot_start_is_shown_and_leaves_the_form_usable(panel, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("another run is still active in this kernel")

    monkeypatch.setattr(panel_module, "start", refuse)
    panel.train_button.click()  # a click has nowhere to raise to
    assert "RuntimeError: another run is still active" in panel.message.value
    assert panel.runs == [] and not panel.active and _locked(panel) == (False, False, False, True)
    with pytest.raises(RuntimeError, match="another run"):
        panel.train()  # code gets the exception as well


def test_a_panel_bug_while_watching_is_shown_not_lost(panel, fake_runs):
    panel.train()
    fake_runs[0].crash(OSError("disk full"))
    panel.wait(timeout=5)
    assert panel.runs[0].status == "failed" and "lost track of run 1: OSError" in panel.message.value
    assert "Traceback" in panel.message.value and not panel.active
    assert not panel.dashboard._thread.is_alive()  # the dashboard stopped redrawing the lost run


def test_wait_gives_up_after_its_timeout_and_the_run_goes_on(panel, fake_runs):
    panel.train()
    with pytest.raises(TimeoutError, match="did not end within 0.2 s"):
        panel.wait(timeout=0.2)
    assert panel.active
    fake_runs[0].end()
    panel.wait(timeout=5)


def test_with_a_warm_pool_the_panel_runs_on_it(panel, fake_runs):
    pool = WorkerPool(processes=2, device="cpu")  # no worker starts before its first job
    set_current_pool(pool)
    try:
        panel.train()
        assert fake_runs[0].pool is pool and panel.devices.options[0][0] == "2 × cpu (gloo), warm pool"
        fake_runs[0].end()
        panel.wait(timeout=5)
        assert panel.devices.disabled  # a pool's size is fixed
    finally:
        set_current_pool(None)
        pool.close()
    panel.train()
    assert fake_runs[1].pool is None and panel.devices.disabled  # locked while the run is active
    fake_runs[1].end()
    panel.wait(timeout=5)
    assert not panel.devices.disabled and panel.devices.value == ("cpu", 2)


def test_a_run_missing_from_the_run_ledger_says_so_in_the_panel(panel, fake_runs):
    panel.train()
    fake_runs[0].ledger_problem = "the run ledger /home/me/runs.sqlite cannot be used (...). This run goes on, unrecorded."
    fake_runs[0].end(value={"test_score": 0.5})
    panel.wait(timeout=5)
    assert panel.message.layout.display is None and "missing from the run ledger" in panel.message.value
    assert "/home/me/runs.sqlite cannot be used" in panel.message.value and "● finished" in panel.status.value


def test_the_history_table_survives_a_damaged_ledger(tmp_path, monkeypatch, fake_runs):
    monkeypatch.setenv("FLAIR_NBDDP_HOME", str(tmp_path))
    (tmp_path / "runs.sqlite").write_bytes(b"not a database" * 100)
    panel = TrainingPanel(_train, corpus="c", params={"learning_rate": 5e-3}, fixed={"model_path": "tiny"})
    assert "no runs yet" in panel.history.value
    panel.train()
    fake_runs[0].end(value={"test_score": 0.5})
    panel.wait(timeout=5)
    assert "0.5000" in panel.history.value  # this panel's own run, from its list


def test_history_table_unites_the_columns_of_every_run():
    html = runs_html([
        PanelRun(1, {"lr": 0.005}, "2 × cpu (gloo)", "finished", 30.0, {"test_score": 0.91}).as_record(),
        PanelRun(2, {"lr": 0.001, "shuffle": False}, "1 × cpu (gloo)", "failed", 3.0).as_record(),
    ], param_names=["lr", "shuffle"])  # fmt: skip
    assert html.count("<tr>") == 3 and ">shuffle<" in html and ">test_score<" in html
    assert html.count("—") == 4  # run 1 had no shuffle; run 2 no score; neither is in the ledger (#)
    unsafe = PanelRun(1, {"optimizer": "<b>"}, "2 × cpu (gloo)").as_record()
    assert "&lt;b&gt;" in runs_html([unsafe], param_names=["optimizer"])


# -- a real run of 2 CPU processes --------------------------------------------------------------------
def _fail_on_rank_one(corpus, learning_rate):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"learning_rate={learning_rate} is not for {corpus}")
    dist.barrier()


@pytest.mark.process
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_real_worker_failure_reaches_the_panel():
    panel = TrainingPanel(_fail_on_rank_one, corpus="this corpus", params={"learning_rate": 5e-3})
    panel.train()
    result = panel.wait(timeout=90)
    assert result.status == "failed" and isinstance(result.error, WorkerError)
    assert "rank 1 failed: ValueError: learning_rate=0.005 is not for this corpus" in panel.message.value
    assert "_fail_on_rank_one" in panel.message.value  # the remote traceback
    assert not panel.active and not panel.train_button.disabled


# -- Train and Stop in a real kernel ------------------------------------------------------------------
SETUP = """
import time, psutil
from flair_nbddp.notebook.panel import TrainingPanel
from flair_nbddp.demo import train_classifier
from flair_nbddp.synthetic import sentiment_corpus

corpus = sentiment_corpus(400)
panel = TrainingPanel(
    train_classifier, corpus=corpus,
    params={{"learning_rate": 5e-3, "max_epochs": (1, 30, 20), "mini_batch_size": [4, 8, 16]}},
    fixed={{"model_path": {model!r}, "base_path": {out!r}, "return_model": False}},
)
panel
"""
CLICK_TRAIN = """
started = time.monotonic()
panel.train_button.click()
print("returned after", time.monotonic() - started)
"""
AWAIT_PROGRESS = """
deadline = time.monotonic() + 90
while panel.dashboard.bar.value < 0.01 and panel.active and time.monotonic() < deadline:
    time.sleep(0.1)
print('progress', panel.dashboard.bar.value)
"""
AFTER_STOP = """
result = panel.wait(timeout=60)
from flair_nbddp.worker.process_name import RANK_PREFIX
workers = [p for p in psutil.Process().children(recursive=True) if p.name().startswith(RANK_PREFIX)]
print(result.status, result.checkpoint.name, panel.runs[0].params, len(workers))
print("test_score", result.value["test_score"], "in the table's scores:", "test_score" in panel.runs[0].scores)
"""
RESUME = """
panel.resume_button.click()
deadline = time.monotonic() + 90
while panel.run.state.snapshot().ranks[0].step < 2 and panel.active and time.monotonic() < deadline:
    time.sleep(0.1)
panel.stop()
resumed = panel.wait(timeout=60)
import flair_nbddp
print(resumed.status, flair_nbddp.history(limit=1)[0].resumed_from == panel.runs[0].record_id, len(panel.runs))
"""


def _ok(result):
    assert result.error is None, "\n".join(result.error["traceback"])[-3000:]
    return result


@pytest.mark.kernel
def test_train_and_stop_buttons_drive_a_real_run_in_a_kernel(tiny_model_path, tmp_path):
    with running_kernel(cwd=tmp_path) as kernel:
        shown = _ok(kernel.execute(SETUP.format(model=tiny_model_path, out=str(tmp_path / "out")), timeout=120))
        assert shown.data("text/plain") == ["TrainingPanel(train_classifier: 0 run(s))"]
        clicked = _ok(kernel.execute(CLICK_TRAIN))
        assert float(clicked.stdout.split()[-1]) < 5  # Train returned while the run goes on
        progressed = _ok(kernel.execute(AWAIT_PROGRESS, timeout=120))
        assert float(progressed.stdout.split()[-1]) >= 0.01, progressed.stdout
        _ok(kernel.execute("panel.stop_button.click()"))
        ended = _ok(kernel.execute(AFTER_STOP, timeout=90))
        resumed = _ok(kernel.execute(RESUME, timeout=150))  # from where the stop left it: its checkpoint

    expected = "stopped final-model.pt {'learning_rate': 0.005, 'max_epochs': 20, 'mini_batch_size': 4} 0"
    assert ended.stdout.strip().splitlines() == [expected, "test_score nan in the table's scores: False"]
    notice, outcome = resumed.stdout.strip().splitlines()  # inside an epoch: where the stop's click reached the run
    resuming = r"flair_nbddp: resuming run #\d+ from epoch \d+, batch \d+ \(.*checkpoint\.pt\)"
    assert re.fullmatch(resuming, notice), notice
    assert outcome == "stopped True 2"
    [train] = kernel.widgets_with_class("nbddp-train")
    [stop] = kernel.widgets_with_class("nbddp-stop")
    [resume] = kernel.widgets_with_class("nbddp-resume")
    assert train.history("disabled") == [False, True, False, True, False]
    assert stop.history("disabled") == [True, False, True, False, True]
    assert resume.history("disabled") == [True, False, True, False]  # offered after each stop
    sliders = [model for model in kernel.widgets.values() if model.model_name == "IntSliderModel"]
    assert sliders[0].history("disabled") == [False, True, False, True, False]
    bar = kernel.widgets_with_class("nbddp-progress")[0]  # the first run's (the resumed run has its own)
    assert any(0 < value < 1 for value in bar.history("value")), "no live progress reached the frontend"
    [status] = kernel.widgets_with_class("nbddp-panel-status")
    assert any("● running" in value for value in status.history("value"))
    assert any("stopping after this batch" in value for value in status.history("value"))
    assert "● stopped" in status.state["value"] and "model saved" in status.state["value"]
    [history] = kernel.widgets_with_class("nbddp-history")
    assert "● stopped" in history.state["value"] and "2 × cpu (gloo)" in history.state["value"]
