"""One run: ``fn(*args, **kwargs)`` on every rank a worker source gives, from start to result.

A :class:`Run` packs the call once into its run directory, asks its
:class:`~flair_nbddp.engine.worker_source.WorkerSource` for ranks, and leaves the watching to a
:class:`~flair_nbddp.engine.supervisor.Supervisor`. It imports no UI: views read its ``state``; the
user-facing functions (:func:`flair_nbddp.launch`, :func:`flair_nbddp.start`) build it.

Example::

    from flair_nbddp import start
    run = start(train, (corpus,))
    run.state.snapshot().status  # 'running'
    run.stop()
    run.wait().status  # 'stopped'
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Callable

from .claims import HOLDINGS, Claim
from .devices import DevicePlan
from ..errors import (
    ConfigurationError,
    NotCallableError,
    RunActiveError,
    RunStateError,
    ShippingError,
    StillRunningError,
)
from ..ledger.provenance import Provenance
from ..ledger.store import Ledger
from ..options import RunOptions
from .rank_output import RankOutput
from .recorder import RunRecorder
from ..result import RunResult
from .resume import resume_point
from .rundir import RunDir
from .state import RunState
from .supervisor import Limits, Supervisor
from ..wire import payload
from ..wire.events import Job
from ..wire.pool_ref import Kept, PoolRef
from .worker_source import RankGroup, WorkerSource

SEED_ENV = "FLAIR_NBDDP_SEED"
TICK_SECONDS = 0.1
_RUNS: list[Run] = []  # every run started in this process, oldest first (for %ddp_info)
_STARTING = threading.Lock()


def default_seed() -> int:
    """``$FLAIR_NBDDP_SEED`` when set (reproducible runs without editing a notebook), else a random seed.

    Example:
        >>> 0 <= default_seed() < 2**31                      # with FLAIR_NBDDP_SEED unset: a random seed
        True
    """
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        return random.randrange(2**31)
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"{SEED_ENV}={value!r} is not a whole number: set it to one (e.g. 0), or unset it for a random seed per run"
        ) from None


def preload_for(args: tuple, kwargs: dict) -> tuple[str, ...]:
    """What new workers import while the call is packed, when packing takes a while: torch and flair when an
    argument (or a value of a dict argument, as the magic's) is a flair object or a pool's copy of one; else
    nothing (the call packs at once, and a call that cannot be packed starts no worker).

    Example:
        >>> from flair_nbddp.synthetic import sentiment_corpus
        >>> preload_for((1,), {"x": 2}), preload_for((), {"ns": {"corpus": sentiment_corpus(2, 1, 1)}})
        ((), ('torch', 'flair'))
    """
    values = [*args, *kwargs.values()]
    values += [inner for value in values if isinstance(value, dict) for inner in value.values()]
    ships_flair = any(
        payload.is_flair_object(value) or (isinstance(value, (PoolRef, Kept)) and value.of_flair)
        for value in values
    )
    return ("torch", "flair") if ships_flair else ()


def runs() -> list[Run]:
    """Every run started in this process (this kernel), oldest first."""
    return list(_RUNS)


class Run:
    """One distributed execution of ``fn(*args, **kwargs)`` on the ranks of ``source``: start, watch, stop, end.

    Build one with :func:`flair_nbddp.start` (or let :func:`flair_nbddp.launch` do it); ``start()`` returns at
    once, ``wait()`` blocks until the :class:`~flair_nbddp.RunResult`, ``stop()`` asks every rank to stop
    after the same batch.

    Args:
        fn, args, kwargs: the call every rank makes (packed once, read by every rank).
        source: where the ranks come from (:class:`~flair_nbddp.engine.worker_source.ColdWorkers`, a
            :class:`~flair_nbddp.WorkerPool`, or any :class:`~flair_nbddp.engine.worker_source.WorkerSource`).
        options: the :class:`~flair_nbddp.RunOptions` (seed, limits, output, run directory...); where the ranks
            run is ``source``'s business.
        provenance: how the run was asked for, as the run ledger records it (:mod:`~flair_nbddp.engine.recorder`);
            default: a call of ``fn``.
        stop_recycles: a stopped run's workers are replaced before a pool's next job (flair's training may
            leave state behind). False: a run whose every rank returned after the stop leaves them as they
            are (``%%ddp_exec``, whose ranks keep their namespaces).
        stop_notice: what an interrupt's graceful stop says it does.
        chunk_size: the ``mini_batch_chunk_size`` every flair training of the run uses instead of its own (a
            restart after running out of memory, ``on_oom="halve_chunk"``); None: theirs.
        shared_payload: the call packed once for several runs (a restart's attempts,
            :class:`~flair_nbddp.engine.restarts.Restarts`): this run ships it if it was packed, else packs it there.

    Raises:
        NotCallableError: ``fn`` is not callable.
    """

    def __init__(
        self,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        source: WorkerSource,
        options: RunOptions = RunOptions(),
        *,
        provenance: Provenance | None = None,
        stop_recycles: bool = True,
        stop_notice: str = "stopping after the current batch on every rank and saving the model",
        chunk_size: int | None = None,
        shared_payload: payload.SharedPayload | None = None,
    ) -> None:
        if not callable(fn):
            raise NotCallableError(f"fn must be callable (a function to run on every rank), not {type(fn).__name__}")
        provenance = provenance or Provenance()
        self.name = provenance.name or getattr(fn, "__name__", type(fn).__name__)  # "%%ddp_train" for the magic
        self.options = options
        self.source, self.seed = source, default_seed() if options.seed is None else int(options.seed)
        self._call: tuple | None = (fn, tuple(args), dict(kwargs or {}))  # dropped once packed: no corpus kept
        self.limits = Limits(options.timeout, options.stop_timeout, options.hang_timeout)
        self.log_starts: dict[int, int] = {}  # where this run's output begins in each rank's log
        self.dir: RunDir | None = None  # created by start()
        self.state = RunState(world_size=self.plan.world_size, device_type=self.plan.device_type)
        self.group: RankGroup | None = None
        self._supervisor: Supervisor | None = None
        self._result: RunResult | None = None
        self._released = False
        self._claimed = False  # start() was called: the run holds its devices until released
        self._leave_queue = threading.Event()  # set by stop(): a run waiting for its devices gives up
        self.hand_over_to: object | None = None  # who holds its devices once it ends (a restart's next attempt)
        self._acquiring = False
        self._finishing = threading.Lock()
        self._recorder = RunRecorder(provenance, Ledger.default())
        self.stop_recycles, self.stop_notice = stop_recycles, stop_notice
        self.chunk_size = chunk_size
        self.shared_payload = shared_payload

    @property
    def record_id(self) -> int | None:
        """The run's id in the run ledger (:func:`flair_nbddp.history`); None before it starts, or unrecorded."""
        return self._recorder.id

    @property
    def ledger_problem(self) -> str | None:
        """Why the run ledger could not (fully) record this run, once that happened (also warned); else None."""
        return self._recorder.problem

    @property
    def plan(self) -> DevicePlan:
        """The :class:`~flair_nbddp.engine.devices.DevicePlan` the run uses (its source's)."""
        return self.source.plan

    @property
    def run_dir(self) -> Path | None:
        """The run's private directory: logs, payload, result (None before ``start()``)."""
        return None if self.dir is None else self.dir.path

    @property
    def log_files(self) -> dict[int, Path]:
        """Each rank's full output during this run (empty before ``start()``)."""
        return {} if self.dir is None else self.dir.logs(self.plan.world_size)

    @property
    def active(self) -> bool:
        """True from ``start()`` until the run has ended, its ranks were given back and its result collected."""
        return self._supervisor is not None and self._result is None

    @property
    def ended(self) -> bool:
        """True once the run has ended (``wait()`` then returns at once)."""
        return self._supervisor is not None and self._supervisor.done.is_set()

    # -- starting ---------------------------------------------------------------------------------
    def start(self) -> Run:
        """Pack the call, hand it to the source's ranks and start watching them; returns at once (with
        ``wait_for_devices``, once its devices are free).

        Raises:
            RunStateError: the run was started before.
            RunActiveError: another active run (of this kernel, or another process of the machine) holds one of its
                devices (GPUs, CPU process slots, Dask workers; :mod:`~flair_nbddp.engine.claims`), also after
                ``wait_for_devices`` seconds or a ``stop()`` while waiting: the message names the holder.
            ShippingError: ``fn`` or an argument cannot be pickled (nothing runs: workers started for the run while
                a corpus was packed are ended at once).
            PayloadWriteError: the payload cannot be written, e.g. the disk is full (nothing runs, as above).
            PoolRefError: an argument is a released :class:`~flair_nbddp.PoolRef` (nothing runs, as above).
            PoolClosedError: the source is a closed pool.
        """
        for ended in [run for run in _RUNS if run.active and run.ended]:
            ended._finish()  # an ended run whose supervisor is still concluding it: its devices go back first
        with _STARTING:  # a Run starts once
            if self._claimed or self.state.ended_at is not None:
                raise RunStateError("this Run was started already: a Run runs once; start a new one")
            self._claimed = True
        self._take_devices()
        try:
            self._start()
        except BaseException:
            HOLDINGS.give_back(self)
            raise
        return self

    def _take_devices(self) -> None:
        """Hold the run's devices in this kernel and on the machine (waiting for them with ``wait_for_devices``); a
        run that asked for none in particular takes those free now, and its state counts its ranks."""
        source = self.source
        claim = getattr(source, "claim", None) or Claim.of(self.plan)
        fit = source.fit if getattr(source, "fits", False) else None
        try:
            HOLDINGS.take(self, self._holder_label(), claim, fit=fit,
                          share=self.options.share_gpus, wait=self.options.wait_for_devices,
                          cancelled=self._leave_queue, inherit=self.hand_over_to)  # fmt: skip
        except BaseException:
            self._claimed = False  # never held anything: it may start later
            raise
        if self.options.wait_for_devices is not None and self._leave_queue.is_set():  # stopped as they came free
            HOLDINGS.give_back(self)
            self._claimed = False
            raise RunActiveError(f"run '{self.name}' was stopped while it waited for its devices; nothing started")
        if self.state.world_size != self.plan.world_size:
            self.state = RunState(world_size=self.plan.world_size, device_type=self.plan.device_type)

    def _holder_label(self) -> str:
        """How other runs' refusals and :func:`~flair_nbddp.devices_in_use` name this run: with its id in the run
        ledger once it has one."""
        number = "" if self.record_id is None else f"#{self.record_id} "
        self._started_clock = getattr(self, "_started_clock", None) or time.strftime("%H:%M:%S")
        return f"run {number}'{self.name}' (started {self._started_clock}, {self.plan})"

    def _start(self) -> None:
        self.dir = RunDir.create(self.options.run_dir)
        try:
            # from here on: a reused run_dir's earlier output is not this run's
            output = RankOutput(self.dir, self.plan.world_size, self.options.output)
            self.log_starts = output.log_starts
            fn, args, kwargs = self._call
            preload, prepare = preload_for(args, kwargs), getattr(self.source, "prepare", None)
            if preload and prepare is not None:  # a corpus takes seconds to pack: new workers start meanwhile
                prepare(self.dir, preload)
            # a restart's attempt ships what its first attempt packed
            write = payload.write_payload if self.shared_payload is None else self.shared_payload.write
            packed = write(self.dir.payload, fn, args, kwargs)
            record = self._recorder.describe(self, fn, args, kwargs, packed.digests)
            point = None
            if self.options.resume is not None:  # refused here, before any worker takes the job
                point = resume_point(self.options.resume, record, self.plan.world_size, self.options.resume_force,
                                     self._recorder.ledger)  # fmt: skip
                record.resumed_from = point.record_id
                self.state.continue_from(point.checkpoint, point.curve)
                print(f"flair_nbddp: {point.describe()}")
            self._recorder.begin(self, record)
            HOLDINGS.relabel(self, self._holder_label())  # with its ledger id, and the devices it took
            notice = self.plan.rehearsal_notice()
            if notice:
                print(f"flair_nbddp: {notice}", flush=True)
            self._call = None
            job = Job(
                str(self.dir.payload), str(self.dir.result), self.seed, str(self.run_dir),
                distributed_eval=self.options.distributed_eval, lazy_corpus=self.options.lazy_corpus,
                fast_inputs=self.options.fast_inputs, direct_embeddings=self.options.direct_embeddings,
                skip_clean_tokens=self.options.skip_clean_tokens, precision=self.options.precision,
                compile_model=self.options.compile_model,
                resume=point.path if point else "", resume_sha256=point.sha256 if point else "",
                chunk_size=self.chunk_size, checkpoint_every=self.options.checkpoint_every,
            )
            self._acquiring = True  # from here on the ranks may hold the job, even if acquire() never returns
            self.group = self.source.acquire(job)  # all or nothing: a source that raises has cleaned up
            self._supervisor = Supervisor(self.group, self.state, self.limits, self.dir, output, self._recorder,
                                          on_done=self._conclude_unwatched)  # fmt: skip
            _RUNS.append(self)
            self._supervisor.start()
        except BaseException as error:  # an interrupt right here must leave no worker, thread or descriptor behind
            if self._supervisor is not None and self._supervisor.started:
                self.kill()  # ends the ranks, concludes the run and gives them back
            else:
                self._supervisor = None
                if self.group is not None:
                    self.group.terminate()
                # the job never reached the ranks: only those started for it go (a pool keeps its workers)
                self.source.release(clean=not self._acquiring, reason="failed to start")
                self.state.end("failed")
                self.dir.remove_job_files()
                self._recorder.start_failed(self, self._call, error)
            raise

    # -- stopping ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask every rank to stop gracefully after the current batch; returns at once.

        flair then saves ``final-model.pt`` in its ``base_path`` (the result's ``checkpoint``) and returns,
        skipping its final test evaluation. Ranks not inside flair training by ``stop_timeout`` seconds are ended.
        A run still waiting for its devices (``wait_for_devices``) leaves the queue: its ``start()`` raises.
        """
        self._leave_queue.set()
        if self._supervisor is not None:
            self._supervisor.request_stop()

    def kill(self) -> RunResult:
        """End every worker now (SIGTERM, then SIGKILL after a second) and collect what there is.

        A run that has ended already is left alone (its ranks may be a pool's, running the next job).
        """
        supervisor = self._started()
        if self._result is None:
            supervisor.end_now()
        return self._finish()

    # -- waiting ----------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, on_tick: Callable[[], None] | None = None) -> RunResult:
        """Block until the run ends and return its :class:`~flair_nbddp.RunResult` (also when it failed or stopped).

        Interrupts follow :func:`wait_for_end`: the first stops the run gracefully, a second ends every worker
        and propagates. ``on_tick`` is called on this thread about ten times a second (a text view prints from
        it). Several threads may wait for the same run; they get the same result.

        Raises:
            RunStateError: the run was never started.
            StillRunningError: it did not end within ``timeout`` seconds (it goes on).
        """
        wait_for_end(self, self._started().done, timeout, on_tick)
        result = self._finish()
        if on_tick is not None:
            with contextlib.suppress(KeyboardInterrupt):  # the run has ended: an interrupt now cannot cost it
                on_tick()
        return result

    def _started(self) -> Supervisor:
        if self._supervisor is None:
            raise RunStateError("this Run was not started: call run.start() first (flair_nbddp.start(...) does both)")
        return self._supervisor

    def _finish(self) -> RunResult:
        with self._finishing:
            if self._result is None:
                self._result = self._conclude(self._started())
                try:
                    self._recorder.end(self, self._result)
                except KeyboardInterrupt:  # the run has ended and its result is kept: an interrupt cannot cost them
                    self._recorder.end(self, self._result)  # the ledger keeps one end, whichever got there
            return self._result

    def _conclude_unwatched(self) -> None:
        """On the supervisor's thread, once the run has ended: conclude it, so that its devices go back at once, to
        this kernel's next run and to other kernels, whether or not anyone waits for it."""
        with contextlib.suppress(Exception):  # then wait() concludes it, and raises what it met
            self._finish()

    def _conclude(self, supervisor: Supervisor) -> RunResult:
        error = supervisor.failure()
        stopped = error is None and (supervisor.ended_by == "stop" or self.state.stop_requested)
        value = None
        try:
            if error is None and self.state.result_path is not None:
                value = payload.read_result(self.dir.result)
        except Exception as failure:  # noqa: BLE001 - whatever it is, it becomes the run's error
            error = ShippingError(
                f"rank 0's return value could not be read back in the notebook ({type(failure).__name__}: "
                f"{failure}); the run itself finished. Return plain data, a flair model, or a path to a file."
            )
        finally:  # even if interrupted here, the run ends and its ranks go back to their source, once
            self.state.end("failed" if error else "stopped" if stopped else "finished")
            returned = supervisor.ended_by is None  # every rank came back from the job on its own
            self._release(clean=error is None and (not stopped or not self.stop_recycles and returned))
        result = RunResult.from_run(self, value, error)
        if error is not None:
            error.result = result
        return result

    def _release(self, clean: bool) -> None:
        if self._released:
            return
        self._released = True
        try:
            self.source.release(clean=clean, reason=self.state.status)
        except KeyboardInterrupt:
            pass  # it came after the run had ended (the release still completed): the result stands
        finally:
            if self.hand_over_to is not None:
                HOLDINGS.hand_over(self, self.hand_over_to)
            else:
                HOLDINGS.give_back(self)
            self.dir.remove_job_files()


def wait_all(runs: Sequence[Run], timeout: float | None = None) -> list[RunResult]:
    """Wait for several runs started side by side (:func:`flair_nbddp.start`), on one interrupt ladder: the kernel's
    first interrupt stops every one of them gracefully and keeps waiting, a second ends all their workers and
    propagates. Returns their results in order (failed runs' too: each has its ``error``).

    Raises:
        StillRunningError: not every run ended within ``timeout`` seconds (they go on).

    Example::

        first = start(train, (corpus,), gpus=[0, 1])
        second = start(train, (corpus,), gpus=[2, 3])
        results = wait_all([first, second])
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    stopping = False
    while True:
        try:
            while not all(run.ended for run in runs):
                if deadline is not None and time.monotonic() > deadline:
                    raise StillRunningError(f"not every run ended within {timeout} s; they go on")
                time.sleep(TICK_SECONDS)
            return [run.wait() for run in runs]
        except KeyboardInterrupt:
            if not stopping:
                stopping = True
                print("flair_nbddp: stopping every run after its current batch, saving the models (interrupt again to "
                      "end their workers now)", flush=True)  # fmt: skip
                for run in runs:
                    run.stop()
                continue
            for run in runs:
                run.kill()
            raise


def wait_for_end(
    run: Run, ended: threading.Event, timeout: float | None = None, on_tick: Callable[[], None] | None = None
) -> None:
    """Wait until ``ended`` is set, on the kit's one interrupt ladder for ``run``.

    A first ``KeyboardInterrupt`` (the kernel's Interrupt) asks every rank to stop after the same batch and
    keeps waiting; one while a stop is already under way ends every worker at once and propagates.

    Raises:
        StillRunningError: ``ended`` was not set within ``timeout`` seconds (the run goes on).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            while not ended.wait(TICK_SECONDS):
                if on_tick is not None:
                    on_tick()
                if deadline is not None and time.monotonic() > deadline:
                    raise StillRunningError(f"the run did not end within {timeout} s; it goes on")
            return
        except KeyboardInterrupt:
            if not run.state.stop_requested:
                print(f"flair_nbddp: {run.stop_notice} (interrupt again to end the workers now)", flush=True)
                run.stop()
                continue
            run.kill()
            raise
