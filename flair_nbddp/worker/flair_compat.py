"""Everything that bends flair inside the workers (the notebook's process never imports it).

* :func:`allow_cpu_ddp`: flair wraps the model as ``DistributedDataParallel(model,
  device_ids=[flair.device.index])``, i.e. ``[None]`` on CPU, which torch rejects. On CPU the ids
  become ``None``, so flair's whole ``multi_gpu=True`` path runs with gloo.
  :func:`bend_flair_launcher_for_cpu` does the same for flair's own launcher in a script (for comparisons).
* :func:`scale_gradients_together`: flair's multi-GPU step multiplies each gradient by the world size in a
  Python loop, one kernel launch per tensor; the same multiplications go in a few launches, with identical results.
* :func:`instrument_trainer`: every ``train``/``fine_tune``/``train_custom`` call gets a fresh
  :class:`StreamingPlugin`, and a call that forgets ``multi_gpu=True`` while several processes run
  is stopped before every rank trains the whole corpus on its own; with several ranks and fast inputs, a
  :class:`.shared_inputs.SharingPlugin` too (each sentence tokenized by one rank).
* :func:`model_subclasses`: flair's model classes, for the modules that wrap their ``evaluate``
  (``distributed_eval``, ``precision``).
* Graceful stop: once the parent asks, all ranks agree at the end of the same batch and raise flair's
  own ``TrainingInterrupt``, so flair saves ``final-model.pt`` and finishes as after Ctrl+C in a script,
  minus its final test evaluation: the returned ``test_score`` is NaN (flair would say 0, a score).

Nothing here makes the CPU wait for the GPU: the stop agreement runs over a gloo group on CPU tensors,
and GPU-valued metrics (flair's gradient norm) are copied to the host asynchronously. A ``.item()`` on
a CUDA tensor after every optimizer step would stall the next batch's preparation behind the GPU.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
import types
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from flair.trainers.plugins import TrainerPlugin
from flair.trainers.plugins.base import TrainingInterrupt
from flair.trainers.plugins.metric_records import MetricRecord

from ..errors import MissingMultiGpuError, ResumeError
from ..wire.events import (
    STOP_REQUESTED,
    CheckpointSaved,
    EventSender,
    Metric,
    ModelsSaved,
    Progress,
    Stopped,
)
from . import checkpoint_files, ddp_exec, fast_inputs
from .checkpoints import Checkpointing
from .counters import TrainingCounters
from .shared_inputs import SharingPlugin

SAVED_MODELS: list[Path] = []  # model files flair wrote during the current job, newest last


def _all_ranks_agree_to_stop(control_group: Any) -> bool:
    """One tiny all-reduce per batch over the CPU ``control_group``: stop when any rank was asked, so every
    rank stops at the same batch. ``None`` (a single process) decides alone."""
    wanted = STOP_REQUESTED.is_set()
    if control_group is None:
        return wanted
    flag = torch.tensor([1 if wanted else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group)
    return bool(flag.item())


class HostScalars:
    """Tensor-valued metrics on their way to the host, in order, without waiting for the device.

    A CUDA value (one element) is copied to pinned memory with ``non_blocking=True`` and becomes ready
    once its copy has completed (a CUDA event); any other value is ready at once.

    Example:
        >>> scalars = HostScalars()
        >>> scalars.put("train/gradient_norm", 3, torch.tensor(2.5))
        >>> list(scalars.ready())
        [('train/gradient_norm', 3, 2.5)]
    """

    def __init__(self) -> None:
        self._pending: deque[tuple[str, int, torch.Tensor, Any]] = deque()

    def put(self, name: str, step: int, value: torch.Tensor) -> None:
        value = value.detach()
        copied = None
        if value.is_cuda:
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(value.device))
            value = host
        self._pending.append((name, step, value, copied))

    def ready(self, wait: bool = False) -> Iterator[tuple[str, int, float]]:
        """``(name, step, value)`` of every metric whose copy is done, oldest first; all of them if ``wait``."""
        while self._pending and (wait or self._pending[0][3] is None or self._pending[0][3].query()):
            name, step, value, copied = self._pending.popleft()
            if copied is not None:
                copied.synchronize()
            yield name, step, float(value)


class StreamingPlugin(TrainerPlugin):
    """Streams progress and metrics (rank 0), counts throughput and handles a graceful stop (every rank).

    Its only collective is the stop agreement, which every rank joins at the same point of every batch,
    over ``control_group`` (a gloo group, ``None`` for a single process). ``batches_before(epoch)``: the batches of
    an epoch trained before this training resumed inside it, which its batch numbers count as flair's loop does not.
    """

    def __init__(self, sender: EventSender, rank: int, counters: TrainingCounters, control_group: Any) -> None:
        super().__init__()
        self._sender, self._rank, self._counters = sender, rank, counters
        self._control_group = control_group
        self._tensor_metrics = HostScalars()
        self._max_epochs = 0
        self._base_path = Path(".")
        self._saves_final_model = True
        self._corpus_before_stop: Any = None
        self._stopped_at: Path | None = None  # the checkpoint, once this plugin stopped the training
        self._set_up_at = 0.0
        self.batches_before: Callable[[int], int] = lambda epoch: 0

    @TrainerPlugin.hook
    def after_setup(
        self, max_epochs: int = 0, base_path: Any = ".", save_final_model: bool = True, mini_batch_size: Any = None,
        mini_batch_chunk_size: Any = None, **_: Any,
    ):  # fmt: skip
        self._max_epochs, self._base_path, self._saves_final_model = max_epochs, Path(base_path), save_final_model
        self._counters.training_set_up(mini_batch_size, mini_batch_chunk_size)
        self._set_up_at = time.time()  # model files older than this are an earlier training's
        # flair silences its logger on ranks > 0 ("only print logs once"); here each rank has its own log, and
        # its warnings reach the cell
        logging.getLogger("flair").disabled = False

    @TrainerPlugin.hook
    def before_training_batch(self, epoch: int = 0, batch_no: int = 0, **_: Any) -> None:
        self._counters.batch_started(epoch, self.batches_before(epoch) + batch_no + 1)

    @TrainerPlugin.hook
    def after_training_batch(self, batch: list, batch_no: int, total_number_of_batches: int, epoch: int, **_: Any):
        self._counters.batch_done(len(batch))
        before = self.batches_before(epoch)
        if self._rank == 0:
            self._sender.send(Progress(0, epoch, self._max_epochs, before + batch_no + 1, before + total_number_of_batches))
            self._send_tensor_metrics()
        if _all_ranks_agree_to_stop(self._control_group):
            self._stop(epoch, before + batch_no + 1)

    def _stop(self, epoch: int, batch: int) -> None:
        if self._saves_final_model:
            checkpoint = self._base_path / "final-model.pt"  # flair saves it on TrainingInterrupt
        else:
            checkpoint = self._base_path / "stopped-model.pt"
            if self._rank == 0:
                self.model.save(checkpoint)
        self._stopped_at = checkpoint
        if self._rank == 0:
            self._sender.send(Stopped(0, str(checkpoint)))
        raise TrainingInterrupt(f"stopped from the notebook after epoch {epoch}, batch {batch}; model: {checkpoint}")

    @property
    def stopped(self) -> bool:
        """This plugin stopped the training (a stop from the notebook)."""
        return self._stopped_at is not None

    @property
    def checkpoint(self) -> Path | None:
        """Where the model was saved when this plugin stopped the training."""
        return self._stopped_at

    @TrainerPlugin.hook
    def training_interrupt(self, **_: Any) -> None:
        """After a stop, flair would evaluate the whole test split (minutes on a real one): skip it."""
        if self._stopped_at is None:  # another plugin's interrupt: flair's usual course
            return
        self._corpus_before_stop = self.trainer.corpus
        without_test = copy.copy(self._corpus_before_stop)
        without_test._test = None
        self.trainer.corpus = without_test
        logging.getLogger("flair").info(
            "flair_nbddp: stopped, so flair's final test evaluation is skipped and test_score is NaN; "
            "evaluate the checkpoint (%s) if you need one", self._stopped_at
        )

    @TrainerPlugin.hook
    def after_training_epoch(self, **_: Any) -> None:
        self._send_tensor_metrics(wait=True)  # one wait per epoch: its last values arrive before its evaluation

    @TrainerPlugin.hook
    def _training_finally(self, **_: Any) -> None:
        """Runs however the training loop ends, before flair's final test evaluation."""
        try:
            self._send_tensor_metrics(wait=True)
        except Exception:  # noqa: BLE001 - e.g. a CUDA error: the loop's own exception is the one to report
            logging.getLogger("flair").warning("flair_nbddp: the last batches' tensor metrics could not be read")

    @TrainerPlugin.hook
    def after_training(self, **_: Any) -> None:
        if self._corpus_before_stop is not None:
            self.trainer.corpus, self._corpus_before_stop = self._corpus_before_stop, None
        for name in ("final-model.pt", "best-model.pt", "stopped-model.pt"):
            path = self._base_path / name
            # written by this training (2 s of slack for file systems with coarse times)
            if path.exists() and path.stat().st_mtime >= self._set_up_at - 2 and path not in SAVED_MODELS:
                SAVED_MODELS.append(path)
        if self._rank == 0 and SAVED_MODELS:
            self._sender.send(ModelsSaved(0, tuple(str(path.resolve()) for path in SAVED_MODELS)))

    @TrainerPlugin.hook
    def metric_recorded(self, record: MetricRecord) -> None:
        if self._rank != 0 or record.is_histogram:
            return
        # flair records an evaluation's main score as a "string" record holding a float
        values = record.value if record.is_scalar_list else [record.value]
        for index, value in enumerate(values):
            name = record.joined_name + (f"/{index}" if len(values) > 1 else "")
            if isinstance(value, torch.Tensor):  # e.g. the gradient norm: float() would wait for the GPU
                if value.numel() == 1:
                    self._tensor_metrics.put(name, int(record.global_step), value)
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            self._sender.send(Metric(0, name, number, int(record.global_step)))

    def _send_tensor_metrics(self, wait: bool = False) -> None:
        """Send the tensor metrics whose values reached the host (only rank 0 records any)."""
        for name, step, value in self._tensor_metrics.ready(wait):
            self._sender.send(Metric(0, name, value, step))


def model_subclasses() -> list[type]:
    """Every subclass of flair's ``Model`` defined so far (flair's own once ``flair.models`` is imported), each
    once, parents before their children."""
    from flair.nn import Model

    found: dict[type, None] = {}
    pending = list(Model.__subclasses__())
    while pending:
        cls = pending.pop(0)
        if cls not in found:
            found[cls] = None
            pending.extend(cls.__subclasses__())
    return list(found)


def allow_cpu_ddp() -> None:
    """Let flair's trainer wrap CPU models in DDP (``device_ids=None`` instead of ``[None]``)."""
    from flair.trainers import trainer as trainer_module

    ddp = torch.nn.parallel.DistributedDataParallel

    @functools.wraps(ddp)
    def distributed_data_parallel(module: torch.nn.Module, device_ids: Any = None, **kwargs: Any):
        if device_ids == [None]:
            device_ids = None
        return ddp(module, device_ids=device_ids, **kwargs)

    trainer_module.DistributedDataParallel = distributed_data_parallel


def scale_gradients_together() -> None:
    """Make flair's ``ModelTrainer._scale_gradients`` (every gradient times the world size, after each batch of a
    multi-GPU training) one ``torch._foreach_mul_`` over the dense gradients instead of a ``mul_`` per tensor.

    Each product is the same multiplication, so the gradients are bit for bit flair's; what changes is the rank's
    CPU time: about 100 kernel launches a batch for a DistilBERT-sized model become one or two. In a world of one
    rank the constant is 1, every product is its factor (but for a NaN's payload, or a denormal where torch flushes
    them, which flair does not ask for), and nothing is launched.
    """
    from flair.trainers import ModelTrainer

    def _scale_gradients(self: Any, constant: float) -> None:
        if constant == 1:
            return
        grads = [param.grad for param in self.model.parameters() if param.grad is not None]
        with torch.no_grad():
            torch._foreach_mul_([grad for grad in grads if not grad.is_sparse], constant)
            for grad in grads:
                if grad.is_sparse:
                    grad.mul_(constant)

    ModelTrainer._scale_gradients = _scale_gradients


def bend_flair_launcher_for_cpu(processes: int) -> None:
    """Let flair's own ``launch_distributed`` run ``processes`` CPU ranks over gloo, in a script, with no GPU.

    flair's launcher counts GPUs for its world size and joins NCCL on ``cuda:rank``: on a machine without
    GPU it starts 0 processes and waits forever. Bent here: the launcher counts ``processes`` (torch itself
    still counts the GPUs there are), each rank joins gloo on flair's own address and port
    (``localhost:12355``) with ``flair.device`` the CPU, and the trainer wraps CPU models in DDP
    (:func:`allow_cpu_ddp`). Nothing else of flair's lifecycle changes. Call it when the script is imported:
    spawned ranks re-import it. The benchmarks and the parity test run flair's way with it, for comparison
    with the kit.
    """
    import os

    import flair
    from flair import distributed_utils
    from torch.distributed import init_process_group

    def ddp_setup(rank: int, world_size: int) -> None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", "12355"
        flair.device = torch.device("cpu")
        init_process_group(backend="gloo", rank=rank, world_size=world_size)

    distributed_utils._ddp_setup = ddp_setup
    cuda = types.SimpleNamespace(**{**vars(torch.cuda), "device_count": lambda: processes})
    distributed_utils.torch = types.SimpleNamespace(**{**vars(torch), "cuda": cuda})  # its world size alone
    allow_cpu_ddp()


def _gatherer(world_size: int, control_group: Any) -> Callable[[Any], list]:
    """``gather(value)``: every rank's value, by rank, over the CPU ``control_group`` (a collective)."""

    def gather(value: Any) -> list:
        if control_group is None:
            return [value]
        values: list = [None] * world_size
        dist.all_gather_object(values, value, group=control_group)
        return values

    return gather


def _checkpointing(
    sender: EventSender, rank: int, world_size: int, control_group: Any, streaming: StreamingPlugin
) -> Any:  # fmt: skip
    """The plugin writing this training's full checkpoints (and resuming the job's first training from one), or
    None where the job writes none; ``streaming`` says when the notebook's stop ended the training."""
    directory = checkpoint_files.job_directory()
    if directory is None:
        return None
    resume = checkpoint_files.take_resume()
    if resume is not None and len(resume["generators"]) != world_size:
        raise ResumeError(
            f"the checkpoint was written by {len(resume['generators'])} ranks and {world_size} run now: each rank "
            "resumes its own random generators"
        )

    def saved(epoch: int, batch: int, steps: int, path: Path, sha256: str) -> None:
        sender.send(CheckpointSaved(0, epoch, str(path.resolve()), sha256, batch, steps))

    return Checkpointing(directory / checkpoint_files.NAME, rank, _gatherer(world_size, control_group), saved, resume,
                         stopping=lambda: streaming.stopped, every=checkpoint_files.job_checkpoint_every())  # fmt: skip


def instrument_trainer(
    sender: EventSender, rank: int, world_size: int, counters: TrainingCounters, control_group: Any
) -> None:
    """Wrap ``ModelTrainer.train_custom`` (which ``train`` and ``fine_tune`` call) for this process."""
    from flair.trainers import ModelTrainer

    original: Callable = ModelTrainer.train_custom

    @functools.wraps(original)
    def train_custom(self: Any, *args: Any, multi_gpu: bool = False, plugins: list | None = None, **kwargs: Any):
        if world_size > 1 and not multi_gpu:
            raise MissingMultiGpuError(
                f"trainer.train()/fine_tune() was called without multi_gpu=True while {world_size} processes run: "
                "each rank would train on the whole corpus on its own. Add multi_gpu=True to the call."
            )
        streaming = StreamingPlugin(sender, rank, counters, control_group)
        checkpointing = _checkpointing(sender, rank, world_size, control_group, streaming)
        if checkpointing is not None and checkpointing.start_epoch:
            kwargs["epoch"] = checkpointing.start_epoch  # flair's own argument: the epoch it goes on after
        if checkpoint_files.job_chunk_size() is not None:  # a restart after running out of memory
            kwargs["mini_batch_chunk_size"] = checkpoint_files.job_chunk_size()
        if checkpointing is not None:
            streaming.batches_before = checkpointing.batches_before
        ours = [streaming] if checkpointing is None else [checkpointing, streaming]  # a batch counted, then a stop
        if world_size > 1 and fast_inputs.enabled():
            ours.append(SharingPlugin(rank, _gatherer(world_size, control_group)))
        ddp_exec.training(True)  # an interrupt of a %%ddp_exec cell waits for the same-batch stop
        try:
            scores = original(self, *args, multi_gpu=multi_gpu, plugins=[*(plugins or []), *ours], **kwargs)
        finally:
            ddp_exec.training(False)
        if streaming.stopped and ddp_exec.in_cell():
            raise KeyboardInterrupt(f"stopped after the same batch on every rank; model: {streaming.checkpoint}")
        if streaming.stopped and isinstance(scores, dict) and "test_score" in scores:
            scores["test_score"] = float("nan")  # flair's 0 would read as a score; there was no test evaluation
        return scores

    ModelTrainer.train_custom = train_custom
