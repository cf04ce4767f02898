"""Where a run's ranks come from: the worker source protocol, and cold workers.

A :class:`~flair_nbddp.engine.run.Run` knows nothing of how its workers were started. It asks a
:class:`WorkerSource` for a group of ranks running its :class:`~flair_nbddp.wire.events.Job` and gives it
back when the job is over. :class:`ColdWorkers` start a group for one job and end it afterwards;
:class:`~flair_nbddp.WorkerPool` keeps its group for the next job. Either group may be this machine's worker
processes (:class:`~flair_nbddp.engine.local_ranks.WorkerGroup`) or ranks on a Dask cluster
(:class:`~flair_nbddp.cluster.ranks.ClusterGroup`): ``Run``, the views, the magic and the panel stay as they are.

Example:
    >>> from flair_nbddp.engine.devices import resolve_devices
    >>> source = ColdWorkers(resolve_devices("cpu", 2))
    >>> source.plan.world_size, isinstance(source, WorkerSource)
    (2, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, Callable, Protocol, runtime_checkable

from .claims import HOLDINGS, Claim, Free, fit_plan
from .devices import DevicePlan, env_processes, resolve_devices
from ..errors import ConfigurationError, DeviceError
from .local_ranks import TERMINATE_GRACE_SECONDS, WorkerGroup
from ..options import RunOptions
from .rundir import RunDir
from ..wire.events import EXIT, Job


@runtime_checkable
class RankGroup(Protocol):
    """The ranks of one machine (:class:`~flair_nbddp.engine.local_ranks.WorkerGroup`) or of a Dask cluster
    (:class:`~flair_nbddp.cluster.ranks.ClusterGroup`): everything a worker source and a run do with them.

    Each rank's events arrive on ``connections[rank]`` (a closed channel means the rank is exiting), and
    each rank writes its output to ``rank<r>.log`` in the job's run directory. A source starts the group,
    submits jobs to it and closes it; the run's supervisor watches and, when it must, terminates it.
    """

    connections: list[Connection]
    terminating: bool  # True once terminate() was called: exits after it are not the ranks' own doing

    def start(self, preload: tuple[str, ...] = ()) -> RankGroup:
        """Start every rank; each imports ``preload`` and waits for its first job. Returns the group."""

    def submit(self, job: Job) -> None:
        """Hand ``job`` to every rank."""

    def close(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """Ask every rank to exit, end those still there after ``grace`` seconds, close the channels."""

    @property
    def alive(self) -> bool:
        """Every rank is running."""

    @property
    def pids(self) -> list[int]:
        """Each rank's worker process id (on a cluster: on its own host)."""

    def send_all(self, message: Any) -> None:
        """Send a request (STOP) to every rank."""

    def dead_ranks(self) -> dict[int, int]:
        """Ranks that have exited, with their exit codes (negative: killed by that signal)."""

    def wait_exit(self, rank: int, timeout: float) -> int | None:
        """A rank's exit code once it exited, waiting up to ``timeout`` s; None if it still runs."""

    def describe_exit(self, rank: int, exit_code: int | None) -> str:
        """What became of a rank's process, for an error message (on a cluster it names the Dask worker)."""

    def collect_stacks(self) -> dict[int, str]:
        """Every rank's Python stacks now, by rank (for the hang watchdog's report)."""

    def terminate(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """End every rank now: SIGTERM, then SIGKILL after ``grace`` seconds."""


@runtime_checkable
class WorkerSource(Protocol):
    """Gives a run a group of ranks for one job, and takes it back.

    A source may also have ``prepare(run_dir, preload)``: a run whose call takes a while to pack (it ships a flair
    corpus) calls it first, so that the source can start workers meanwhile and have them import ``preload``
    (:class:`ColdWorkers` and :class:`~flair_nbddp.WorkerPool` do). A source without it is asked for ranks
    once the call is packed."""

    plan: DevicePlan

    def acquire(self, job: Job) -> RankGroup:
        """Hand ``job`` to a group of ``plan.world_size`` ranks and return that group; all or nothing (a source
        that raises leaves no rank holding the job)."""

    def release(self, clean: bool, reason: str) -> None:
        """The job is over, or never reached the ranks (then ``clean``, and ranks prepared for it go if the
        source started them for it). ``clean``: it finished, and its ranks may take another job; else ``reason``
        (its status) says why they must not (a stopped or failed job may leave a rank mid-collective)."""


class ColdWorkers:
    """A cold launch: a pool that runs one job and exits. Its workers start for the job, in the job's run
    directory, while the run packs the job (importing torch, and flair when the job ships flair objects), are
    told to exit right behind the job (they leave as soon as it is done), and are ended when the job is released
    if they have not.

    ``new_group`` makes the group for a directory: this machine's worker processes by default, or a cluster's
    ranks (:func:`flair_nbddp.cluster.ranks.cluster_group_factory`), which ``where`` then names. ``fits``: ``plan``
    is the defaults' (or ``processes`` GPUs, none named), so the run takes the devices free as it starts
    (:meth:`fit`)."""

    def __init__(
        self, plan: DevicePlan, new_group: Callable[[RunDir], RankGroup] | None = None, where: str = "",
        claim: Claim | None = None, fits: bool = False, processes: int | None = None,
    ) -> None:  # fmt: skip
        self.plan, self.where, self.fits, self._asked = plan, where, fits, (plan, processes)
        self.claim = claim or Claim.of(plan)  # what its run holds while it runs (:mod:`~flair_nbddp.engine.claims`)
        self.new_group = new_group or (lambda home: WorkerGroup(self.plan, home))
        self._group: RankGroup | None = None
        self._handed = False  # whether the group got its job

    def fit(self, free: Free) -> tuple[Claim, str | None] | None:
        """Take the devices free now (``free``) instead of those asked by default; None when too few are."""
        fitted = fit_plan(*self._asked, free)
        if fitted is None:
            return None
        self.plan, line = fitted
        self.claim = Claim.of(self.plan)
        return self.claim, line

    def prepare(self, run_dir: RunDir, preload: tuple[str, ...]) -> None:
        """Start the workers now, importing ``preload``, while the run packs its call."""
        self._group = self.new_group(run_dir)  # held before it starts: release() ends what started
        self._group.start(preload)

    def acquire(self, job: Job) -> RankGroup:
        if self._group is None:
            self._group = self.new_group(RunDir.create(job.run_dir))
            self._group.start()
        try:
            self._group.submit(job)
            self._handed = True
            self._group.send_all(EXIT)
        except BaseException:  # all or nothing: no worker outlives a failed acquire
            self._group.close(grace=0.0)
            raise
        return self._group

    def release(self, clean: bool, reason: str) -> None:
        if self._group is not None:
            # workers that never got a job are busy importing: they are ended, not asked to leave
            self._group.close() if self._handed else self._group.close(grace=0.0)


def new_workers(
    processes: int | None, device: str | None, gpus: Sequence[int] | None, cluster: Any = None,
    share_gpus: bool = False, fits: bool = True,
) -> ColdWorkers:  # fmt: skip
    """New workers for one run: on this machine, or one rank per Dask worker of ``cluster`` (a
    ``distributed.Client`` or a scheduler address; see :mod:`flair_nbddp.cluster.client`). On this machine, a run
    that names no GPUs takes the free ones as it starts, and one that gives no process count (nor
    ``$FLAIR_NBDDP_PROCESSES``) the CPU's free slots, unless ``fits`` is False (a resumed run keeps its count)."""
    if cluster is None:
        plan = resolve_devices(device, processes, gpus, share_gpus)
        asked = processes if processes is not None else env_processes()
        fits = fits and gpus is None and (asked is None or plan.device_type == "cuda")
        return ColdWorkers(plan, fits=fits, processes=asked)
    from ..cluster.client import connect, place
    from ..cluster.ranks import cluster_group_factory

    if share_gpus:
        raise ConfigurationError(
            "share_gpus=True rehearses several ranks on this machine's GPUs; on a cluster each Dask worker with a GPU "
            "runs one rank: leave share_gpus out there (rehearse on this machine first, without cluster=)"
        )
    if gpus is not None:
        raise ConfigurationError(
            "gpus= picks GPUs of this machine; on a cluster every Dask worker with a GPU runs one rank: leave gpus "
            "out (processes= says how many)"
        )
    client = connect(cluster)
    placement = place(client, processes, device, held=HOLDINGS.workers_held())
    claim = Claim.on_cluster(site.worker for site in placement.sites)
    return ColdWorkers(placement.plan, cluster_group_factory(client, placement), f" {placement.describe()}", claim)


def left_the_cluster(cluster: Any, claim: Claim) -> list[str]:
    """The addresses of the Dask workers ``claim`` holds that are no longer in ``cluster`` (a lost node), sorted."""
    from ..cluster.client import connect, departed

    workers = claim.workers
    return departed(connect(cluster), workers) if workers else []


def source_for(options: RunOptions, pool: WorkerSource | None) -> WorkerSource:
    """Where a run with ``options`` gets its ranks: ``pool`` (whose devices ``options`` may only repeat; a
    :class:`~flair_nbddp.WorkerPool` lent in slices gives a free slice, and any source with ``lease`` what that
    gives), else new workers of this machine or of ``options.cluster``.

    Raises:
        ConfigurationError: both a pool and a cluster.
        DeviceError: devices the pool does not have, or impossible ones.
        ClusterError: the cluster cannot take the ranks.
    """
    if pool is None:
        return new_workers(options.processes, options.device, options.gpus, options.cluster, options.share_gpus,
                           fits=options.resume is None)  # fmt: skip
    if options.cluster is not None:
        raise ConfigurationError(
            "pool= and cluster= both say where to run: a pool made with WorkerPool(cluster=...) runs on its cluster "
            "already, so pass only pool=, or only cluster= for new workers"
        )
    lease = getattr(pool, "lease", None)  # a WorkerPool: itself, or one of its free slices
    if lease is not None:
        return lease(options.processes, options.device, options.gpus)
    mismatch = pool.plan.mismatch(options.processes, options.device, options.gpus)
    if mismatch:
        raise DeviceError(
            f"the warm pool runs {mismatch}: leave processes/device/gpus out to run on it, or run without the "
            "pool (launch without pool=, or '%ddp_pool stop' in a notebook)"
        )
    return pool
