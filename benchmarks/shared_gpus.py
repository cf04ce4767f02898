"""Rehearse a multi-GPU run on one GPU: N ranks sharing it over gloo, against N CPU ranks, same seed.

    python benchmarks/shared_gpus.py --json results/gpu-shared-gpus.json     # on a machine with a GPU

For 2 and 4 ranks:

- **Training.** The parity jobs (``tests/parity_jobs.py``: an RNN ``TextClassifier`` trained with ``train``, the
  tiny transformer with ``fine_tune``, a BiLSTM-CRF ``SequenceTagger``; 4 epochs each) run on N CPU gloo ranks, on
  N ranks sharing the GPU started for the run, and on a pool of N ranks sharing it. The report gives each figure's
  largest difference between the cold and the pool runs on the GPU (equal), and to the CPU run: as the jobs are,
  and with every dropout at 0. The dropout masks come from the GPU's generator on one side and the CPU's on the
  other, so with dropout the runs differ from the first batch on; without it only CPU and GPU fp32 rounding does,
  except in ``fine_tune``, whose decoder starts from other weights on the GPU (``--gap``: flair resizes the
  transformer's embeddings on the device, drawing there, so the CPU generator reaches the decoder in another state).
- **Shared evaluation.** ``tests/eval_jobs.evaluate_everywhere`` on the pool: every evaluation shared out over the
  ranks on the GPU, each result compared with one process's evaluation of the returned model on the same GPU.
- **Interrupt.** A SIGINT to this process while N shared ranks train (as the kernel's Interrupt sends) stops the
  run after the same batch on every rank; the report gives its status, the model flair saved, the full checkpoints,
  each rank's GPU memory as the dashboard showed it, and any worker process or GPU context left afterwards.

``--rounding-on-cpu`` runs, instead, the dropout-free jobs on 2 CPU ranks with 1 and with 2 threads per rank:
how far a change in the order of float sums alone carries each job over 4 epochs, with no GPU in the comparison.

``--gap`` runs, instead, only the ``fine_tune`` job (the tiny transformer), every dropout at 0, to tell where its
CPU/GPU gap comes from. Each run records, besides the parity figures, every batch's training loss and gradient
norm on rank 0, digests of the initial weights (the classifier's decoder, the transformer, the embedding row
flair adds for its context separator), the attention implementation, the float32 matmul settings, any dropout
left above 0, and whether training drew from the GPU's generator. On **one rank**: a CPU rank (gloo) against one
CUDA rank (NCCL, an ordinary run); both again from the same start (``same_start``: the transformer's
``resize_token_embeddings``, which flair calls after moving the model to its device, and which therefore draws
from the GPU's generator on the GPU, leaves the CPU generator as it found it on the CPU too, so both draw the
decoder's initial weights alike); the CUDA rank again (reproducible?), made strict (``allow_tf32`` off for matmul
and cuDNN, ``torch.use_deterministic_algorithms(True, warn_only=True)`` with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
SDPA's math backend only) and with ``fast_inputs=False``; a CPU rank whose initial weights get a relative noise
of 1e-7 (how far a perturbation of fp32 rounding's size carries this job, with no GPU); and flair alone, without
the kit (a subprocess with its own 1-process group, the same job; on the CPU only flair's DDP wrap mended as in
the kit) on the CPU and on the GPU. On **2 ranks**: 2 CPU ranks against 2 ranks sharing the GPU, as they are and
from the same start, with the kit's ``fast_inputs`` on (its default) and off; the shared run again and made
strict. Each comparison gives the first batch's loss on both sides and their difference (the same batch: the
initial weights and per-op precision), the first gradient norm's difference, the largest batch-loss difference
in each epoch, the first batch at which the difference passes 1e-6, 1e-4 and 1e-2, and each epoch's train loss,
dev loss and dev score difference. The report so far is written after every run; the 18 runs take about 6
minutes with an H100 (a CUDA run about 18 s, most of it start-up).

``--faults`` runs, instead, 2 ranks sharing the GPU while rank 1 fails in epoch 2 of a fine-tuning (after noting
the time): once by raising an error, once by SIGKILLing itself. Per case: the error's type and rank, the seconds
from the failure to ``launch`` raising, the exit code, any worker process left 10 s later, and the GPU contexts
``nvidia-smi --query-compute-apps=pid`` still lists (the workers', and all).

``--device cpu`` runs any mode with CPU ranks where it says GPU (the script checking itself without a GPU).

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


GAP_KIND = "fine_tune"
THRESHOLDS = (1e-6, 1e-4, 1e-2)
PERTURBATION = 1e-7  # relative noise on each initial weight of the perturbed CPU run: fp32 rounding's size


def traced_fine_tune(corpora: dict, model_path: str, base_path: str, settings: dict | None = None) -> dict:
    """The dropout-free ``fine_tune`` job of :func:`every_kind` (``corpora`` holds only its corpus), with each
    batch's loss and gradient norm on this rank, digests of the initial weights, and what set this device's
    arithmetic. ``settings``: ``strict`` (TF32 off, deterministic algorithms, SDPA's math backend only),
    ``perturb`` (relative noise on every initial weight, from a generator of its own), ``same_start`` (the
    transformer's ``resize_token_embeddings`` leaves the CPU generator as it found it: on the GPU its draws come
    from the GPU's generator anyway, so CPU and GPU then draw the classifier's initial weights alike)."""
    import hashlib
    import warnings

    import flair
    import torch
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin
    from transformers import PreTrainedModel

    settings = settings or {}
    cuda = flair.device.type == "cuda"
    if settings.get("strict"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        if cuda:
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
            torch.backends.cuda.enable_math_sdp(True)
    batches: dict = {"batch_loss": [], "gradient_norm": []}
    seen: dict = {}

    class Batches(TrainerPlugin):
        @TrainerPlugin.hook
        def metric_recorded(self, record) -> None:
            name = str(record.name)
            if name in ("train/batch_loss", "train/gradient_norm"):
                batches[name.split("/")[1]].append(float(record.value))

    def left_dropouts(model) -> list:
        left = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Dropout) and module.p > 0:
                left.append(f"{name}.p={module.p}")
            for attribute in ("dropout_rate", "dropout_prob"):
                value = getattr(module, attribute, None)
                if isinstance(value, float) and value > 0:
                    left.append(f"{name}.{attribute}={value}")
        return left

    given_init, given_fine_tune = ModelTrainer.__init__, ModelTrainer.fine_tune
    given_resize = PreTrainedModel.resize_token_embeddings

    def resize(transformer, *args, **kw):
        seen["resize_token_embeddings_on"] = str(transformer.device)
        if not settings.get("same_start"):
            return given_resize(transformer, *args, **kw)
        with torch.random.fork_rng(devices=[]):  # the CPU generator's state is put back afterwards
            return given_resize(transformer, *args, **kw)

    def digest(tensors) -> str:
        hashed = hashlib.sha256()
        for name, tensor in tensors:
            hashed.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
        return hashed.hexdigest()[:16]

    def init(trainer, model, *rest, **kw):
        state = model.state_dict()
        seen["initial_weights"] = {
            "decoder": digest((k, v) for k, v in sorted(state.items()) if k.startswith("decoder.")),
            "transformer_without_added_rows": digest(
                (k, v[:-1] if k.endswith("word_embeddings.weight") else v)
                for k, v in sorted(state.items()) if k.startswith("embeddings.")
            ),
            "added_embedding_row": digest((k, v[-1:]) for k, v in state.items() if k.endswith("word_embeddings.weight")),
        }  # fmt: skip
        if settings.get("perturb"):
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for parameter in model.parameters():
                    noise = torch.randn(parameter.shape, generator=generator).to(parameter.device, parameter.dtype)
                    parameter.mul_(1 + settings["perturb"] * noise)
        given_init(trainer, model, *rest, **kw)

    def fine_tune(trainer, *args, **kw):
        kw["plugins"] = [*kw.get("plugins", []), Batches()]
        transformer = trainer.model.embeddings.model
        seen["attention"] = getattr(transformer.config, "_attn_implementation", None)
        seen["config_attention_dropout"] = getattr(transformer.config, "attention_dropout", None)
        seen["dropouts_left"] = left_dropouts(trainer.model)
        gpu_rng = torch.cuda.get_rng_state() if cuda else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome = given_fine_tune(trainer, *args, **kw)
        seen["gpu_generator_drew"] = bool(cuda and not torch.equal(gpu_rng, torch.cuda.get_rng_state()))
        seen["nondeterministic_warnings"] = sorted({str(w.message)[:200] for w in caught if "determinis" in str(w.message)})
        return outcome

    ModelTrainer.__init__, ModelTrainer.fine_tune = init, fine_tune
    PreTrainedModel.resize_token_embeddings = resize
    try:
        figures = every_kind(corpora, model_path, base_path, dropout=False)[GAP_KIND]
    finally:
        ModelTrainer.__init__, ModelTrainer.fine_tune = given_init, given_fine_tune
        PreTrainedModel.resize_token_embeddings = given_resize
    seen["arithmetic"] = {
        "device": str(flair.device),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "sdp_enabled": {
            "flash": torch.backends.cuda.flash_sdp_enabled(), "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(), "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        } if cuda else None,
        "gpu": torch.cuda.get_device_name(flair.device) if cuda else None,
    }  # fmt: skip
    return {"figures": figures, "batches": batches, "setup": seen}


def curves_apart(one: dict, other: dict) -> dict:
    """How far two traced runs are apart: the first batch (the same weights, the same batch), each epoch's
    largest batch-loss difference, when the difference first passes each threshold, each epoch's figures."""
    losses = [one["batches"]["batch_loss"], other["batches"]["batch_loss"]]
    norms = [one["batches"]["gradient_norm"], other["batches"]["gradient_norm"]]
    apart = [abs(a - b) for a, b in zip(*losses, strict=True)]
    per_epoch = len(apart) // len(one["figures"]["train/loss"])
    report = {
        "first_batch_loss": [losses[0][0], losses[1][0]],
        "first_batch_loss_diff": apart[0],
        "first_batch_loss_relative_diff": apart[0] / abs(losses[1][0]),
        "first_gradient_norm_diff": abs(norms[0][0] - norms[1][0]) if norms[0] and norms[1] else None,
        "first_gradient_norm_relative_diff": abs(norms[0][0] - norms[1][0]) / abs(norms[1][0]) if norms[1] else None,
        "batch_loss_diff_max_per_epoch": [max(apart[i : i + per_epoch]) for i in range(0, len(apart), per_epoch)],
        "batches_per_epoch": per_epoch,
        "first_batch_over": {f"{limit:g}": next((i for i, d in enumerate(apart) if d > limit), None) for limit in THRESHOLDS},
    }  # fmt: skip
    for name in ("train/loss", "dev/loss", "dev/score"):
        report[f"{name}_diff_per_epoch"] = [abs(a - b) for a, b in zip(one["figures"][name], other["figures"][name])]
    report["test_score"] = [one["figures"]["test/score"], other["figures"]["test/score"]]
    report["weights_identical"] = one["figures"]["weights"] == other["figures"]["weights"]
    return report


def plain_flair(device: str, model_path: str, workdir: str) -> dict:
    """The traced job run by flair alone, without the kit: a new Python process with a 1-process group of its
    own (NCCL on the GPU, gloo on the CPU), flair's device set, the seed set as flair's launcher sets it; on the
    CPU, flair's DDP wrap given ``device_ids=None`` (as the kit's CPU ranks), which torch needs there."""
    Path(workdir).mkdir(parents=True, exist_ok=True)
    out = Path(workdir, f"plain-{device}.json")
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import shared_gpus; "
        f"shared_gpus._plain_main({device!r}, {model_path!r}, {workdir!r}, {str(out)!r})"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # as the kit gives its one rank
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"flair alone on {device} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def _plain_main(device: str, model_path: str, workdir: str, out: str) -> None:
    import socket

    import flair
    import torch
    import torch.distributed as dist
    from parity_jobs import SEED, build_corpus

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device == "cuda":
        torch.cuda.set_device(0)
        flair.device = torch.device("cuda:0")
    else:
        from flair_nbddp.worker.flair_compat import allow_cpu_ddp

        flair.device = torch.device("cpu")
        allow_cpu_ddp()  # flair's DDP wrap gives a CPU model device_ids=[None], which torch refuses: None instead
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        flair.set_seed(SEED)
        traced = traced_fine_tune({GAP_KIND: build_corpus(GAP_KIND)}, model_path, f"{workdir}/plain-{device}")
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(traced))


ONE_RANK_PAIRS = {  # comparison: (run, run), in the order the runs are made
    "gpu_vs_cpu": ("gpu", "cpu"),
    "gpu_same_start_vs_cpu_same_start": ("gpu_same_start", "cpu_same_start"),
    "gpu_same_start_vs_gpu": ("gpu_same_start", "gpu"),
    "gpu_again_vs_gpu": ("gpu_again", "gpu"),
    "gpu_strict_vs_gpu": ("gpu_strict", "gpu"),
    "gpu_strict_vs_cpu": ("gpu_strict", "cpu"),
    "gpu_no_fast_inputs_vs_gpu": ("gpu_no_fast_inputs", "gpu"),
    "cpu_perturbed_vs_cpu": ("cpu_perturbed", "cpu"),
    "flair_alone_gpu_vs_cpu": ("flair_alone_gpu", "flair_alone_cpu"),
    "kit_gpu_vs_flair_alone_gpu": ("gpu", "flair_alone_gpu"),
    "kit_cpu_vs_flair_alone_cpu": ("cpu", "flair_alone_cpu"),
}
TWO_RANK_PAIRS = {
    "shared_gpu_vs_cpu": ("shared_gpu", "cpu"),
    "shared_gpu_same_start_vs_cpu_same_start": ("shared_gpu_same_start", "cpu_same_start"),
    "shared_gpu_vs_cpu_no_fast_inputs": ("shared_gpu_no_fast_inputs", "cpu_no_fast_inputs"),
    "shared_gpu_fast_inputs_off_vs_on": ("shared_gpu_no_fast_inputs", "shared_gpu"),
    "cpu_fast_inputs_off_vs_on": ("cpu_no_fast_inputs", "cpu"),
    "shared_gpu_again_vs_shared_gpu": ("shared_gpu_again", "shared_gpu"),
    "shared_gpu_strict_vs_shared_gpu": ("shared_gpu_strict", "shared_gpu"),
}


def transformer_gap(model_path: str, workdir: str, json_path: str | None = None) -> dict:
    """Where the dropout-free ``fine_tune`` job's CPU/GPU gap comes from: 1 rank each way (also from the same start,
    made strict, without fast inputs, without the kit), a CPU perturbation of rounding's size; 2 CPU against 2
    shared ranks. The report so far is written to ``json_path`` after every run (a run cut short keeps it)."""
    import flair_nbddp
    from parity_jobs import SEED, build_corpus

    corpora = {GAP_KIND: build_corpus(GAP_KIND)}
    started = time.monotonic()
    seconds: dict = {}
    one: dict = {}
    two: dict = {}

    def report() -> dict:
        runs = {**one, **{f"2-{name}": value for name, value in two.items()}}
        return {
            "one_rank": {name: curves_apart(one[a], one[b]) for name, (a, b) in ONE_RANK_PAIRS.items()
                         if a in one and b in one},
            "two_ranks": {name: curves_apart(two[a], two[b]) for name, (a, b) in TWO_RANK_PAIRS.items()
                          if a in two and b in two},
            "setups": {name: value["setup"] for name, value in runs.items()},
            "curves": {name: {"batch_loss": value["batches"]["batch_loss"], "dev/loss": value["figures"]["dev/loss"],
                              "dev/score": value["figures"]["dev/score"]} for name, value in runs.items()},
            "run_seconds": seconds,
            "seconds": round(time.monotonic() - started, 1),
        }  # fmt: skip

    def run(into: dict, name: str, device: str, settings: dict | None = None, **options) -> None:
        processes = 1 if into is one else 2
        began = time.monotonic()
        env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if (settings or {}).get("strict") else {}
        os.environ.update(env)  # the workers take this process's environment: deterministic cuBLAS, strict runs only
        try:
            if name.startswith("flair_alone"):
                into[name] = plain_flair(device, model_path, f"{workdir}/gap")
            else:
                result = flair_nbddp.launch(
                    traced_fine_tune, (corpora, model_path, f"{workdir}/gap/{processes}-{name}", settings),
                    device=device, processes=processes, share_gpus=processes > 1, seed=SEED, dashboard=False,
                    **options,
                )  # fmt: skip
                if result.status != "finished":
                    raise RuntimeError(f"{name}: {result.status} {result.error}")
                into[name] = result.value
        finally:
            for key in env:
                del os.environ[key]
        seconds[f"{processes}-{name}"] = round(time.monotonic() - began, 1)
        if json_path:
            Path(json_path).write_text(json.dumps({"fine_tune_gap_without_dropout": report(), "partial": True}))

    same = {"same_start": True}
    run(one, "cpu", "cpu")
    run(one, "gpu", DEVICE)
    run(one, "cpu_same_start", "cpu", same)
    run(one, "gpu_same_start", DEVICE, same)
    run(two, "cpu", "cpu")
    run(two, "shared_gpu", DEVICE)
    run(two, "cpu_same_start", "cpu", same)
    run(two, "shared_gpu_same_start", DEVICE, same)
    run(one, "gpu_again", DEVICE)
    run(one, "gpu_strict", DEVICE, {"strict": True})
    run(one, "gpu_no_fast_inputs", DEVICE, fast_inputs=False)
    run(one, "cpu_perturbed", "cpu", {"perturb": PERTURBATION})
    run(one, "flair_alone_cpu", "cpu")
    run(one, "flair_alone_gpu", DEVICE)
    run(two, "cpu_no_fast_inputs", "cpu", fast_inputs=False)
    run(two, "shared_gpu_no_fast_inputs", DEVICE, fast_inputs=False)
    run(two, "shared_gpu_again", DEVICE)
    run(two, "shared_gpu_strict", DEVICE, {"strict": True})
    return report()


def fails_in_epoch_2(corpus, model_path: str, base_path: str, stamps: str, how: str) -> float:
    """Fine-tune the tiny transformer for 3 epochs; rank 1 notes the time, then fails at epoch 2's third batch:
    ``how`` is ``"raise"`` (an error) or ``"kill"`` (SIGKILL)."""
    import os
    import signal
    import time
    from pathlib import Path

    import torch.distributed as dist
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin

    class Fail(TrainerPlugin):
        @TrainerPlugin.hook
        def before_training_batch(self, epoch: int, batch_no: int, **_):
            if epoch == 2 and batch_no == 2 and dist.get_rank() == 1:
                Path(stamps, "failed").write_text(repr(time.time()))
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("rank 1 fails on purpose in epoch 2")

    model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    scores = ModelTrainer(model, corpus).fine_tune(base_path, max_epochs=3, mini_batch_size=4, learning_rate=5e-3,
                                                   multi_gpu=True, plugins=[Fail()])  # fmt: skip
    return scores["test_score"]


def faults_on_shared_gpu(model_path: str, workdir: str) -> dict:
    """Rank 1 of 2 ranks sharing the GPU raises, or is SIGKILLed, in epoch 2: how the run ends, and what is left."""
    import psutil

    import flair_nbddp
    from flair_nbddp import WorkerError
    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(n_train=64, n_dev=16, n_test=16, seed=4)
    smi = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    report = {}
    for how in ("raise", "kill"):
        stamps = Path(workdir, f"fault-{how}")
        stamps.mkdir(parents=True)
        entry: dict = {}
        try:
            result = flair_nbddp.launch(fails_in_epoch_2, (corpus, model_path, str(stamps / "out"), str(stamps), how),
                                        device=DEVICE, processes=2, share_gpus=True, seed=3, dashboard=False)  # fmt: skip
            entry["error"] = None
            entry["status"] = result.status
            pids = [rank.pid for rank in result.ranks]
        except WorkerError as error:
            raised = time.time()
            entry.update(
                error="WorkerError", rank=error.rank, exc_type=error.exc_type, exit_code=error.exit_code,
                message=str(error).splitlines()[0][:300],
                failure_to_error_s=round(raised - float((stamps / "failed").read_text()), 2),
            )  # fmt: skip
            pids = [rank.pid for rank in error.result.ranks] if error.result is not None else []
        except Exception as error:  # noqa: BLE001 - reported, not hidden
            entry.update(error=type(error).__name__, message=str(error)[:500])
            pids = []
        entry["worker_pids"] = pids
        _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
        entry["workers_left"] = [process.pid for process in alive if _running(process.pid)]
        if shutil.which(smi[0]):
            contexts = [int(pid) for pid in subprocess.run(smi, capture_output=True, text=True).stdout.split()]
            entry["gpu_contexts_left_of_workers"] = [pid for pid in contexts if pid in pids]
            entry["gpu_contexts_all"] = contexts
        report[how] = entry
    return report


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--rounding-on-cpu", action="store_true",
                        help="only compare 1 and 2 threads per CPU rank without dropout (no GPU needed)")
    parser.add_argument("--gap", action="store_true",
                        help="only trace the fine_tune job's CPU/GPU gap without dropout (1 rank each way, then 2)")
    parser.add_argument("--faults", action="store_true",
                        help="only make a rank of 2 sharing the GPU raise, then die, in training")
    parser.add_argument("--device", default=DEVICE, choices=("cuda", "cpu"),
                        help="what the GPU ranks use: cpu checks the script on a machine without a GPU")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    DEVICE = args.device
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(TESTS))
    from flair_nbddp.ledger.versions import versions
    from flair_nbddp.synthetic import tiny_transformer

    workdir = tempfile.mkdtemp(prefix="shared-gpus-")
    model = str(tiny_transformer(Path(workdir, "model")))
    started = time.monotonic()
    if args.rounding_on_cpu:
        report = {"threads_2_vs_1_without_dropout": rounding_on_cpu(model, workdir)}
    elif args.gap:
        report = {"fine_tune_gap_without_dropout": transformer_gap(model, workdir, args.json)}
    elif args.faults:
        report = {"faults_on_shared_gpu": faults_on_shared_gpu(model, workdir)}
    else:
        report = {str(n): rehearse(n, model, workdir) for n in args.ranks}
    report["seconds"] = round(time.monotonic() - started, 1)
    report["versions"] = versions()
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
