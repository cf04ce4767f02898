"""Rehearse a multi-GPU run on one GPU (#37): N ranks sharing it over gloo, against N CPU ranks, same seed.

    python benchmarks/shared_gpus.py --json results/gpu-shared-gpus.json     # on a machine with a GPU

For 2 and 4 ranks:

- **Training.** The parity jobs (``tests/parity_jobs.py``: an RNN ``TextClassifier`` trained with ``train``, the
  tiny transformer with ``fine_tune``, a BiLSTM-CRF ``SequenceTagger``; 4 epochs each) run on N CPU gloo ranks, on
  N ranks sharing the GPU started for the run, and on a pool of N ranks sharing it. The report gives each figure's
  largest difference between the cold and the pool runs on the GPU (equal), and to the CPU run: as the jobs are,
  and with every dropout at 0. The dropout masks come from the GPU's generator on one side and the CPU's on the
  other, so with dropout the runs differ from the first batch on; without it only CPU and GPU fp32 rounding does.
- **Shared evaluation.** ``tests/eval_jobs.evaluate_everywhere`` on the pool: every evaluation shared out over the
  ranks on the GPU, each result compared with one process's evaluation of the returned model on the same GPU.
- **Interrupt.** A SIGINT to this process while N shared ranks train (as the kernel's Interrupt sends) stops the
  run after the same batch on every rank; the report gives its status, the model flair saved, the full checkpoints,
  each rank's GPU memory as the dashboard showed it, and any worker process or GPU context left afterwards.

``--rounding-on-cpu`` runs, instead, the dropout-free jobs on 2 CPU ranks with 1 and with 2 threads per rank:
how far a change in the order of float sums alone carries each job over 4 epochs, with no GPU in the comparison.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
RANKS = (2, 4)
DEVICE = "cuda"  # what the ranks share (on "cpu" the script checks itself on a machine without GPU)
INTERRUPT_AT_STEP = 60  # rank 0's training steps before the interrupt: past the first epoch's end on 2 and 4 ranks


def every_kind(corpora: dict, model_path: str, base_path: str, dropout: bool = True) -> dict:
    """The parity jobs one after the other in one run, each from the parity seed, as flair's launcher seeds them;
    ``dropout=False``: with every dropout of their models at 0."""
    import flair
    from flair.trainers import ModelTrainer
    from parity_jobs import SEED, kit_train

    given = ModelTrainer.__init__
    if not dropout:
        ModelTrainer.__init__ = lambda trainer, model, *rest, **kw: given(trainer, _without_dropout(model), *rest, **kw)
    try:
        figures = {}
        for kind, corpus in corpora.items():
            flair.set_seed(SEED)
            figures[kind] = kit_train(corpus, kind, model_path, f"{base_path}/{kind}")["figures"]
        return figures
    finally:
        ModelTrainer.__init__ = given


def _without_dropout(model):
    """``model`` with each of its dropouts at 0 (torch's, flair's word and locked dropout, attention's): nothing
    random is drawn on the device, whose generator differs from the CPU's, so CPU and GPU differ by rounding only."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("dropout_rate", "dropout_prob"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return model


def largest_differences(one: dict, other: dict) -> dict:
    """Per kind and figure, the largest absolute difference (0.0: equal), and whether the weights are identical."""
    report = {}
    for kind, figures in one.items():
        entry = {}
        for name, value in figures.items():
            theirs = other[kind][name]
            if name == "weights":
                entry["weights_identical"] = value == theirs
                continue
            pairs = zip(value, theirs, strict=True) if isinstance(value, list) else [(value, theirs)]
            entry[name] = max(abs(a - b) for a, b in pairs)
        report[kind] = entry
    return report


def shared_evaluation(result, model_path: str) -> dict:
    """Each evaluation the shared ranks made, against one process's on this GPU: equal, and the ranks agreeing."""
    import flair
    import torch
    from eval_jobs import build, evaluated, splits, summary

    flair.device = torch.device(DEVICE)
    report = {}
    for kind, outcome in result.value.items():
        corpus, _, label_type = build(kind, model_path)
        model = outcome["model"].to(flair.device)
        with tempfile.TemporaryDirectory() as scratch:
            for name, points in splits(corpus).items():
                one = summary(evaluated(model, points, label_type, Path(scratch) / f"{name}.tsv"))
                every_rank = outcome["every_rank"][name]
                report[f"{kind}/{name}"] = {
                    "equals_one_process": every_rank[0] == one,
                    "ranks_agree": all(entry == every_rank[0] for entry in every_rank),
                    "batches_per_rank": outcome["computed_here"][name],
                }
    return report


def interrupted_run(processes: int, model_path: str, base_path: str) -> dict:
    """A training of N shared ranks, interrupted with SIGINT once rank 0 has made ``INTERRUPT_AT_STEP`` steps."""
    import psutil
    from training_jobs import train_sentiment

    import flair_nbddp

    run = flair_nbddp.start(
        train_sentiment, (model_path, base_path), {"epochs": 20, "batch": 4, "docs": 400},
        device=DEVICE, processes=processes, share_gpus=True, seed=1,
    )  # fmt: skip
    seen: dict = {}

    def interrupt_when_far_enough() -> None:
        while not run.state.ended_at:
            ranks = run.state.snapshot().ranks
            if ranks[0].step >= INTERRUPT_AT_STEP:
                seen["ranks"] = [(rank.device, rank.gpu_memory_bytes, rank.gpu_utilization) for rank in ranks]
                seen["interrupted_at"] = time.monotonic()
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_when_far_enough, daemon=True).start()
    result = run.wait()
    freed_after = time.monotonic() - seen["interrupted_at"]
    pids = [rank.pid for rank in result.ranks]
    gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
    smi = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    contexts = subprocess.run(smi, capture_output=True, text=True).stdout.split() if shutil.which(smi[0]) else []
    return {
        "status": result.status,
        "cell_freed_s": round(freed_after, 2),
        "model_saved": bool(result.checkpoint and Path(result.checkpoint).exists()),
        "full_checkpoints": [checkpoint.epoch for checkpoint in result.checkpoints],
        "ranks_at_interrupt": seen["ranks"],
        "workers_left": [process.pid for process in alive],
        "gpu_contexts_left": [pid for pid in map(int, contexts) if pid in pids],
        "ledger_devices": flair_nbddp.history(limit=1)[0].devices,
    }


def rehearse(processes: int, model_path: str, workdir: str) -> dict:
    from eval_jobs import evaluate_everywhere
    from parity_jobs import KINDS, SEED, build_corpus

    import flair_nbddp

    corpora = {kind: build_corpus(kind) for kind in KINDS}
    base = f"{workdir}/{processes}"
    cpu = flair_nbddp.launch(every_kind, (corpora, model_path, f"{base}/cpu"), device="cpu", processes=processes,
                             seed=SEED, dashboard=False)  # fmt: skip
    cold = flair_nbddp.launch(every_kind, (corpora, model_path, f"{base}/cold"), device=DEVICE, processes=processes,
                              share_gpus=True, seed=SEED, dashboard=False)  # fmt: skip
    recorded = flair_nbddp.history(limit=1)[0].devices
    still = {
        device: flair_nbddp.launch(every_kind, (corpora, model_path, f"{base}/{device}-still", False), device=device,
                                   processes=processes, share_gpus=True, seed=SEED, dashboard=False).value
        for device in ("cpu", DEVICE)
    }  # fmt: skip
    with flair_nbddp.WorkerPool(processes, DEVICE, share_gpus=True) as pool:
        warm = pool.launch(every_kind, (corpora, model_path, f"{base}/pool"), seed=SEED, dashboard=False)
        evaluation = pool.launch(evaluate_everywhere, (("text", "tagger_crf", "tagger"), model_path, f"{base}/eval"),
                                 seed=3, dashboard=False)  # fmt: skip
        pool_workers = [rank.pid for rank in evaluation.ranks]
    return {
        "ledger_devices": recorded,
        "statuses": [cpu.status, cold.status, warm.status, evaluation.status],
        "gpu_vs_cpu": largest_differences(cold.value, cpu.value),
        "gpu_vs_cpu_without_dropout": largest_differences(still[DEVICE], still["cpu"]),
        "dropout_off_changed_the_cpu_curves": still["cpu"] != cpu.value,
        "pool_vs_cold": largest_differences(warm.value, cold.value),
        "test_scores": {kind: [run.value[kind]["test/score"] for run in (cpu, cold, warm)] for kind in KINDS},
        "shared_evaluation": shared_evaluation(evaluation, model_path),
        "pool_workers_left_after_close": [pid for pid in pool_workers if _running(pid)],
        "interrupt": interrupted_run(processes, model_path, f"{base}/interrupted"),
    }


def rounding_on_cpu(model_path: str, workdir: str) -> dict:
    """How far rounding alone carries each job: the dropout-free jobs on 2 CPU ranks with 1 thread each and with
    2 (torch sums in another order), every figure's largest difference, no GPU involved."""
    import flair_nbddp
    from parity_jobs import KINDS, SEED, build_corpus

    corpora = {kind: build_corpus(kind) for kind in KINDS}
    runs, given = {}, os.environ.get("OMP_NUM_THREADS")
    for threads in ("1", "2"):
        os.environ["OMP_NUM_THREADS"] = threads  # each rank's, as the kit passes the environment on
        runs[threads] = flair_nbddp.launch(every_kind, (corpora, model_path, f"{workdir}/threads-{threads}", False),
                                           device="cpu", processes=2, seed=SEED, dashboard=False).value  # fmt: skip
    if given is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = given
    return largest_differences(runs["2"], runs["1"])


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--rounding-on-cpu", action="store_true",
                        help="only compare 1 and 2 threads per CPU rank without dropout (no GPU needed)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(TESTS))
    from flair_nbddp.ledger.versions import versions
    from flair_nbddp.synthetic import tiny_transformer

    workdir = tempfile.mkdtemp(prefix="shared-gpus-")
    model = str(tiny_transformer(Path(workdir, "model")))
    started = time.monotonic()
    if args.rounding_on_cpu:
        report = {"threads_2_vs_1_without_dropout": rounding_on_cpu(model, workdir)}
    else:
        report = {str(n): rehearse(n, model, workdir) for n in args.ranks}
    report["seconds"] = round(time.monotonic() - started, 1)
    report["versions"] = versions()
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
