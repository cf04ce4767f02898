"""A run of one rank trains flair's model without DDP's wrapper: the same numbers, less work on every batch.

flair's ``multi_gpu=True`` path wraps the model in ``DistributedDataParallel`` whatever the world size. With one
rank the wrapper changes no number: its all-reduce sums one gradient, its average divides by 1, and the buffers it
broadcasts before every forward pass are the rank's own. But it still does all of it on every batch: a broadcast of
the buffers, a copy of every gradient into its buckets and back, a collective per bucket, a search of the autograd
graph for unused parameters (flair's ``find_unused_parameters=True``). On one GPU in bf16, where the rank's
training thread sets the pace, that was 15 % of a step (``benchmarks/throughput.py`` with and without ``--no-ddp``).

:func:`install` makes flair's trainer wrap the model in :class:`OneRank` when the world has one rank: flair calls
it as it calls DDP (``ddp_model(batch)`` and ``ddp_model.no_sync()``), and it calls the model. Everything else of
flair's multi-GPU path stays: the distributed sampler and its shuffling, the corpus check, the aggregated metrics.
With two or more ranks flair's DDP is untouched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class OneRank(torch.nn.Module):
    """What flair's trainer gets instead of ``DistributedDataParallel(module)`` in a world of one rank.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> wrapped = OneRank(model)
        >>> with wrapped.no_sync():
        ...     torch.equal(wrapped(torch.ones(1, 2)), model(torch.ones(1, 2)))
        True
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's context for gradient accumulation (flair's ``mini_batch_chunk_size``): with one rank there is no
        synchronization to skip."""
        yield


def install() -> None:
    """Make flair's trainer wrap the model in :class:`OneRank` when the process group has one rank (after
    :func:`~flair_nbddp.worker.flair_compat.allow_cpu_ddp`, whose wrapper it keeps for two or more)."""
    from flair.trainers import trainer as trainer_module

    wrap = trainer_module.DistributedDataParallel

    @functools.wraps(wrap)
    def distributed_data_parallel(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if dist.get_world_size() == 1:
            return OneRank(module)
        return wrap(module, *args, **kwargs)

    trainer_module.DistributedDataParallel = distributed_data_parallel
