"""Every exception the kit raises: one family under :class:`FlairNbddpError`.

Each class also derives from the builtin exception callers would expect (``ShippingError`` is a
``TypeError``, ``ConfigurationError`` a ``ValueError``...), so ``except ValueError`` keeps working. The
magics report a mistake in their options or cell as IPython's own ``UsageError``: IPython shows only that
exact class as one line without a traceback.

Example:
    >>> issubclass(ShippingError, TypeError) and issubclass(ShippingError, FlairNbddpError)
    True
    >>> try:
    ...     raise WorkerError(1, "ValueError", "bad label", "Traceback ...", log_path="/tmp/rank1.log")
    ... except FlairNbddpError as error:
    ...     error.rank
    1
"""

from __future__ import annotations

import signal


def describe_exit(exit_code: int | None) -> str:
    """``-9`` → ``"killed by signal SIGKILL"``; ``1`` → ``"exited with code 1"``."""
    if exit_code is None:
        return "is still running"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = str(-exit_code)
        return f"was killed by signal {name}"
    return f"exited with code {exit_code}"


class FlairNbddpError(Exception):
    """Base of every exception flair_nbddp raises."""


# -- before anything runs: the input ----------------------------------------------------------------
class ConfigurationError(FlairNbddpError, ValueError):
    """An option, argument or environment variable that cannot work; the message names it and the fix."""


class DeviceError(ConfigurationError):
    """Impossible devices or process counts, or ones a warm pool does not have."""


class UnknownOptionError(FlairNbddpError, TypeError):
    """A keyword that is not a run option (:class:`~flair_nbddp.RunOptions`); the message suggests the closest."""


class NotCallableError(FlairNbddpError, TypeError):
    """The function to run on every rank is not callable."""


class ShippingError(FlairNbddpError, TypeError):
    """Something the run needs cannot be sent to the workers (or back); the message names it."""


class UnsupportedContentError(FlairNbddpError, TypeError):
    """The corpus codec cannot keep this object exactly; it travels by cloudpickle instead."""


class PayloadWriteError(FlairNbddpError, OSError):
    """The run's payload could not be written (e.g. the disk is full); nothing was started."""


class ForkServerError(FlairNbddpError, OSError):
    """The fork server could not fork a CPU worker (it exited, or did not answer): the worker starts afresh."""


class MissingDependencyError(FlairNbddpError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra to install."""


class ClusterError(FlairNbddpError, RuntimeError):
    """A Dask cluster cannot take the run: unreachable, too few workers for the ranks asked, or workers
    without the kit; the message says what the cluster has and what to change."""


class UnsupportedPlatformError(FlairNbddpError, RuntimeError):
    """The workers need POSIX (process groups, ``SIGUSR1``, inherited descriptors): Windows is refused at launch."""


class DashboardUnavailableError(FlairNbddpError, RuntimeError):
    """``dashboard=True`` where no Jupyter kernel with ipywidgets can show it."""


# -- runs and pools in the wrong state ------------------------------------------------------------
class RunActiveError(FlairNbddpError, RuntimeError):
    """Another active run holds a device the run asks for (a GPU, CPU process slots, a Dask worker), in this kernel or
    in another process of the machine, or no device is free: the message names the holder (user, process, notebook,
    since when). Runs on disjoint devices go side by side; ``wait_for_devices=S`` waits for busy ones."""


class RunStateError(FlairNbddpError, RuntimeError):
    """A :class:`~flair_nbddp.Run` was asked for something its state does not allow (e.g. ``wait`` before ``start``)."""


class StillRunningError(FlairNbddpError, TimeoutError):
    """A ``wait(timeout=...)`` gave up; the run goes on."""


class PoolClosedError(FlairNbddpError, RuntimeError):
    """The :class:`~flair_nbddp.WorkerPool` was closed; start a new one."""


# -- the run ledger -------------------------------------------------------------------------------
class LedgerError(FlairNbddpError, RuntimeError):
    """The run ledger (``runs.sqlite``) cannot be read or written; the message names the file, the cause and
    the way out. Reading it (:func:`flair_nbddp.history`) raises this; a run only warns (:class:`LedgerWarning`).
    ``busy``: another process kept the file locked (trying again later may work)."""

    busy = False


class LedgerWarning(FlairNbddpError, UserWarning):
    """A run could not be recorded in the ledger (an unwritable or damaged file): it goes on, unrecorded."""


# -- inside the workers ---------------------------------------------------------------------------
class PoolRefError(FlairNbddpError, RuntimeError):
    """A :class:`~flair_nbddp.PoolRef` that was released, or whose pool was closed, was given to a run."""


class CheckpointWriteError(FlairNbddpError, OSError):
    """A full checkpoint could not be written (a full disk, a directory gone); the message names the file."""


class PredictionsWriteError(FlairNbddpError, OSError):
    """The JSON Lines file of :func:`flair_nbddp.predict` could not be written (a full disk, a quota); the message
    names the file and how many rows it holds."""


class ResumeError(ConfigurationError):
    """A run cannot resume from the run it names: no checkpoint, another function or corpus, a changed file, or
    another number of processes; the message says which and the fix."""


class CorpusMismatchError(FlairNbddpError, RuntimeError):
    """The corpus bytes a worker read differ from the ones the notebook packed."""


class MissingMultiGpuError(FlairNbddpError, RuntimeError):
    """``.train()``/``.fine_tune()`` was called without ``multi_gpu=True`` in a run of several processes."""


class EvaluationShareError(FlairNbddpError, RuntimeError):
    """flair's ``evaluate`` did not take the shared-out batches it was given (a flair change the kit does not know);
    ``distributed_eval=False`` evaluates as flair does."""


class HealthCheckError(FlairNbddpError, RuntimeError):
    """The all-reduce every job starts with did not add up: the process group is broken."""


# -- a run that failed ----------------------------------------------------------------------------
class RunError(FlairNbddpError):
    """A run failed on its workers. In IPython the cell shows this message alone (the remote traceback and
    the log path it holds), not the kit's own frames that waited for the workers."""

    def _render_traceback_(self) -> list[str]:
        return f"{type(self).__name__}: {self}".splitlines()


class WorkerError(RunError, RuntimeError):
    """A worker rank failed; the run was ended on every rank (for ``%%ddp_exec``, one rank's error in its cell:
    the other ranks and their namespaces go on).

    Attributes:
        rank: the rank that failed first.
        exc_type: the remote exception's type name (``""`` if the process died without one).
        remote_traceback: the traceback formatted in the worker.
        exit_code: the process's exit status (negative: killed by that signal).
        log_path: the rank's full output.
        result: the failed run's :class:`~flair_nbddp.RunResult` (logs, metrics), once the run has ended.

    Example:
        >>> error = WorkerError(1, "ValueError", "bad label", "Traceback ...", log_path="/tmp/rank1.log")
        >>> print("\\n".join(error._render_traceback_()))
        WorkerError: rank 1 failed: ValueError: bad label
        <BLANKLINE>
        --- traceback on rank 1 ---
        Traceback ...
        <BLANKLINE>
        full output of rank 1: /tmp/rank1.log
    """

    def __init__(
        self,
        rank: int,
        exc_type: str,
        message: str,
        remote_traceback: str = "",
        exit_code: int | None = None,
        log_path: str = "",
    ) -> None:
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, remote_traceback
        self.message, self.exit_code, self.log_path = message, exit_code, log_path
        cause = f"{exc_type}: {message}" if exc_type else message
        text = f"rank {rank} failed: {cause}"
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        if log_path:
            text += f"\n\nfull output of rank {rank}: {log_path}"
        super().__init__(text)

    def __reduce__(self):
        fields = (self.rank, self.exc_type, self.message, self.remote_traceback, self.exit_code, self.log_path)
        return type(self), fields


class OutOfMemoryError(WorkerError, MemoryError):
    """A rank ran out of GPU (or host) memory; the run was ended on every rank. The message names the rank, the
    batch it was on, ``mini_batch_size`` and ``mini_batch_chunk_size``, the memory in use and the fix.

    Attributes:
        memory: what the rank reported: ``device``, ``in_use_gib``, ``total_gib``, ``mini_batch_size``,
            ``mini_batch_chunk_size``, ``epoch``, ``batch`` (those it knew).

    Example:
        >>> error = OutOfMemoryError(1, "OutOfMemoryError", "CUDA out of memory", memory={
        ...     "device": "cuda:1", "in_use_gib": 78.9, "total_gib": 79.6, "mini_batch_size": 32,
        ...     "mini_batch_chunk_size": None, "epoch": 3, "batch": 17})
        >>> print(str(error).splitlines()[0])
        rank 1 failed: OutOfMemoryError: CUDA out of memory
        >>> print(str(error).splitlines()[2])
        rank 1 ran out of memory on cuda:1 in epoch 3, batch 17, with mini_batch_size=32 and mini_batch_chunk_size=None; 78.9 of 79.6 GiB were in use.
    """

    def __init__(
        self, rank: int, exc_type: str, message: str, remote_traceback: str = "", exit_code: int | None = None,
        log_path: str = "", memory: dict | None = None,
    ) -> None:  # fmt: skip
        self.memory = dict(memory or {})
        super().__init__(rank, exc_type, f"{message}\n\n{_out_of_memory_advice(rank, self.memory)}",
                         remote_traceback, exit_code, log_path)  # fmt: skip
        self.message = message

    def __reduce__(self):
        fields = (self.rank, self.exc_type, self.message, self.remote_traceback, self.exit_code, self.log_path)
        return type(self), (*fields, self.memory)


def _out_of_memory_advice(rank: int, memory: dict) -> str:
    """What ran out, where, and the fix (a smaller chunk keeps the effective batch and so the schedule)."""
    where = f" on {memory['device']}" if memory.get("device") else ""
    when = f" in epoch {memory['epoch']}, batch {memory['batch']}," if memory.get("epoch") else ""
    batch, chunk = memory.get("mini_batch_size"), memory.get("mini_batch_chunk_size")
    sizes = f" with mini_batch_size={batch} and mini_batch_chunk_size={chunk}" if batch else ""
    held = ""
    if memory.get("in_use_gib") is not None:
        held = f"; {memory['in_use_gib']:.1f} of {memory['total_gib']:.1f} GiB were in use"
    smaller = max(1, (chunk or batch or 2) // 2)
    return (
        f"rank {rank} ran out of memory{where}{when}{sizes}{held}.\n"
        f"Fix: pass mini_batch_chunk_size={smaller} to train()/fine_tune(): each batch is computed in pieces of "
        "that size, the same effective batch (and so the same schedule) with less memory at once; or lower "
        "mini_batch_size, or free the memory other programs hold."
    )


class RunTimeoutError(RunError, TimeoutError):
    """The run took longer than its ``timeout``; every worker was ended."""


class RunHangError(RunError, RuntimeError):
    """No rank made progress for ``hang_timeout`` seconds; the message holds every rank's Python stack."""
