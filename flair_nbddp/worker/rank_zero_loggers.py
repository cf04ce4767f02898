"""flair's loggers log once, from rank 0: on the other ranks, building one leaves nothing behind.

flair attaches a plugin whose ``attach_to_all_processes`` is False (its loggers: TensorBoard, W&B, ClearML, the
``training.log`` and ``loss.tsv`` plugins, the metric history; and any plugin a user marks so) to the main process
only, so its hooks run on rank 0 alone, with flair's epoch and step numbers. But the plugin is *built* wherever the
training function builds it, which in a launched function is every rank, and two of flair's loggers do something
when they are built:

* ``TensorboardLogger`` makes its ``log_dir`` and opens a ``SummaryWriter`` there: each other rank adds an event
  file holding nothing but its header, which TensorBoard lists beside rank 0's (and two ranks making the directory
  at the same moment can fail with ``FileExistsError``);
* ``LogFilePlugin`` (``training.log``, which flair's trainer builds itself) adds a file handler to the ``flair``
  logger that reopens ``training.log`` for writing, cutting off what rank 0 wrote there so far, then copies the
  rank's own log lines into it; never attached, it is never removed.

:func:`install` bends these two so that on a rank other than 0 they are built without their writer or handler:
the same attributes, no file, no handler. Whether a rank is "other" is flair's own test, ``is_main_process()``,
the one that keeps the plugin's hooks off that rank. A run of one process is flair's main process, so it is
untouched, as is rank 0.

The others are left as flair has them: ``WandbLogger`` and ``ClearmlLoggerPlugin`` call W&B or ClearML only in
their hooks; ``LossFilePlugin`` (and ``WeightExtractorPlugin``) only touch a file in the base path that flair's
trainer makes on every rank, without writing to it; ``MetricHistoryPlugin`` keeps lists.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any


def _other_rank() -> bool:
    """This process is a rank other than 0 of a process group, where flair attaches no logger."""
    from flair.distributed_utils import is_main_process

    return not is_main_process()


def install() -> None:
    """Build flair's TensorBoard and log-file plugins without writer or handler on ranks other than 0."""
    from flair.trainers.plugins import TrainerPlugin
    from flair.trainers.plugins.loggers import log_file
    from flair.trainers.plugins.loggers.tensorboard import TensorboardLogger

    flairs_init = TensorboardLogger.__init__

    @functools.wraps(flairs_init)
    def __init__(self: Any, log_dir: Any = None, comment: str = "", tracked_metrics: Any = ()) -> None:
        if not _other_rank():
            flairs_init(self, log_dir, comment, tracked_metrics)
            return
        TrainerPlugin.__init__(self)
        self.comment, self.tracked_metrics, self.log_dir = comment, tracked_metrics, log_dir
        self.writer, self._warned = None, False  # its hooks, which use the writer, run on rank 0 only

    flairs_add_file_handler = log_file.add_file_handler

    @functools.wraps(flairs_add_file_handler)
    def add_file_handler(log: logging.Logger, output_file: Path) -> logging.Handler:
        if not _other_rank():
            return flairs_add_file_handler(log, output_file)
        return logging.NullHandler()  # on no logger, and no file opened

    TensorboardLogger.__init__ = __init__
    log_file.add_file_handler = add_file_handler  # the name LogFilePlugin calls (flair's other callers keep theirs)
