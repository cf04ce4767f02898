"""flair_nbddp: train Flair models on every GPU of one machine (or of a Dask cluster), from a Jupyter notebook.

Example::

    from flair_nbddp import launch_distributed
    scores = launch_distributed(train, corpus)        # train: a function defined in a notebook cell
"""

from typing import Any

__version__ = "0.1.0"  # first: modules imported below read it

from .api import launch, launch_distributed, start
from .compare import compare
from .errors import (
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
    PayloadWriteError,
    PoolClosedError,
    PoolRefError,
    RunActiveError,
    RunError,
    RunHangError,
    RunStateError,
    RunTimeoutError,
    ShippingError,
    StillRunningError,
    UnsupportedPlatformError,
    WorkerError,
)
from .interactive import RankResult
from .ledger import RunRecord, history
from .panel import TrainingPanel
from .pool import WorkerPool
from .result import RunResult
from .run import Run, runs
from .shared import PoolRef
from .tensorboard_export import export_tensorboard

__all__ = [
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
    "PayloadWriteError",
    "PoolClosedError",
    "PoolRef",
    "PoolRefError",
    "RankResult",
    "Run",
    "RunActiveError",
    "RunError",
    "RunHangError",
    "RunRecord",
    "RunResult",
    "RunStateError",
    "RunTimeoutError",
    "ShippingError",
    "StillRunningError",
    "TrainingPanel",
    "UnsupportedPlatformError",
    "WorkerError",
    "WorkerPool",
    "compare",
    "export_tensorboard",
    "history",
    "launch",
    "launch_distributed",
    "load_ipython_extension",
    "runs",
    "start",
]

def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext flair_nbddp``: registers ``%%ddp_train``, ``%%ddp_exec``, ``%ddp_pool``, ``%ddp_info`` and
    ``%ddp_runs``."""
    from .magic import DdpMagics

    ipython.register_magics(DdpMagics)
