"""The run ledger across real kernels: records outlive their kernel, two kernels write at once, a kernel killed
mid-run leaves a lost run, ``%ddp_runs`` and the panel read it (2 CPU processes with gloo)."""

import os
import signal
import time

import psutil
import pytest
from conftest import wait_for
from jupyter_kernel import running_kernel

from flair_nbddp.ledger.store import history

pytestmark = pytest.mark.kernel
TESTS = os.path.dirname(os.path.abspath(__file__))
SET_UP = """
%load_ext flair_nbddp
import flair_nbddp
from flair_nbddp import TrainingPanel, history, launch
from flair_nbddp.synthetic import ner_corpus
from training_jobs import train_ner
corpus = ner_corpus(n_train=40, n_dev=8, n_test=8)

def panel_job(lr=0.1):
    return {"test_score": lr * 2}
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAIR_NBDDP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _kernel(home):
    env = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "FLAIR_NBDDP_HOME": str(home)}
    return running_kernel(env=env)


def _ok(result):
    assert result.error is None, result.error and "\n".join(result.error["traceback"])[-3000:]
    return result


def test_runs_outlive_their_kernel_and_show_in_the_next_one(home, tmp_path):
    with _kernel(home) as first:
        _ok(first.execute(SET_UP, timeout=120))
        _ok(first.execute(f"%%ddp_train --no-dashboard --seed 3\ntrain_ner(corpus, {str(tmp_path / 'cell')!r}, epochs=1)",
                          timeout=300))  # fmt: skip
        _ok(first.execute(
            "panel = TrainingPanel(panel_job, params={'lr': 0.25})\npanel.train(); panel.wait(120)\n"
            "print('PANEL', panel.runs[0].status, panel.runs[0].record_id)", timeout=180,
        ))  # fmt: skip
    cell, panel = history(limit=2)[::-1]
    assert (cell.name, cell.origin, cell.status, cell.seed) == ("%%ddp_train", "%%ddp_train", "finished", 3)
    assert cell.source.startswith("train_ner(corpus, ") and cell.options["line"] == "--no-dashboard --seed 3"
    assert cell.params["variables"]["corpus"]["type"] == "Corpus" and "sha256" in cell.params["variables"]["corpus"]
    assert cell.history("dev/score") and cell.models
    assert (panel.name, panel.origin, panel.status, panel.kwargs) == ("panel_job", "panel", "finished", {"lr": 0.25})

    with _kernel(home) as second:  # a new kernel: as after a restart
        _ok(second.execute(SET_UP, timeout=120))
        listed = _ok(second.execute("[(r.name, r.status) for r in history()]")).data("text/plain")[0]
        assert listed == "[('panel_job', 'finished'), ('%%ddp_train', 'finished')]"
        table = _ok(second.execute("%ddp_runs --limit 5")).data("text/html")[0]
        assert table.count("<tr>") == 3 and "%%ddp_train" in table and "panel_job" in table and "lr=0.25" in table
        only_cells = _ok(second.execute("%ddp_runs --name %%ddp_train")).data("text/html")[0]
        assert only_cells.count("<tr>") == 2 and "panel_job" not in only_cells
        mistake = second.execute("%ddp_runs --limit -1")
        assert mistake.reply["status"] == "error" and mistake.stderr.startswith("UsageError: --limit -1: give a number")
        figure = _ok(second.execute("from flair_nbddp import compare\ncompare(history(), metric='dev/score')"))
        assert figure.data("image/png") and figure.data("text/plain")[0].startswith("<Figure")  # drawn once, in the cell
        assert len(figure.outputs) == 1
        # the panel of the same function shows the earlier kernel's run in its table
        history_table = _ok(second.execute("TrainingPanel(panel_job, params={'lr': 0.1}).history_html()"))
        assert f">{panel.id}<" in history_table.data("text/plain")[0] and "0.25" in history_table.data("text/plain")[0]


def test_two_kernels_training_at_once_both_land_whole(home, tmp_path):
    with _kernel(home) as one, _kernel(home) as two:
        for kernel in (one, two):
            _ok(kernel.execute(SET_UP, timeout=120))
        # one process each: what is tested is two kernels writing one ledger at once, not their ranks
        code = (
            "result = launch(train_ner, (corpus, {!r}), {{'epochs': 3}}, dashboard=False, processes=1)\n"
            "print('METRICS', len(result.metrics), result.record_id)"
        )
        ids = [one.submit(code.format(str(tmp_path / "one"))), two.submit(code.format(str(tmp_path / "two")))]
        outputs = [_ok(kernel.collect(msg_id, timeout=400)).stdout for kernel, msg_id in zip((one, two), ids)]
    counts = {int(line.split()[2]): int(line.split()[1]) for out in outputs for line in out.splitlines()
              if line.startswith("METRICS")}  # fmt: skip
    records = {record.id: record for record in history()}
    assert sorted(records) == sorted(counts) and len(counts) == 2
    for run_id, count in counts.items():
        assert records[run_id].status == "finished" and len(records[run_id].metrics()) == count > 0


def test_a_kernel_killed_mid_run_leaves_a_lost_run_and_no_workers(home, tmp_path, tiny_model_path):
    with _kernel(home) as kernel:
        _ok(kernel.execute(SET_UP, timeout=120))
        pid = int(_ok(kernel.execute("import os; print(os.getpid())")).stdout)
        kernel.submit(
            "from training_jobs import train_sentiment\n"
            f"launch(train_sentiment, ({str(tiny_model_path)!r}, {str(tmp_path / 'out')!r}), {{'epochs': 50}}, "
            "dashboard=False)"
        )
        wait_for(lambda: any(record.history("train/batch_loss") for record in history()), 120, "metrics in the ledger")
        workers = psutil.Process(pid).children(recursive=True)
        os.kill(pid, signal.SIGKILL)
        psutil.wait_procs(workers, timeout=15)
        assert not [worker for worker in workers if worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE]
    time.sleep(0.1)
    [record] = history()
    assert record.status == "lost" and f"pid {pid}" in record.error
    assert record.ended_at == pytest.approx(record.updated_at) and record.ended_at > record.started_at
    assert record.history("train/batch_loss")  # what it had recorded before it died is kept
