"""Interactive ranks: a cell run on every rank of a warm pool, in a namespace each rank keeps between cells.

What ``%%ddp_exec`` and :meth:`flair_nbddp.WorkerPool.exec` ship to the workers is :func:`run_ddp_exec_cell`. On each
rank it runs the cell (or calls a function) in that rank's namespace (``rank``, ``world_size`` and ``device``
predefined, the process group up), catches whatever the cell raises, and hands rank 0 its outcome through the
ranks' store, never through a collective: a rank that failed, or was not asked to run, still answers. Rank 0
returns every rank's :class:`RankOutcome`; the notebook turns them into :class:`RankResult` objects.

An interrupt (the parent's STOP) raises ``KeyboardInterrupt`` inside every rank's cell, also in a ``sleep``;
flair's training in a cell first stops after the same batch on every rank (its collectives stay in step), then
the cell is interrupted. A rank blocked in a collective only sees the interrupt when the collective returns,
and the run's stop timeout then ends the ranks.

Importable without IPython: workers import it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import WorkerError
from ..wire import payload
from ..wire.events import STOP_REQUESTED
from .cell_code import run_source

PREDEFINED = ("rank", "world_size", "device")  # in every rank's namespace, set afresh for each cell
FILENAME = "<ddp_exec cell>"
POLL_SECONDS = 0.02  # rank 0 looks for the other ranks' outcomes this often (the run's limits bound the wait)
_NAMESPACE: dict[str, Any] = {}  # this rank's namespace of exec cells, kept from job to job
_CONTEXT: dict[str, Any] = {}  # the current job's rank, world size, device, store and key (set by the worker)


class _Interrupts:
    """When a SIGINT (the parent's STOP, sent by the listener thread) interrupts: only while a cell runs, and not
    while flair trains in it (flair then stops after the same batch on every rank, and the cell is interrupted
    once it has). Read by the handler, which runs on the main thread: it cannot race with the cell's end."""

    cell = False
    training = False


def install_interrupts() -> None:
    """In a worker, once: SIGINT raises ``KeyboardInterrupt`` inside a running cell, and is ignored elsewhere."""

    def on_sigint(signum: int, frame: Any) -> None:
        if _Interrupts.cell and not _Interrupts.training:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)


def interrupt_cell() -> None:
    """In a worker's listener thread, on the parent's STOP: interrupt the running cell, even in ``time.sleep``."""
    if _Interrupts.cell:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def in_cell() -> bool:
    """Whether a ``%%ddp_exec`` cell runs now (flair's training in it turns a stop into ``KeyboardInterrupt``)."""
    return _Interrupts.cell


def training(active: bool) -> None:
    """flair's training starts (True) or ends (False) on this rank: a stop goes through the same-batch stop."""
    _Interrupts.training = active


def begin_job(rank: int, world_size: int, device: Any, store: Any, key: str) -> None:
    """In a worker, before each job: what :func:`run_ddp_exec_cell` needs to know of its rank and job."""
    _CONTEXT.update(rank=rank, world_size=world_size, device=device, store=store, key=key)


@dataclass(frozen=True)
class RankOutcome:
    """One rank's outcome of a cell, as rank 0 gathers it: whether it ran, its packed value or its error, and
    the names its namespace holds afterwards."""

    rank: int
    ran: bool
    value: bytes | None = None  # packed as the kit packs results (a flair model lands on CPU in the notebook)
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    names: tuple[str, ...] = ()


def _cell_traceback(error: BaseException) -> str:
    """The traceback of ``error`` from the cell's own frames on (the kit's are left out)."""
    frames = error.__traceback__
    while frames is not None and frames.tb_frame.f_code.co_filename != FILENAME and frames.tb_next is not None:
        frames = frames.tb_next
    return "".join(traceback.format_exception(type(error), error, frames))


def _on_cpu(value: Any) -> Any:
    """A tensor value comes back on CPU (it would land on the notebook's own GPU otherwise)."""
    torch = sys.modules.get("torch")
    return value.cpu() if torch is not None and isinstance(value, torch.Tensor) else value


def _outcome(rank: int, work: Callable[[], Any]) -> RankOutcome:
    try:
        try:
            _Interrupts.cell = True
            if STOP_REQUESTED.is_set():  # the interrupt came before the cell could start
                raise KeyboardInterrupt
            value = work()
        finally:
            _Interrupts.cell = False  # a SIGINT after this is ignored; one before it is raised in here
    except BaseException as error:  # noqa: BLE001 - every outcome goes back to the notebook, interrupts too
        return RankOutcome(rank, True, None, type(error).__name__, str(error), _cell_traceback(error))
    try:
        return RankOutcome(rank, True, payload.dumps(_on_cpu(value)))
    except Exception as error:  # noqa: BLE001 - the value cannot travel: say so, keep the rank
        return RankOutcome(
            rank, True, None, "ShippingError",
            f"the cell's value, a {type(value).__name__}, cannot be sent back to the notebook ({error})",
        )  # fmt: skip


def run_ddp_exec_cell(
    code: str | Callable, variables: dict[str, Any], ranks: tuple[int, ...] | None, reset: bool
) -> list[RankOutcome] | None:
    """Run ``code`` (a cell's source, or a function called with no arguments, which sees its own globals) on this
    rank if ``ranks`` (None: every rank) holds it, in this rank's kept namespace updated with ``variables``
    (emptied first if ``reset``); return every rank's :class:`RankOutcome` on rank 0 (None on the others)."""
    rank, world_size, store, key = (_CONTEXT[name] for name in ("rank", "world_size", "store", "key"))
    if reset:
        _NAMESPACE.clear()
    _NAMESPACE.update(variables)
    _NAMESPACE.update(zip(PREDEFINED, (rank, world_size, _CONTEXT["device"])))
    _NAMESPACE.setdefault("__name__", "__main__")
    if ranks is not None and rank not in ranks:
        outcome = RankOutcome(rank, False)
    elif callable(code):
        outcome = _outcome(rank, code)
    else:
        outcome = _outcome(rank, lambda: run_source(code, _NAMESPACE, FILENAME))
    names = tuple(sorted(name for name in _NAMESPACE if not name.startswith("__") and name not in PREDEFINED))
    outcome = RankOutcome(**{**outcome.__dict__, "names": names})
    if rank != 0:
        store.set(f"flair_nbddp/{key}/exec/{rank}", payload.dumps(outcome))
        return None
    outcomes = [outcome]
    for other in range(1, world_size):  # each read once and deleted: a value may be a model
        name = f"flair_nbddp/{key}/exec/{other}"
        while not store.check([name]):  # no store timeout: the run's own limits bound a rank that never answers
            time.sleep(POLL_SECONDS)
        outcomes.append(payload.loads(store.get(name)))
        store.delete_key(name)
    return outcomes


# -- in the notebook ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankResult:
    """What one rank made of a ``%%ddp_exec`` cell (:meth:`flair_nbddp.WorkerPool.exec` returns one per rank).

    Attributes:
        rank: the rank.
        ran: False for a rank the cell was not run on (``ranks=``).
        value: the value of the cell's last expression on this rank (a flair model arrives on CPU).
        error: the :class:`~flair_nbddp.WorkerError` the cell raised on this rank (its remote traceback
            included; ``error.exc_type == "KeyboardInterrupt"`` after an interrupt), else None.
    """

    rank: int
    ran: bool
    value: Any = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        """The cell ran on this rank without raising."""
        return self.ran and self.error is None

    @property
    def interrupted(self) -> bool:
        """An interrupt stopped the cell on this rank (its ``error`` is a ``KeyboardInterrupt``)."""
        return self.error is not None and self.error.exc_type == "KeyboardInterrupt"


def results_of(outcomes: list[RankOutcome]) -> list[RankResult]:
    """The notebook's view of the outcomes rank 0 gathered: values unpacked, errors as WorkerErrors."""
    results = []
    for outcome in outcomes:
        value, error = None, None
        if outcome.error_type:
            error = WorkerError(outcome.rank, outcome.error_type, outcome.error, outcome.traceback)
        elif outcome.value is not None:
            try:
                value = payload.read_value(outcome.value)
            except Exception as failure:  # noqa: BLE001 - e.g. a class only the workers can import
                message = f"the value came back but cannot be unpacked in the notebook ({type(failure).__name__}: {failure})"
                error = WorkerError(outcome.rank, "ShippingError", message)
        results.append(RankResult(outcome.rank, outcome.ran, value, error))
    return results


def names_held(outcomes: list[RankOutcome]) -> set[str]:
    """The names every rank's namespace holds after a cell (a later cell reads them there, unshipped)."""
    return set.intersection(*(set(outcome.names) for outcome in outcomes)) if outcomes else set()
