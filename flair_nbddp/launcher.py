"""Starting, watching and ending the worker processes of a run; ``launch`` and ``launch_distributed``.

One :class:`Run` per launch. The parent packs the call once into the run's private directory, starts
one ``python -m flair_nbddp.worker`` per rank in its own session (a kernel interrupt reaches only the
kernel, which then ends the workers), and one supervisor thread drains every rank's events and the
tail of rank 0's log into a :class:`~flair_nbddp.state.RunState`. The supervisor ends every rank as
soon as one fails, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

from . import payload
from .devices import DevicePlan, free_loopback_port, resolve_devices
from .errors import RunTimeoutError, WorkerError, describe_exit
from .events import Failed, Finished
from .result import RunResult
from .state import RunState

RUNS_ENV = "FLAIR_NBDDP_RUNS"
TERMINATE_GRACE_SECONDS = 3.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def runs_root() -> Path:
    """Where run directories go: ``$FLAIR_NBDDP_RUNS``, else ``<tmp>/flair_nbddp-<uid>`` (mode 0700)."""
    root = Path(os.environ.get(RUNS_ENV) or Path(tempfile.gettempdir()) / f"flair_nbddp-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    return root


class _LogTail:
    """Incremental reader of a growing log file, yielding whole lines (a tqdm ``\\r`` keeps its last state)."""

    def __init__(self, path: Path) -> None:
        self._path, self._offset, self._partial = path, 0, b""

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
    """One distributed execution of ``fn(*args, **kwargs)``: start it, watch it, end it.

    Most users call :func:`launch`; a ``Run`` is for code that must not block (a widget panel)::

        run = Run(train, (corpus,), {}, resolve_devices("cpu", 2))
        run.start()
        run.state.snapshot().status      # "starting", "running", ...
        result = run.wait()              # RunResult, also when the run failed
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
        run_dir: str | Path | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable (a function to run on every rank), not {type(fn).__name__}")
        self.fn, self.args, self.kwargs, self.plan = fn, tuple(args), dict(kwargs or {}), plan
        self.seed = random.randrange(2**31) if seed is None else int(seed)
        self.timeout = timeout
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="run-", dir=runs_root()))
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.state = RunState(world_size=plan.world_size, device_type=plan.device_type)
        self.log_files = {rank: self.run_dir / f"rank{rank}.log" for rank in range(plan.world_size)}
        self.new_log_lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._payload_path = self.run_dir / "payload.pkl"
        self._result_path = self.run_dir / "result.pkl"
        self._processes: list[subprocess.Popen] = []
        self._connections: dict[Connection, int] = {}
        self._done = threading.Event()
        self._timed_out = False
        self._terminating = False
        self._first_death: int | None = None  # the rank that died on its own before we ended anyone
        self._terminate_lock = threading.Lock()
        self._supervisor: threading.Thread | None = None
        self._result: RunResult | None = None

    # -- starting ---------------------------------------------------------------------------------
    def start(self) -> Run:
        """Pack the call, start one worker per rank and the supervisor thread; returns at once."""
        payload.write_payload(self._payload_path, self.fn, self.args, self.kwargs)
        port = free_loopback_port()
        try:
            for rank in range(self.plan.world_size):
                self._spawn(rank, port)
        except BaseException:
            self._terminate_workers()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="flair_nbddp-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _spawn(self, rank: int, port: int) -> None:
        parent_end, child_end = socket.socketpair()
        spec = {
            "rank": rank,
            "world_size": self.plan.world_size,
            "device": self.plan.device_for(rank),
            "backend": self.plan.backend,
            "payload": str(self._payload_path),
            "result": str(self._result_path),
            "seed": self.seed,
            "sys_path": [entry for entry in sys.path if entry],
            "fd": child_end.fileno(),
        }
        env = {**os.environ, **self.plan.rank_environment(rank, port)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        log_fd = os.open(self.log_files[rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "flair_nbddp.worker"],
                stdin=subprocess.PIPE,
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(child_end.fileno(),),
                start_new_session=True,
            )
        finally:
            os.close(log_fd)
            child_end.close()
        self._processes.append(process)
        self._connections[Connection(parent_end.detach())] = rank
        process.stdin.write(json.dumps(spec).encode())
        process.stdin.close()

    # -- watching ---------------------------------------------------------------------------------
    def _supervise(self) -> None:
        tail = _LogTail(self.log_files[0])
        deadline = None if self.timeout is None else self.state.started_at + self.timeout
        open_connections = dict(self._connections)
        while open_connections:
            for connection in wait(list(open_connections), timeout=0.1):
                try:
                    event = connection.recv()
                except (EOFError, OSError):
                    self._rank_closed(open_connections.pop(connection))
                    continue
                self.state.apply(event)
                if isinstance(event, Failed):
                    self._blame_signal_deaths()
                    self._terminate_workers()
            self._publish_log(tail.read_lines())
            if deadline is not None and time.time() > deadline and not self._timed_out:
                self._timed_out = True
                self._terminate_workers()
        self._publish_log(tail.read_lines(final=True))
        self._done.set()

    def _publish_log(self, lines: list[str]) -> None:
        self.state.add_log_lines(lines)
        for line in lines:
            self.new_log_lines.put(line)

    def _rank_closed(self, rank: int) -> None:
        """A rank's channel closed: its process is exiting. Reap it; end the others if it died early."""
        process = self._processes[rank]
        try:
            exit_code = process.wait(timeout=TERMINATE_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self._kill_group(process, signal.SIGKILL)
            exit_code = process.wait()
        self.state.rank_exited(rank, exit_code)
        if exit_code != 0 and not self._terminating and self._first_death is None:
            self._first_death = rank
            self._terminate_workers()

    def _blame_signal_deaths(self) -> None:
        """A rank killed by a signal (e.g. the OOM killer) makes its peers fail in a collective: blame it."""
        for rank, process in enumerate(self._processes):
            exit_code = process.poll()
            if exit_code is not None and exit_code < 0 and self._first_death is None:
                self._first_death = rank
                self.state.rank_exited(rank, exit_code)

    # -- ending -----------------------------------------------------------------------------------
    @staticmethod
    def _kill_group(process: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)

    def _terminate_workers(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left after ``grace`` seconds."""
        with self._terminate_lock:
            self._terminating = True
            alive = [p for p in self._processes if p.poll() is None]
            for process in alive:
                self._kill_group(process, signal.SIGTERM)
            end = time.monotonic() + grace
            for process in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.0, end - time.monotonic()))
            for process in self._processes:
                # the whole group: a worker's own children (e.g. data loader processes) go too
                self._kill_group(process, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=grace)

    def _first_failure(self) -> WorkerError | None:
        snapshot = self.state.snapshot()
        if self._first_death is not None:
            dead = snapshot.ranks[self._first_death]
            return WorkerError(
                dead.rank, "", f"the worker process {describe_exit(dead.exit_code)} without reporting an error",
                exit_code=dead.exit_code, log_path=str(self.log_files[dead.rank]),
            )
        if snapshot.failure is not None:
            failure = snapshot.failure
            exit_code = snapshot.ranks[failure.rank].exit_code
            return WorkerError(
                failure.rank, failure.exc_type, failure.message, failure.traceback, exit_code,
                str(self.log_files[failure.rank]),
            )
        if not self.state.all_finished() or self.state.result_path is None:
            return WorkerError(0, "", "the workers exited without returning a result", log_path=str(self.log_files[0]))
        return None

    def wait(self, echo: bool = False) -> RunResult:
        """Block until the run ends; with ``echo``, print rank 0's output lines as they arrive.

        A ``KeyboardInterrupt`` (the kernel's Interrupt) ends every worker before it propagates.
        """
        try:
            while not self._done.wait(0.1):
                self._echo(echo)
        except BaseException:
            self._terminate_workers(grace=1.0)
            self._done.wait(TERMINATE_GRACE_SECONDS * 2)
            self.state.end("stopped")
            self._cleanup()
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
        value = None
        if self._timed_out:
            error = None
        elif error is None:
            value = payload.read_result(self._result_path)
        self.state.end("failed" if error or self._timed_out else "finished")
        self._cleanup()
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
            log_files=dict(self.log_files),
            error=error,
        )
        if error is not None:
            error.result = self._result
        return self._result

    def _cleanup(self) -> None:
        self._terminate_workers(grace=1.0)
        for connection in self._connections:
            connection.close()
        for path in (self._payload_path, self._result_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    @property
    def timed_out(self) -> bool:
        """True if the run was ended because it exceeded its ``timeout``."""
        return self._timed_out


def launch(
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    processes: int | None = None,
    device: str | None = None,
    timeout: float | None = None,
    seed: int | None = None,
    echo: bool = True,
    run_dir: str | Path | None = None,
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on one process per device and return a :class:`RunResult`.

    ``fn`` may be defined in a notebook cell, close over notebook variables, and receive a flair corpus
    built in the notebook; it runs inside an initialised process group, so flair's
    ``.train(..., multi_gpu=True)`` works in it.

    Args:
        fn: the function every rank runs.
        args, kwargs: its arguments (packed once, read by every rank).
        processes: number of processes; default every visible GPU, else 2 CPU processes
            (or ``$FLAIR_NBDDP_PROCESSES``).
        device: ``"cuda"`` (NCCL), ``"cpu"`` (gloo), or None for CUDA when GPUs are visible
            (or ``$FLAIR_NBDDP_DEVICE``).
        timeout: seconds after which the run is ended and :class:`RunTimeoutError` raised.
        seed: the seed given to every rank (``flair.set_seed``); random if None, and kept in the result.
        echo: print rank 0's output in the cell as it happens.
        run_dir: where logs go; default a new private directory under :func:`runs_root`.

    Raises:
        WorkerError: a rank failed (``.rank``, the remote traceback, ``.result`` with the logs).
        RunTimeoutError: the run exceeded ``timeout``.
        ShippingError: ``fn`` or an argument cannot be sent to the workers (names which one).
        ValueError: impossible devices or process counts.

    Example:
        >>> def train(corpus):                                           # doctest: +SKIP
        ...     trainer = ModelTrainer(make_classifier(corpus), corpus)
        ...     return trainer.train("out", max_epochs=2, multi_gpu=True)
        >>> result = launch(train, args=(corpus,), processes=2)          # doctest: +SKIP
        >>> result.value["test_score"], result.world_size                # doctest: +SKIP
        (0.91, 2)
    """
    plan = resolve_devices(device, processes)
    run = Run(fn, args, kwargs or {}, plan, seed=seed, timeout=timeout, run_dir=run_dir).start()
    result = run.wait(echo=echo)
    if run.timed_out:
        raise RunTimeoutError(
            f"the run exceeded timeout={timeout} s and every worker was ended; logs: {run.run_dir}"
        )
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
