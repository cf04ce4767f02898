"""flair_nbddp: train Flair models on every GPU of one machine, from a Jupyter notebook.

Example::

    from flair_nbddp import launch_distributed
    scores = launch_distributed(train, corpus)        # train: a function defined in a notebook cell
"""

from typing import Any

from .api import launch, launch_distributed, start
from .errors import (
    ConfigurationError,
    CorpusMismatchError,
    DashboardUnavailableError,
    DeviceError,
    EvaluationShareError,
    FlairNbddpError,
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
from .panel import TrainingPanel
from .pool import WorkerPool
from .result import RunResult
from .run import Run, runs
from .shared import PoolRef

__all__ = [
    "ConfigurationError",
    "CorpusMismatchError",
    "DashboardUnavailableError",
    "DeviceError",
    "EvaluationShareError",
    "FlairNbddpError",
    "NotCallableError",
    "PayloadWriteError",
    "PoolClosedError",
    "PoolRef",
    "PoolRefError",
    "Run",
    "RunActiveError",
    "RunError",
    "RunHangError",
    "RunResult",
    "RunStateError",
    "RunTimeoutError",
    "ShippingError",
    "StillRunningError",
    "TrainingPanel",
    "UnsupportedPlatformError",
    "WorkerError",
    "WorkerPool",
    "launch",
    "launch_distributed",
    "load_ipython_extension",
    "runs",
    "start",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext flair_nbddp``: registers ``%%ddp_train``, ``%ddp_pool`` and ``%ddp_info``."""
    from .magic import DdpMagics

    ipython.register_magics(DdpMagics)
