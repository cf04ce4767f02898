"""The versions a run depends on: python, torch, CUDA, NCCL, flair, transformers and the kit.

Example:
    >>> found = versions()
    >>> list(found)
    ['python', 'torch', 'CUDA', 'NCCL', 'flair', 'transformers', 'flair_nbddp']
    >>> found["flair_nbddp"] == __import__("flair_nbddp").__version__
    True
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform

from .._version import __version__

NO_CUDA = "none (a CPU build of torch)"


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def package_versions() -> dict[str, str]:
    """python, torch, flair, transformers and the kit, from the installed packages' metadata: what the run
    ledger records (importing nothing, so a kernel that never imported torch does not start to).

    Example:
        >>> list(package_versions())
        ['python', 'torch', 'flair', 'transformers', 'flair_nbddp']
    """
    return {
        "python": platform.python_version(),
        "torch": _installed("torch"),
        "flair": _installed("flair"),
        "transformers": _installed("transformers"),
        "flair_nbddp": __version__,
    }


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
    found = package_versions()
    return {
        "python": found["python"],
        "torch": torch.__version__,
        "CUDA": torch.version.cuda or NO_CUDA,
        "NCCL": nccl,
        **{name: found[name] for name in ("flair", "transformers", "flair_nbddp")},
    }
