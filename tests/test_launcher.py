"""Multi-process tests: 2 CPU processes with gloo, as CI runs them."""

import json
import os
import time

import psutil
import pytest
from conftest import python_program

import flair_nbddp
from flair_nbddp import RunTimeoutError, WorkerError, launch, launch_distributed
from flair_nbddp.engine.devices import resolve_devices
from flair_nbddp.engine.worker_source import ColdWorkers

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_processes")]


def _gone(result):
    return all(not psutil.pid_exists(rank.pid) for rank in result.ranks if rank.pid)


def test_notebook_function_trains_a_classifier_and_returns_a_usable_model(tmp_path, tiny_model_path):
    """A function from a file-less __main__, a corpus built in the parent, multi_gpu=True on 2 ranks."""
    out = python_program(
        f"""
import json
import flair_nbddp
from flair_nbddp.synthetic import sentiment_corpus
from flair.data import Sentence

corpus = sentiment_corpus(n_train=200, n_dev=40, n_test=40, seed=3)   # built here, shipped to the ranks
label_type = "sentiment"

def main(corpus, epochs):
    import torch.distributed as dist
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer
    model = TextClassifier(TransformerDocumentEmbeddings({tiny_model_path!r}, fine_tune=True),
                           label_type=label_type,
                           label_dictionary=corpus.make_label_dictionary(label_type, add_unk=False))
    scores = ModelTrainer(model, corpus).fine_tune({str(tmp_path / "out")!r}, max_epochs=epochs,
                                                   mini_batch_size=8, learning_rate=5e-3, multi_gpu=True)
    print("rank", dist.get_rank(), "says goodbye")
    return {{"score": scores["test_score"], "world": dist.get_world_size(), "model": model}}

result = flair_nbddp.launch(main, args=(corpus,), kwargs={{"epochs": 6}}, seed=1)
positive, negative = Sentence("a superb wonderful brilliant film"), Sentence("an awful boring dreadful plot")
result.value["model"].predict([positive, negative])
print(json.dumps({{
    "score": result.value["score"], "world": result.value["world"], "status": result.status,
    "predictions": [positive.get_label(label_type).value, negative.get_label(label_type).value],
    "device": str(next(result.value["model"].parameters()).device),
    "losses": [v for _, v in result.history("train/loss")],
    "gradient_norms": result.history("train/gradient_norm"),   # a tensor in flair: reaches the host asynchronously
    "pids": [r.pid for r in result.ranks], "steps": [r.step for r in result.ranks],
    "samples": [r.samples for r in result.ranks], "logs": {{str(k): str(v) for k, v in result.log_files.items()}},
    "first_batch": result.time_to_first_batch, "sps": result.samples_per_second,
}}))
""",
        timeout=600,
    )
    cell_output, report_line = out.rsplit("\n", 2)[0], out.strip().splitlines()[-1]
    report = json.loads(report_line)
    assert report["status"] == "finished" and report["world"] == 2
    assert report["score"] >= 0.75, report  # learned: chance is 0.5
    assert report["predictions"] == ["POSITIVE", "NEGATIVE"]
    assert report["device"] == "cpu"
    assert len(report["losses"]) == 6 and report["losses"][-1] < report["losses"][0]
    assert report["first_batch"] > 0 and report["sps"] > 0
    # each rank's last word is its final count: 100 documents each, batches of 8 -> 13 steps per epoch
    assert report["steps"] == [6 * 13, 6 * 13] and report["samples"] == [6 * 100, 6 * 100]
    # every step's gradient norm, in order, the last one included
    steps = [step for step, _ in report["gradient_norms"]]
    assert len(steps) == 6 * 13 and steps == sorted(set(steps))
    assert all(norm > 0 for _, norm in report["gradient_norms"])
    # rank 0's log reached the "cell"; rank 1's did not, but its file has it
    assert "EPOCH 6 done" in cell_output and "rank 0 says goodbye" in cell_output
    assert "rank 1 says goodbye" not in cell_output
    assert "rank 1 says goodbye" in open(report["logs"]["1"]).read()
    assert not any(psutil.pid_exists(pid) for pid in report["pids"])


def _rank_and_payload(size):
    import torch.distributed as dist

    return dist.get_rank(), os.urandom(size)


def test_five_megabyte_result_comes_back(capsys):
    result = launch(_rank_and_payload, args=(5_000_000,))
    rank, blob = result.value
    assert rank == 0 and len(blob) == 5_000_000
    assert result.status == "finished" and _gone(result)


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(1)
        raise ValueError("label column missing on this rank")
    dist.barrier()  # rank 0 would wait here forever


def test_failing_rank_raises_worker_error_naming_it_and_ends_the_others():
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        launch(_fail_on_rank_one, dashboard=False)
    error = caught.value
    assert error.rank == 1 and error.exc_type == "ValueError"
    assert "label column missing" in str(error) and "_fail_on_rank_one" in error.remote_traceback
    # the failing rank's traceback reached the cell too, to its last line, before the run was concluded
    assert "[rank 1] ValueError: label column missing on this rank" in error.result.log.splitlines()
    assert error.result.status == "failed" and _gone(error.result)
    # failure happens ~1 s after start-up; we must not wait for a collective timeout
    assert time.monotonic() - started < 60
    failed_at = max(r.last_seen for r in error.result.ranks)
    assert error.result.run_dir.exists() and error.result.elapsed - (failed_at - error.result.ranks[0].last_seen) < 60


def _kill_self_on_rank_one():
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_rank_killed_by_a_signal_is_named():
    with pytest.raises(WorkerError, match="rank 1 failed: the worker process was killed by signal SIGKILL"):
        launch(_kill_self_on_rank_one, dashboard=False)


def _train_without_multi_gpu(model_path):
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(16, 4, 4)
    model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))
    ModelTrainer(model, corpus).train("unused", max_epochs=1)


def test_forgetting_multi_gpu_stops_before_training(tiny_model_path):
    with pytest.raises(WorkerError, match="without multi_gpu=True while 2 processes run"):
        launch(_train_without_multi_gpu, args=(tiny_model_path,), dashboard=False)


def test_timeout_ends_every_worker():
    with pytest.raises(RunTimeoutError, match="timeout=3"):
        launch(time.sleep, args=(600,), timeout=3, dashboard=False)  # the workers are gone: no_leftover_processes


def _world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), os.environ["MASTER_PORT"]


def _nobody_listens_on(port: int) -> bool:
    # connections of the finished run may linger in TIME_WAIT for a minute; a listener must not
    return not any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in psutil.net_connections("tcp"))


def test_two_launches_in_a_row_work_and_leave_no_port_bound():
    first = launch(_world, dashboard=False)
    assert _nobody_listens_on(int(first.value[2]))  # the rendezvous port is free the moment launch returns
    second = launch(_world, dashboard=False)
    assert first.value[:2] == second.value[:2] == (0, 2)
    assert _nobody_listens_on(int(second.value[2]))
    assert _gone(first) and _gone(second)


def test_seed_comes_from_the_environment_when_not_given(monkeypatch, warm_pool):
    monkeypatch.setenv("FLAIR_NBDDP_SEED", "11")
    assert launch(_world, pool=warm_pool, dashboard=False).seed == 11
    assert launch(_world, pool=warm_pool, dashboard=False, seed=3).seed == 3
    monkeypatch.setenv("FLAIR_NBDDP_SEED", "eleven")
    with pytest.raises(ValueError, match="FLAIR_NBDDP_SEED='eleven' is not a whole number"):
        launch(_world, pool=warm_pool, dashboard=False)


def test_launch_distributed_is_a_drop_in_returning_rank_zero_value():
    assert launch_distributed(_world)[:2] == (0, 2)


def test_non_callable_is_refused_before_any_process_starts():
    with pytest.raises(TypeError, match="fn must be callable"):
        launch("train.py")


def test_run_directory_and_logs_are_private():
    result = launch(_world, dashboard=False)
    assert oct(os.stat(result.run_dir).st_mode & 0o777) == "0o700"
    files = list(result.run_dir.iterdir())  # logs, stacks; payload and result are gone
    assert {p.name for p in files} >= {"rank0.log", "rank1.log", "stacks-rank0.txt", "stacks-rank1.txt"}, files
    assert all(oct(os.stat(p).st_mode & 0o777) == "0o600" for p in files), [(p.name, oct(p.stat().st_mode)) for p in files]
    assert not (result.run_dir / "payload.pkl").exists() and not (result.run_dir / "result.pkl").exists()


def test_package_exports_the_public_api():
    assert set(flair_nbddp.__all__) >= {"launch", "launch_distributed", "RunResult", "WorkerError"}


class CountingSource:
    """A worker source of the test's own: the kit's cold workers behind a wrapper that records each call."""

    def __init__(self):
        self.inner = ColdWorkers(resolve_devices("cpu", 2))
        self.plan = self.inner.plan
        self.calls = []

    def prepare(self, run_dir, preload):
        self.calls.append(("prepare", preload))
        self.inner.prepare(run_dir, preload)

    def acquire(self, job):
        self.calls.append("acquire")
        return self.inner.acquire(job)

    def release(self, clean, reason):
        self.calls.append(("release", clean, reason))
        self.inner.release(clean, reason)


def test_a_worker_source_of_ones_own_plugs_into_launch():
    source = CountingSource()
    result = launch(_world, pool=source, dashboard=False)
    assert result.value[:2] == (0, 2) and result.status == "finished"
    assert source.calls == ["acquire", ("release", True, "finished")]
    assert all(not psutil.pid_exists(rank.pid) or psutil.Process(rank.pid).status() == psutil.STATUS_ZOMBIE
               for rank in result.ranks)  # fmt: skip


def test_workers_run_the_notebooks_kit_whatever_folder_the_notebook_is_in(tmp_path, monkeypatch):
    shadow = tmp_path / "flair_nbddp"  # e.g. a checkout of another version beside the notebook
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the copy in the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    assert launch(_world, dashboard=False).value[:2] == (0, 2)
