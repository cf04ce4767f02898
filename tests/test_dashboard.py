"""The run views: pure rendering, the widget dashboard on synthetic events, and the dashboard in a real kernel."""

import re
import time
from types import SimpleNamespace

import pytest
from jupyter_kernel import running_kernel

from flair_nbddp.engine.devices import DevicePlan
from flair_nbddp.errors import WorkerError
from flair_nbddp.notebook import dashboard
from flair_nbddp.notebook.dashboard import (
    Dashboard,
    NullView,
    TextView,
    charts_html,
    decimate,
    describe_problem,
    epoch_table_html,
    format_bytes,
    format_duration,
    log_html,
    metric_series,
    open_view,
    progress_text,
    ranks_table_html,
    status_html,
    summary_text,
    svg_chart,
)
from flair_nbddp.engine.state import RunState
from flair_nbddp.wire.events import Heartbeat, Metric, Progress, Started


class FakeRun:
    """What the views read from a :class:`~flair_nbddp.Run`, fed with synthetic events."""

    def __init__(self, run_dir):
        self.plan = DevicePlan("cpu", 2, "gloo")
        self.state = RunState(world_size=2, device_type="cpu")
        self.run_dir = run_dir

    def start_ranks(self):
        for rank in (0, 1):
            self.state.apply(Started(rank, pid=1000 + rank, device="cpu"))

    def train(self, epochs=2, batches=4):
        """Every event flair would cause for ``epochs`` epochs of ``batches`` batches, losses falling."""
        step = 0
        for epoch in range(1, epochs + 1):
            for batch in range(1, batches + 1):
                step += 1
                self.state.apply(Progress(0, epoch=epoch, max_epochs=epochs, batch=batch, total_batches=batches))
                self.state.apply(Metric(0, name="train/batch_loss", value=1.0 / step, step=step))
                self.state.apply(Metric(0, name="learning_rate/0", value=0.01, step=step))
            self.state.apply(Metric(0, name="train/loss", value=1.0 / epoch, step=epoch))
            self.state.apply(Metric(0, name="dev/score", value=0.5 + 0.2 * epoch, step=epoch))
            for rank in (0, 1):
                self.state.apply(Heartbeat(rank, step=step, samples=8 * step, samples_per_second=40.0,
                                           host_memory_bytes=3 * 2**29))  # fmt: skip
            self.state.add_log_lines([f"EPOCH {epoch} done: loss {1.0 / epoch:.4f}"])


@pytest.fixture
def run(tmp_path):
    return FakeRun(tmp_path)


def finished(run, status="finished"):
    """End the fake run as ``Run.wait`` does (workers may live on in a pool); return what ``finish`` receives."""
    run.state.end(status)
    return SimpleNamespace(status=status)


def worker_error():
    return WorkerError(1, "ValueError", "label column missing", 'Traceback:\n  File "train.py"\nValueError: <missing>',
                       exit_code=1, log_path="/runs/rank1.log")  # fmt: skip


# -- pure rendering -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seconds, text", [(None, "—"), (0.4, "0 s"), (42.3, "42 s"), (59.6, "1:00"), (125, "2:05"), (3725, "1:02:05")]
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("count, text", [(0, "—"), (300 * 2**20, "300 MB"), (5 * 2**29, "2.50 GB")])
def test_format_bytes(count, text):
    assert format_bytes(count) == text


def test_decimate_averages_equal_runs_of_points_down_to_the_limit():
    points = [(x, float(x)) for x in range(1000)]
    fewer = decimate(points, limit=100)
    assert 50 <= len(fewer) <= 100
    assert fewer[0] == (7.5, 7.5) and fewer[1] == (23.5, 23.5)  # means of runs of 16
    assert fewer[-1][0] > 990  # the newest points are in, if only as a shorter run
    assert decimate(points[:5], limit=100) == points[:5]


def test_downsampled_curve_stays_short_and_matches_decimating_at_once():
    curve = dashboard.Downsampled(limit=300)
    points = [(step, 1.0 / step) for step in range(1, 100_001)]
    for x, y in points:
        curve.add(x, y)
    assert 150 <= len(curve.points) <= 300
    assert curve.points == decimate(points, limit=300)


def test_svg_chart_draws_the_points_inside_its_box_and_escapes_the_title():
    svg = svg_chart([(1, 2.0), (2, 1.0), (3, 0.5)], "loss <per batch>", "#123456", width=300, height=120)
    coordinates = re.search(r'<polyline points="([^"]+)"', svg).group(1).split()
    assert len(coordinates) == 3
    xs, ys = zip(*(map(float, pair.split(",")) for pair in coordinates))
    assert xs[0] < xs[1] < xs[2] and ys[0] < ys[1] < ys[2]  # the loss falls: SVG y grows downwards
    assert all(0 <= x <= 300 for x in xs) and all(0 <= y <= 120 for y in ys)
    assert "loss &lt;per batch&gt;" in svg and "<per batch>" not in svg
    assert "no data yet" in svg_chart([], "loss", "#123456")


def test_svg_chart_of_many_points_is_decimated():
    svg = svg_chart([(x, 1.0 / (x + 1)) for x in range(10_000)], "loss", "#123456")
    assert len(re.search(r'<polyline points="([^"]+)"', svg).group(1).split()) <= dashboard.MAX_CHART_POINTS


def test_charts_prefer_the_batch_loss_and_find_the_learning_rate_of_the_first_group(run):
    run.train()
    html = charts_html(metric_series(run.state.snapshot()))
    assert "loss per batch" in html and html.count("<polyline") == 2
    only_epochs = {"train/loss": [(1, 0.5), (2, 0.3)]}
    assert "loss per epoch" in charts_html(only_epochs) and "no data yet" in charts_html(only_epochs)


def test_epoch_table_has_a_row_per_epoch_and_marks_the_best_dev_score(run):
    assert "no epoch finished yet" in epoch_table_html({})
    run.train(epochs=2)
    html = epoch_table_html(metric_series(run.state.snapshot()))
    assert "train loss" in html and "dev score" in html and "dev loss" not in html
    assert "0.5000" in html and "<b>0.9000</b>" in html and "<b>0.7000</b>" not in html
    assert html.count("<tr>") == 3  # header and two epochs


def test_log_tail_keeps_the_last_lines_escaped(run):
    run.state.add_log_lines([f"line {i}" for i in range(40)] + ["<script>alert(1)</script>"])
    html = log_html(run.state.snapshot())
    assert "line 39" in html and "line 26" in html and "line 25" not in html  # 15 lines in all
    assert "&lt;script&gt;" in html and "<script>" not in html


def test_ranks_table_shows_liveness_throughput_and_memory(run):
    assert ranks_table_html(run.state.snapshot()).count("—") >= 4  # nobody started: no pid, no last seen
    run.start_ranks()
    run.train(epochs=1)
    run.state.rank_exited(1, -9)
    html = ranks_table_html(run.state.snapshot())
    assert "1000" in html and "● alive" in html and "exit -9" in html
    assert "40.0" in html and "1.50 GB" in html and "s ago" in html


def test_status_shows_elapsed_eta_throughput_and_a_pending_stop(run):
    assert "● starting" in status_html(run.state.snapshot())
    run.start_ranks()
    run.state.apply(Progress(0, epoch=1, max_epochs=2, batch=1, total_batches=4, time=time.time() - 10))
    run.state.apply(Progress(0, epoch=1, max_epochs=2, batch=4, total_batches=4))
    run.state.apply(Heartbeat(0, step=4, samples=32, samples_per_second=12.5, host_memory_bytes=0))
    html = status_html(run.state.snapshot())
    assert "● running" in html and "ETA 10 s" in html and "12.5 samples/s" in html
    assert dashboard.STATUS_COLORS["running"] in html
    run.state.request_stop()
    assert "stopping after this batch" in status_html(run.state.snapshot())


def test_progress_text(run):
    assert progress_text(run.state.snapshot()) == "waiting for the first batch"
    run.state.apply(Progress(0, epoch=2, max_epochs=3, batch=12, total_batches=25))
    assert progress_text(run.state.snapshot()) == "epoch 2/3 · batch 12/25 · 49%"


def test_describe_problem_gives_a_headline_and_the_remote_traceback():
    headline, details = describe_problem(worker_error())
    assert headline == "rank 1 failed: ValueError: label column missing"
    assert 'File "train.py"' in details and "/runs/rank1.log" in details
    assert describe_problem(KeyboardInterrupt()) == ("interrupted: every worker was ended", "")
    assert describe_problem(TimeoutError("too slow"))[0] == "TimeoutError: too slow"
    assert describe_problem(None) == ("", "")


def test_summary_line_names_status_scores_and_failure(run):
    run.train(epochs=2)
    finished(run)
    line = summary_text(run.state.snapshot())
    assert line.startswith("flair_nbddp: finished in 0 s on 2 × cpu")
    assert "80.0 samples/s" in line and "train/loss 0.5000" in line and "dev/score 0.9000" in line
    failed = summary_text(run.state.snapshot(), describe_problem(worker_error()))
    assert failed.endswith("rank 1 failed: ValueError: label column missing")


# -- the widget dashboard -------------------------------------------------------------------------
def test_dashboard_widgets_follow_the_state(run, capsys):
    view = Dashboard(run)
    assert "nbddp-dashboard" in view.widget._dom_classes and "nbddp-status" in view.status._dom_classes
    assert "nbddp-progress" in view.bar._dom_classes and "nbddp-log" in view.log._dom_classes
    run.state.add_log_lines(["rank 0 says hi"])
    view.poll()
    assert capsys.readouterr().out == ""  # the dashboard shows the log in its widget, never prints it
    assert "● starting" in view.status.value and view.bar.value == 0.0

    run.start_ranks()
    run.train(epochs=2, batches=4)
    run.state.apply(Progress(0, epoch=3, max_epochs=4, batch=2, total_batches=4))  # the run is now at 10/16
    assert view.refresh()
    assert view.bar.value == pytest.approx(10 / 16) and view.bar.bar_style == ""
    assert "● running" in view.status.value and "epoch 3/4 · batch 2/4" in view.progress.value
    assert "EPOCH 2 done" in view.log.value and "<b>0.9000</b>" in view.epochs.value
    assert view.charts.value.count("<polyline") == 2 and "1.50 GB" in view.ranks.value
    assert view.outcome.layout.display == "none"


def test_dashboard_redraws_only_when_the_state_changed(run):
    view = Dashboard(run)
    assert not view.refresh()  # the constructor drew this version already
    run.state.add_log_lines(["a new line"])
    assert view.refresh() and "a new line" in view.log.value
    assert not view.refresh()


def test_dashboard_updater_thread_redraws_at_most_five_times_a_second(run, monkeypatch, capsys):
    view = Dashboard(run)
    draws = []
    monkeypatch.setattr(view, "_draw", draws.append)
    view.start()  # outside a kernel display() just prints; the thread still runs
    ends = time.monotonic() + 1.0
    while time.monotonic() < ends:  # a change every millisecond
        run.state.add_log_lines(["tick"])
        time.sleep(0.001)
    view.finish(finished(run))
    assert 2 <= len(draws) <= 1 + 5 + 1  # the live ones (fewer on a starved machine), plus the frozen one
    assert not view._thread.is_alive()


def test_finished_dashboard_freezes_into_a_summary(run):
    view = Dashboard(run)
    run.start_ranks()
    run.train(epochs=2)
    view.finish(finished(run))
    assert "● finished" in view.status.value and view.bar.value == 1.0 and view.bar.bar_style == "success"
    assert view.outcome.layout.display is None and "dev/score 0.9000" in view.outcome.value
    assert "ended" in view.ranks.value and "alive" not in view.ranks.value

    bundle = view._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == view.widget.model_id
    assert bundle["text/plain"].startswith("flair_nbddp: finished in") and "dev/score 0.9000" in bundle["text/plain"]
    assert 'class="nbddp-summary"' in bundle["text/html"] and "<svg" in bundle["text/html"]
    assert "finished" in bundle["text/html"] and "EPOCH 2 done" in bundle["text/html"]


def test_failed_dashboard_shows_the_error_and_its_traceback(run):
    view = Dashboard(run)
    run.start_ranks()
    run.state.rank_exited(1, 1)
    view.finish(finished(run, "failed"), worker_error())
    assert "exit 1" in view.ranks.value
    assert "● failed" in view.status.value and dashboard.STATUS_COLORS["failed"] in view.status.value
    assert view.bar.bar_style == "danger"
    assert "<details" in view.outcome.value
    assert "rank 1 failed: ValueError: label column missing" in view.outcome.value
    assert "ValueError: &lt;missing&gt;" in view.outcome.value  # the remote traceback, escaped
    summary, *table = view._repr_mimebundle_()["text/plain"].splitlines()
    assert summary.endswith("rank 1 failed: ValueError: label column missing")
    assert table[0].split()[:4] == ["rank", "device", "pid", "state"] and table[2].split()[:4] == ["1", "cpu", "1001", "exit"]


def test_interrupted_dashboard_says_stopped(run):
    view = Dashboard(run)
    run.state.end("stopped")
    view.finish(None, KeyboardInterrupt())
    assert "● stopped" in view.status.value and view.bar.bar_style == "warning"
    assert "interrupted" in view.outcome.value


def test_dashboard_of_a_run_that_could_not_start_says_failed(run):
    view = Dashboard(run)
    view.finish(None, RuntimeError("another run is still active in this kernel"))
    assert "● failed" in view.status.value
    assert "RuntimeError: another run is still active" in view.outcome.value


# -- plain views and the choice ---------------------------------------------------------------------
def test_text_view_prints_a_header_progress_lines_and_a_summary(run, capsys):
    view = TextView(run, interval=3600)
    view.start()
    view.poll()  # nothing trained yet: no line
    run.state.apply(Progress(0, epoch=1, max_epochs=2, batch=1, total_batches=4))
    view.poll()
    run.state.apply(Progress(0, epoch=1, max_epochs=2, batch=2, total_batches=4))
    view.poll()  # same epoch, interval not over: no line
    run.state.apply(Progress(0, epoch=2, max_epochs=2, batch=1, total_batches=4))
    view.poll()
    view.finish(finished(run, "failed"), worker_error())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"flair_nbddp: 2 × cpu processes (gloo), logs in {run.run_dir}"
    assert lines[1].startswith("flair_nbddp: epoch 1/2, batch 1/4, 12% done")
    assert lines[2].startswith("flair_nbddp: epoch 2/2, batch 1/4, 62% done") and "ETA" in lines[2]
    assert lines[3].startswith("flair_nbddp: failed after") and lines[3].endswith("label column missing")
    assert lines[4].split()[:6] == ["rank", "device", "pid", "state", "step", "samples/s"]
    assert [line.split()[0] for line in lines[5:]] == ["0", "1"]  # the ranks as a table, for scripts


@pytest.mark.parametrize("view_class", [TextView, NullView])
def test_text_and_null_views_print_rank_zero_lines_as_they_arrive(run, capsys, view_class):
    view = view_class(run)
    run.state.add_log_lines(["first", "second"])
    view.poll()
    run.state.add_log_lines(["third"])
    view.poll()
    view.poll()
    assert capsys.readouterr().out.splitlines() == ["first", "second", "third"]


def test_text_view_repeats_progress_after_its_interval(run, capsys):
    view = TextView(run, interval=0)
    for batch in (1, 2, 3):
        run.state.apply(Progress(0, epoch=1, max_epochs=1, batch=batch, total_batches=3))
        view.poll()
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_outside_a_kernel_the_choice_is_text_null_or_an_error(run, capsys):
    assert type(open_view(run)) is TextView
    view = open_view(run, dashboard=False)
    assert type(view) is NullView
    view.start()
    view.poll()
    view.finish(None, KeyboardInterrupt())
    assert capsys.readouterr().out == ""
    with pytest.raises(RuntimeError, match="dashboard=True needs a Jupyter kernel"):
        open_view(run, dashboard=True)


# -- in a real kernel -------------------------------------------------------------------------------
TRAIN_IN_KERNEL = """
import flair_nbddp
from flair_nbddp.demo import train_classifier
from flair_nbddp.synthetic import sentiment_corpus

corpus = sentiment_corpus(n_train=400, n_dev=40, n_test=40, words=(40, 80), seed=3)
result = flair_nbddp.launch(train_classifier, args=(corpus, {model!r}, {out!r}),
                            kwargs={{"max_epochs": 3, "mini_batch_size": 8, "return_model": False}})
print("status:", result.status)
"""


@pytest.mark.kernel
def test_dashboard_in_a_kernel_updates_live_and_ends_finished(tiny_model_path, tmp_path, no_leftover_processes):
    with running_kernel(cwd=tmp_path) as kernel:
        result = kernel.execute(TRAIN_IN_KERNEL.format(model=tiny_model_path, out=str(tmp_path / "out")), timeout=240)
    assert result.error is None, "\n".join(result.error["traceback"])
    assert result.stdout.strip().endswith("status: finished")
    assert "EPOCH 1 done" not in result.stdout  # the dashboard shows the log; the cell does not repeat it

    [root] = kernel.widgets_with_class("nbddp-dashboard")
    assert root.model_name == "VBoxModel"
    [bar] = kernel.widgets_with_class("nbddp-progress")
    values = bar.history("value")
    assert values == sorted(values) and values[-1] == 1.0
    assert len({value for value in values if 0 < value < 1}) >= 3, f"no live progress: {values}"
    [status] = kernel.widgets_with_class("nbddp-status")
    assert any("● running" in value for value in status.history("value"))
    assert "● finished" in status.state["value"]
    assert "By class:" in kernel.widgets_with_class("nbddp-log")[0].state["value"]

    [output] = result.outputs
    assert output["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] == root.comm_id
    assert output["data"]["text/plain"].startswith("flair_nbddp: finished in")  # updated when it ended
    assert "dev/score" in output["data"]["text/plain"] and "nbddp-summary" in output["data"]["text/html"]
