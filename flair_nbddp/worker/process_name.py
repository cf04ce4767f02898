"""The name a kit process shows in ``ps -e``, ``top`` and ``psutil.Process.name()``: ``flair_nbddp r0`` for rank 0.

A forked worker's command line is its fork server's, so the name is what tells the processes apart.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15
NAME_BYTES = 15  # Linux keeps this many bytes of a process's name
RANK_PREFIX = "flair_nbddp r"  # a worker's name: this and its rank


def set_name(name: str) -> None:
    """Name this process ``name`` (its first 15 bytes) on Linux; elsewhere nothing changes."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:NAME_BYTES]), 0, 0, 0)


def rank_name(rank: int) -> str:
    """The name of rank ``rank``'s worker process.

    Example:
        >>> rank_name(3)
        'flair_nbddp r3'
    """
    return f"{RANK_PREFIX}{rank}"
