"""Which devices each active run of this kernel holds, so that runs on disjoint devices go side by side.

A run holds what it runs on from its start until its ranks are given back: its GPUs (by the ``CUDA_VISIBLE_DEVICES``
entry its workers get, so ``gpus=[1]`` and another run's GPU 1 are the same device), or on CPU some of the CPU's
process slots (as many as the default number of CPU processes: 2, or ``$FLAIR_NBDDP_PROCESSES``; a run of more
processes holds them all); and what only one run can use at a time: on a Dask cluster its workers, on a warm pool
the workers it runs on (the pool's, or one of its slices). A run asking for any of these while another run holds it
is refused with :class:`~flair_nbddp.RunActiveError`, naming that run, before anything of it starts.

Example:
    >>> from flair_nbddp.engine.devices import DevicePlan
    >>> desk = Holdings()
    >>> desk.take("first", "run #1 'train'", Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2))
    >>> desk.take("second", "run #2 'train'", Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2))
    >>> desk.take("third", "run #3 'train'", Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2))
    Traceback (most recent call last):
    ...
    flair_nbddp.errors.RunActiveError: the CPU's 2 process slots are held: 1 by run #1 'train', 1 by run #2 'train'; wait for one to end or stop it, or raise $FLAIR_NBDDP_PROCESSES to let more CPU processes run at once
    >>> desk.give_back("first"); desk.take("third", "run #3 'train'", Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2))
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

from .devices import DevicePlan, cpu_slots, cuda_visible_entry
from ..errors import RunActiveError

DASK_WORKER = "Dask worker "  # how a Dask worker's unit is named: this, then its address


@dataclass(frozen=True)
class Claim:
    """What one run holds: GPUs (their ``CUDA_VISIBLE_DEVICES`` entries), CPU process slots, and units only one run
    uses at a time (a Dask worker, a pool's workers), each named as messages name it.

    Example:
        >>> sorted(Claim.of(DevicePlan("cuda", 2, "nccl", (2, 3))).gpus)
        ['2', '3']
    """

    gpus: frozenset[str] = frozenset()
    cpu: int = 0
    units: frozenset[str] = frozenset()
    capacity: int = field(default=0, compare=False)  # the CPU's slots when this was claimed

    @classmethod
    def of(cls, plan: DevicePlan, slots: int | None = None) -> Claim:
        """What a run of ``plan`` on this machine holds (``slots``: the CPU's, default
        :func:`~flair_nbddp.engine.devices.cpu_slots`)."""
        if plan.device_type == "cuda":
            chosen = plan.gpus if plan.gpus is not None else range(plan.world_size)
            return cls(gpus=frozenset(cuda_visible_entry(gpu) for gpu in chosen))
        capacity = slots or cpu_slots()
        return cls(cpu=min(plan.world_size, capacity), capacity=capacity)

    @classmethod
    def on_cluster(cls, workers: Collection[str]) -> Claim:
        """What a run on these Dask workers (their addresses) holds."""
        return cls(units=frozenset(DASK_WORKER + address for address in workers))

    @property
    def workers(self) -> frozenset[str]:
        """The addresses of the Dask workers it holds."""
        return frozenset(unit.removeprefix(DASK_WORKER) for unit in self.units if unit.startswith(DASK_WORKER))


class Holdings:
    """The claims of the active runs of one process: taken as a run starts, given back as it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Hashable, tuple[str, Claim]] = {}

    def take(self, holder: Hashable, label: str, claim: Claim) -> None:
        """Hold ``claim`` for ``holder`` (``label`` names it in other runs' refusals).

        Raises:
            RunActiveError: another holder has one of its GPUs or workers, or the CPU slots it needs; nothing is held.
        """
        with self._lock:
            others = [(name, held) for key, (name, held) in self._held.items() if key != holder]
            conflict = _conflict(claim, others)
            if conflict:
                raise RunActiveError(conflict)
            self._held[holder] = (label, claim)

    def give_back(self, holder: Hashable) -> None:
        """Release what ``holder`` held (nothing happens if it held nothing)."""
        with self._lock:
            self._held.pop(holder, None)

    def units_held(self) -> frozenset[str]:
        """Every unit a run holds now (a new cluster run is placed on the other Dask workers, a pool's job on a free
        slice)."""
        with self._lock:
            return frozenset().union(*(claim.units for _, claim in self._held.values()))

    def workers_held(self) -> frozenset[str]:
        """The addresses of the Dask workers runs hold now."""
        return Claim(units=self.units_held()).workers


def _conflict(claim: Claim, others: list[tuple[str, Claim]]) -> str | None:
    """Why ``claim`` cannot be held beside ``others`` (None: it can)."""
    for name, held in others:
        gpus, units = sorted(claim.gpus & held.gpus), sorted(claim.units & held.units)
        if gpus:
            what, hint = f"GPU{'s' * (len(gpus) > 1)} {', '.join(gpus)}", ", or choose other GPUs (gpus=[...])"
        elif units:
            what, hint = ", ".join(units), ""
        else:
            continue
        return (f"{what} {'are' if len(gpus) > 1 or len(units) > 1 else 'is'} held by {name}: runs share no device. "
                f"Wait for it to end or stop it{hint}")  # fmt: skip
    users = [(name, held.cpu) for name, held in others if held.cpu]
    if claim.cpu and sum(count for _, count in users) + claim.cpu > claim.capacity:
        listed = ", ".join(f"{count} by {name}" for name, count in users)
        return (
            f"the CPU's {claim.capacity} process slots are held: {listed}; wait for one to end or stop it, or raise "
            "$FLAIR_NBDDP_PROCESSES to let more CPU processes run at once"
        )
    return None


HOLDINGS = Holdings()  # this process's: every Run takes and gives back here
