"""Which devices each active run holds, in this kernel and on the whole machine, so that runs on disjoint devices
go side by side and no two runs land on one GPU unasked.

A run holds what it runs on from its start until its ranks are given back: its GPUs, or on CPU some of the CPU's
process slots (as many as the default number of CPU processes: 2, or ``$FLAIR_NBDDP_PROCESSES``; a run of more
processes holds them all); and what only one run can use at a time: on a Dask cluster its workers, on a warm pool
the workers it runs on (the pool's, or one of its slices). A warm pool on GPUs holds its GPUs for as long as it is
open (its workers keep CUDA memory); a warm pool's CPU workers exist already, so its jobs take no CPU slot.

Every holding is also written to the machine's claim directory (:mod:`~flair_nbddp.engine.claim_files`), so runs of
other kernels and other users see it, with who holds it. A GPU is named there by its UUID
(:mod:`~flair_nbddp.engine.gpu_use`), so ``gpus=[1]`` in one kernel and GPU 1 of another are the same device
whatever their ``CUDA_VISIBLE_DEVICES``.

A run asking for something held is refused with :class:`~flair_nbddp.RunActiveError` naming the holder, before
anything of it starts; or, with ``wait_for_devices=S``, it waits up to S seconds in the machine's queue and starts
when its devices are free, runs asking earlier first. A run that asked for no particular devices (no ``gpus``, no
``processes``) takes the free ones: every GPU that no run holds and no other program uses, or the CPU's free slots,
and says in one line what it left out and why.

Example:
    >>> import tempfile
    >>> os.environ["FLAIR_NBDDP_CLAIMS"] = tempfile.mkdtemp()   # a directory of claims of one's own
    >>> from flair_nbddp.engine.devices import DevicePlan
    >>> desk = Holdings()
    >>> desk.take("first", "run #1 'train'", Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2))
    >>> desk.take("second", "run #2 'train'", Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2))
    >>> desk.take("third", "run #3 'train'", Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2))
    Traceback (most recent call last):
    ...
    flair_nbddp.errors.RunActiveError: the CPU's 2 process slots are held: 1 by run #1 'train', 1 by run #2 'train'; wait for one to end or stop it (or start with wait_for_devices=SECONDS), or raise $FLAIR_NBDDP_PROCESSES to let more CPU processes run at once
    >>> desk.give_back("first"); desk.take("third", "run #3 'train'", Claim.of(DevicePlan("cpu", 1, "gloo"), slots=2))
    >>> for holder in ("second", "third"): desk.give_back(holder)
    >>> del os.environ["FLAIR_NBDDP_CLAIMS"]
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterator
from dataclasses import dataclass, field, replace

from .claim_files import ClaimDir, ClaimRecord, Held
from . import devices
from .devices import DevicePlan, cpu_slots, cuda_plan, cuda_visible_entry
from ..errors import RunActiveError
from .gpu_use import GpuUse, gpu_id, gpu_label, machine_gpus

DASK_WORKER = "Dask worker "  # how a Dask worker's unit is named: this, then its address
ANY_GPU = "any"  # a queued run that takes whichever GPUs are free
POLL_SECONDS = 0.25  # how often a waiting run looks again
GIB = 1 << 30


@dataclass(frozen=True)
class Claim:
    """What one run holds: GPUs (machine-wide ids: UUIDs where NVML is there, else ``CUDA_VISIBLE_DEVICES``
    entries), CPU process slots, and units only one run uses at a time (a Dask worker, a pool's workers), each named
    as messages name it.

    Example:
        >>> sorted(Claim.of(DevicePlan("cuda", 2, "nccl", (2, 3))).gpus)     # without NVML
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
            machine = machine_gpus()
            return cls(gpus=frozenset(gpu_id(cuda_visible_entry(gpu), machine) for gpu in chosen))
        capacity = slots or cpu_slots()
        return cls(cpu=min(plan.world_size, capacity), capacity=capacity)

    @classmethod
    def on_cluster(cls, workers: Collection[str]) -> Claim:
        """What a run on these Dask workers (their addresses) holds."""
        return cls(units=frozenset(DASK_WORKER + address for address in workers))

    @classmethod
    def read(cls, record: ClaimRecord) -> Claim:
        """What another process's claim file says it holds."""
        return cls(frozenset(record.gpus), record.cpu, frozenset(record.units), record.capacity)

    @property
    def workers(self) -> frozenset[str]:
        """The addresses of the Dask workers it holds."""
        return frozenset(unit.removeprefix(DASK_WORKER) for unit in self.units if unit.startswith(DASK_WORKER))

    def fields(self) -> dict:
        """What its claim file says of it."""
        return {"gpus": sorted(self.gpus), "cpu": self.cpu, "capacity": self.capacity, "units": sorted(self.units)}


@dataclass
class Free:
    """What a run that asked for no particular devices may take now.

    Attributes:
        gpus: the GPUs (as this kernel numbers them) no run holds and no other program uses.
        left_out: why each other GPU is left out, one phrase each.
        cpu: the CPU's free process slots, of ``capacity``; ``cpu_holders`` say who holds the rest.
    """

    gpus: list[int]
    left_out: list[str]
    cpu: int
    capacity: int
    cpu_holders: list[str]


def fit_plan(plan: DevicePlan, processes: int | None, free: Free) -> tuple[DevicePlan, str | None] | None:
    """``plan`` (the defaults', or ``processes`` GPUs) on the devices that are free: its plan, and the line that says
    what it left out; None when too few are free.

    Example:
        >>> free = Free([1, 3], ["GPU 0 is held by run 'a' of ann", "GPU 2 is held by run 'b' of bo"], 1, 2, ["1 by x"])
        >>> plan, line = fit_plan(DevicePlan("cuda", 4, "nccl"), None, free)
        >>> str(plan)
        '2 × cuda 1,3 (nccl)'
        >>> line
        "GPU 0 is held by run 'a' of ann; GPU 2 is held by run 'b' of bo: this run takes GPUs 1,3"
        >>> str(fit_plan(DevicePlan("cpu", 2, "gloo"), None, free)[0]), fit_plan(DevicePlan("cuda", 3, "nccl"), 3, free)
        ('1 × cpu (gloo)', None)
    """
    if plan.device_type == "cpu":
        count = min(plan.world_size, free.cpu)
        if count < 1:
            return None
        if count == plan.world_size:
            return plan, None
        held = free.capacity - free.cpu
        return replace(plan, world_size=count), (
            f"{held} of the CPU's {free.capacity} process slots {'is' if held == 1 else 'are'} held "
            f"({'; '.join(free.cpu_holders)}): this run takes {count} process{'es' * (count > 1)}"
        )
    want = processes or len(free.gpus)
    if not free.gpus or len(free.gpus) < want and not plan.shares_gpus:
        return None
    if plan.shares_gpus:  # more ranks than GPUs: they share the free ones
        fitted = cuda_plan(plan.world_size, len(free.gpus), tuple(free.gpus))
    else:
        chosen = tuple(free.gpus[:want])
        fitted = DevicePlan("cuda", want, "nccl", None if chosen == tuple(range(want)) else chosen)
    if not free.left_out:
        return fitted, None
    taken = fitted.gpus or tuple(range(want))
    return fitted, f"{'; '.join(free.left_out)}: this run takes GPU{'s' * (len(taken) > 1)} {','.join(map(str, taken))}"


@dataclass
class Ask:
    """What a run asks for, as the queue compares it: GPUs (``("any",)``: whichever are free) and CPU slots."""

    gpus: tuple[str, ...]
    cpu: int

    def overlaps(self, other: Ask | ClaimRecord) -> bool:
        """True when both ask for CPU slots, or for GPUs that may be the same."""
        if self.cpu and other.cpu:
            return True
        if not self.gpus or not other.gpus:
            return False
        return ANY_GPU in self.gpus or ANY_GPU in other.gpus or bool(set(self.gpus) & set(other.gpus))


_reports = threading.local()  # where a thread's waiting run reports, and what makes it leave the queue


@contextlib.contextmanager
def queue_reports(say: Callable[[str], None], leave: threading.Event) -> Iterator[None]:
    """Within it, a run this thread starts reports its lines (what it left out, its place in the queue) to ``say``
    instead of printing them, and leaves the queue when ``leave`` is set (the panel's Stop)."""
    _reports.say, _reports.leave = say, leave
    try:
        yield
    finally:
        del _reports.say, _reports.leave


class Holdings:
    """The claims of the active runs of one process, written to the machine's claim directory as they are taken
    and removed as they are given back."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held: dict[Hashable, tuple[str, Claim, Held]] = {}

    def take(
        self, holder: Hashable, label: str, claim: Claim, *,
        fit: Callable[[Free], tuple[Claim, str | None] | None] | None = None,
        share: bool = False, wait: float | None = None, say: Callable[[str], None] | None = None,
        cancelled: threading.Event | None = None, inherit: Hashable | None = None,
    ) -> None:  # fmt: skip
        """Hold ``claim`` for ``holder`` (``label`` names it in other runs' refusals), in this process and on the
        machine.

        Args:
            fit: for a run that asked for no particular devices: what it holds of the devices free now, and the line
                saying what it left out (None: too few are free); ``claim`` is then what it would hold with every
                device free.
            share: GPUs held by other runs (or used by other programs) may be shared (``share_gpus=True``); a line
                says with whom.
            wait: seconds to wait in the machine's queue for the devices to be free (None: refuse at once).
            say: where the lines for the user go (what was left out, the queue while waiting); default
                :func:`queue_reports`' or ``print``.
            cancelled: set it to leave the queue (so does :func:`queue_reports`' event).
            inherit: a holder whose claim this one takes over (:meth:`hand_over`: a restart's next attempt, on the
                devices its failed attempt held, which no other run could take in between); it goes once this one
                holds.

        Raises:
            RunActiveError: another holder has one of its GPUs or workers, or the CPU slots it needs (after ``wait``
                seconds, or when ``cancelled``); nothing is held.
        """
        files = ClaimDir()
        say = say or getattr(_reports, "say", print)
        leave = [event for event in (cancelled, getattr(_reports, "leave", None)) if event is not None]
        began = time.monotonic()
        deadline = None if wait is None else began + wait
        any_gpus, any_slot = bool(fit and claim.gpus), bool(fit and claim.cpu)  # it takes whichever are free
        ask = Ask((ANY_GPU,) if any_gpus else tuple(sorted(claim.gpus)), 1 if any_slot else claim.cpu)
        ticket: Held | None = None
        shown, conflict, ahead = "", None, []
        try:
            while True:
                if ticket is not None and any(event.is_set() for event in leave):  # a stop while it waited
                    raise RunActiveError(_refusal(conflict, ahead, time.monotonic() - began))
                with self._lock, files.mutex():
                    machine = machine_gpus() if claim.gpus else None  # NVML's view, once a look
                    others = self._others({holder, inherit}, files, machine)
                    queue = files.live("wait", include_own=True)
                    chosen, line = claim, None
                    if fit is not None:  # the GPUs runs waiting ahead asked for by name are not free for it
                        named = [(f"waited for by {record.holder()}", Claim(gpus=frozenset(record.gpus)))
                                 for record in _ahead(queue, ticket, None) if ANY_GPU not in record.gpus]  # fmt: skip
                        free = self._free(others + named, claim.capacity or cpu_slots(), machine)
                        chosen, line = fit(free) or (None, None)
                    if chosen is None:
                        conflict, shared = self._none_free(claim, others, machine), ""
                    else:
                        conflict, shared = _conflict(chosen, others, share, machine)
                    # it yields to the runs waiting ahead for what it would take now, but for what it inherits
                    kept = self._held[inherit][1] if inherit in self._held else Claim()
                    ahead = [] if conflict else _ahead(
                        queue, ticket, Ask(tuple(sorted(chosen.gpus - kept.gpus)), max(0, chosen.cpu - kept.cpu))
                    )  # fmt: skip
                    if not conflict and not ahead:
                        held = files.publish("claim", {"label": label, "shared": bool(shared), **chosen.fields()})
                        self._held[holder] = (label, chosen, held)
                        if inherit in self._held:
                            files.withdraw(self._held.pop(inherit)[2])
                        break
                    if deadline is None or time.monotonic() >= deadline or any(event.is_set() for event in leave):
                        waited = time.monotonic() - began if wait else None
                        raise RunActiveError(_refusal(conflict, ahead, waited))
                    if ticket is None:
                        ticket = files.publish("wait", {"label": label, "gpus": list(ask.gpus), "cpu": ask.cpu})
                        queue.append(ticket.record)
                    text = _queue_text(conflict, queue, ticket, ask, wait)
                if text != shown:
                    say(f"flair_nbddp: {text}")
                    shown = text
                time.sleep(POLL_SECONDS)
        finally:
            if ticket is not None:
                files.withdraw(ticket)
        for said in filter(None, (line, shared)):  # held: what it left out, and whom it shares with
            say(f"flair_nbddp: {said}")

    def give_back(self, holder: Hashable) -> None:
        """Release what ``holder`` held (nothing happens if it held nothing)."""
        with self._lock:
            taken = self._held.pop(holder, None)
        if taken is not None:
            ClaimDir(taken[2].path.parent).withdraw(taken[2])

    def hand_over(self, holder: Hashable, to: Hashable) -> None:
        """What ``holder`` holds is held by ``to`` from now on (nothing happens if it held nothing)."""
        with self._lock:
            if holder in self._held:
                if to in self._held:  # what it held before goes
                    ClaimDir(self._held[to][2].path.parent).withdraw(self._held.pop(to)[2])
                self._held[to] = self._held.pop(holder)

    def relabel(self, holder: Hashable, label: str) -> None:
        """Name ``holder`` anew in its claim (a run, once the run ledger has given it its id)."""
        files = ClaimDir()
        with self._lock, files.mutex():
            if holder in self._held:
                _, claim, held = self._held[holder]
                self._held[holder] = (label, claim, files.rewrite(held, {"label": label}))

    def holds(self, holder: Hashable) -> bool:
        """True while ``holder`` holds a claim."""
        with self._lock:
            return holder in self._held

    def units_held(self) -> frozenset[str]:
        """Every unit a run holds now, on the machine (a new cluster run is placed on the other Dask workers, a pool's
        job on a free slice)."""
        files = ClaimDir()
        with self._lock, files.mutex():
            return frozenset().union(*(claim.units for _, claim in self._others(set(), files, None)))

    def workers_held(self) -> frozenset[str]:
        """The addresses of the Dask workers runs hold now."""
        return Claim(units=self.units_held()).workers

    def _others(
        self, holders: Collection[Hashable], files: ClaimDir, machine: list[GpuUse] | None
    ) -> list[tuple[str, Claim]]:  # fmt: skip
        """Every holding but ``holders``': this process's, other processes' (their files), and the GPUs of
        ``machine`` (NVML's view; None: no GPU asked for) other programs use, each named as messages name it."""
        others = [(name, held) for key, (name, held, _) in self._held.items() if key not in holders]
        others += [(record.holder(), Claim.read(record)) for record in files.live("claim")]
        if machine:
            claimed = set().union(*(held.gpus for _, held in others))
            others += [(who, Claim(gpus=frozenset({gpu}))) for gpu, who in programs_on_gpus(machine, claimed)]
        return others

    def _free(self, others: list[tuple[str, Claim]], capacity: int, machine: list[GpuUse] | None) -> Free:
        holders: dict[str, list[str]] = {}  # a GPU shared on purpose has several
        for name, held in others:
            for gpu in held.gpus:
                holders.setdefault(gpu, []).append(name)
        free, left_out = [], []
        for number in range(devices.visible_gpu_count()):
            gpu = gpu_id(cuda_visible_entry(number), machine)
            if gpu in holders:
                label = gpu_label(gpu, machine)
                named = f"GPU {number}" + (f" (the machine's GPU {label})" if label != str(number) else "")
                left_out.append(f"{named} is {' and '.join(map(_held_by, holders[gpu]))}")
            else:
                free.append(number)
        users = [(name, held.cpu) for name, held in others if held.cpu]
        return Free(free, left_out, max(0, capacity - sum(count for _, count in users)), capacity,
                    [f"{count} by {name}" for name, count in users])  # fmt: skip

    def _none_free(self, claim: Claim, others: list[tuple[str, Claim]], machine: list[GpuUse] | None) -> Conflict:
        """Why a run that takes the free devices (as many as ``claim`` at most) finds none."""
        if claim.cpu:
            listed = ", ".join(f"{held.cpu} by {name}" for name, held in others if held.cpu)
            return Conflict(f"every CPU process slot is held ({listed})", "; ", "wait for a run to end or stop it")
        free = self._free(others, cpu_slots(), machine)
        plural = "s are" if len(free.gpus) > 1 else " is"
        count = f"only {len(free.gpus)} GPU{plural} free" if free.gpus else "no GPU is free"
        return Conflict(f"{count}: {'; '.join(free.left_out)}", ". ", "Wait for them",
                        ", ask for fewer, or share one on purpose (gpus=[N], share_gpus=True)",
                        queue=" (start with wait_for_devices=SECONDS)")  # fmt: skip


def _held_by(who: str) -> str:
    return who if who.startswith(("used by", "waited for by")) else f"held by {who}"


def programs_on_gpus(machine: list[GpuUse] | None, claimed: Collection[str] = ()) -> list[tuple[str, str]]:
    """The GPUs of ``machine`` (:func:`~flair_nbddp.engine.gpu_use.machine_gpus`; machine-wide ids, other than
    ``claimed``) on which processes other than this one and its own children use memory, with a phrase naming them:
    ``used by 2 other processes (pids 41, 97: python; 10.4 GB)``."""
    if not machine:
        return []
    import psutil

    own = {os.getpid()} | {child.pid for child in psutil.Process().children(recursive=True)}
    found = []
    for gpu in machine:
        users = [(pid, used) for pid, used in gpu.processes if pid not in own]
        if gpu.uuid in claimed or not users:
            continue
        names = sorted({_process_name(pid) for pid, _ in users})
        memory = sum(used or 0 for _, used in users) / GIB
        found.append((gpu.uuid, f"used by {len(users)} other process{'es' * (len(users) > 1)} (pid"
                      f"{'s' * (len(users) > 1)} {', '.join(str(pid) for pid, _ in users)}: {', '.join(names)}; "
                      f"{memory:.1f} GB)"))  # fmt: skip
    return found


def _process_name(pid: int) -> str:
    import psutil

    try:
        process = psutil.Process(pid)
        return f"{process.name()} of {process.username()}"
    except (psutil.Error, KeyError):
        return "a process of another container or user"


@dataclass(frozen=True)
class Conflict:
    """Why a run cannot hold what it asks for: who holds what (``held``), then what to do: ``advice``, the hint to
    queue (``queue``, left out once the run has waited) and the other ways out (``rest``)."""

    held: str
    join: str
    advice: str
    rest: str = ""
    queue: str = " (or start with wait_for_devices=SECONDS)"

    def message(self, waited: float | None = None) -> str:
        """The refusal's text (after ``waited`` seconds in the queue: without the hint to queue)."""
        if waited:
            return f"after waiting {waited:.0f} s: {self.held}{self.join}{self.advice}{self.rest}"
        return f"{self.held}{self.join}{self.advice}{self.queue}{self.rest}"


def _conflict(
    claim: Claim, others: list[tuple[str, Claim]], share: bool, machine: list[GpuUse] | None
) -> tuple[Conflict | None, str]:  # fmt: skip
    """Why ``claim`` cannot be held beside ``others`` (None: it can), and, with ``share``, whom its GPUs are shared
    with."""
    shared = []
    for name, held in others:
        gpus, units = sorted(claim.gpus & held.gpus), sorted(claim.units & held.units)
        named = f"GPU{'s' * (len(gpus) > 1)} {', '.join(gpu_label(gpu, machine) for gpu in gpus)}"
        if gpus and share:
            shared.append(f"{named} with {name}")
            gpus = []
        if gpus:
            what, rest = (named,
                          ", or choose other GPUs (gpus=[...]), or share them on purpose (share_gpus=True)")
        elif units:
            what, rest = ", ".join(units), ""
        else:
            continue
        plural = len(gpus) > 1 or len(units) > 1
        held_by = f"{what} {'are' if plural else 'is'} {_held_by(name)}"
        return Conflict(held_by, ": ", "runs share no device unasked. Wait for it to end or stop it", rest), ""
    users = [(name, held.cpu) for name, held in others if held.cpu]
    if claim.cpu and sum(count for _, count in users) + claim.cpu > claim.capacity:
        listed = ", ".join(f"{count} by {name}" for name, count in users)
        return Conflict(f"the CPU's {claim.capacity} process slots are held: {listed}", "; ",
                        "wait for one to end or stop it",
                        ", or raise $FLAIR_NBDDP_PROCESSES to let more CPU processes run at once"), ""  # fmt: skip
    return None, ("shares " + "; ".join(shared) + " (share_gpus=True)") if shared else ""


def _ahead(queue: list[ClaimRecord], ticket: Held | None, ask: Ask | None) -> list[ClaimRecord]:
    """The waiting runs that asked before this one (every one, before it has a place) for devices it asks for (with
    ``ask`` None: for any devices)."""
    mine = None if ticket is None else (ticket.record.since, ticket.path.name)
    return [record for record in queue if (mine is None or (record.since, record.path.name) < mine)
            and (ticket is None or record.path != ticket.path) and (ask is None or ask.overlaps(record))]  # fmt: skip


def _refusal(conflict: Conflict | None, ahead: list[ClaimRecord], waited: float | None) -> str:
    if conflict:
        return conflict.message(waited)
    waited = f"after waiting {waited:.0f} s: " if waited else ""
    names = "; ".join(record.holder() for record in ahead)
    return (f"{waited}{len(ahead)} run{'s' * (len(ahead) > 1)} waiting for these devices asked first ({names}); "
            "start with wait_for_devices=SECONDS to queue behind them")  # fmt: skip


def _queue_text(conflict: Conflict | None, queue: list[ClaimRecord], ticket: Held, ask: Ask, wait: float) -> str:
    mine = (ticket.record.since, ticket.path.name)
    position = 1 + sum((record.since, record.path.name) < mine and ask.overlaps(record) for record in queue)
    held = conflict.held if conflict else "free, for runs ahead"
    ahead = [record.holder() for record in queue if (record.since, record.path.name) < mine and ask.overlaps(record)]
    return (f"waiting for devices ({_ordinal(position)} in the machine's queue, up to {wait:g} s): {held}"
            + (f"; ahead: {'; '.join(ahead)}" if ahead else ""))  # fmt: skip


def _ordinal(number: int) -> str:
    return f"{number}{'th' if 10 <= number % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(number % 10, 'th')}"


HOLDINGS = Holdings()  # this process's: every Run and WorkerPool takes and gives back here
