"""Everything that bends flair inside the workers (never imported by the parent).

* :func:`allow_cpu_ddp`: flair wraps the model as ``DistributedDataParallel(model,
  device_ids=[flair.device.index])``, i.e. ``[None]`` on CPU, which torch rejects. On CPU the ids
  become ``None``, so flair's whole ``multi_gpu=True`` path runs with gloo.
* :func:`instrument_trainer`: every ``train``/``fine_tune``/``train_custom`` call gets a fresh
  :class:`StreamingPlugin`, and a call that forgets ``multi_gpu=True`` while several processes run
  is stopped before every rank trains the whole corpus on its own.
* Graceful stop: once the parent asks, all ranks agree at the end of the same batch and raise flair's
  own ``TrainingInterrupt``, so flair saves ``final-model.pt`` and finishes as after Ctrl+C in a script,
  minus its final test evaluation.
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path
from typing import Any, Callable

import flair
import torch
import torch.distributed as dist
from flair.trainers.plugins import TrainerPlugin
from flair.trainers.plugins.base import TrainingInterrupt
from flair.trainers.plugins.metric_records import MetricRecord

from .events import STOP_REQUESTED, EventSender, Metric, Progress, Stopped
from .counters import TrainingCounters

SAVED_MODELS: list[Path] = []  # model files flair wrote during the current job, newest last


class MissingMultiGpuError(RuntimeError):
    """``.train()``/``.fine_tune()`` was called without ``multi_gpu=True`` in a run of several processes."""


def _all_ranks_agree_to_stop() -> bool:
    """One tiny all-reduce per batch: stop when any rank was asked, so every rank stops at the same batch."""
    wanted = STOP_REQUESTED.is_set()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return wanted
    device = flair.device if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if wanted else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class StreamingPlugin(TrainerPlugin):
    """Streams progress and metrics (rank 0), counts throughput and handles a graceful stop (every rank).

    Its only collective is the stop agreement, which every rank joins at the same point of every batch.
    """

    def __init__(self, sender: EventSender, rank: int, counters: TrainingCounters) -> None:
        super().__init__()
        self._sender, self._rank, self._counters = sender, rank, counters
        self._max_epochs = 0
        self._base_path = Path(".")
        self._saves_final_model = True
        self._corpus_before_stop: Any = None
        self._stopped_at: Path | None = None  # the checkpoint, once this plugin stopped the training

    @TrainerPlugin.hook
    def after_setup(self, max_epochs: int = 0, base_path: Any = ".", save_final_model: bool = True, **_: Any):
        self._max_epochs, self._base_path, self._saves_final_model = max_epochs, Path(base_path), save_final_model

    @TrainerPlugin.hook
    def before_training_batch(self, **_: Any) -> None:
        self._counters.batch_started()

    @TrainerPlugin.hook
    def after_training_batch(self, batch: list, batch_no: int, total_number_of_batches: int, epoch: int, **_: Any):
        self._counters.batch_done(len(batch))
        if self._rank == 0:
            self._sender.send(Progress(0, epoch, self._max_epochs, batch_no + 1, total_number_of_batches))
        if _all_ranks_agree_to_stop():
            self._stop(epoch, batch_no + 1)

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
            "flair_nbddp: stopped, so flair's final test evaluation is skipped and test_score is 0; "
            "evaluate the checkpoint (%s) if you need one", self._stopped_at
        )

    @TrainerPlugin.hook
    def after_training(self, **_: Any) -> None:
        if self._corpus_before_stop is not None:
            self.trainer.corpus, self._corpus_before_stop = self._corpus_before_stop, None
        for name in ("final-model.pt", "best-model.pt", "stopped-model.pt"):
            path = self._base_path / name
            if path.exists() and path not in SAVED_MODELS:
                SAVED_MODELS.append(path)

    @TrainerPlugin.hook
    def metric_recorded(self, record: MetricRecord) -> None:
        if self._rank != 0 or record.is_histogram:
            return
        # flair records an evaluation's main score as a "string" record holding a float
        values = record.value if record.is_scalar_list else [record.value]
        for index, value in enumerate(values):
            suffix = f"/{index}" if len(values) > 1 else ""
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            self._sender.send(Metric(0, record.joined_name + suffix, number, int(record.global_step)))


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


def instrument_trainer(sender: EventSender, rank: int, world_size: int, counters: TrainingCounters) -> None:
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
        plugins = [*(plugins or []), StreamingPlugin(sender, rank, counters)]
        return original(self, *args, multi_gpu=multi_gpu, plugins=plugins, **kwargs)

    ModelTrainer.train_custom = train_custom
