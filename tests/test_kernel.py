"""The magic, interrupts and a soak, in a real IPython kernel (jupyter_client), 2 CPU processes with gloo."""

import os
import time

import pytest
from jupyter_kernel import running_kernel

pytestmark = pytest.mark.kernel
TESTS = os.path.dirname(os.path.abspath(__file__))
PROBE = (
    "import os, threading, time, psutil\n"
    "from flair_nbddp.engine import forkserver\n"
    "me = psutil.Process()\n"
    "def others():  # the kernel's fork server, which stays for the next launch, is no leftover\n"
    "    return [c for c in me.children(recursive=True) if c.pid not in forkserver.server_pids()]\n"
    "psutil.wait_procs(others(), timeout=10)  # workers of the last run may still be exiting\n"
    "def target(fd):\n"
    "    try:\n"
    "        return os.readlink(f'/proc/self/fd/{fd}')\n"
    "    except OSError:\n"
    "        return ''\n"
    "# IPython's history thread opens and closes its database's journal at any moment, and listdir's own\n"
    "# descriptor is gone once it returns: neither is ours to count. A leak stays; the least of three looks.\n"
    "def open_fds():\n"
    "    targets = [target(fd) for fd in os.listdir('/proc/self/fd')]\n"
    "    return len([t for t in targets if t and not t.endswith('history.sqlite-journal')])\n"
    "looks = []\n"
    "for _ in range(3):\n"
    "    looks.append(open_fds())\n"
    "    time.sleep(0.2)\n"
    "fds = min(looks)\n"
    "print('PROBE', len(others()), threading.active_count(), fds,"
    " len([c for c in me.connections('inet') if c.status == psutil.CONN_LISTEN]))\n"
)


def probe(kernel) -> tuple[int, ...]:
    """(child processes, threads, open file descriptors, listening sockets) of the kernel."""
    out = kernel.execute(PROBE).stdout
    return tuple(int(x) for x in out.split("PROBE", 1)[1].split())


@pytest.fixture(scope="module")
def shared_kernel():
    with running_kernel(env={"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}) as kernel:
        yield kernel


@pytest.fixture
def kernel(shared_kernel):
    """The module's kernel (a start and flair's import, once), the widgets of earlier tests forgotten: each test
    sees those its own cells make; each test leaves no worker behind (its probes say so)."""
    shared_kernel.widgets.clear()
    return shared_kernel


def _ok(result):
    assert result.error is None, result.error and "\n".join(result.error["traceback"])[-3000:]
    return result


def test_magic_trains_with_names_from_earlier_cells_and_reports_mistakes(kernel, tiny_model_path, tmp_path):
    _ok(kernel.execute("%load_ext flair_nbddp"))
    _ok(kernel.execute(f"""
from flair_nbddp.synthetic import sentiment_corpus
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
corpus = sentiment_corpus(n_train=160, n_dev=30, n_test=40, seed=5)
label_type = "sentiment"
def make_classifier(corpus):
    return TextClassifier(TransformerDocumentEmbeddings({tiny_model_path!r}, fine_tune=True), label_type=label_type,
                          label_dictionary=corpus.make_label_dictionary(label_type, add_unk=False))
"""))
    trained = _ok(kernel.execute(f"""%%ddp_train --out scores --no-dashboard --seed 1
import torch.distributed as dist
result = ModelTrainer(make_classifier(corpus), corpus).fine_tune(
    {str(tmp_path / "out")!r}, max_epochs=6, mini_batch_size=8, learning_rate=5e-3, multi_gpu=True)
{{"score": result["test_score"], "world": dist.get_world_size()}}
""", timeout=300))
    assert "'world': 2" in trained.data("text/plain")[-1]  # the cell's output: rank 0's last value
    assert _ok(kernel.execute("print(scores['score'] >= 0.75, scores['world'])")).stdout.strip() == "True 2"

    # IPython shows a UsageError as one line on stderr, without a traceback, and the cell fails
    undefined = kernel.execute("%%ddp_train --no-dashboard\nnot_defined_anywhere + 1")
    assert undefined.reply["status"] == "error"
    assert undefined.stderr.startswith("UsageError: the cell uses 'not_defined_anywhere', not defined in the notebook")
    _ok(kernel.execute("import threading\nholder = {'guard': threading.Lock()}"))
    unpicklable = kernel.execute("%%ddp_train --no-dashboard\nholder")
    assert unpicklable.reply["status"] == "error"
    assert "UsageError: variable 'holder' (dict)" in unpicklable.stderr and "holder['guard'] is a lock" in unpicklable.stderr
    shell_line = kernel.execute("%%ddp_train --no-dashboard\nx = 1\n!nvidia-smi\nx")
    assert shell_line.stderr.startswith("UsageError: line 2 of the cell, `!nvidia-smi`, is IPython syntax")
    # launch() names the notebook global that cannot travel, with the path to it
    _ok(kernel.execute("lock = threading.Lock()\ndef uses_lock():\n    with lock:\n        return 1"))
    global_lock = kernel.execute("import flair_nbddp\nflair_nbddp.launch(uses_lock, dashboard=False)")
    assert global_lock.error["ename"] == "ShippingError"
    assert global_lock.error["evalue"].startswith(
        "the function 'uses_lock' cannot be sent to the worker processes: uses_lock uses the variable 'lock', "
        "a lock that cannot be pickled (TypeError: cannot pickle '_thread.lock' object). Build it inside the "
        "function 'uses_lock' instead"
    ), global_lock.error["evalue"]
    bad_option = kernel.execute("%%ddp_train --bogus\n1")
    assert bad_option.reply["status"] == "error" and "UsageError" in bad_option.stderr
    assert probe(kernel)[0] == 0  # no worker left


def test_another_ranks_warnings_show_in_the_dashboards_log(kernel):
    _ok(kernel.execute("import flair_nbddp\nfrom test_every_rank import speaks_on_every_rank"))
    _ok(kernel.execute("result = flair_nbddp.launch(speaks_on_every_rank, processes=2, device='cpu')", timeout=120))
    [log] = kernel.widgets_with_class("nbddp-log")
    assert "ordinary line of rank 0" in log.state["value"] and "[rank 1] rank 1 writes to stderr" in log.state["value"]
    [view] = kernel.widgets_with_class("nbddp-rank-view")
    assert view.state["_options_labels"] == ["cell", "rank 0", "rank 1"]
    assert probe(kernel)[0] == 0


LONG_TRAINING = """
import flair_nbddp
from training_jobs import train_sentiment
result = flair_nbddp.launch(train_sentiment, args=({model!r}, {base!r}))
print("STATUS", result.status, result.checkpoint)
"""


def test_kernel_interrupt_stops_gracefully_and_the_kernel_can_run_again(kernel, tiny_model_path, tmp_path):
    msg_id = kernel.submit(LONG_TRAINING.format(model=tiny_model_path, base=str(tmp_path / "out")))

    def training() -> bool:
        return any(m.state.get("value", 0) > 0.001 for m in kernel.widgets_with_class("nbddp-progress"))

    kernel.collect(msg_id, timeout=180, until=training)
    assert training(), "the dashboard never showed progress"
    interrupted = time.monotonic()
    kernel.interrupt()
    result = kernel.collect(msg_id, timeout=60)
    freed_after = time.monotonic() - interrupted
    _ok(result)
    assert f"STATUS stopped {tmp_path / 'out' / 'final-model.pt'}" in result.stdout
    assert freed_after < 10, f"the cell was busy {freed_after:.1f} s after the interrupt"
    assert probe(kernel)[0] == 0
    again = _ok(kernel.execute("print(flair_nbddp.launch(abs, args=(-3,), dashboard=False).value)", timeout=120))
    assert again.stdout.strip().endswith("3")


def test_second_interrupt_ends_the_workers_at_once(kernel):
    msg_id = kernel.submit(
        "import flair_nbddp\nfrom training_jobs import nap\n"
        "flair_nbddp.launch(nap, args=(600,), dashboard=False, stop_timeout=300)"
    )
    kernel.printed(msg_id, "napping")  # the workers are up and in the function
    kernel.interrupt()
    kernel.printed(msg_id, "interrupt again to end the workers now")
    second = time.monotonic()
    kernel.interrupt()
    result = kernel.collect(msg_id, timeout=30)
    assert time.monotonic() - second < 5
    assert result.error["ename"] == "KeyboardInterrupt"
    assert probe(kernel)[0] == 0


def test_soak_six_runs_with_random_interrupts_leak_nothing(kernel):
    import random

    rng = random.Random(20)
    _ok(kernel.execute("import flair_nbddp\nfrom training_jobs import nap"))
    # warm up: first use of everything a run touches, an interrupted run included, before the baseline
    _ok(kernel.execute("flair_nbddp.launch(nap, args=(0,), dashboard=False)", timeout=120))
    msg_id = kernel.submit("flair_nbddp.launch(nap, args=(5,), dashboard=False, stop_timeout=2)")
    kernel.printed(msg_id, "napping")
    kernel.interrupt()
    kernel.collect(msg_id, timeout=60)
    before = probe(kernel)
    statuses = []
    for run in range(6):
        code = "r = flair_nbddp.launch(nap, args=(0.5,), dashboard=False, stop_timeout=2)\nprint('STATUS', r.status)"
        msg_id = kernel.submit(code)
        if run % 3 == 1:  # interrupt a third of them, at random moments (starting up, running: about 2 s, 0.5 s)
            time.sleep(rng.uniform(0.2, 2.5))
            kernel.interrupt()
        result = kernel.collect(msg_id, timeout=120)
        statuses.append("interrupted" if result.error else result.stdout.split("STATUS")[-1].strip())
    after = probe(kernel)
    assert statuses.count("finished") >= 4 and set(statuses) <= {"finished", "stopped", "interrupted"}, statuses
    grew = [name for name, b, a in zip(("processes", "threads", "fds", "listening sockets"), before, after) if a > b]
    assert not grew, f"{grew} grew: (processes, threads, fds, listening sockets) went from {before} to {after}"


def test_the_magic_restarts_a_killed_rank_from_its_last_checkpoint(kernel, tiny_model_path, tmp_path):
    marker = tmp_path / "kill"
    marker.touch()
    _ok(kernel.execute("%load_ext flair_nbddp"))
    _ok(kernel.execute(f"""
from flair_nbddp.synthetic import sentiment_corpus
corpus = sentiment_corpus(n_train=48, n_dev=12, n_test=12, seed=4)
model_path, base, marker = {tiny_model_path!r}, {str(tmp_path / "out")!r}, {str(marker)!r}
"""))
    restarted = _ok(kernel.execute("""%%ddp_train --no-dashboard --seed 11 --max-restarts 1 --out scores
from training_jobs import fine_tune_failing_once
fine_tune_failing_once(corpus, model_path, base, marker, "kill")
""", timeout=300))
    assert "rank 1 died (was killed by signal SIGKILL)" in restarted.stdout, restarted.stdout[-3000:] + restarted.stderr
    assert "restart 1 of 1 from the end of epoch 2" in restarted.stdout
    assert not marker.exists()
    linked = _ok(kernel.execute("""import flair_nbddp
last, first = flair_nbddp.history(limit=2)
print(last.status, first.status, last.resumed_from == first.id, scores["test_score"] >= 0)"""))
    assert linked.stdout.strip() == "finished failed True True"
    assert probe(kernel)[0] == 0  # no worker left
