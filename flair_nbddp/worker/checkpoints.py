"""Full checkpoints of a flair training, and training resumed from one exactly where it ended.

:class:`Checkpointing` is a flair plugin. Whenever an epoch has ended (as the next begins, after flair's own
``best-model.pt`` save, and as the training loop ends) it gathers every rank's random number generators and rank 0
writes one file: the model's and the optimizer's state, the state of flair's plugins that decide (their
schedulers' ``state_dict``: a linear schedule with warm-up, annealing on plateau; and their plain attributes), the
epoch, flair's step count, the best dev score so far and, with an ``embeddings_storage_mode`` other than ``"none"``,
the embeddings of trainable embeddings flair's evaluations left stored on each rank's corpus
(:mod:`.stored_embeddings`). It writes one inside an epoch too, when the notebook
stops the training and, with ``checkpoint_every``, every N steps: then with where each rank is in the epoch (the
batches trained, its generators as the epoch began) and what flair's loop has summed so far in its own local
variables (the epoch's train loss and samples). The file is written beside its final name,
flushed to disk and renamed over the previous one, so ``checkpoint.pt`` is always a whole checkpoint (never a torn
one) and the previous stays until the new one is complete; its sha256 goes to the notebook with its position.

Given a checkpoint, the same plugin resumes: flair's trainer starts after the checkpoint's last whole epoch (its
own ``epoch=`` argument), and as its first epoch begins (flair's optimizer and every plugin's scheduler built,
nothing drawn since) every rank loads the saved states into them and its own generators, so the epoch draws what
it would have drawn. From inside an epoch, the generators are those the epoch began with (its data loader draws
the same order), the epoch's loader leaves out the batches trained before the checkpoint, and as the first batch
after them begins each rank takes the checkpoint's generators and flair's loop its sums back. As the first batch
of a resumed training begins, flair's step count (``batch_count``, the step of its per-batch metrics) goes on from
the checkpoint's. flair decides "best
so far" from 0 again in a resumed training; the plugin keeps the checkpoint's best and lets flair overwrite
``best-model.pt`` only with a better model, as the uninterrupted training would have.

Training goes on while a checkpoint is written: the states are copied (from a GPU, into pinned host memory, queued on
the training's stream) and a thread writes the file; the next checkpoint, and the end of training, wait for it. The
pinned memory is made by another thread while the first epoch trains, as the first step ends and again, until the first
checkpoint, when the optimizer holds states it was not made for (with fp16, the first step its gradient scaler did not
skip): torch's caching host allocator keeps it for the copies of every checkpoint, so the first checkpoint normally
finds it made (a DistilBERT-sized model with AdamW on an H100 host: the first checkpoint's wait fell from 0.28-0.31 s to
0.004 s, ``benchmarks/checkpoint_cost.py``). A checkpoint that comes while the thread still pins (every step, or a stop
in the first steps) waits for it, as it would have pinned the rest itself.

Nothing here draws a random number: a training with checkpoints is the same training.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flair.trainers.trainer as trainer_module
import torch
from flair.trainers.plugins import TrainerPlugin

from ..errors import CheckpointWriteError, FlairNbddpError
from .checkpoint_files import FORMAT, generators, set_generators, write
from .stored_embeddings import changing_names, collect, restore

_PLAIN = (bool, int, float, str, type(None))


class Checkpointing(TrainerPlugin):
    """Writes full checkpoints (rank 0) and resumes from ``resume`` (every rank).

    ``gather(value)`` returns every rank's value, rank 0's first (a single process: ``[value]``); ``saved(epoch, batch,
    steps, path, sha256)`` is called on rank 0 after each write (``steps``: flair's step count then); ``stopping()``
    says the notebook's stop ended the training (every rank at the same batch); ``every``: also a checkpoint every so
    many optimizer steps, written as the next batch begins (once every plugin, a scheduler's included, is done with the
    last one). In a run it comes after flair's own plugins (``train``/``fine_tune`` put their schedulers' in the list of
    plugins) and before the one that stops the training, so that a stop's checkpoint sees the last batch counted and the
    schedule stepped.
    """

    def __init__(
        self, path: Path, rank: int, gather: Callable[[Any], list], saved: Callable[[int, int, int, Path, str], None],
        resume: dict[str, Any] | None = None, stopping: Callable[[], bool] = lambda: False, every: int | None = None,
    ) -> None:  # fmt: skip
        """``resume``: a checkpoint from :func:`read` to continue from, with as many ranks as wrote it."""
        super().__init__()
        self._path, self._rank, self._gather, self._saved = Path(path), rank, gather, saved
        self._checkpoint, self._restored = resume, False
        self._stopping, self._every = stopping, every
        self._first_batch = False  # restored, the first batch after the checkpoint is still to begin
        self._position: dict[str, Any] | None = None  # a mid-epoch checkpoint's, until that batch
        self._steps = 0  # flair's optimizer steps so far
        self._epoch = 0  # the epoch being trained
        self._batches = 0  # its batches trained so far
        self._epoch_generators: dict[str, Any] = {}  # this rank's generators as the epoch began
        self._loader: type | None = None  # flair's data loader while the resumed epoch's stands in for it
        self._epoch_ended = False  # the last batch trained was its epoch's last
        self._due = False  # a checkpoint every N steps is due as the next batch begins
        self._best: float | None = None
        self._higher_is_better = True
        self._storage_mode = "none"  # flair's embeddings_storage_mode
        self._written_for: tuple[int, int] = (-1, 0)
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self._pinning: threading.Thread | None = None  # making the checkpoints' pinned memory (rank 0, on a GPU)
        self._pinned_for = -1  # the optimizer's states (how many parameters had them) it was last made for

    @property
    def start_epoch(self) -> int:
        """The epoch flair's trainer starts after (its ``epoch=`` argument): the checkpoint's last whole epoch, or 0."""
        return self._checkpoint["epoch"] if self._checkpoint else 0

    def batches_before(self, epoch: int) -> int:
        """The batches of ``epoch`` trained before this training began (a resume from inside it): flair counts the
        epoch's batches from 1 again, its loader leaving those out."""
        resumed_inside = self._checkpoint is not None and self._checkpoint.get("positions")
        return self._checkpoint["batch"] if resumed_inside and epoch == self.start_epoch + 1 else 0

    @property
    def step_offset(self) -> int:
        """flair's step count before this training: its per-step metrics continue from there."""
        return self._checkpoint["steps"] if self._checkpoint else 0

    @TrainerPlugin.hook
    def after_setup(self, train_with_dev: bool = False, embeddings_storage_mode: str = "none", **_: Any) -> None:
        self._higher_is_better = not train_with_dev and bool(self.trainer.corpus.dev)
        self._storage_mode = embeddings_storage_mode
        self._steps = self.step_offset
        save_model = self.trainer._save_model

        def save_unless_worse(path: Any, *args: Any, **kwargs: Any) -> Any:
            if Path(path).name == "best-model.pt" and not self._improved:
                return None  # flair's best so far restarted at 0; the checkpoint's best is better
            return save_model(path, *args, **kwargs)

        self.trainer._save_model = save_unless_worse
        self._improved = True

    @TrainerPlugin.hook
    def before_training_epoch(self, epoch: int, **_: Any) -> None:
        if self._checkpoint is not None and not self._restored:  # flair's optimizer and every plugin's schedulers
            self._restored = True  # are built, and nothing was drawn since
            self._restore(self._checkpoint)
            # flair's step count goes on from the checkpoint's before the epoch's first learning rate is recorded
            _set_locals(_training_frame(), {"batch_count": self.step_offset})
        if epoch - 1 > self.start_epoch:  # an epoch of this training has ended
            self._write(epoch - 1)
        self._epoch, self._batches, self._epoch_generators = epoch, 0, generators()

    @TrainerPlugin.hook
    def before_training_batch(self, **_: Any) -> None:
        if self._first_batch:  # the first batch after the checkpoint: flair's loop goes on from there
            self._first_batch = False
            values = {"batch_count": self.step_offset + 1}  # its step count (it counted this batch already)
            if self._position is not None:  # inside an epoch: its sums, and the generators of that moment
                position, self._position = self._position, None
                self._put_flairs_loader_back()
                set_generators(position["generators"])
                self._batches = position["batches"]
                values.update({name: position[name] for name in _LOOP_SUMS})
            _set_locals(_training_frame(), values)
        if self._due:  # every plugin has finished with the last batch (a scheduler's step included)
            self._due = False
            self._write_position()

    @TrainerPlugin.hook
    def after_training_batch(self, batch_no: int, total_number_of_batches: int, **_: Any) -> None:
        self._steps += 1
        self._batches += 1
        self._epoch_ended = batch_no + 1 == total_number_of_batches
        self._due = bool(self._every) and self._steps % self._every == 0 and not self._epoch_ended
        # rank 0 copies states; from its first checkpoint on, each checkpoint pins what is new itself (a thread pinning
        # every state at once while a file's copies hold their blocks would pin them all a second time)
        if self._rank == 0 and self._written_for == (-1, 0):
            self._pin_new_states()

    @TrainerPlugin.hook
    def training_interrupt(self, **_: Any) -> None:
        if self._stopping() and not self._epoch_ended:  # the notebook's stop: every rank is at the same batch
            self._write_position()  # (at an epoch's last batch its evaluation is still to come: the end before)

    @TrainerPlugin.hook
    def after_evaluation(self, epoch: int, validation_scores: tuple = (), **_: Any) -> None:
        score = validation_scores[0] if validation_scores else None
        if score is None:
            self._improved = True
            return
        better = self._best is None or (score > self._best if self._higher_is_better else score < self._best)
        self._improved = better
        if better:
            self._best = score

    @TrainerPlugin.hook
    def after_training_loop(self, **_: Any) -> None:
        last = self.trainer.model.model_card["training_parameters"].get("epoch", 0)  # flair's, as it ended
        if last > self.start_epoch:
            self._write(last)

    @TrainerPlugin.hook
    def _training_finally(self, **_: Any) -> None:
        self.trainer.__dict__.pop("_save_model", None)  # flair's own method again
        self._put_flairs_loader_back()  # a resume that never reached its first batch
        self.finish_writing()

    def _put_flairs_loader_back(self) -> None:
        if self._loader is not None:
            trainer_module.DataLoader, self._loader = self._loader, None

    def _write_position(self) -> None:
        """A checkpoint inside the epoch, with what flair's loop has summed so far."""
        sums = {name: _training_frame().f_locals[name] for name in _LOOP_SUMS}
        self._write(self._epoch - 1, {"batches": self._batches, "epoch_generators": self._epoch_generators, **sums})

    def _write(self, epoch: int, position: dict[str, Any] | None = None) -> None:
        """Write the checkpoint of the end of ``epoch``, or of ``position`` in the epoch after it."""
        batch = position["batches"] if position else 0
        if (epoch, batch) == self._written_for:
            return
        self._written_for = (epoch, batch)
        stored = {}
        if self._storage_mode != "none":  # what flair's evaluations left on the corpus, and a new process cannot redo
            stored = collect(self.trainer.corpus, changing_names(self.trainer.model))
        ranks = self._gather({"generators": generators(), "position": position, "stored": stored})
        if self._rank != 0:
            return
        self.finish_writing()  # the previous file written before this one's copies are made (one extra copy at most)
        checkpoint, copied = _snapshot({
            "format": FORMAT,
            "epoch": epoch,
            "batch": batch,
            "steps": self._steps,
            "best": self._best,
            **self._states(),
            "plugins": self._plugin_states(),
            "generators": [rank["generators"] for rank in ranks],
            "positions": [rank["position"] for rank in ranks] if position else None,
            "stored_embeddings": [rank["stored"] for rank in ranks] if any(rank["stored"] for rank in ranks) else None,
        })  # fmt: skip
        self._writer = threading.Thread(target=self._write_file, args=(epoch, batch, self._steps, checkpoint, copied),
                                        daemon=True, name="flair_nbddp-checkpoint")  # fmt: skip
        self._writer.start()

    def _write_file(self, epoch: int, batch: int, steps: int, checkpoint: dict[str, Any], copied: list[Any]) -> None:
        try:
            for event in copied:
                event.synchronize()
            self._saved(epoch, batch, steps, self._path, write(self._path, checkpoint))
        except BaseException as error:  # noqa: BLE001 - raised in the training's thread by finish_writing
            self._write_error = error

    def _pin_new_states(self) -> None:
        """Have the pinned memory made, in another thread, for the states a checkpoint would copy now, where the
        optimizer holds states it was not made for (and no earlier such thread is still pinning). What was made before
        is torch's cache's again, so only what is new is pinned anew."""
        holding = len(self.trainer.optimizer.state)
        if holding != self._pinned_for and (self._pinning is None or not self._pinning.is_alive()):
            self._pinned_for = holding
            self._pinning = _pin_ahead(self._states())

    def _states(self) -> dict[str, Any]:
        """The model's and the optimizer's state, as a checkpoint holds them."""
        return {"model": self.trainer.model.state_dict(), "optimizer": self.trainer.optimizer.state_dict()}

    def finish_writing(self) -> None:
        """Wait for the pinned memory being made and the checkpoint being written; raise what stopped it being
        written."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise CheckpointWriteError(f"the checkpoint {self._path} could not be written: {error}") from error

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        """Load the checkpoint's states and its generators; for a position inside the next epoch, the generators
        as that epoch began (its data loader draws its order from them, the order it had), flair's loader for the
        epoch leaving out the batches trained before the checkpoint, and the generators of the checkpoint as the
        first batch after them begins."""
        self.trainer.model.load_state_dict(checkpoint["model"])
        self.trainer.optimizer.load_state_dict(checkpoint["optimizer"])
        for name, plugin in self._plugins():
            for attribute, value in checkpoint["plugins"].get(name, {}).items():
                current = getattr(plugin, attribute, None)
                if hasattr(current, "load_state_dict"):
                    current.load_state_dict(value)
                else:
                    setattr(plugin, attribute, value)
        self._best = checkpoint["best"]
        if checkpoint.get("stored_embeddings"):
            restore(self.trainer.corpus, checkpoint["stored_embeddings"][self._rank], self._storage_mode)
        self._first_batch = True
        generators_here = checkpoint["generators"][self._rank]
        if not checkpoint.get("positions"):
            set_generators(generators_here)
            return
        self._position = {**checkpoint["positions"][self._rank], "generators": generators_here}
        set_generators(self._position["epoch_generators"])
        self._loader = trainer_module.DataLoader
        trainer_module.DataLoader = _loader_leaving_out(self._loader, self._position["batches"])

    def _plugins(self) -> list[tuple[str, Any]]:
        """The trainer's other plugins, each named by its class and its place among that class's: the same names on
        every rank, although flair attaches loggers (a TensorBoard logger the user passed) on rank 0 only."""
        seen: dict[str, int] = {}
        named = []
        for plugin in self.trainer.plugins:
            if plugin is not self:
                kind = type(plugin).__name__
                seen[kind] = seen.get(kind, -1) + 1
                named.append((f"{kind}:{seen[kind]}", plugin))
        return named

    def _plugin_states(self) -> dict[str, dict[str, Any]]:
        """The state of each plugin that decides the rest of training (one that holds a scheduler): its schedulers
        (by ``state_dict``) and its plain attributes. Loggers and the like start afresh, as flair starts them."""
        states: dict[str, dict[str, Any]] = {}
        for name, plugin in self._plugins():
            attributes = {name: value for name, value in vars(plugin).items() if not name.startswith("_")}
            schedulers = {name: value.state_dict() for name, value in attributes.items() if _scheduler(value)}
            if schedulers:
                states[name] = {**{name: value for name, value in attributes.items() if _plain(value)}, **schedulers}
        return states


_LOOP_SUMS = ("epoch_train_loss", "epoch_train_samples", "total_train_samples")
# what flair's train_custom sums in its loop's own variables (an epoch's train loss); its step count is `batch_count`


def _training_frame() -> Any:
    """The frame of flair's ``train_custom`` running this training (its loop's sums are its local variables)."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "train_custom" and "epoch_train_loss" in
                                     frame.f_code.co_varnames):  # fmt: skip
        frame = frame.f_back
    if frame is None:
        raise FlairNbddpError(
            "flair's ModelTrainer.train_custom keeps no epoch_train_loss here: this flair's training loop is not the "
            "one a checkpoint inside an epoch (at a stop, or with checkpoint_every) is made for: use flair 0.15"
        )
    return frame


def _set_locals(frame: Any, values: dict[str, Any]) -> None:
    """Set local variables of ``frame``, a running function's."""
    if sys.version_info >= (3, 13):  # frame.f_locals writes through
        for name, value in values.items():
            frame.f_locals[name] = value
        return
    frame.f_locals.update(values)
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


def _loader_leaving_out(loader: type, batches: int) -> type:
    """flair's data loader for the epoch a mid-epoch checkpoint was in: its batches after the first ``batches``."""

    class ResumedEpochLoader(loader):
        def __iter__(self) -> Any:
            return itertools.islice(super().__iter__(), batches, None)

        def __len__(self) -> int:
            return max(0, super().__len__() - batches)

    return ResumedEpochLoader


def _snapshot(value: Any) -> tuple[Any, list[Any]]:
    """``value`` with every tensor copied (training changes the originals in place), and the CUDA events after
    which the copies are whole. A tensor on a GPU is copied into pinned host memory, queued on its device's stream
    without waiting: the training's next kernels, queued after it, cannot change it first, the training's thread
    goes on at once, and neither a copy of the states in the GPU's memory nor the writer's ``torch.save`` holds up
    that stream later. Other tensors are cloned where they are."""
    devices: set[torch.device] = set()

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_cuda:
            return tensor.detach().clone()
        devices.add(tensor.device)
        return _pinned_like(tensor).copy_(tensor.detach(), non_blocking=True)

    copied = _map_tensors(value, copy)
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return copied, events


def _pin_ahead(states: Any) -> threading.Thread | None:
    """A thread making the pinned host memory that :func:`_snapshot`'s copies of the GPU tensors in ``states`` will
    take, and giving it back to torch's caching host allocator, where those copies find it; None without GPU tensors.
    Pinning is the host's work (about 2 GB a second) and lets go of the GIL: the training's thread goes on."""
    tensors: list[torch.Tensor] = []
    _map_tensors(states, lambda tensor: tensors.append(tensor) if tensor.is_cuda else None)
    if not tensors:
        return None

    def pin() -> None:
        torch.cuda.set_device(tensors[0].device)
        with contextlib.suppress(RuntimeError):  # short of pinnable memory: the checkpoint's copies say so in its error
            held = [_pinned_like(tensor) for tensor in tensors]  # all held at once: a block for each copy
            del held  # back to the cache, for the checkpoints' copies

    thread = threading.Thread(target=pin, daemon=True, name="flair_nbddp-pinned-memory")
    thread.start()
    return thread


def _pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor in pinned host memory shaped as ``tensor`` (on a GPU)."""
    return torch.empty_like(tensor, device="cpu", pin_memory=True)


def _map_tensors(value: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``function(tensor)`` for each tensor in it, through dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, dict):
        return {key: _map_tensors(entry, function) for key, entry in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(entry, function) for entry in value)
    return value


def _scheduler(value: Any) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict") and not isinstance(
        value, (torch.nn.Module, torch.optim.Optimizer)
    )


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain(item) for key, item in value.items())
    return False
