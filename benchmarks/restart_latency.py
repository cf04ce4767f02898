"""From a rank's death to the first batch after the automatic restart: cold, on a pool and on a Dask cluster.

    python benchmarks/restart_latency.py --json results/cpu-restart-latency.json

The job fine-tunes the tiny transformer on 2 CPU ranks for 3 epochs (64 short reviews, batch 4) with
``max_restarts=1``; in the first attempt rank 1 notes the time and SIGKILLs itself at the third batch of epoch 2,
after epoch 1's checkpoint. Rank 0 notes when each attempt's first batch ends. Per way of running, the seconds
from the death to: the failed attempt's end (every rank ended, the error known), the restarted attempt's start
(its record in the ledger), and its first batch (new ranks started, the corpus shipped again, the checkpoint
loaded). Cold: new processes for each attempt; pool: a warm ``WorkerPool``, whose failed workers are replaced;
cluster: a ``dask scheduler`` and 2 ``dask worker`` processes on 127.0.0.1 (``tests/dask_cluster.py``), the
checkpoint coming up to the notebook and going down to each node again. Prints one JSON line.

``--device cuda`` runs the cold and pool ways with CUDA ranks: one GPU each where there are 2 (NCCL), else the 2
ranks sharing the GPU (``share_gpus=True``, gloo); the cluster way stays on CPU Dask workers.

    python benchmarks/restart_latency.py --device cuda --modes cold pool --json results/gpu-restart-latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
MODES = ("cold", "pool", "cluster")


def dies_once(corpus, model_path: str, base_path: str, stamps: str) -> float:
    """Fine-tune for 3 epochs; rank 1 dies as the module says while ``stamps/marker`` exists; rank 0 appends the
    time each attempt's first batch ended to ``stamps/first-batches``."""
    import os
    import signal
    import time
    from pathlib import Path

    import torch.distributed as dist
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin

    folder, rank = Path(stamps), dist.get_rank()

    class Timing(TrainerPlugin):
        first = True

        @TrainerPlugin.hook
        def before_training_batch(self, epoch: int, batch_no: int, **_):
            if epoch == 2 and batch_no == 2 and rank == 1 and (folder / "marker").exists():
                (folder / "marker").unlink()
                (folder / "died").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        @TrainerPlugin.hook
        def after_training_batch(self, **_):
            if self.first and rank == 0:
                self.first = False
                with open(folder / "first-batches", "a") as file:
                    file.write(f"{time.time()!r}\n")

    model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    scores = ModelTrainer(model, corpus).fine_tune(base_path, max_epochs=3, mini_batch_size=4, learning_rate=5e-3,
                                                   multi_gpu=True, plugins=[Timing()])  # fmt: skip
    return scores["test_score"]


def measure(mode: str, corpus, model_path: str, workdir: Path, **where) -> dict:
    import flair_nbddp

    stamps = workdir / mode
    stamps.mkdir()
    (stamps / "marker").touch()
    args = (corpus, model_path, str(stamps / "out"), str(stamps))
    result = (where.pop("pool").launch if "pool" in where else flair_nbddp.launch)(
        dies_once, args, seed=3, dashboard=False, max_restarts=1, **where
    )
    failed, restarted = (flair_nbddp.history(limit=2)[1], flair_nbddp.history(limit=1)[0])
    died = float((stamps / "died").read_text())
    first_batches = [float(line) for line in (stamps / "first-batches").read_text().split()]
    return {
        "status": result.status,
        "attempts": len(result.attempts),
        "resumed_from_epoch": result.attempts[-1].resumed_from_epoch,
        "death_to_failure_s": round(failed.ended_at - died, 2),
        "death_to_restart_s": round(restarted.started_at - died, 2),
        "death_to_first_batch_s": round(first_batches[-1] - died, 2),
        "first_attempt_launch_to_first_batch_s": round(first_batches[0] - failed.started_at, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="the ranks' device for the cold and pool ways (cuda: 2 ranks share one GPU if need be)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(TESTS))
    from dask_cluster import LoopbackCluster

    import flair_nbddp
    from flair_nbddp.ledger.versions import versions
    from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer

    workdir = Path(tempfile.mkdtemp(prefix="restart-latency-"))
    model = str(tiny_transformer(workdir / "model"))
    corpus = sentiment_corpus(n_train=64, n_dev=16, n_test=16, seed=4)
    report: dict = {"device": args.device}
    where: dict = {"device": args.device}
    if args.device == "cuda":
        import torch

        where["share_gpus"] = torch.cuda.device_count() < 2
        report["gpus"] = torch.cuda.device_count()
        report["share_gpus"] = where["share_gpus"]
    for mode in args.modes:
        if mode == "cold":
            report[mode] = measure(mode, corpus, model, workdir, processes=2, **where)
        elif mode == "pool":
            with flair_nbddp.WorkerPool(2, **where) as pool:
                pool.warm_up()
                report[mode] = measure(mode, corpus, model, workdir, pool=pool)
        else:
            with LoopbackCluster(workers=2, log_dir=workdir) as cluster:
                report[mode] = measure(mode, corpus, model, workdir, cluster=cluster.client(), processes=2)
    report["versions"] = versions()
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
