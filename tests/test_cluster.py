"""Runs on a real Dask cluster on loopback: a ``dask scheduler`` and two ``dask worker`` processes, each its own
"node" (its own runs directory), 2 gloo ranks; the last test drives it with ``%%ddp_train --cluster`` from a
real kernel."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_for
from dask_cluster import LoopbackCluster
from jupyter_kernel import running_kernel
from training_jobs import (
    fine_tune_counting_tokenizations,
    fine_tune_failing_once,
    train_classifier_with,
    train_sentiment,
)

import flair_nbddp
from flair_nbddp import WorkerError, WorkerPool, launch, runs, start
from flair_nbddp.synthetic import ner_corpus, sentiment_corpus

pytestmark = pytest.mark.cluster
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LoopbackCluster(workers=2, log_dir=tmp_path_factory.mktemp("dask")) as cluster:
        yield cluster


@pytest.fixture
def client(cluster):
    client = cluster.client()
    client.wait_for_workers(2, timeout=60)
    yield client
    assert not cluster.wait_no_kit_processes(), "kit processes were left on the Dask workers"
    wait_for(lambda: not cluster.leftover_files(), 10, "the kit's files on the nodes to be removed")


def train_classifier(corpus, model_path: str, base_path: str, epochs: int = 6):
    """The quickstart's function: a tiny-transformer TextClassifier on the corpus the notebook built."""
    import torch.distributed as dist
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    model = TextClassifier(
        TransformerDocumentEmbeddings(model_path, fine_tune=True), label_type="sentiment",
        label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
    )  # fmt: skip
    scores = ModelTrainer(model, corpus).fine_tune(
        base_path, max_epochs=epochs, mini_batch_size=8, learning_rate=5e-3, multi_gpu=True
    )
    print("rank", dist.get_rank(), "of", dist.get_world_size(), "on", socket.gethostname(), "says goodbye")
    return {"score": scores["test_score"], "model": model}


def _listening(pids: set[int]) -> list:
    return [c for c in psutil.net_connections("tcp") if c.pid in pids and c.status == psutil.CONN_LISTEN]


def test_a_classifier_trains_from_a_notebook_corpus_on_two_dask_workers(
    cluster, client, tmp_path, tiny_model_path, monkeypatch
):
    from distributed import Client
    from flair.data import Sentence

    corpus = sentiment_corpus(n_train=200, n_dev=40, n_test=40, seed=3)  # built here, as in a notebook
    scattered = []
    scatter = Client.scatter

    def spy(self, data, *args, **kwargs):
        scattered.append((len(data), tuple(kwargs.get("workers") or ())))
        return scatter(self, data, *args, **kwargs)

    monkeypatch.setattr(Client, "scatter", spy)
    run = start(train_classifier, (corpus, tiny_model_path, str(tmp_path / "out")), cluster=client, seed=1)
    wait_for(lambda: run.state.snapshot().batch >= 1, 180, "training to start")
    listening = _listening({process.pid for process in cluster.kit_processes()})
    result = run.wait()

    assert result.status == "finished", result.error
    assert result.value["score"] >= 0.75, result.value
    positive, negative = Sentence("a superb wonderful brilliant film"), Sentence("an awful boring dreadful plot")
    result.value["model"].predict([positive, negative])
    assert [positive.get_label("sentiment").value, negative.get_label("sentiment").value] == ["POSITIVE", "NEGATIVE"]
    # one rank per Dask worker, each named with its worker and host; 100 documents each, batches of 8
    workers = sorted(client.nthreads())
    assert sorted(rank.worker for rank in result.ranks) == workers
    assert {rank.host for rank in result.ranks} == {socket.gethostname()}
    assert [rank.step for rank in result.ranks] == [6 * 13, 6 * 13]
    assert result.models and all(str(path).startswith(f"{socket.gethostname()}:") for path in result.models)
    # the payload (the corpus inside) went once to each node, two here; rank 0's result came back once
    payloads = sorted(workers_ for size, workers_ in scattered if workers_)
    assert payloads == [(worker,) for worker in workers], scattered
    # rank 0's store listens on its Dask worker's own address only, and nothing listens in the notebook
    assert listening and {c.laddr.ip for c in listening} <= {"127.0.0.1"}, listening
    assert not [c for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    # rank 0's log came back to the notebook's run directory, rank 1's output to its own file there
    assert "EPOCH 6 done" in result.log and "rank 0 of 2" in result.log
    assert "rank 1 of 2" in result.log_files[1].read_text()
    # nothing that finished was cancelled: a cancel goes to every client, and one registering then fails to start
    assert not [event for _, event in client.get_events(client.id) if event.get("action") == "cancel"]


def _world_and_host():
    import torch.distributed as dist

    return dist.get_world_size(), socket.gethostname()


def _the_next_launch_works(client) -> None:
    """The cluster's workers are healthy after the end before: a new run on the same client finishes."""
    result = launch(_world_and_host, cluster=client, dashboard=False)
    assert result.status == "finished" and result.value == (2, socket.gethostname())


def test_stop_ends_every_rank_after_the_same_batch_and_names_the_checkpoints_host(client, tmp_path, tiny_model_path):
    run = start(train_sentiment, (tiny_model_path, str(tmp_path / "out")), cluster=client)
    wait_for(lambda: run.state.snapshot().batch >= 3, 180, "training to start")
    stopped_at = time.monotonic()
    run.stop()  # what the first interrupt of the cell does
    result = run.wait()
    assert result.status == "stopped", result.error
    assert time.monotonic() - stopped_at < 15
    host, path = str(result.checkpoint).split(":", 1)
    assert host == socket.gethostname() and path == str(tmp_path / "out" / "final-model.pt")
    assert os.path.exists(path)  # one machine here: the rank 0 worker's file is at hand
    steps = [rank.step for rank in result.ranks]
    assert steps[0] == steps[1] and steps[0] < 20 * 50, steps  # the same batch, long before the end


def test_a_second_interrupt_ends_every_rank_at_once(cluster, client):
    run = start(time.sleep, (600,), cluster=client, stop_timeout=300)  # a stop it never honours
    wait_for(lambda: run.state.snapshot().status == "running", 120, "the ranks")
    assert len(cluster.kit_processes()) == 2
    run.stop()
    killed_at = time.monotonic()
    result = run.kill()  # what the second interrupt does
    assert result.status == "stopped"
    assert not cluster.wait_no_kit_processes(timeout=10)
    assert time.monotonic() - killed_at < 10


@pytest.mark.parametrize("on", ["new workers", "a pool"])
def test_a_lost_node_restarts_the_run_from_its_checkpoint_on_a_worker_that_joins(
    on, cluster, client, tmp_path, tiny_model_path, capsys
):
    corpus = sentiment_corpus(n_train=32, n_dev=8, n_test=8, seed=4)
    marker, paused = tmp_path / "pause", tmp_path / "pause.paused"
    marker.touch()  # rank 1 pauses in epoch 3 of the first attempt, after epoch 2's checkpoint

    lost: dict = {}

    def lose_rank_1s_node() -> None:
        wait_for(lambda: paused.exists() and [c[0] for c in runs()[-1].state.snapshot().checkpoints] == [1, 2],
                 300, "rank 1 to pause once epoch 2's checkpoint is in the notebook")  # fmt: skip
        lost["worker"] = next(rank.worker for rank in runs()[-1].state.snapshot().ranks if rank.rank == 1)
        cluster.add_worker(len(cluster.workers))  # a third worker joins...
        dask_worker = int(paused.read_text())
        cluster.kill_worker(next(index for index, nanny in enumerate(cluster.workers) if nanny.poll() is None and any(
            process.pid == dask_worker for process in cluster.worker_tree(index))))  # ...and rank 1's node is lost
        lost["at"] = time.time()

    threading.Thread(target=lose_rank_1s_node, daemon=True).start()
    where = {"cluster": client} if on == "new workers" else {"pool": WorkerPool(cluster=client)}
    try:
        result = launch(fine_tune_failing_once, (corpus, tiny_model_path, str(tmp_path / "out"), str(marker), "pause"),
                        seed=11, dashboard=False, max_restarts=1, **where)  # fmt: skip
    finally:
        if on == "a pool":
            placed_again = where["pool"].notes[-2:]
            where["pool"].close()
    assert result.status == "finished", result.error
    first, last = result.attempts
    assert isinstance(first.error, WorkerError) and first.error.rank == 1, first.error
    assert "left the cluster" in str(first.error) and lost["worker"] in str(first.error), str(first.error)
    assert (last.status, last.resumed_from_epoch) == ("finished", 2)
    assert "restart 1 of 1 from the end of epoch 2" in capsys.readouterr().out
    if on == "a pool":
        assert placed_again[0].startswith(f"Dask worker(s) {lost['worker']} left the cluster: the pool's ranks are "
                                          "placed again, on 2 Dask workers of 2 nodes"), placed_again  # fmt: skip
        assert placed_again[1].startswith("recycled the pool's workers"), placed_again
    failed = flair_nbddp.history(limit=2)[1]  # its checkpoints outlived the node: they are in the notebook's run
    assert failed.ended_at - lost["at"] < 30  # rank 0, left waiting for rank 1, was ended at once
    assert Path(failed.checkpoints[-1]["path"]).is_file() and failed.checkpoints[-1]["epoch"] == 2
    # one curve from the first epoch, its epochs 1-2 the failed attempt's (they were not trained again)
    assert [step for step, _ in result.history("train/loss")] == [1, 2, 3, 4] and result.resumed_at[0] == 2
    assert result.history("train/loss")[:2] == failed.history("train/loss")
    placed = {rank.worker for rank in result.ranks}  # the worker left and the one that joined
    assert len(placed) == 2 and lost["worker"] not in placed and result.value["test_score"] >= 0


KERNEL_PROGRAM = """
import time
from distributed import Client
import flair_nbddp
from training_jobs import train_sentiment
client = Client({address!r})
run = flair_nbddp.start(train_sentiment, ({model!r}, {base!r}), cluster=client)
while run.state.snapshot().batch < 2:
    time.sleep(0.2)
print("TRAINING", flush=True)
time.sleep(600)
"""


def test_a_kernel_that_dies_leaves_nothing_running_on_the_cluster(cluster, client, tmp_path, tiny_model_path):
    program = subprocess.Popen(
        [sys.executable, "-c", KERNEL_PROGRAM.format(
            address=cluster.address, model=tiny_model_path, base=str(tmp_path / "out"))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )  # fmt: skip
    seen = []
    for line in program.stdout:
        seen.append(line)
        if "TRAINING" in line:
            break
    assert program.poll() is None, "".join(seen)[-3000:]
    assert len(cluster.kit_processes()) == 2
    program.send_signal(signal.SIGKILL)  # the kernel dies: its client's connection to the scheduler goes with it
    program.wait()
    died_at = time.monotonic()
    assert not cluster.wait_no_kit_processes(timeout=30)
    assert time.monotonic() - died_at < 30
    _the_next_launch_works(client)


def _corpus_sizes(corpus):
    import torch.distributed as dist

    return dist.get_rank(), len(corpus.train), os.getpid()


def test_a_pool_on_the_cluster_keeps_its_ranks_the_corpus_put_on_it_and_its_encodings(
    cluster, client, tmp_path, tiny_model_path
):
    corpus = sentiment_corpus(n_train=120, n_dev=10, n_test=10, seed=4)
    with WorkerPool(cluster=client) as pool:
        assert "on 2 Dask workers of 2 nodes" in pool.status()
        ref = pool.put(corpus)
        first = launch(_corpus_sizes, (ref,), pool=pool, dashboard=False)
        second = launch(_corpus_sizes, (ref,), pool=pool, dashboard=False)
        assert first.value[:2] == second.value[:2] == (0, 120)
        assert first.value[2] == second.value[2]  # rank 0's process stayed warm between the jobs
        assert [rank.pid for rank in first.ranks] == [rank.pid for rank in second.ranks]
        assert pool.pids == [rank.pid for rank in second.ranks]  # forked ranks included (their pid comes later)
        assert {rank.worker for rank in second.ranks} == set(client.nthreads())
        assert len(cluster.kit_processes()) == 2
        # inputs built once on the cluster too: each sentence tokenized once in 3 epochs, none in the next job
        tuned = [launch(fine_tune_counting_tokenizations, (ref, tiny_model_path, str(tmp_path / name), "classifier"),
                        pool=pool, dashboard=False, seed=5) for name in ("first", "again")]  # fmt: skip
        assert tuned[0].value["encoded"] == tuned[0].value["distinct"] > 0
        assert tuned[1].value["encoded"] == 0 and tuned[1].history("dev/score") == tuned[0].history("dev/score")
        # a tagger takes its transformer's batch tensor on the cluster too, and trains as with flair's own path
        ner = pool.put(ner_corpus(n_train=48, n_dev=8, n_test=8, seed=4))
        tagged = {on: launch(fine_tune_counting_tokenizations, (ner, tiny_model_path, str(tmp_path / f"tag{on}"),
                                                                "tagger"),
                             pool=pool, dashboard=False, seed=5, direct_embeddings=on, skip_clean_tokens=on)
                  for on in (True, False)}  # fmt: skip
        assert tagged[True].value["direct_batches"] > 0 == tagged[False].value["direct_batches"]
        assert tagged[True].history("dev/loss") == tagged[False].history("dev/loss")
        assert tagged[True].value["test_score"] == tagged[False].value["test_score"]


def test_a_sweep_runs_one_trial_on_each_dask_worker_at_once(client, tmp_path):
    import optuna

    corpus = sentiment_corpus(n_train=120, n_dev=30, n_test=30, seed=2)
    space = {"lr": optuna.distributions.CategoricalDistribution([0.05, 0.5])}
    result = flair_nbddp.sweep(train_classifier_with, (corpus, str(tmp_path)), {"epochs": 1}, space=space, n_trials=2,
                               cluster=client, dashboard=False)  # fmt: skip
    records = result.records
    assert [record.trial["state"] for record in records] == ["complete", "complete"]
    first, second = records
    assert first.started_at < second.ended_at and second.started_at < first.ended_at  # side by side
    assert {record.ranks[0]["worker"] for record in records} == set(client.nthreads())  # one worker each


def _ok(result):
    assert result.error is None, result.error and "\n".join(result.error["traceback"])[-3000:]
    return result


@pytest.mark.kernel
def test_the_magic_trains_a_tagger_on_the_cluster_from_a_notebook_corpus(cluster, client, tmp_path):
    with running_kernel(env={"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}) as kernel:
        _ok(kernel.execute(f"""
%load_ext flair_nbddp
from distributed import Client
from flair.embeddings import OneHotEmbeddings
from flair.models import SequenceTagger
from flair.trainers import ModelTrainer
from flair_nbddp.synthetic import ner_corpus
client = Client({cluster.address!r})
corpus = ner_corpus(n_train=300, n_dev=40, n_test=40, seed=2)
def make_tagger(corpus):
    embeddings = OneHotEmbeddings.from_corpus(corpus, embedding_length=32, min_freq=1)
    return SequenceTagger(hidden_size=32, embeddings=embeddings, tag_dictionary=corpus.make_label_dictionary("ner"),
                          tag_type="ner", use_crf=False)
""", timeout=120))
        _ok(kernel.execute(f"""%%ddp_train --cluster client --out scores --seed 0
import socket
import torch.distributed as dist
tagger = make_tagger(corpus)
result = ModelTrainer(tagger, corpus).train({str(tmp_path / "ner")!r}, max_epochs=15, mini_batch_size=16,
                                            learning_rate=0.1, multi_gpu=True)
{{"score": result["test_score"], "world": dist.get_world_size(), "host": socket.gethostname(), "model": tagger}}
""", timeout=300))
        report = _ok(kernel.execute(
            "print(scores['score'] >= 0.8, scores['world'], scores['host'] == socket.gethostname() if "
            "(socket := __import__('socket')) else 0, type(scores['model']).__name__)"
        )).stdout.split()
        assert report == ["True", "2", "True", "SequenceTagger"], report
        # rank 0's log streamed into the cell's dashboard, as on one machine
        [log] = kernel.widgets_with_class("nbddp-log")
        assert "- F-score (micro)" in log.state["value"]  # rank 0's last words: flair's test evaluation
        # a name that is no notebook variable says so; an address works as well as a Client's name
        typo = kernel.execute("%%ddp_train --cluster clinet --no-dashboard\n1")
        assert typo.stderr.startswith("UsageError: --cluster clinet: no notebook variable has that name")
        # warm ranks on the cluster: the pool's status names them, and cells run there
        started = _ok(kernel.execute(f"%ddp_pool start --cluster {cluster.address}", timeout=120))
        assert "on 2 Dask workers of 2 nodes, warm" in started.stdout
        warm = _ok(kernel.execute("%%ddp_train --no-dashboard\nimport os\nos.getpid()", timeout=120))
        again = _ok(kernel.execute("%%ddp_train --no-dashboard\nimport os, torch.distributed as dist\n"
                                   "os.getpid(), dist.get_world_size()", timeout=120))  # fmt: skip
        assert again.data("text/plain")[-1] == f"({warm.data('text/plain')[-1]}, 2)"
        _ok(kernel.execute("%ddp_pool stop"))
    assert not cluster.wait_no_kit_processes()
