"""The thread that watches one run's ranks, and what it concludes when the run is over.

The :class:`Supervisor` drains every rank's events and output (:mod:`~flair_nbddp.engine.rank_output`) into the run's
:class:`~flair_nbddp.engine.state.RunState`. It ends every rank as soon as one fails, and enforces the run's
:class:`Limits` (the timeout, the grace period of a stop, the hang watchdog), so no rank is ever left
waiting in a collective. Once the ranks are done, :meth:`Supervisor.failure` says what went wrong, if
anything, naming the rank and its log.
"""

from __future__ import annotations

from collections.abc import Callable

import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from ..errors import OutOfMemoryError, RunHangError, RunTimeoutError, WorkerError
from .local_ranks import TERMINATE_GRACE_SECONDS
from .rank_output import RankOutput
from .recorder import RunRecorder
from .rundir import RunDir
from .state import RunState, Snapshot
from ..wire.events import STOP, Failed
from .worker_source import RankGroup

POLL_SECONDS = 0.1


@dataclass(frozen=True)
class Limits:
    """How long a run may take (None: no limit), how long a graceful stop may take, and how long every rank
    may go without progress before the run counts as hung (None: no watchdog)."""

    timeout: float | None
    stop_timeout: float
    hang_timeout: float | None


class Supervisor:
    """Watches ``group`` running one job, from a daemon thread, until every rank finished or is gone."""

    def __init__(
        self, group: RankGroup, state: RunState, limits: Limits, run_dir: RunDir, output: RankOutput,
        recorder: RunRecorder | None = None, on_done: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.group, self.state, self.limits, self.run_dir = group, state, limits, run_dir
        self._on_done = on_done  # called on the watching thread once every rank finished or is gone
        self._recorder = recorder  # the run ledger's, fed the metrics in batches
        self.done = threading.Event()
        self.ended_by: str | None = None  # "timeout", "hang" or "stop" once the supervisor ended the ranks
        self._stop_deadline: float | None = None
        self._stacks: dict[int, str] = {}
        self._first_death: int | None = None  # the rank that died on its own before anyone was ended
        self._output = output  # what the ranks print, from where this run's output begins
        self._thread = threading.Thread(target=self._watch, name="flair_nbddp-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        """The watching thread was started."""
        return self._thread.ident is not None

    # -- watching ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        open_connections = {connection: rank for rank, connection in enumerate(self.group.connections)}
        while open_connections and not self.state.all_finished():
            failed = False
            for connection in wait(list(open_connections), timeout=POLL_SECONDS):
                try:
                    event = connection.recv()
                except (EOFError, OSError):
                    self._rank_closed(open_connections.pop(connection))
                    continue
                self.state.apply(event)
                failed = failed or isinstance(event, Failed)
            if failed:  # after every channel that was ready: a rank killed by a signal closed its own meanwhile
                self._blame_signal_deaths()
                self.group.terminate()
            self._output.read(self.state)
            self._enforce_limits()
            if self._recorder is not None:
                self._recorder.flush(self.state)
        self._output.read(self.state, final=True)
        self.done.set()
        if self._on_done is not None:
            self._on_done()

    def _enforce_limits(self) -> None:
        """End the run when its timeout, the stop grace period or the hang watchdog says so."""
        if self.ended_by is not None:
            return
        now, limits = time.time(), self.limits
        if limits.timeout is not None and now > self.state.started_at + limits.timeout:
            self.ended_by = "timeout"
        elif self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
            self.ended_by = "stop"
        elif limits.hang_timeout is not None and self.state.all_stalled(since=now - limits.hang_timeout):
            self._stacks = self.group.collect_stacks()
            self.ended_by = "hang"
        if self.ended_by is not None:
            self.group.terminate()

    def _rank_closed(self, rank: int) -> None:
        """A rank's channel closed: its process is exiting. Reap it; end the others if it died early."""
        exit_code = self.group.wait_exit(rank, TERMINATE_GRACE_SECONDS)
        if exit_code is None:  # it closed its channel but lives on
            self.group.terminate()
            exit_code = self.group.wait_exit(rank, TERMINATE_GRACE_SECONDS)
        self.state.rank_exited(rank, exit_code)
        if exit_code != 0 and not self.group.terminating and self._first_death is None:
            self._first_death = rank
            self.group.terminate()

    def _blame_signal_deaths(self) -> None:
        """A rank killed by a signal (e.g. the OOM killer) makes its peers fail in a collective: blame it."""
        if self.group.terminating:  # a signal we sent ourselves after an earlier failure is not a cause
            return
        for rank, exit_code in self.group.dead_ranks().items():
            if exit_code < 0 and self._first_death is None:
                self._first_death = rank
                self.state.rank_exited(rank, exit_code)

    # -- ending -----------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask every rank to stop after the current batch; they are ended if not done within the stop timeout."""
        if self._stop_deadline is not None or self.done.is_set():
            return
        self._stop_deadline = time.monotonic() + self.limits.stop_timeout
        self.state.request_stop()
        self.group.send_all(STOP)

    def end_now(self) -> None:
        """End every rank at once (SIGTERM, SIGKILL after a second) and wait for the watch to conclude."""
        self.ended_by = self.ended_by or "stop"  # before anyone waiting wakes up to conclude the run
        self.group.terminate(grace=1.0)
        self.done.wait(TERMINATE_GRACE_SECONDS * 2)

    def failure(self) -> Exception | None:
        """Why the run failed (the first cause), or None if it finished or was stopped."""
        snapshot = self.state.snapshot()
        if self.ended_by == "timeout":
            return RunTimeoutError(
                f"the run exceeded timeout={self.limits.timeout} s and every worker was ended; "
                f"logs: {self.run_dir.path}"
            )
        if self.ended_by == "hang":
            return self._hang_error(snapshot)
        if self._first_death is not None:
            dead = snapshot.ranks[self._first_death]
            return WorkerError(
                dead.rank, "", f"{self.group.describe_exit(dead.rank, dead.exit_code)} without reporting an error",
                exit_code=dead.exit_code, log_path=str(self.run_dir.log(dead.rank)),
            )  # fmt: skip
        if snapshot.failure is not None:
            failure = snapshot.failure
            details = (failure.rank, failure.exc_type, failure.message, failure.traceback,
                       snapshot.ranks[failure.rank].exit_code, str(self.run_dir.log(failure.rank)))  # fmt: skip
            if failure.memory is not None:
                return OutOfMemoryError(*details, memory=failure.memory)
            return WorkerError(*details)
        if self.ended_by == "stop":
            return None
        if not self.state.all_finished() or self.state.result_path is None:
            return WorkerError(
                0, "", "the workers exited without returning a result", log_path=str(self.run_dir.log(0))
            )
        return None

    def _hang_error(self, snapshot: Snapshot) -> RunHangError:
        stuck = min(snapshot.ranks, key=lambda rank: rank.last_progress)
        stacks = "\n".join(f"--- rank {rank} ---\n{text.strip()}" for rank, text in sorted(self._stacks.items()))
        return RunHangError(
            f"no rank made progress for {self.limits.hang_timeout:.0f} s (rank {stuck.rank} stalled first, at step "
            f"{stuck.step}); every worker was ended. Python stacks at that moment:\n{stacks}\n"
            f"Raise hang_timeout= if a step can legitimately take that long. Logs: {self.run_dir.path}"
        )
