"""Runs from the ledger as TensorBoard event files, to browse them in TensorBoard (needs ``tensorboard``:
``pip install 'flair_nbddp[tensorboard]'``).

Example::

    from flair_nbddp import export_tensorboard, history
    export_tensorboard(history(limit=10), "tb")     # then: tensorboard --logdir tb
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..errors import MissingDependencyError
from .store import RunRecord


def run_directory_name(record: RunRecord) -> str:
    """Where a run's events go under the log directory: ``run-12-train`` (its id and a file-safe name).

    Example:
        >>> run_directory_name(RunRecord(id=7, name="%%ddp_train"))
        'run-7-ddp_train'
    """
    return f"run-{record.id}-" + (re.sub(r"[^\w.-]+", "_", record.name).strip("_") or "run")


def _hparams(record: RunRecord) -> dict[str, float | int | str | bool]:
    """The run's plain keyword arguments and seed, as TensorBoard's HParams tab takes them."""
    plain = {name: value for name, value in record.kwargs.items() if isinstance(value, (int, float, str, bool))}
    return {**plain, "seed": record.seed if record.seed is not None else -1, "world_size": record.world_size}


def export_tensorboard(records: Sequence[RunRecord], log_dir: str | os.PathLike) -> list[Path]:
    """Write each run's metric history as a TensorBoard run under ``log_dir``; return the run directories.

    Every metric point becomes a scalar at its step and wall time; the run's keyword arguments and its final
    scores go to the HParams tab (scores as ``final/<name>``), and its parameters, status and versions to the
    Text tab. Exporting a run again adds a second event file beside the first: export into a fresh directory.

    Raises:
        MissingDependencyError: (an ``ImportError``) ``tensorboard`` is not installed (the message says how to
            install it).
        LedgerError: the ledger cannot be read.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise MissingDependencyError(
            f"export_tensorboard needs the tensorboard package ({error}): pip install 'flair_nbddp[tensorboard]'"
        ) from error
    written = []
    for record in records:
        directory = Path(log_dir) / run_directory_name(record)
        with SummaryWriter(log_dir=str(directory)) as writer:
            for point in record.metrics():
                writer.add_scalar(point.name, point.value, global_step=point.step, walltime=point.time)
            summary = {"status": record.status, "devices": record.devices, "params": record.params,
                       "versions": record.versions, "error": record.error}  # fmt: skip
            writer.add_text("run", "\n\n".join(f"**{key}**: `{value}`" for key, value in summary.items()))
            scores = {f"final/{name}": value for name, value in record.scores.items()}
            if scores:
                writer.add_hparams(_hparams(record), scores, run_name=".")
        written.append(directory)
    return written
