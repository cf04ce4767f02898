"""Watching, stopping and ending one run; ``launch`` and ``launch_distributed``.

One :class:`Run` per launch. The parent packs the call once into the run's private directory and hands
it to a :class:`~flair_nbddp.group.WorkerGroup` (fresh, or a warm pool's). One supervisor thread drains
every rank's events and the tail of rank 0's log into a :class:`~flair_nbddp.state.RunState`; it ends
every rank as soon as one fails, and enforces the stop grace period, the timeout and the hang watchdog,
so no rank is ever left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from . import payload
from .devices import DevicePlan, resolve_devices
from .errors import RunHangError, RunTimeoutError, WorkerError, describe_exit
from .events import STOP, Failed
from .group import TERMINATE_GRACE_SECONDS, WorkerGroup
from .result import RunResult
from .state import RunState

if TYPE_CHECKING:
    from .pool import WorkerPool

RUNS_ENV = "FLAIR_NBDDP_RUNS"
SEED_ENV = "FLAIR_NBDDP_SEED"
DEFAULT_STOP_TIMEOUT = 30.0
DEFAULT_HANG_TIMEOUT = 300.0
_RUNS: list[Run] = []  # every run started in this process, oldest first (for %ddp_info)


def default_seed() -> int:
    """``$FLAIR_NBDDP_SEED`` when set (reproducible runs without editing a notebook), else a random seed.

    Example:
        >>> os.environ["FLAIR_NBDDP_SEED"] = "7"
        >>> default_seed()
        7
    """
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        return random.randrange(2**31)
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{SEED_ENV}={value!r} is not a whole number: set it to one (e.g. 0), or unset it for a random seed per run"
        ) from None


def runs_root() -> Path:
    """Where run directories go: ``$FLAIR_NBDDP_RUNS``, else ``<tmp>/flair_nbddp-<uid>`` (mode 0700)."""
    root = Path(os.environ.get(RUNS_ENV) or Path(tempfile.gettempdir()) / f"flair_nbddp-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    return root


class _LogTail:
    """Incremental reader of a growing log file, yielding whole lines (a tqdm ``\\r`` keeps its last state)."""

    def __init__(self, path: Path) -> None:
        self._path, self._partial = path, b""
        self._offset = path.stat().st_size if path.exists() else 0  # a warm worker's log holds earlier jobs

    def read_lines(self, final: bool = False) -> list[str]:
        try:
            with open(self._path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        if final and self._partial:
            complete, self._partial = [*complete, self._partial], b""
        return [line.decode("utf-8", "replace").rsplit("\r", 1)[-1] for line in complete]


class Run:
    """One distributed execution of ``fn(*args, **kwargs)``: start it, watch it, stop it, end it.

    Most users call :func:`launch`; a ``Run`` is for code that must not block (a widget panel)::

        run = Run(train, (corpus,), {}, resolve_devices("cpu", 2)).start()
        run.state.snapshot().status      # "starting", "running", ...
        run.stop()                       # graceful: every rank stops after the same batch
        result = run.wait()              # RunResult, also when the run failed or was stopped
    """

    def __init__(
        self,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        plan: DevicePlan,
        *,
        seed: int | None = None,
        timeout: float | None = None,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
        run_dir: str | Path | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable (a function to run on every rank), not {type(fn).__name__}")
        self.fn, self.args, self.kwargs, self.plan = fn, tuple(args), dict(kwargs or {}), plan
        self.seed = default_seed() if seed is None else int(seed)
        self.timeout, self.stop_timeout, self.hang_timeout = timeout, stop_timeout, hang_timeout
        self.pool = pool
        if pool is not None:
            run_dir = pool.run_dir
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="run-", dir=runs_root()))
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.state = RunState(world_size=plan.world_size, device_type=plan.device_type)
        self.new_log_lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        job_name = f"job{time.time_ns()}"
        self._payload_path = self.run_dir / f"{job_name}-payload.pkl"
        self._result_path = self.run_dir / f"{job_name}-result.pkl"
        self.group: WorkerGroup | None = None
        self._done = threading.Event()
        self._ended_by: str | None = None  # "timeout", "hang" or "stop" when the supervisor ended the workers
        self._stop_deadline: float | None = None
        self._stacks: dict[int, str] = {}
        self._first_death: int | None = None  # the rank that died on its own before we ended anyone
        self._supervisor: threading.Thread | None = None
        self._result: RunResult | None = None

    @property
    def log_files(self) -> dict[int, Path]:
        """Each rank's full output (in a pool: every job's, this one's at the end)."""
        return {rank: self.run_dir / f"rank{rank}.log" for rank in range(self.plan.world_size)}

    # -- starting ---------------------------------------------------------------------------------
    def start(self) -> Run:
        """Pack the call, hand it to every rank and start the supervisor thread; returns at once.

        Raises:
            RuntimeError: another run of this process is still active (runs share the devices).
            ShippingError: ``fn`` or an argument cannot be pickled (nothing was started).
        """
        active = [run for run in _RUNS if run.active]
        if active:
            since = time.strftime("%H:%M:%S", time.localtime(active[0].state.started_at))
            raise RuntimeError(
                f"another run is still active in this kernel (started {since}, status "
                f"{active[0].state.snapshot().status}); both would compete for the same devices. "
                "Wait for it to end, or stop it first (run.stop() or the dashboard's Stop)."
            )
        payload.write_payload(self._payload_path, self.fn, self.args, self.kwargs)
        job = {"payload": str(self._payload_path), "result": str(self._result_path), "seed": self.seed}
        tail = _LogTail(self.log_files[0])
        if self.pool is not None:
            self.group = self.pool.submit(job)
        else:
            self.group = WorkerGroup(self.plan, self.run_dir).start(job, stay=False)
        try:
            _RUNS.append(self)
            self._supervisor = threading.Thread(
                target=self._supervise, args=(tail,), name="flair_nbddp-supervisor", daemon=True
            )
            self._supervisor.start()
        except BaseException:  # an interrupt right here must not leave workers or channels behind
            self.group.terminate()
            if self.pool is None and not (self._supervisor and self._supervisor.is_alive()):
                self.group.close_channels()  # else the supervisor's run is ended by whoever started it
            raise
        return self

    @property
    def active(self) -> bool:
        """True from ``start()`` until the job is over and its result collected."""
        return self._supervisor is not None and self._result is None and self.state.ended_at is None

    # -- watching ---------------------------------------------------------------------------------
    def _supervise(self, tail: _LogTail) -> None:
        group = self.group
        open_connections = {connection: rank for rank, connection in enumerate(group.connections)}
        while open_connections and not self.state.all_finished():
            for connection in wait(list(open_connections), timeout=0.1):
                try:
                    event = connection.recv()
                except (EOFError, OSError):
                    self._rank_closed(open_connections.pop(connection))
                    continue
                self.state.apply(event)
                if isinstance(event, Failed):
                    self._blame_signal_deaths()
                    group.terminate()
            self._publish_log(tail.read_lines())
            self._enforce_limits()
        self._publish_log(tail.read_lines(final=True))
        self._done.set()

    def _enforce_limits(self) -> None:
        """End the run when its timeout, the stop grace period or the hang watchdog says so."""
        if self._ended_by is not None:
            return
        now = time.time()
        if self.timeout is not None and now > self.state.started_at + self.timeout:
            self._ended_by = "timeout"
        elif self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
            self._ended_by = "stop"
        elif self.hang_timeout is not None:
            alive = [rank for rank in self.state.snapshot().ranks if rank.alive]
            if alive and all(now - rank.last_progress > self.hang_timeout for rank in alive):
                self._stacks = self.group.collect_stacks()
                self._ended_by = "hang"
        if self._ended_by is not None:
            self.group.terminate()

    def _publish_log(self, lines: list[str]) -> None:
        self.state.add_log_lines(lines)
        for line in lines:
            self.new_log_lines.put(line)

    def _rank_closed(self, rank: int) -> None:
        """A rank's channel closed: its process is exiting. Reap it; end the others if it died early."""
        process = self.group.processes[rank]
        try:
            exit_code = process.wait(timeout=TERMINATE_GRACE_SECONDS)
        except subprocess.TimeoutExpired:  # it closed its channel but lives on
            self.group.terminate()
            exit_code = process.wait()
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

    # -- stopping and ending ----------------------------------------------------------------------
    def stop(self) -> None:
        """Ask every rank to stop gracefully after the current batch; returns at once.

        flair then saves ``final-model.pt`` in its ``base_path`` (the result's ``checkpoint``) and returns,
        skipping its final test evaluation. Ranks not inside flair training by ``stop_timeout`` seconds are ended.
        """
        if self._stop_deadline is not None or self._done.is_set() or self.group is None:
            return
        self._stop_deadline = time.monotonic() + self.stop_timeout
        self.state.request_stop()
        self.group.send_all(STOP)

    def _first_failure(self) -> Exception | None:
        snapshot = self.state.snapshot()
        if self._ended_by == "timeout":
            return RunTimeoutError(
                f"the run exceeded timeout={self.timeout} s and every worker was ended; logs: {self.run_dir}"
            )
        if self._ended_by == "hang":
            return self._hang_error(snapshot)
        if self._first_death is not None:
            dead = snapshot.ranks[self._first_death]
            return WorkerError(
                dead.rank, "", f"the worker process {describe_exit(dead.exit_code)} without reporting an error",
                exit_code=dead.exit_code, log_path=str(self.log_files[dead.rank]),
            )
        if snapshot.failure is not None:
            failure = snapshot.failure
            return WorkerError(
                failure.rank, failure.exc_type, failure.message, failure.traceback,
                snapshot.ranks[failure.rank].exit_code, str(self.log_files[failure.rank]),
            )
        if self._ended_by == "stop":
            return None
        if not self.state.all_finished() or self.state.result_path is None:
            return WorkerError(0, "", "the workers exited without returning a result", log_path=str(self.log_files[0]))
        return None

    def _hang_error(self, snapshot: Any) -> RunHangError:
        stuck = min(snapshot.ranks, key=lambda rank: rank.last_progress)
        stacks = "\n".join(f"--- rank {rank} ---\n{text.strip()}" for rank, text in sorted(self._stacks.items()))
        return RunHangError(
            f"no rank made progress for {self.hang_timeout:.0f} s (rank {stuck.rank} stalled first, at step "
            f"{stuck.step}); every worker was ended. Python stacks at that moment:\n{stacks}\n"
            f"Raise hang_timeout= if a step can legitimately take that long. Logs: {self.run_dir}"
        )

    def kill(self) -> RunResult:
        """End every worker now (SIGTERM, then SIGKILL after a second) and collect what there is."""
        self.group.terminate(grace=1.0)
        self._done.wait(TERMINATE_GRACE_SECONDS * 2)
        self._ended_by = self._ended_by or "stop"
        return self._finish()

    def wait(self, echo: bool = False, on_tick: Callable[[], None] | None = None) -> RunResult:
        """Block until the run ends; with ``echo``, print rank 0's output lines as they arrive.

        ``on_tick`` is called on this thread about every 0.1 s (a text view prints progress from it).
        A first ``KeyboardInterrupt`` (the kernel's Interrupt) stops the run gracefully and keeps waiting;
        a second one ends every worker at once and propagates.
        """
        while True:
            try:
                while not self._done.wait(0.1):
                    self._echo(echo)
                    if on_tick is not None:
                        on_tick()
                break
            except KeyboardInterrupt:
                if self._stop_deadline is None:
                    print(
                        "flair_nbddp: stopping after the current batch on every rank and saving the model "
                        "(interrupt again to end the workers now)",
                        flush=True,
                    )
                    self.stop()
                    continue
                self.kill()
                raise
        self._echo(echo)
        return self._finish()

    def _echo(self, echo: bool) -> None:
        while True:
            try:
                line = self.new_log_lines.get_nowait()
            except queue.Empty:
                return
            if echo:
                print(line, flush=True)

    def _finish(self) -> RunResult:
        if self._result is not None:
            return self._result
        error = self._first_failure()
        stopped = error is None and (self._ended_by == "stop" or self.state.stop_requested)
        value = None
        if error is None and self.state.result_path is not None:
            value = payload.read_result(self._result_path)
        self.state.end("failed" if error else "stopped" if stopped else "finished")
        try:
            self._release_workers(clean=error is None and not stopped)
        except KeyboardInterrupt:
            pass  # it came after the run had ended (the release still completed): the result stands
        snapshot = self.state.snapshot()
        self._result = RunResult(
            value=value,
            status=snapshot.status,
            world_size=self.plan.world_size,
            device_type=self.plan.device_type,
            backend=self.plan.backend,
            elapsed=snapshot.elapsed,
            time_to_first_batch=(
                None if snapshot.first_batch_at is None else snapshot.first_batch_at - snapshot.started_at
            ),
            samples_per_second=snapshot.samples_per_second,
            log="\n".join(snapshot.log_lines),
            metrics=list(snapshot.metrics),
            ranks=list(snapshot.ranks),
            seed=self.seed,
            run_dir=self.run_dir,
            log_files=self.log_files,
            checkpoint=Path(snapshot.checkpoint) if snapshot.checkpoint else None,
            error=error,
        )
        if error is not None:
            error.result = self._result
        return self._result

    def _release_workers(self, clean: bool) -> None:
        """A cold run's workers exit; a pool keeps them after a clean job and recycles them otherwise."""
        try:
            if self.pool is not None:
                self.pool.job_ended(clean, reason=self.state.snapshot().status)
            else:
                self.group.close(grace=TERMINATE_GRACE_SECONDS)
        finally:
            for path in (self._payload_path, self._result_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


def runs() -> list[Run]:
    """Every run started in this process (this kernel), oldest first."""
    return list(_RUNS)


def launch(
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    processes: int | None = None,
    device: str | None = None,
    timeout: float | None = None,
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
    seed: int | None = None,
    dashboard: bool | None = None,
    run_dir: str | Path | None = None,
    pool: WorkerPool | None = None,
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on one process per device and return a :class:`RunResult`.

    ``fn`` may be defined in a notebook cell, close over notebook variables, and receive a flair corpus
    built in the notebook; it runs inside an initialised process group, so flair's
    ``.train(..., multi_gpu=True)`` works in it.

    Interrupting the kernel (or ``Stop``) stops gracefully: every rank stops after the same batch, flair
    saves ``final-model.pt``, and ``launch`` *returns* a result with ``status == "stopped"`` and its
    ``checkpoint``. A second interrupt ends the workers at once and raises ``KeyboardInterrupt``.

    Args:
        fn: the function every rank runs.
        args, kwargs: its arguments (packed once, read by every rank).
        processes: number of processes; default every visible GPU, else 2 CPU processes
            (or ``$FLAIR_NBDDP_PROCESSES``).
        device: ``"cuda"`` (NCCL), ``"cpu"`` (gloo), or None for CUDA when GPUs are visible
            (or ``$FLAIR_NBDDP_DEVICE``).
        timeout: seconds after which the run is ended and :class:`RunTimeoutError` raised.
        stop_timeout: seconds a graceful stop may take before the workers are ended.
        hang_timeout: seconds without progress on any rank (no training step, an unchanged call stack)
            after which the run is ended with :class:`RunHangError` showing every rank's stack; None: off.
            A rank stuck in a collective or a tight loop has an unchanging stack; one that loops through
            different Python functions (polling, retrying) looks busy to it: ``timeout`` bounds those.
        seed: the seed given to every rank (``flair.set_seed``); if None, ``$FLAIR_NBDDP_SEED`` or a random
            one. Kept in the result.
        dashboard: None shows the live widget dashboard in a notebook (plain progress lines and rank 0's
            log elsewhere); True insists on the widget; False shows nothing but rank 0's log lines.
        run_dir: where logs go; default a new private directory under :func:`runs_root`.
        pool: run on these warm workers instead of starting new ones (see :class:`~flair_nbddp.WorkerPool`);
            ``processes``/``device``, if given, must match the pool.

    Raises:
        WorkerError: a rank failed (``.rank``, the remote traceback, ``.result`` with the logs).
        RunTimeoutError, RunHangError: the run exceeded ``timeout`` / made no progress.
        ShippingError: ``fn`` or an argument cannot be sent to the workers (names which one).
        ValueError: impossible devices or process counts, or ones a given ``pool`` does not have.

    Example:
        >>> def train(corpus):                                           # doctest: +SKIP
        ...     trainer = ModelTrainer(make_classifier(corpus), corpus)
        ...     return trainer.train("out", max_epochs=2, multi_gpu=True)
        >>> result = launch(train, args=(corpus,), processes=2)          # doctest: +SKIP
        >>> result.value["test_score"], result.world_size                # doctest: +SKIP
        (0.91, 2)
    """
    from .dashboard import open_view

    mismatch = pool and pool.mismatch(processes, device)
    if mismatch:
        raise ValueError(f"{mismatch}: leave processes/device out to run on it, or launch without pool=")
    plan = pool.plan if pool is not None else resolve_devices(device, processes)
    run = Run(
        fn, args, kwargs or {}, plan, seed=seed, timeout=timeout, stop_timeout=stop_timeout,
        hang_timeout=hang_timeout, run_dir=run_dir, pool=pool,
    )
    view = None
    try:
        run.start()
        view = open_view(run, dashboard)
        view.start()
        result = run.wait(echo=view.echo_logs, on_tick=view.poll)
    except BaseException as error:
        if run.active:  # the view failed, or an interrupt came before the run was watched: end it here
            run.kill()
        if view is not None:
            view.finish(None, error)
        raise
    view.finish(result, result.error)
    if result.error is not None:
        raise result.error
    return result


def launch_distributed(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Drop-in for ``flair.distributed_utils.launch_distributed``: run ``fn`` on every device, return rank 0's value.

    Unlike flair's, it works from a notebook, picks a free port, prints rank 0's log in the cell, returns
    results of any size (a flair model arrives usable, on CPU), and raises :class:`WorkerError` as soon as
    a rank fails. Use :func:`launch` for options and the full :class:`RunResult`.

    Example:
        >>> from flair_nbddp import launch_distributed                   # doctest: +SKIP
        >>> scores = launch_distributed(train, corpus)                   # doctest: +SKIP
    """
    return launch(fn, args, kwargs).value
