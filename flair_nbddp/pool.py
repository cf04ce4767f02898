"""Warm workers: a pool whose processes stay up across cells, with imports done and the process group up.

A cold launch pays a new interpreter, ``import torch, flair``, the device context and the process group
on every rank (seconds on CPU, ~30 s to the first batch on an H200 machine). A pool pays that once. It is
a :class:`~flair_nbddp.engine.worker_source.WorkerSource` like cold workers: every run on it is an ordinary run, with
its own run directory and logs.

A pool also keeps objects for its jobs: :meth:`WorkerPool.put` packs a corpus once, and every job that
gets the returned :class:`~flair_nbddp.PoolRef` uses the workers' copy (:mod:`flair_nbddp.wire.pool_ref`).

Example::

    from flair_nbddp import WorkerPool
    with WorkerPool(processes=2, device="cpu") as pool:
        ref = pool.put(corpus)                                   # packed once
        first = pool.launch_distributed(train, ref, lr=1e-3)
        second = pool.launch_distributed(train, ref, lr=3e-3)   # starts at once, nothing packed again
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from .engine.claims import HOLDINGS, Claim
from .engine.devices import DevicePlan
from .errors import ConfigurationError, DeviceError, PoolClosedError, RunActiveError, UnknownOptionError
from .engine.local_ranks import WorkerGroup
from .ledger.provenance import Provenance
from .options import RunOptions, documented
from .predicting import PredictCall, Predictions, predict
from .result import RunResult
from .engine.run import Run, runs
from .engine.rundir import RunDir
from .engine.watch import launch_and_watch, watch
from .wire.events import Job
from .wire.pool_ref import PoolRef
from .worker import ddp_exec
from .worker.ddp_exec import RankResult
from .engine.worker_source import RankGroup, WorkerSource, left_the_cluster, new_workers, source_for

_CURRENT: WorkerPool | None = None
_EXEC_DECIDES = {  # run options exec() takes none of: it decides them
    "output": "every rank's output is shown, prefixed",
    "dashboard": "exec shows the ranks' output only",
    "max_restarts": "a cell's code is run once; a failed rank's error is its cell's",
    "restart_timeout": "a cell's code is run once",
}


def check_ranks(ranks: Sequence[int] | None, world_size: int) -> tuple[int, ...] | None:
    """``ranks`` as a sorted tuple (None: every rank), checked against the pool's ``world_size``.

    Example:
        >>> check_ranks([1, 0, 1], 2), check_ranks(None, 2)
        ((0, 1), None)
    """
    if ranks is None:
        return None
    chosen = tuple(sorted(set(int(rank) for rank in ranks)))
    wrong = [rank for rank in chosen if not 0 <= rank < world_size]
    if wrong or not chosen:
        raise ConfigurationError(
            f"ranks {list(ranks)}: the pool has ranks 0 to {world_size - 1}; name one or more of them, or none for all"
        )
    return chosen


class WorkerPool:
    """Workers started once and reused by every job launched through the pool.

    Jobs are isolated: each gets a fresh unpickled function, a reset flair logger, its own seed, its own
    run directory and log files, a cleared CUDA cache, and a health check (a tiny all-reduce on every rank)
    before it starts. A failed or stopped job, or a failed health check, recycles the workers: the next job
    starts on fresh ones, and the pool says so. The workers exit with the kernel, like any worker.

    An open pool on GPUs holds its GPUs for every kernel of the machine (:mod:`~flair_nbddp.engine.claims`): other
    runs, here or elsewhere, are refused them, naming the pool, until it is closed; every pool is listed by
    :func:`~flair_nbddp.devices_in_use`.

    Args:
        processes: number of workers; default every free GPU (none held by another run or used by another
            program), else 2 CPU processes.
        device: ``"cuda"``, ``"cpu"`` or None (automatic), as for :func:`~flair_nbddp.launch`.
        gpus: these GPUs only, one worker each (e.g. ``[0, 2]``), as for :func:`~flair_nbddp.launch`.
        share_gpus: let more workers than GPUs share them, over gloo (a rehearsal), as for
            :func:`~flair_nbddp.launch`.
        run_dir: where the workers' start-up output and stack dumps go; default a new private directory.
            Each job's output goes to its own run directory.
        cluster: keep the ranks warm on a Dask cluster instead (a ``distributed.Client`` or a scheduler address),
            one per Dask worker, as :func:`~flair_nbddp.launch` places them. When some of those workers leave the
            cluster (a lost node), the next job, or a restart (``max_restarts``), places the ranks again on the
            workers there then; ``cluster`` is kept as the attribute of that name (None: this machine).
        job_processes: lend the workers in slices of this many, each with a process group of its own, so that
            ``processes // job_processes`` jobs run on the pool at once (a sweep's trials:
            :func:`~flair_nbddp.sweep`); on GPUs each slice has its GPUs (``WorkerPool(8, job_processes=2)``: GPUs
            0,1 / 2,3 / ...; a job asking ``gpus=[2, 3]`` gets that slice). Default: every job takes every worker.

    Raises:
        DeviceError: impossible devices, GPUs or process counts.
        RunActiveError: its GPUs are held by another run or pool (of this kernel or another), or none is free.
        ClusterError: the cluster cannot take the ranks (see :func:`~flair_nbddp.launch`).
        UnsupportedPlatformError: on Windows (the workers need POSIX).

    Example:
        >>> pool = WorkerPool(2, "cpu")          # no worker starts before the first job (or warm_up())
        >>> pool.status().split(";")[0]
        'WorkerPool: 2 × cpu (gloo), idle (workers start with the next job)'
        >>> pool.close()
        >>> pool = WorkerPool(2, "cpu", job_processes=1)   # two one-process jobs at once
        >>> pool.status().split(";")[0]
        'WorkerPool: 2 × cpu (gloo) lent as 2 slices of 1 × cpu (gloo), idle (workers start with the next job)'
        >>> pool.close()
    """

    def __init__(
        self,
        processes: int | None = None,
        device: str | None = None,
        run_dir: str | Path | None = None,
        *,
        gpus: Sequence[int] | None = None,
        cluster: Any = None,
        share_gpus: bool = False,
        job_processes: int | None = None,
    ) -> None:
        source = new_workers(processes, device, gpus, cluster, share_gpus)  # checks the devices, places the ranks
        self.cluster = cluster
        slice_plans(source.plan, job_processes, sliceable=cluster is None)  # refused before anything is made
        self.home = RunDir.create(run_dir, prefix="pool-")
        self._name = f"WorkerPool {self.home.path.name}"  # a pool's workers, or a slice's, serve one run at a time
        # open, it holds its GPUs (its workers keep CUDA memory), taking the free ones if none were named; other
        # kernels see it either way
        on_gpus = cluster is None and source.plan.device_type == "cuda"
        HOLDINGS.take(self, self._name, source.claim if on_gpus else Claim(), share=share_gpus,
                      fit=source.fit if on_gpus and source.fits else None)  # fmt: skip
        self.plan: DevicePlan = source.plan
        self.where = source.where
        try:
            HOLDINGS.relabel(self, f"{self._name} (warm, {self.plan})")
            plans = slice_plans(self.plan, job_processes, sliceable=cluster is None)
        except BaseException:  # the free GPUs do not make whole slices
            HOLDINGS.give_back(self)
            raise
        if plans is None:
            self._slices = [PoolSlice(self, 0, self.plan, source.new_group, self._whole(source.claim))]
        else:
            self._slices = [
                PoolSlice(self, index, plan, lambda home, plan=plan: WorkerGroup(plan, home),
                          Claim(units=frozenset({f"slice {index} of {self._name}"})), f"slice-{index}")
                for index, plan in enumerate(plans)
            ]  # fmt: skip
        self.jobs_run = 0
        self.recycled = 0
        self.exec_names: set[str] = set()  # what every rank's exec namespace holds (a cell reads it there)
        self._lost_names: set[str] = set()  # what namespaces ended since the last recycle held
        self.notes: list[str] = []  # what the pool did on its own (recycling), newest last
        self._refs: weakref.WeakValueDictionary[str, PoolRef] = weakref.WeakValueDictionary()  # what put() packed
        self.named: dict[str, PoolRef] = {}  # notebook variables put with '%ddp_pool put NAME'
        self._unlink_later: list[Path] = []  # files of refs dropped: they go once no job runs (one may read them)
        self._running = 0  # jobs holding a slice now
        self._lock = threading.Lock()
        self._closed = False

    @property
    def run_dir(self) -> Path:
        """The workers' own directory: their start-up output and stack dumps."""
        return self.home.path

    # -- the worker source ------------------------------------------------------------------------
    @property
    def job_plan(self) -> DevicePlan:
        """The devices of one job on the pool: the whole pool's, or one slice's (``job_processes``)."""
        return self._slices[0].plan

    def prepare(self, run_dir: RunDir, preload: tuple[str, ...]) -> None:
        """Start the workers now if none are up (the pool's first job), so they start while the job is packed."""
        self._slices[0].prepare(run_dir, preload)

    def acquire(self, job: Job) -> RankGroup:
        """Hand ``job`` to every worker (starting or recycling them first) and return their group.

        Raises:
            PoolClosedError: the pool was closed.
        """
        return self._slices[0].acquire(job)

    def release(self, clean: bool, reason: str) -> None:
        """A job ended; an unclean end (failed, stopped) recycles the workers before the next job."""
        self._slices[0].release(clean, reason)

    @property
    def claim(self) -> Claim:
        """What a job on the pool's workers holds while it runs (:mod:`~flair_nbddp.engine.claims`): those workers (the
        pool itself holds their GPUs while it is open, and its CPU processes exist already: they hold no CPU slot)."""
        return self._slices[0].claim

    def lease(self, processes: int | None, device: str | None, gpus: Sequence[int] | None) -> WorkerSource:
        """Where a job asking for ``processes``/``device``/``gpus`` runs on this pool: the pool itself, or a slice no
        run holds (with ``gpus``: the slice of those GPUs); when every slice that fits is held, the first, which the
        run's start then refuses, naming the run that holds it.

        Raises:
            DeviceError: the pool's workers, or its slices, are not what the job asks for.
        """
        plan = self.job_plan
        wanted_gpus = None if gpus is None or len(self._slices) == 1 else tuple(gpus)
        mismatch = plan.mismatch(processes, device, None if wanted_gpus else gpus)
        if mismatch:
            shape = f"{len(self._slices)} slices of " if len(self._slices) > 1 else ""
            raise DeviceError(
                f"the warm pool runs {shape}{mismatch}: leave processes/device/gpus out to run on it, or run "
                "without the pool (launch without pool=, or '%ddp_pool stop' in a notebook)"
            )
        if len(self._slices) == 1:
            self._place_again()
            return self
        fits = [part for part in self._slices if wanted_gpus is None or set(part.plan.gpus or ()) == set(wanted_gpus)]
        if not fits:
            have = " / ".join(",".join(map(str, part.plan.gpus or ())) for part in self._slices)
            raise DeviceError(f"no slice of the pool has GPUs {','.join(map(str, wanted_gpus))}: its slices have {have}")
        held = HOLDINGS.units_held()
        return next((part for part in fits if not part.claim.units & held), fits[0])

    def _whole(self, claim: Claim) -> Claim:
        """What a job on every worker holds: the workers' Dask workers, if any, and the pool's name (the pool holds
        its GPUs itself, and its CPU processes exist already: they hold no CPU slot)."""
        return Claim(units=claim.units | {self._name})

    def _place_again(self) -> None:
        """On a Dask cluster: if Dask workers of the pool's ranks left (a lost node), place the ranks afresh on the
        workers there now, those still there or new ones, as a new pool would; their job starts on fresh ranks.

        Raises:
            ClusterError: too few workers now (a restart waits ``restart_timeout`` seconds for new ones to join).
        """
        if self.cluster is None:
            return
        part = self._slices[0]
        with self._lock:
            gone = [] if part.busy or self._closed else left_the_cluster(self.cluster, part.claim)
            if not gone:
                return
            source = new_workers(self.plan.world_size, self.plan.device_type, None, self.cluster)
            part.recycle_before_next(f"Dask worker(s) {', '.join(gone)} left the cluster")
            part.claim, part.new_group, self.where = self._whole(source.claim), source.new_group, source.where
            self._note(f"Dask worker(s) {', '.join(gone)} left the cluster: the pool's ranks are placed again,"
                       f"{source.where}")  # fmt: skip

    def _job_began(self, job: Job) -> Job:
        """A slice takes ``job``: with the copies of put objects its workers keep. Under the pool's lock."""
        self._running += 1
        self.jobs_run += 1
        return dataclasses.replace(job, shared=tuple(ref.id for ref in self.refs))

    def _job_ended(self, held: bool) -> None:
        """A slice's job ended (``held``: it held the slice), or never reached its ranks. Under the pool's lock."""
        self._running -= held
        if self._running == 0:  # no job can read the files of dropped refs any more
            self._unlink(self._unlink_later)
            self._unlink_later.clear()  # the same list: the finalizers of put() append to it

    def _forget_namespaces(self) -> None:
        """The workers' exec namespaces are going: what they held is said at the recycle."""
        self._lost_names |= self.exec_names
        self.exec_names = set()

    @staticmethod
    def _unlink(paths: list[Path]) -> None:
        for path in paths:
            path.unlink(missing_ok=True)

    def _note(self, message: str) -> None:
        self.notes.append(message)
        print(f"flair_nbddp: {message}", flush=True)

    # -- public -----------------------------------------------------------------------------------
    @documented()
    def launch(
        self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *, options: RunOptions | None = None,
        provenance: Provenance | None = None, **run_options: Any,
    ) -> RunResult:  # fmt: skip
        """:func:`flair_nbddp.launch` on the pool's workers (``processes``/``device``/``gpus``, if given, must match).

        Run options (keywords, or ``options=RunOptions(...)``; keywords win):
            {run_options}

        Example::

            result = pool.launch(train, (ref,), seed=0, timeout=600)
        """
        options = RunOptions.of(run_options, options, where="WorkerPool.launch(): ")
        return launch_and_watch(fn, args, kwargs, options, self, provenance or Provenance("launch"))

    def launch_distributed(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """:func:`flair_nbddp.launch_distributed` on the pool's workers: rank 0's return value."""
        return self.launch(fn, args, kwargs).value

    def predict(self, model: Any, data: Any, **arguments: Any) -> Predictions | PredictCall:
        """:func:`flair_nbddp.predict` on the pool's workers, with the same arguments. A model passed as a ref of
        this pool (``pool.put(model)``) is loaded once per worker, on its device, and kept for the next calls.

        Example::

            ref = pool.put(tagger)
            first = pool.predict(ref, "week-1.txt", output="week-1.jsonl")
            second = pool.predict(ref, "week-2.txt", output="week-2.jsonl")   # the workers have the model already
        """
        if "pool" in arguments:
            raise UnknownOptionError("WorkerPool.predict(): pool= is not taken here: it runs on this pool")
        return predict(model, data, pool=self, **arguments)

    @documented(*_EXEC_DECIDES)
    def exec(
        self, code: str | Callable[[], Any], ranks: Sequence[int] | None = None, *, variables: dict | None = None,
        reset: bool = False, options: RunOptions | None = None, provenance: Provenance | None = None,
        **run_options: Any,
    ) -> list[RankResult]:  # fmt: skip
        """Run ``code`` on the ranks of this pool, each in a namespace it keeps from one ``exec`` to the next.

        ``code`` is a cell's source (the value of its last expression comes back) or a function called with no
        arguments (its return value comes back; it sees its own globals, not the namespace). Every rank's namespace holds ``rank``, ``world_size`` and
        ``device``, and the process group is up (collectives work when every rank runs the code). What
        ``%%ddp_train`` and :meth:`launch` run does not see these namespaces; :meth:`restart` or ``reset=True``
        empties them. Each rank's output is shown as it comes, every line prefixed ``[rank r]``.

        An exception on a rank comes back as that rank's ``error`` and leaves the workers and their namespaces
        as they are. An interrupt raises ``KeyboardInterrupt`` inside every rank's code (their ``error``); when
        not every rank returns within ``stop_timeout`` (one blocked in a collective), every worker is ended, the
        pool says so, ``exec`` raises ``KeyboardInterrupt``, and the next job starts on fresh workers.

        Args:
            code: a cell's source, or a function.
            ranks: run only on these ranks (the others return at once: collectives would hang).
            variables: names put in every rank's namespace first (shipped as ``launch`` ships arguments).
            reset: empty the namespaces first.
            options, run_options: as for :meth:`launch`, but ``output`` (every rank's output is shown, prefixed)
                and ``dashboard`` (nothing else is), which ``exec`` decides.
            provenance: as for :func:`flair_nbddp.launch`.

        Run options (keywords, or ``options=RunOptions(...)``; keywords win):
            {run_options}

        Raises:
            ConfigurationError: a rank that the pool does not have.
            ShippingError: ``code`` or a variable cannot be sent to the workers (nothing ran).
            RunActiveError: another run holds the pool's workers (the message names it).
            KeyboardInterrupt: interrupted, and not every rank returned within ``stop_timeout`` (every worker was
                ended). On GPUs (NCCL) the workers are replaced after any interrupted cell, with a note: a
                collective may be left queued on some ranks.
            WorkerError, RunHangError, RunTimeoutError: a worker died, hung or ran out of time (the pool then
                starts its next job on fresh workers).

        Example::

            pool.exec("import torch; total = torch.tensor([rank])")
            [result.value for result in pool.exec("int(total)")]      # [0, 1]
        """
        if len(self._slices) > 1:
            raise ConfigurationError(
                f"exec() runs code on every worker of one process group, and this pool is{self._lent_as()} (each its "
                "own group): use a pool made without job_processes for %%ddp_exec"
            )
        chosen = check_ranks(ranks, self.plan.world_size)
        options = RunOptions.of(run_options, options, where="exec(): ", not_here=_EXEC_DECIDES)
        options = RunOptions.of({"output": "all", "dashboard": False}, options)
        args = (code, dict(variables or {}), chosen, reset)
        run = Run(
            ddp_exec.run_ddp_exec_cell, args, {}, source_for(options, self), options, stop_recycles=False,
            provenance=provenance or Provenance("exec", name=getattr(code, "__name__", "exec")),
            stop_notice="interrupting the code on every rank (KeyboardInterrupt)",
        )  # fmt: skip
        result = watch(run, dashboard=False)
        if result.value is None:  # stopped, and not every rank came back within the stop timeout: all were ended
            self._note(
                f"not every rank returned within stop_timeout={run.limits.stop_timeout:g} s of the interrupt (one may "
                "wait in a collective): every worker was ended; the next job starts on fresh ones, namespaces empty"
            )
            raise KeyboardInterrupt("the code was interrupted and its workers ended")
        self.exec_names = ddp_exec.names_held(result.value)
        results = ddp_exec.results_of(result.value)
        if any(result.interrupted for result in results) and self.plan.backend == "nccl":
            self._note(
                "on GPUs an interrupted cell may leave a collective queued on some ranks, which would pair with the "
                "next job's: the workers are replaced before it (namespaces empty)"
            )
            self.restart()
        return results

    def restart(self) -> None:
        """Replace the workers with fresh ones before the next job (their ``exec`` namespaces go with them).

        Raises:
            RunActiveError: a run on this pool is still active (stop it first).
        """
        if any(run.active and (run.source is self or run.source in self._slices) for run in runs()):
            raise RunActiveError("a run on this pool is still active: stop it (or wait for it) before restarting the pool")
        with self._lock:
            self._forget_namespaces()
            for part in self._slices:
                part.recycle_before_next("it was restarted")

    def put(self, obj: Any) -> PoolRef:
        """Pack ``obj`` (a corpus, or any large argument) once for every later job on this pool.

        Jobs that get the returned ref, as an argument or inside one, get the workers' copy: each worker reads
        the packed file once and keeps it until the ref is released or the pool closes, and each job decodes
        its own copy from it (a corpus stays lazy: :mod:`flair_nbddp.wire.lazy_corpus`). The ref is a snapshot:
        after changing ``obj`` in the notebook, put it again.

        A ref the notebook no longer holds is dropped as if released (``pool.put(corpus)`` run again makes a new
        copy; the old one goes).

        Raises:
            PoolClosedError: the pool was closed (also while ``obj`` was being packed).
            ShippingError: ``obj`` cannot be pickled (the message names the part).
            PayloadWriteError: the packed object cannot be written (e.g. the disk is full).

        Example:
            >>> from flair_nbddp.synthetic import sentiment_corpus
            >>> pool = WorkerPool(2, "cpu")
            >>> corpus = sentiment_corpus(n_train=20, n_dev=2, n_test=2)
            >>> ref = pool.put(corpus)
            >>> ref.matches(corpus), len(pool.refs)
            (True, 1)
            >>> ref.release(); ref.released, len(pool.refs)
            (True, 0)
            >>> pool.close()
        """
        if self._closed:
            raise PoolClosedError("this WorkerPool is closed: start a new one (WorkerPool(...) or %ddp_pool start)")
        ref = PoolRef.put(self, self.run_dir / "shared", obj)
        with self._lock:
            if self._closed:  # closed while packing
                ref.released = True
                ref.path.unlink(missing_ok=True)
                raise PoolClosedError("this WorkerPool was closed while the object was packed: start a new one")
            self._refs[ref.id] = ref
            weakref.finalize(ref, self._unlink_later.append, ref.path)  # dropped by the notebook: as if released
        return ref

    def drop(self, ref: PoolRef) -> None:
        """Drop what ``ref`` holds (the same as ``ref.release()``): the workers let it go before their next job,
        and its file goes once the job started before it is over."""
        with self._lock:
            self._refs.pop(ref.id, None)
            for name in [name for name, held in self.named.items() if held is ref]:
                del self.named[name]
            if not ref.released:
                ref.released = True
                self._unlink_later.append(ref.path)

    @property
    def refs(self) -> list[PoolRef]:
        """The objects put on the pool and not dropped, oldest first."""
        return list(self._refs.values())

    @property
    def started(self) -> bool:
        """True while the workers are up (every slice's that has started)."""
        groups = [part.group for part in self._slices if part.group is not None]
        return bool(groups) and all(group.alive for group in groups) and not self._closed

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (empty before the first job or after ``close``)."""
        return [pid for part in self._slices if part.group is not None for pid in part.group.pids] if self.started else []

    def status(self) -> str:
        """One line: size, device, whether the workers are up, jobs run, recycles."""
        state = "closed" if self._closed else "warm" if self.started else "idle (workers start with the next job)"
        return (
            f"WorkerPool: {self.plan}{self.where}{self._lent_as()}, {state}; "
            f"{self.jobs_run} job(s) run, {self.recycled} recycle(s); workers' logs {self.run_dir}"
        )

    def _lent_as(self) -> str:
        return f" lent as {len(self._slices)} slices of {self.job_plan}" if len(self._slices) > 1 else ""

    def warm_up(self) -> WorkerPool:
        """Start the workers now and import flair in them (every slice's at once), so the first real job starts warm.

        Raises:
            RunActiveError: a run holds some of the workers.
            WorkerError: a worker could not start or import flair (the first such slice's error).
        """
        started = [Run(_import_flair, (), {}, part, provenance=Provenance("launch")).start() for part in self._slices]
        errors = [result.error for result in (run.wait() for run in started) if result.error is not None]
        if errors:
            raise errors[0]
        return self

    def close(self) -> None:
        """End the workers (they leave their process group and exit). The pool cannot be used afterwards."""
        global _CURRENT
        try:
            with self._lock:
                self._closed = True
                for part in self._slices:
                    part.close()
                for ref in self.refs:
                    ref.released = True
                    self._unlink_later.append(ref.path)
                self._unlink(self._unlink_later)
                self._unlink_later.clear()
                self._refs, self.named = weakref.WeakValueDictionary(), {}
        finally:
            HOLDINGS.give_back(self)
        if _CURRENT is self:
            _CURRENT = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self.status()}>"


class PoolSlice:
    """Some of a pool's workers with a process group of their own: the worker source of one job at a time.

    A pool made without ``job_processes`` is one slice of every worker; with it, several. What a pool keeps for
    its jobs (objects put, notes, counts) is the pool's; a slice has its workers and whether they are fresh.
    """

    def __init__(
        self, pool: WorkerPool, index: int, plan: DevicePlan, new_group: Callable[[RunDir], RankGroup], claim: Claim,
        name: str = "",
    ) -> None:  # fmt: skip
        self.pool, self.index, self.plan, self.new_group = pool, index, plan, new_group
        self.claim = claim  # its workers (and GPUs): one job at a time
        self.home = RunDir.create(pool.home.path / name) if name else pool.home  # its workers' start-up logs
        self.group: RankGroup | None = None  # this machine's worker processes, or the ranks on a cluster
        self.busy = False  # a job holds it
        self._needs_recycle: str | None = None

    def prepare(self, run_dir: RunDir, preload: tuple[str, ...]) -> None:
        """Start the workers now if none are up (the slice's first job), so they start while the job is packed."""
        with self.pool._lock:
            if self.group is None and not self.pool.closed:
                self.group = self.new_group(self.home).start(preload)

    def acquire(self, job: Job) -> RankGroup:
        """Hand ``job`` to every worker of the slice (starting or recycling them first) and return their group.

        A second job cannot come before this one's release: both hold the slice's claim
        (:mod:`~flair_nbddp.engine.claims`).

        Raises:
            PoolClosedError: the pool was closed.
        """
        pool = self.pool
        with pool._lock:
            if pool.closed:
                raise PoolClosedError("this WorkerPool is closed: start a new one (WorkerPool(...) or %ddp_pool start)")
            group, reason = self.group, self._needs_recycle
            if group is not None and reason is None and not group.alive:
                reason = f"worker(s) {sorted(group.dead_ranks())} had exited"
            if group is not None and reason is not None:
                group.close(grace=1.0)
                pool.recycled += 1
                pool._forget_namespaces()
                lost = f", their %%ddp_exec namespaces empty ({', '.join(sorted(pool._lost_names))} gone)"
                pool._note(f"recycled the pool's workers ({reason}); this job starts on fresh ones" + (
                    lost if pool._lost_names else ""))  # fmt: skip
                pool._lost_names = set()
                self.group = None
            self._needs_recycle = None
            if self.group is None:
                self.group = self.new_group(self.home).start()
            job = pool._job_began(job)
            self.busy = True
            try:
                self.group.submit(job)
            except BaseException:  # some ranks may hold the job: these workers cannot take another
                self.group.terminate()
                self._needs_recycle = "a job could not be handed to every worker"
                raise
            return self.group

    def release(self, clean: bool, reason: str) -> None:
        """A job ended (or never reached the ranks); an unclean end (failed, stopped) recycles the workers before
        the next job."""
        with self.pool._lock:
            if not clean:
                self.pool._forget_namespaces()  # the workers are ended: their namespaces with them
                self.recycle_before_next(f"the last job {reason}")
            self.pool._job_ended(self.busy)
            self.busy = False

    def recycle_before_next(self, reason: str) -> None:
        """End the workers now; the next job starts on fresh ones, and the pool says why. Under the pool's lock."""
        self._needs_recycle = reason
        if self.group is not None:
            self.group.terminate()

    def close(self) -> None:
        """End the workers (they leave their process group and exit). Under the pool's lock."""
        if self.group is not None:
            self.group.close()
            self.group = None


def slice_plans(plan: DevicePlan, job_processes: int | None, sliceable: bool = True) -> list[DevicePlan] | None:
    """The plans of a pool's slices of ``job_processes`` workers each (None: one job takes every worker).

    Example:
        >>> [str(part) for part in slice_plans(DevicePlan("cuda", 4, "nccl"), 2)]
        ['2 × cuda 0,1 (nccl)', '2 × cuda 2,3 (nccl)']
        >>> slice_plans(DevicePlan("cpu", 2, "gloo"), 2) is None
        True
    """
    if job_processes is None or job_processes == plan.world_size:
        return None
    if isinstance(job_processes, bool) or not isinstance(job_processes, int) or job_processes < 1:
        raise ConfigurationError(f"job_processes={job_processes!r} must be a positive integer (or None: every worker)")
    if plan.world_size % job_processes:
        raise ConfigurationError(
            f"job_processes={job_processes} does not divide the pool's {plan.world_size} workers into slices: use a "
            f"divisor of {plan.world_size}"
        )
    if not sliceable or plan.shares_gpus:
        what = "a Dask cluster's" if not sliceable else "workers sharing GPUs"
        raise ConfigurationError(
            f"job_processes= lends this machine's workers in slices, not {what}: leave it out (jobs take every "
            "worker), or make a pool per slice"
        )
    if plan.device_type == "cpu":  # all the pool's workers exist at once: they share the cores
        return [DevicePlan("cpu", job_processes, "gloo", cpu_share=plan.world_size)] * (plan.world_size // job_processes)
    gpus = plan.gpus or tuple(range(plan.world_size))
    return [DevicePlan("cuda", job_processes, plan.backend, gpus[start : start + job_processes])
            for start in range(0, len(gpus), job_processes)]  # fmt: skip


def _import_flair() -> None:
    import flair.trainers  # noqa: F401 - the import is the point: flair, torch and transformers, once


def current_pool() -> WorkerPool | None:
    """The pool started with ``%ddp_pool start`` (or :func:`set_current_pool`), which the magic and panel use."""
    return _CURRENT if _CURRENT is not None and not _CURRENT.closed else None


def set_current_pool(pool: WorkerPool | None) -> None:
    """Make ``pool`` the one ``%%ddp_train`` and the panel run on (None: cold launches again)."""
    global _CURRENT
    _CURRENT = pool
