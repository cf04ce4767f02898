"""flair_nbddp: train Flair models on every GPU of one machine, from a Jupyter notebook.

Example:
    >>> from flair_nbddp import launch_distributed, launch   # doctest: +SKIP
    >>> scores = launch_distributed(train, corpus)            # doctest: +SKIP
"""

from typing import Any

from .errors import RunHangError, RunTimeoutError, WorkerError
from .launcher import Run, launch, launch_distributed, runs
from .panel import TrainingPanel
from .payload import CorpusMismatchError, ShippingError
from .pool import WorkerPool
from .result import RunResult

__all__ = [
    "CorpusMismatchError",
    "Run",
    "RunHangError",
    "RunResult",
    "RunTimeoutError",
    "ShippingError",
    "TrainingPanel",
    "WorkerError",
    "WorkerPool",
    "launch",
    "launch_distributed",
    "load_ipython_extension",
    "runs",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext flair_nbddp``: registers ``%%ddp_train``, ``%ddp_pool`` and ``%ddp_info``."""
    from .magic import DdpMagics

    ipython.register_magics(DdpMagics)
