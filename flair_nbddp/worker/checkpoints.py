"""Full checkpoints of a flair training, and training resumed from one exactly where it ended.

:class:`Checkpointing` is a flair plugin. Whenever an epoch has ended (as the next begins, after flair's own
``best-model.pt`` save, and as the training loop ends) it gathers every rank's random number generators and rank 0
writes one file: the model's and the optimizer's state, the state of flair's plugins that decide (their
schedulers' ``state_dict``: a linear schedule with warm-up, annealing on plateau; and their plain attributes), the
epoch, flair's step count and the best dev score so far. The file is written beside its final name, flushed to
disk and renamed over the previous one, so ``checkpoint.pt`` is always a whole checkpoint (never a torn one) and
the previous stays until the new one is complete; its sha256 goes to the notebook with its epoch.

Given a checkpoint, the same plugin resumes: flair's trainer starts after the checkpoint's epoch (its own
``epoch=`` argument), and as its first epoch begins (flair's optimizer and every plugin's scheduler built, nothing
drawn since) every rank loads the saved states into them and its own generators, so the epoch draws what it would
have drawn. flair decides "best so far" from 0 again in a resumed training; the plugin keeps the checkpoint's best
and lets flair overwrite ``best-model.pt`` only with a better model, as the uninterrupted training would have.

Training goes on while a checkpoint is written: the states are copied where they are at the epoch's end (on a GPU,
in its memory) and a thread writes the file; the next checkpoint, and the end of training, wait for it.

Nothing here draws a random number: a training with checkpoints is the same training.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flair.trainers.plugins import TrainerPlugin

from ..errors import CheckpointWriteError
from .checkpoint_files import FORMAT, generators, set_generators, write

_PLAIN = (bool, int, float, str, type(None))


class Checkpointing(TrainerPlugin):
    """Writes a full checkpoint at every epoch's end (rank 0) and resumes from ``resume`` (every rank).

    ``gather(value)`` returns every rank's value, rank 0's first (a single process: ``[value]``); ``saved(epoch,
    path, sha256)`` is called on rank 0 after each write. It must be the last plugin (flair dispatches in order,
    and it restores before the schedulers' plugins, which flair attaches after the caller's, read the optimizer).
    """

    def __init__(
        self, path: Path, rank: int, gather: Callable[[Any], list], saved: Callable[[int, Path, str], None],
        resume: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """``resume``: a checkpoint from :func:`read` to continue from, with as many ranks as wrote it."""
        super().__init__()
        self._path, self._rank, self._gather, self._saved, self._resume = Path(path), rank, gather, saved, resume
        self._resume_done: dict[str, Any] | None = None
        self._steps = 0  # flair's optimizer steps so far
        self._best: float | None = None
        self._higher_is_better = True
        self._written_for = -1
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None

    @property
    def _checkpoint(self) -> dict[str, Any] | None:
        return self._resume or self._resume_done

    @property
    def start_epoch(self) -> int:
        """The epoch flair's trainer starts after (its ``epoch=`` argument): the checkpoint's, or 0."""
        return self._checkpoint["epoch"] if self._checkpoint else 0

    @property
    def step_offset(self) -> int:
        """flair's step count before this training: its per-step metrics continue from there."""
        return self._checkpoint["steps"] if self._checkpoint else 0

    @TrainerPlugin.hook
    def after_setup(self, train_with_dev: bool = False, **_: Any) -> None:
        self._higher_is_better = not train_with_dev and bool(self.trainer.corpus.dev)
        self._steps = self.step_offset
        save_model = self.trainer._save_model

        def save_unless_worse(path: Any, *args: Any, **kwargs: Any) -> Any:
            if Path(path).name == "best-model.pt" and not self._improved:
                return None  # flair's best so far restarted at 0; the checkpoint's best is better
            return save_model(path, *args, **kwargs)

        self.trainer._save_model = save_unless_worse
        self._improved = True

    @TrainerPlugin.hook
    def after_training_batch(self, **_: Any) -> None:
        self._steps += 1

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
    def before_training_epoch(self, epoch: int, **_: Any) -> None:
        if self._resume is not None:  # every plugin has built its schedulers, and nothing was drawn since
            self._restore(self._resume)
            self._resume_done, self._resume = self._resume, None
        if epoch - 1 > self.start_epoch:  # an epoch of this training has ended
            self._write(epoch - 1)

    @TrainerPlugin.hook
    def after_training_loop(self, **_: Any) -> None:
        last = self.trainer.model.model_card["training_parameters"].get("epoch", 0)  # flair's, as it ended
        if last > self.start_epoch:
            self._write(last)

    @TrainerPlugin.hook
    def _training_finally(self, **_: Any) -> None:
        self.trainer.__dict__.pop("_save_model", None)  # flair's own method again
        self.finish_writing()

    def _write(self, epoch: int) -> None:
        if epoch == self._written_for:
            return
        self._written_for = epoch
        states = self._gather(generators())
        if self._rank != 0:
            return
        checkpoint = _snapshot({
            "format": FORMAT,
            "epoch": epoch,
            "steps": self._steps,
            "best": self._best,
            "model": self.trainer.model.state_dict(),
            "optimizer": self.trainer.optimizer.state_dict(),
            "plugins": self._plugin_states(),
            "generators": states,
        })  # fmt: skip
        self.finish_writing()
        self._writer = threading.Thread(target=self._write_file, args=(epoch, checkpoint), daemon=True,
                                        name="flair_nbddp-checkpoint")  # fmt: skip
        self._writer.start()

    def _write_file(self, epoch: int, checkpoint: dict[str, Any]) -> None:
        try:
            self._saved(epoch, self._path, write(self._path, checkpoint))
        except BaseException as error:  # noqa: BLE001 - raised in the training's thread by finish_writing
            self._write_error = error

    def finish_writing(self) -> None:
        """Wait for the checkpoint being written; raise what stopped it being written."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise CheckpointWriteError(f"the checkpoint {self._path} could not be written: {error}") from error

    def _restore(self, checkpoint: dict[str, Any]) -> None:
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
        set_generators(checkpoint["generators"][self._rank])

    def _plugins(self) -> list[tuple[str, Any]]:
        return [(f"{index}:{type(plugin).__name__}", plugin) for index, plugin in enumerate(self.trainer.plugins)
                if plugin is not self]  # fmt: skip

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


def _snapshot(value: Any) -> Any:
    """``value`` with every tensor copied where it is (training changes the originals in place): on a GPU a copy
    in its own memory takes a millisecond, and the writer thread's ``torch.save`` brings it to the host."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(item) for item in value)
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
