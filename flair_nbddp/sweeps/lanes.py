"""Where a sweep's trials run side by side: its lanes, each a disjoint share of the devices that runs one trial at
a time.

On this machine's GPUs a lane is ``trial_processes`` GPUs (8 GPUs, 2 per trial: GPUs 0,1 / 2,3 / 4,5 / 6,7); on CPU
it is ``trial_processes`` of the CPU's process slots (:func:`~flair_nbddp.engine.devices.cpu_slots`: 2 without
``$FLAIR_NBDDP_PROCESSES``); on a warm pool, one of its slices (``WorkerPool(..., job_processes=trial_processes)``);
on a Dask cluster, ``trial_processes`` of its workers, placed as each trial starts.

Example:
    >>> from flair_nbddp.options import RunOptions
    >>> [lane.label for lane in lanes(RunOptions(device="cpu"), 1)]
    ['CPU', 'CPU']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.devices import cpu_slots, resolve_devices
from ..errors import ConfigurationError
from ..options import RunOptions
from ..engine.worker_source import new_workers

_DEVICES_OF_THE_LANE = {"processes": None, "device": None, "gpus": None}  # the sweep's, replaced by the lane's


@dataclass(frozen=True)
class Lane:
    """One trial at a time: the run options its trials start with (their devices: they replace the sweep's), and
    the pool they run on (None: new workers)."""

    label: str
    options: dict = field(default_factory=dict)
    pool: Any = None


def lanes(options: RunOptions, trial_processes: int, pool: Any = None) -> list[Lane]:
    """The lanes of a sweep with run ``options`` (its ``processes``/``device``/``gpus``/``cluster``: every device
    the sweep may use), ``trial_processes`` per trial, on ``pool`` if given.

    Raises:
        ConfigurationError: ``trial_processes`` is not a positive integer, more than the devices, or not the size
            of the pool's jobs.
        DeviceError, ClusterError: as for :func:`~flair_nbddp.launch` with these options.
    """
    if isinstance(trial_processes, bool) or not isinstance(trial_processes, int) or trial_processes < 1:
        raise ConfigurationError(f"trial_processes={trial_processes!r} must be a positive integer (processes per trial)")
    if pool is not None:
        return _pool_lanes(pool, trial_processes, options)
    if options.cluster is not None:
        size = new_workers(options.processes, options.device, None, options.cluster).plan.world_size
        lane = Lane("Dask workers", {**_DEVICES_OF_THE_LANE, "device": options.device, "processes": trial_processes})
        return [lane] * _count(size, trial_processes, "Dask workers")
    plan = resolve_devices(options.device, options.processes, options.gpus, options.share_gpus)
    if plan.device_type == "cpu":
        slots = cpu_slots()
        if plan.world_size > slots:
            raise ConfigurationError(
                f"processes={plan.world_size} CPU processes for the sweep, and the CPU has {slots} process slots "
                "(runs side by side share them): ask for at most that many, or set $FLAIR_NBDDP_PROCESSES"
            )
        lane = Lane("CPU", {**_DEVICES_OF_THE_LANE, "device": "cpu", "processes": trial_processes})
        return [lane] * _count(plan.world_size, trial_processes, "CPU processes")
    if plan.shares_gpus:
        raise ConfigurationError(
            "share_gpus=True rehearses one run's ranks on fewer GPUs; a sweep's trials each take their own GPUs: "
            "leave share_gpus out (trial_processes=1 runs one trial per GPU)"
        )
    gpus = plan.gpus or tuple(range(plan.world_size))
    count = _count(len(gpus), trial_processes, "GPUs")
    return [
        Lane(f"GPU{'s' * (trial_processes > 1)} {','.join(map(str, chosen))}", {**_DEVICES_OF_THE_LANE, "gpus": chosen})
        for chosen in (gpus[index * trial_processes : (index + 1) * trial_processes] for index in range(count))
    ]


def _count(devices: int, trial_processes: int, what: str) -> int:
    if trial_processes > devices:
        raise ConfigurationError(
            f"trial_processes={trial_processes}, and the sweep has {devices} {what}: ask for at most {devices} per trial"
        )
    return devices // trial_processes


def _pool_lanes(pool: Any, trial_processes: int, options: RunOptions) -> list[Lane]:
    if options.cluster is not None:
        raise ConfigurationError("pool= and cluster= both say where trials run: pass one of them")
    size = pool.job_plan.world_size
    if size != trial_processes:
        raise ConfigurationError(
            f"the pool's jobs take {size} process{'es' * (size != 1)}, and trial_processes={trial_processes}: make the "
            f"pool with WorkerPool(..., job_processes={trial_processes}) to lend its workers to trials side by side"
        )
    return [Lane("pool slice", _DEVICES_OF_THE_LANE, pool)] * (pool.plan.world_size // size)
