"""The versions a run depends on: python, torch, CUDA, NCCL, flair, transformers and the kit.

Example:
    >>> found = versions()
    >>> list(found)
    ['python', 'torch', 'CUDA', 'NCCL', 'flair', 'transformers', 'flair_nbddp']
    >>> found["flair_nbddp"] == __import__("flair_nbddp").__version__
    True
"""

from __future__ import annotations

import importlib.metadata
import platform

from . import __version__

NO_CUDA = "none (a CPU build of torch)"


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Each component's version; ``CUDA`` and ``NCCL`` say so when torch is a CPU build.

    Reads no GPU: nothing here initialises CUDA in this process.
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        nccl = "none (not in this torch build)"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA": torch.version.cuda or NO_CUDA,
        "NCCL": nccl,
        "flair": _installed("flair"),
        "transformers": _installed("transformers"),
        "flair_nbddp": __version__,
    }
