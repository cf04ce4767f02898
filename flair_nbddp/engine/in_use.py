"""Every claim on the machine, with its holder: what :func:`flair_nbddp.devices_in_use` and ``%ddp_devices`` show.

Example:
    >>> import tempfile
    >>> os.environ["FLAIR_NBDDP_CLAIMS"] = tempfile.mkdtemp()
    >>> from flair_nbddp import WorkerPool
    >>> pool = WorkerPool(2, "cpu")
    >>> [(use.holder.startswith("WorkerPool pool-"), use.state, use.pid == os.getpid()) for use in devices_in_use()]
    [(True, 'holds', True)]
    >>> pool.close(); devices_in_use()
    no device of this machine is held by a flair_nbddp run, waited for, or used by another program
    >>> del os.environ["FLAIR_NBDDP_CLAIMS"]
"""

from __future__ import annotations

import html
import os
import time
from dataclasses import dataclass

from .claim_files import ClaimDir
from .claims import programs_on_gpus
from .gpu_use import GpuUse, gpu_label, machine_gpus

GIB = 1 << 30
COLUMNS = ("holder", "state", "user", "pid", "where", "age", "GPUs", "CPU slots", "other", "GPU memory, use")


@dataclass(frozen=True)
class DeviceUse:
    """One holder of devices on this machine.

    Attributes:
        holder: what holds them (``"run #12 'train' (started 10:02:13)"``, ``"WorkerPool pool-x1y2 (warm, ...)"``),
            or the programs other than the kit's using a GPU.
        state: ``"holds"``, ``"waits"`` (in the machine's queue, for what it lists) or ``"uses"`` (another program).
        user, pid, where: who: the user, the process (a kernel, a script), its notebook or script (None for other
            programs, which NVML names by pid in ``holder``).
        since: when it took them or began to wait (seconds since the epoch; None for other programs).
        gpus: the GPUs (as ``nvidia-smi`` numbers them), ``cpu`` the CPU process slots, ``units`` a pool's or Dask's
            workers; ``gpu_use``: each of its GPUs now (memory, utilisation), where NVML is there.
    """

    holder: str
    state: str
    user: str | None
    pid: int | None
    where: str | None
    since: float | None
    gpus: tuple[str, ...] = ()
    cpu: int = 0
    units: tuple[str, ...] = ()
    gpu_use: tuple[GpuUse, ...] = ()

    @property
    def age(self) -> float | None:
        """Seconds since it took (or asked for) its devices."""
        return None if self.since is None else time.time() - self.since

    def row(self) -> list[str]:
        """Its cells, in :data:`COLUMNS`' order."""
        memory = "; ".join(
            f"GPU {use.index}: {use.memory_used / GIB:.1f}/{use.memory_total / GIB:.0f} GB"
            + (f", {use.utilization} %" if use.utilization is not None else "")
            for use in self.gpu_use
        )
        return [self.holder, self.state, self.user or "", "" if self.pid is None else str(self.pid), self.where or "",
                "" if self.age is None else _duration(self.age), ",".join(self.gpus), str(self.cpu or ""),
                ", ".join(self.units), memory]  # fmt: skip


class DevicesInUse(list):
    """:func:`devices_in_use`'s list of :class:`DeviceUse`, shown as a table (HTML in a notebook)."""

    def __repr__(self) -> str:
        if not self:
            return "no device of this machine is held by a flair_nbddp run, waited for, or used by another program"
        rows = [list(COLUMNS)] + [use.row() for use in self]
        keep = [column for column in range(len(COLUMNS)) if any(row[column] for row in rows[1:])]
        widths = [max(len(row[column]) for row in rows) for column in keep]
        return "\n".join("  ".join(row[column].ljust(width) for column, width in zip(keep, widths)).rstrip()
                         for row in rows)  # fmt: skip

    def _repr_html_(self) -> str:
        if not self:
            return f"<p>{html.escape(repr(self))}</p>"
        head = "".join(f"<th>{html.escape(name)}</th>" for name in COLUMNS)
        rows = ("".join(f"<td>{html.escape(cell)}</td>" for cell in use.row()) for use in self)
        body = "".join(f"<tr>{row}</tr>" for row in rows)
        return f"<table class='flair-nbddp-devices'><tr>{head}</tr>{body}</table>"


def devices_in_use() -> DevicesInUse:
    """Every claim on this machine, from every kernel and user of the kit (runs, warm pools, runs waiting in the
    queue), and the GPUs other programs use, each with its holder, its age and, for GPUs, their memory and
    utilisation now. Where the claims are kept: ``$FLAIR_NBDDP_CLAIMS``
    (:mod:`~flair_nbddp.engine.claim_files`).

    Example::

        devices_in_use()          # in a notebook: a table; ``%ddp_devices`` shows the same
        # holder                                  state  user   pid    where            age  GPUs  GPU memory, use
        # run #12 'train' (started 10:02:13, ...) holds  alice  41230  ner/train.ipynb  14m  0,1   GPU 0: 31.2/80 GB...
        # WorkerPool pool-k2 (warm, 1 × cuda 2)   holds  bob    51002  sweep.ipynb      2h   2     GPU 2: 4.1/80 GB
        # run 'finetune' (started 10:15:40, ...)  waits  carol  60311  finetune.ipynb   30s  any
        # used by 1 other process (pid 7: ...)    uses                                       3     GPU 3: 20.0/80 GB
    """
    files = ClaimDir()
    machine = machine_gpus()
    with files.mutex():
        records = files.live("claim", include_own=True) + files.live("wait", include_own=True)
    found = DevicesInUse()
    for record in records:
        state = "waits" if record.kind == "wait" else "holds"
        found.append(DeviceUse(
            record.label, state, record.user, record.pid, record.where, record.since,
            tuple(gpu if gpu == "any" else gpu_label(gpu, machine) for gpu in record.gpus), record.cpu,
            record.units, _use_of(record.gpus, machine),
        ))  # fmt: skip
    claimed = {gpu for record in records if record.kind == "claim" for gpu in record.gpus}
    for gpu, who in programs_on_gpus(machine, claimed):
        found.append(DeviceUse(who, "uses", None, None, None, None, (gpu_label(gpu, machine),),
                               gpu_use=_use_of((gpu,), machine)))  # fmt: skip
    return found


def _use_of(gpus: tuple[str, ...], machine: list[GpuUse] | None) -> tuple[GpuUse, ...]:
    return tuple(use for use in machine or () if use.uuid in gpus)


def _duration(seconds: float) -> str:
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
