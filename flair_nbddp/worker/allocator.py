"""The C allocator's settings in a worker: big blocks are kept for the next batch, not handed back every time.

glibc's ``malloc`` serves a block over its mmap threshold (128 KiB, raised as far as 32 MiB as blocks are freed)
with a fresh ``mmap`` and unmaps it on ``free``, and trims the heap's free top beyond twice that. A CPU rank frees
and allocates the same tensors every batch (a tiny transformer's attention scores are ~23 MB a layer for a batch of
32 IMDB-length reviews), so each batch the kernel maps, faults in and zeroes them again: 14 % of a rank's CPU time
was system time (0.24 of 1.73 s, 20 steps; none with the settings below). Raising both thresholds keeps the blocks
in the heap. The arithmetic is untouched: results are the same, bit for bit.

While a job runs, freed memory stays with the worker (up to :data:`TRIM_THRESHOLD` at the main heap's top, and what
lies below it or in threads' arenas), so a worker's resident memory stays near its peak; between jobs it hands all
it can back (``malloc_trim``). Settings the user made (``MALLOC_*_`` variables, ``glibc.malloc``
tunables) are left as they are, and so is any C library other than glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap (larger ones are rare enough for their own mapping)
MMAP_THRESHOLD = 256 << 20
#: glibc before 2.26 refuses a threshold over this (HEAP_MAX_SIZE / 2 on 64-bit)
OLD_GLIBC_MMAP_THRESHOLD = 32 << 20
#: the free memory the heap may keep at its top before it gives some back
TRIM_THRESHOLD = 512 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # TypeError: Windows has no process-wide namespace to open
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def _user_chose() -> bool:
    if any(name.startswith("MALLOC_") and name.endswith("_") for name in os.environ):
        return True
    return "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def keep_freed_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if they were raised.

    Example (what a worker does first; it changes the whole process's allocator)::

        if not keep_freed_blocks():
            print("another C library, or the user's own MALLOC_* settings: left as they are")
    """
    libc = _glibc()
    if libc is None or _user_chose():
        return False
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and not libc.mallopt(M_MMAP_THRESHOLD, OLD_GLIBC_MMAP_THRESHOLD):
        return False
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def give_back_free_memory() -> None:
    """Return the heap's free pages to the system (between jobs, when nothing reuses them soon)."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
