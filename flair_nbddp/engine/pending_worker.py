"""A CPU rank whose fork server is still importing torch and flair: the launch goes on, the rank starts later.

A notebook's first CPU launch starts its fork server (:mod:`flair_nbddp.engine.forkserver`). Starting the ranks afresh
beside it would import torch and flair three times at once (on a 2-core machine, the ranks wait for all three);
waiting for the server in the launch call would hold a Train click or a launch cell for those seconds. Instead
each rank is a :class:`PendingWorker`: the launch call returns at once with its channel open (messages wait in
the socket), and a thread forks the rank as soon as the server is ready. If the server exits first, or is not
ready in :data:`READY_TIMEOUT_SECONDS`, the rank starts afresh, and its log says why.

Example::

    worker = PendingWorker(server, fork=lambda: server.fork(env, cwd, fds)[0], fresh=start_afresh,
                           note=lambda text: print(text, file=log), release=close_fds)
    worker.poll()         # None: pending or running, as for a process
    signal_group(worker, signal.SIGTERM)  # before it started: it never starts
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


READY_TIMEOUT_SECONDS = 120.0  # a server importing longer than this is passed by: the rank starts afresh


class _Server(Protocol):
    ready: bool

    def wait_ready(self, timeout: float) -> None: ...


class PendingWorker:
    """A rank that starts once its fork server is ready, with the part of :class:`subprocess.Popen`'s interface
    the kit uses. ``fork()`` forks it from the server, ``fresh()`` starts it afresh (after ``note(why)``);
    ``release()`` closes the descriptors both were given, once either ran or the rank was cancelled."""

    def __init__(
        self, server: _Server, fork: Callable[[], Any], fresh: Callable[[], Any], note: Callable[[str], None],
        release: Callable[[], None],
    ) -> None:  # fmt: skip
        self._server, self._fork, self._fresh, self._note, self._release = server, fork, fresh, note, release
        self._lock = threading.Lock()
        self._settled = threading.Event()  # it started, could not start, or was cancelled
        self._process: Any = None
        self._code: int | None = None  # its exit code if it never started
        threading.Thread(target=self._start, name="flair_nbddp-pending-rank", daemon=True).start()

    def _start(self) -> None:
        self._server.wait_ready(READY_TIMEOUT_SECONDS)
        with self._lock:
            if self._settled.is_set():  # cancelled meanwhile
                return
            try:
                self._process = self._started()
            finally:
                self._settle()

    def _settle(self) -> None:
        """(With the lock held.) Started, could not start, or cancelled: its descriptors are closed here."""
        self._release()
        self._settled.set()

    def _started(self) -> Any:
        if self._server.ready:
            try:
                return self._fork()
            except OSError as error:  # a ForkServerError, or the request could not reach the server
                self._note(f"the fork server could not start this worker ({error}): it starts afresh")
        else:
            self._note("the fork server exited or was not ready in time: this worker starts afresh, importing torch "
                       "and flair")  # fmt: skip
        try:
            return self._fresh()
        except OSError as error:
            self._note(f"this worker could not be started: {error}")
            self._code = 1
            return None

    @property
    def pid(self) -> int | None:
        """The process's id once it started (waiting for that); None if it never did."""
        self._settled.wait()
        return self.started_pid

    @property
    def started_pid(self) -> int | None:
        """The process's id if it has started, without waiting: None while it is pending or if it never started."""
        return None if self._process is None else self._process.pid

    def poll(self) -> int | None:
        return self._code if self._process is None else self._process.poll()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._settled.wait(timeout):
            raise subprocess.TimeoutExpired("flair_nbddp worker (not started yet)", timeout or 0.0)
        if self._process is None:
            return self._code  # type: ignore[return-value]
        return self._process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def send_signal(self, sig: int) -> None:
        """Signal the process; one that ends it (``SIGTERM``, ``SIGKILL``) keeps a rank not started from starting."""
        self._signal(sig, lambda process: process.send_signal(sig))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def cancel(self) -> None:
        """Keep it from starting if it has not yet (its exit code is then ``-SIGTERM``); a process is left alone."""
        self._signal(signal.SIGTERM, lambda process: None)

    def _signal(self, sig: int, send: Callable[[Any], None]) -> None:
        with self._lock:
            if self._process is None:
                if not self._settled.is_set() and sig in (signal.SIGTERM, signal.SIGKILL):
                    self._code = -sig  # as if it started and the signal ended it
                    self._settle()
                return
        with contextlib.suppress(ProcessLookupError):
            send(self._process)


def signal_group(process: Any, sig: int) -> None:
    """Send ``sig`` to a worker's process group (a worker has a session of its own, which its children share). A
    :class:`PendingWorker` not started yet is kept from starting by ``SIGTERM`` or ``SIGKILL``.

    Example::

        signal_group(group.processes[0], signal.SIGTERM)
    """
    if isinstance(process, PendingWorker):
        process._signal(sig, lambda started: signal_group(started, sig))
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
