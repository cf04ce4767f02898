"""flair_nbddp: train Flair models on every GPU of one machine (or of a Dask cluster), from a Jupyter notebook.

Example::

    from flair_nbddp import launch_distributed
    scores = launch_distributed(train, corpus)        # train: a function defined in a notebook cell
"""

from typing import Any

from ._version import __version__ as __version__  # the explicit re-export form
from .api import launch, launch_distributed, start
from .errors import (
    CheckpointWriteError,
    ClusterError,
    ConfigurationError,
    CorpusMismatchError,
    DashboardUnavailableError,
    DeviceError,
    EvaluationShareError,
    FlairNbddpError,
    LedgerError,
    LedgerWarning,
    MissingDependencyError,
    NotCallableError,
    OutOfMemoryError,
    PayloadWriteError,
    PoolClosedError,
    PoolRefError,
    PredictionsWriteError,
    ResumeError,
    RunActiveError,
    RunError,
    RunHangError,
    RunStateError,
    RunTimeoutError,
    ShippingError,
    StillRunningError,
    UnknownOptionError,
    UnsupportedPlatformError,
    WorkerError,
)
from .ledger.store import RunRecord, history
from .ledger.tensorboard_export import export_tensorboard
from .notebook.compare import compare
from .notebook.panel import TrainingPanel
from .options import RunOptions
from .pool import WorkerPool
from .result import Attempt, Checkpoint, RunResult
from .engine.run import Run, runs, wait_all
from .engine.in_use import devices_in_use
from .sweeps import Sweep, sweep
from .predicting import PredictCall, Predictions, predict
from .wire.pool_ref import PoolRef
from .worker.ddp_exec import RankResult

__all__ = [
    "Attempt",
    "Checkpoint",
    "CheckpointWriteError",
    "ClusterError",
    "ConfigurationError",
    "CorpusMismatchError",
    "DashboardUnavailableError",
    "DeviceError",
    "EvaluationShareError",
    "FlairNbddpError",
    "LedgerError",
    "LedgerWarning",
    "MissingDependencyError",
    "NotCallableError",
    "OutOfMemoryError",
    "PayloadWriteError",
    "PoolClosedError",
    "PoolRef",
    "PoolRefError",
    "PredictCall",
    "Predictions",
    "PredictionsWriteError",
    "RankResult",
    "ResumeError",
    "Run",
    "RunActiveError",
    "RunError",
    "RunHangError",
    "RunOptions",
    "RunRecord",
    "RunResult",
    "RunStateError",
    "RunTimeoutError",
    "ShippingError",
    "StillRunningError",
    "Sweep",
    "TrainingPanel",
    "UnknownOptionError",
    "UnsupportedPlatformError",
    "WorkerError",
    "WorkerPool",
    "compare",
    "devices_in_use",
    "export_tensorboard",
    "history",
    "launch",
    "launch_distributed",
    "load_ipython_extension",
    "predict",
    "runs",
    "start",
    "sweep",
    "wait_all",
]

def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext flair_nbddp``: registers ``%%ddp_train``, ``%%ddp_sweep``, ``%%ddp_exec``, ``%ddp_pool``,
    ``%ddp_info`` and ``%ddp_runs``."""
    from .notebook.magic import DdpMagics

    ipython.register_magics(DdpMagics)
