"""flair_nbddp: train Flair models on every GPU of one machine, from a Jupyter notebook.

Example:
    >>> from flair_nbddp import launch_distributed, launch   # doctest: +SKIP
    >>> scores = launch_distributed(train, corpus)            # doctest: +SKIP
"""

from .errors import RunTimeoutError, WorkerError
from .launcher import Run, launch, launch_distributed
from .payload import CorpusMismatchError, ShippingError
from .result import RunResult

__all__ = [
    "CorpusMismatchError",
    "Run",
    "RunResult",
    "RunTimeoutError",
    "ShippingError",
    "WorkerError",
    "launch",
    "launch_distributed",
]
__version__ = "0.1.0"
