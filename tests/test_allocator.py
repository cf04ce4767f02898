"""A worker's C allocator keeps big freed blocks for the next batch instead of mapping them afresh each time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flair_nbddp.worker import allocator

FAULTS = """
import ctypes, json, resource, sys
import numpy as np
from flair_nbddp.worker import allocator
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, whatever the kernel's huge-page policy
applied = allocator.keep_freed_blocks() if sys.argv[1] == "on" else False
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    block = np.ones(5 << 20)  # 40 MB, freed at the next turn: a batch's activations
    del block
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", **env})  # fmt: skip
    return json.loads(out.stdout)


@pytest.mark.process
@pytest.mark.skipif(allocator._glibc() is None, reason="the settings are glibc's")
def test_big_blocks_are_kept_between_batches_unless_the_user_set_the_allocator_up():
    default, kept = _faults("off"), _faults("on")
    assert kept["applied"] and kept["faults"] * 20 < default["faults"]  # here: 10,216 page faults against 1,024,100
    assert not _faults("on", MALLOC_TRIM_THRESHOLD_="65536")["applied"]  # e.g. Dask's nanny: left as it is
    assert not _faults("on", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")["applied"]
