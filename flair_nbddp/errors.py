"""Exceptions a run raises in the notebook."""

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


class WorkerError(RuntimeError):
    """A worker rank failed; the run was ended on every rank.

    Attributes:
        rank: the rank that failed first.
        exc_type: the remote exception's type name (``""`` if the process died without one).
        remote_traceback: the traceback formatted in the worker.
        exit_code: the process's exit status (negative: killed by that signal).
        log_path: the rank's full output.

    Example:
        >>> try:
        ...     raise WorkerError(1, "ValueError", "bad label", "Traceback ...", log_path="/tmp/rank1.log")
        ... except WorkerError as error:
        ...     error.rank
        1
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
        return type(self), (self.rank, self.exc_type, self.message, self.remote_traceback, self.exit_code, self.log_path)


class RunTimeoutError(TimeoutError):
    """The run took longer than its ``timeout``; every worker was ended."""


class RunHangError(RuntimeError):
    """No rank made progress for ``hang_timeout`` seconds; the message holds every rank's Python stack."""
