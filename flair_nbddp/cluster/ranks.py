"""A run's ranks on a Dask cluster, on the notebook's side: a rank group like the worker processes of one machine.

A :class:`ClusterGroup` submits one :func:`~flair_nbddp.cluster.rank_host.host_rank` task per rank, pinned to the Dask
worker its :class:`~flair_nbddp.cluster.client.Placement` chose, and relays everything through Dask, over the client's
own connection to the scheduler:

- each rank's events arrive on a local socket pair (the supervisor reads ``connections`` as on one machine);
- the new bytes of each rank's log land in the notebook's run directory (the dashboard tails them there);
- rank 0's result is fetched before its ``ResultReady`` is passed on, and written where the run reads it; so is
  each full checkpoint, in the notebook's run directory (the node's copy goes with the group, or with the node);
- jobs, STOP and EXIT go down each rank's queue; a job's payload, the checkpoint it resumes from, and the
  objects put on a pool are stored once per node (not once per rank) before the job is handed over, and checked
  on every rank.

A rank whose Dask worker leaves the cluster, or whose task stops answering for :data:`LOST_AFTER_SECONDS`
while the notebook listens, counts as killed (SIGKILL); :meth:`ClusterGroup.describe_exit` names its worker and
host. A pause of the notebook's own (a garbage collection of a big corpus just built holds every thread for
seconds) is not a rank's silence: only time the relay was there to hear counts.

Example::

    placement = place(client, processes=2)
    group = ClusterGroup(client, placement, RunDir.create()).start()
    group.submit(job)
    group.close()
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import os
import pickle
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..errors import ClusterError, describe_exit
from ..engine.local_ranks import RENDEZVOUS_TIMEOUT_SECONDS, TERMINATE_GRACE_SECONDS
from ..engine.rundir import RunDir
from ..wire.events import CheckpointSaved, Failed, Job, ResultReady, WorkerSpec
from ..worker import checkpoint_files
from . import rank_host
from .client import Placement, require_distributed, workers_of
from .rank_host import JOB, STACKS, TERMINATE, Batch

LOST_AFTER_SECONDS = 20.0  # a rank's task silent this long (it says something every 2 s) is lost with its node
CHECK_SECONDS = 1.0  # how often the cluster's membership is checked
PAUSED_AFTER_SECONDS = 1.0  # a relay that took this long to come round again was held up by this process
POLL_SECONDS = 0.1  # how often the ranks' queue is read
TASKS_END_SECONDS = 2.0  # how long a closing group waits for its ranks' tasks to return before cancelling them


class ClusterGroup:
    """One Dask task per rank of ``placement``, each keeping that rank's worker process on its Dask worker."""

    def __init__(self, client: Any, placement: Placement, home: RunDir) -> None:
        self.client, self.placement, self.plan, self.home = client, placement, placement.plan, home
        self.group_id = uuid.uuid4().hex[:12]
        self.names = rank_host.names(self.group_id)
        world_size = self.plan.world_size
        self.connections: list[Connection] = []  # the supervisor's ends
        self._feeds: list[Connection] = []  # the relay's ends
        self.terminating = False
        self._lock = threading.RLock()
        self._exits: dict[int, int] = {}
        self._exited = [threading.Event() for _ in range(world_size)]
        self._lost: dict[int, str] = {}
        self._pids: dict[int, int] = {}
        self._stacks: dict[int, str] = {}
        self._heard = [time.monotonic()] * world_size  # when each rank was last heard, in the relay's time
        self._listened = time.monotonic()  # when the relay last came round
        self._jobs: dict[str, Job] = {}  # by key: where each job's output lands in the notebook
        self._shipped: collections.deque = collections.deque()  # Futures of rank 0's result and checkpoints, in order
        self._stored: set[str] = set()  # the files every node has
        self._tasks: list[Any] = []
        self._up: Any = None
        self._downs: list[Any] = []
        self._closed = threading.Event()
        self._pump = threading.Thread(target=self._relay, name="flair_nbddp-cluster", daemon=True)

    # -- starting ---------------------------------------------------------------------------------
    def start(self, preload: tuple[str, ...] = ()) -> ClusterGroup:
        """Submit every rank's task; each starts its worker process, which imports ``preload``."""
        distributed = require_distributed()
        try:
            self._up = distributed.Queue(self.names["up"], client=self.client)
            for site in self.placement.sites:
                self._downs.append(distributed.Queue(f"{self.names['down']}{site.rank}", client=self.client))
                ours, theirs = socket.socketpair()
                self.connections.append(Connection(ours.detach()))
                self._feeds.append(Connection(theirs.detach()))
                spec = WorkerSpec(
                    rank=site.rank, world_size=self.plan.world_size, device=site.device, backend=self.plan.backend,
                    port=0, rendezvous_timeout=RENDEZVOUS_TIMEOUT_SECONDS, stacks="",
                    sys_path=tuple(entry for entry in sys.path if entry), preload=preload,
                )  # fmt: skip  # the notebook's modules import where the workers share its file system
                self._tasks.append(self.client.submit(
                    rank_host.host_rank, self.group_id, site, spec, key=f"flair_nbddp-rank{site.rank}-{self.group_id}",
                    workers=[site.worker], allow_other_workers=False, pure=False,
                ))  # fmt: skip
        except BaseException:
            self.close(grace=0.0)
            raise
        self._pump.start()
        return self

    # -- talking ----------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Store the job's payload (and the pool's objects it may use) on every node, then hand it to every rank."""
        name, digest = self._store(Path(job.payload), f"payload-{job.key}.pkl")
        resume_name = self._store(Path(job.resume), f"resume-{job.key}.pt")[0] if job.resume else ""
        for ref_id in job.shared:
            if ref_id not in self._stored:
                self._store(self.home.path / "shared" / f"{ref_id}.pkl", f"shared/{ref_id}.pkl")
                self._stored.add(ref_id)
        self._jobs[job.key] = job
        run_dir = RunDir(Path(job.run_dir))
        for rank in range(self.plan.world_size):  # there, as on one machine, before a rank writes a line
            for path in (run_dir.log(rank), run_dir.stderr(rank)):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        self._send((JOB, job, name, digest, resume_name))

    def send_all(self, message: Any) -> None:
        """Send ``message`` (STOP, EXIT) down every live rank's queue."""
        self._send(message)

    def _send(self, message: Any, ranks: list[int] | None = None) -> None:
        data = pickle.dumps(message)
        for rank in range(self.plan.world_size) if ranks is None else ranks:
            if not self._exited[rank].is_set():
                with contextlib.suppress(Exception):  # a queue of a group that is closing
                    self._downs[rank].put(data)

    def _store(self, path: Path, name: str) -> tuple[str, str]:
        """Put ``path`` on every node once, as ``name`` in the group's directory there; its name and sha256."""
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        first = {}
        for site in self.placement.sites:
            first.setdefault(site.node, site)
        futures = []
        try:
            for site in first.values():
                shipped = self.client.scatter(data, workers=[site.worker], hash=False)
                futures.append(shipped)
                futures.append(self.client.submit(
                    rank_host.store_file, self.group_id, name, shipped, digest, workers=[site.worker],
                    allow_other_workers=False, pure=False,
                ))  # fmt: skip
            self.client.gather(futures[1::2])
        except Exception as error:  # noqa: BLE001 - a node that cannot take the file fails the launch
            raise ClusterError(
                f"{path.name} ({len(data) / 1e6:.1f} MB) could not be stored on the cluster's nodes "
                f"({type(error).__name__}: {error}); check the workers' free disk space in their temporary directory"
            ) from None
        finally:
            let_go(self.client, futures)
        return name, digest

    # -- relaying ---------------------------------------------------------------------------------
    def _relay(self) -> None:
        """Take what the ranks sent, about ten times a second (a non-blocking batch get: a get that waits with a
        timeout makes the scheduler log an error each time it times out), and check the ranks once a second."""
        checked = 0.0
        while not self._closed.wait(POLL_SECONDS):
            self._listening(time.monotonic())
            try:
                items = self._up.get(batch=True)
            except Exception:  # noqa: BLE001 - the client closed under us (the kernel is shutting down)
                items = []
            for item in items:
                self._take(item)
            if time.monotonic() - checked > CHECK_SECONDS:
                checked = time.monotonic()
                with contextlib.suppress(Exception):
                    self._check_ranks(silence=True)

    def _listening(self, now: float) -> None:
        """The relay comes round at ``now``; if this process held it up (the notebook's thread in a long garbage
        collection), the ranks could not be heard meanwhile, and their silence is counted from here."""
        paused = now - self._listened
        self._listened = now
        if paused > PAUSED_AFTER_SECONDS:
            self._heard = [heard + paused for heard in self._heard]

    def _take(self, item: Any) -> None:
        if not isinstance(item, bytes):  # a Future of rank 0's result or checkpoint, which comes before its event
            self._shipped.append(item)
            return
        batch: Batch = pickle.loads(item)
        rank = batch.rank
        self._heard[rank] = time.monotonic()
        if batch.pid is not None:
            self._pids[rank] = batch.pid
        job = self._jobs.get(batch.job_key) if batch.job_key else None
        if job is not None:
            run_dir = RunDir(Path(job.run_dir))
            for kind, data in batch.logs.items():
                with open(run_dir.log(rank) if kind == "log" else run_dir.stderr(rank), "ab") as handle:
                    handle.write(data)
        if batch.stacks is not None:
            self._stacks[rank] = batch.stacks
        for event in batch.events:
            if isinstance(event, ResultReady | CheckpointSaved):
                event = self._arrived(event, job)
            self._feed(rank, event)
        if batch.exit_code is not None:
            self._record_exit(rank, batch.exit_code)

    def _arrived(self, event: ResultReady | CheckpointSaved, job: Job | None) -> ResultReady | CheckpointSaved:
        """Keep what rank 0 shipped ahead of ``event`` on this machine, and name it in the event: its result where the
        job says, its checkpoint in the run's directory (whole or not at all, replacing the one before), so that a
        restart or a later resume finds it when the node that wrote it is gone."""
        try:
            future = self._shipped.popleft()
            data = future.result()
            future.release()
        except Exception:  # noqa: BLE001 - the bytes went with the node: the event names the node's file, which a
            return event  # resume refuses naming the node, and a result that cannot be read fails the run, saying so
        if job is None:
            return event
        if isinstance(event, ResultReady):
            Path(job.result).write_bytes(data)
            return dataclasses.replace(event, path=job.result)
        path = Path(job.run_dir) / checkpoint_files.NAME
        checkpoint_files.write_bytes(path, data)
        return dataclasses.replace(event, path=str(path))

    def _record_exit(self, rank: int, code: int) -> None:
        with self._lock:
            if self._exited[rank].is_set():
                return
            self._exits[rank] = code
            self._exited[rank].set()
        self._close_feed(rank)  # the supervisor sees the channel close, as when a process exits

    def _feed(self, rank: int, event: Any) -> None:
        """Pass ``event`` to the supervisor on rank ``rank``'s channel, unless that is closed."""
        with self._lock, contextlib.suppress(OSError):
            self._feeds[rank].send(event)

    def _close_feed(self, rank: int) -> None:
        """Close the relay's end of rank ``rank``'s channel, once: a second close of its descriptor could close
        another file that reused the number."""
        with self._lock:
            self._feeds[rank].close()  # a no-op once closed

    def _check_ranks(self, silence: bool) -> None:
        """Count ranks whose Dask worker left, or whose task failed, as killed; with ``silence`` (the relay's own
        check, right after it listened), also those it has not heard for :data:`LOST_AFTER_SECONDS`."""
        live = set(workers_of(self.client))
        now = time.monotonic()
        for site, task in zip(self.placement.sites, self._tasks):
            rank = site.rank
            if self._exited[rank].is_set():
                continue
            if site.worker not in live:
                self._lose(rank, "left the cluster (its node was lost, or the worker was ended)")
            elif task.status == "error":
                self._feed(rank, task_failure(rank, task))
                self._record_exit(rank, 1)
            elif silence and now - self._heard[rank] > LOST_AFTER_SECONDS:
                self._lose(rank, f"stopped answering for {LOST_AFTER_SECONDS:.0f} s")

    def _lose(self, rank: int, why: str) -> None:
        with self._lock:
            if not self._exited[rank].is_set():
                self._lost[rank] = why
        self._record_exit(rank, -9)

    # -- the rank group ---------------------------------------------------------------------------
    def dead_ranks(self) -> dict[int, int]:
        """Ranks that have exited (or were lost with their Dask worker), with their exit codes."""
        if not self.terminating:
            with contextlib.suppress(Exception):
                self._check_ranks(silence=False)  # a rank's peers may report its loss before the relay's check
        with self._lock:
            return dict(self._exits)

    def wait_exit(self, rank: int, timeout: float) -> int | None:
        """Rank ``rank``'s exit code once its worker process exited, waiting up to ``timeout`` s."""
        self._exited[rank].wait(timeout)
        with self._lock:
            return self._exits.get(rank)

    def describe_exit(self, rank: int, exit_code: int | None) -> str:
        """What became of rank ``rank``'s process, naming its Dask worker and host."""
        site = self.placement.sites[rank]
        where = f"Dask worker {site.worker} (host {site.hostname})"
        if rank in self._lost:
            return f"its {where} {self._lost[rank]}, and the rank with it,"
        return f"its worker process on {where} {describe_exit(exit_code)}"

    def collect_stacks(self) -> dict[int, str]:
        """Every live rank's Python stacks now, by rank (each rank's task signals its process and reads them)."""
        self._stacks.clear()
        live = [rank for rank in range(self.plan.world_size) if not self._exited[rank].is_set()]
        self._send(STACKS, live)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not set(live) <= set(self._stacks):
            time.sleep(0.1)
        return dict(self._stacks)

    def terminate(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """End every rank's worker process: SIGTERM, SIGKILL after ``grace`` seconds; a rank whose task does not
        answer has its task cancelled, and counts as killed."""
        with self._lock:
            self.terminating = True
        self._send((TERMINATE, grace))
        if self._wait_all(grace + TERMINATE_GRACE_SECONDS + 2.0):
            return
        with contextlib.suppress(Exception):
            self.client.cancel([task for rank, task in enumerate(self._tasks) if not self._exited[rank].is_set()])
        if not self._wait_all(TERMINATE_GRACE_SECONDS):
            for rank in range(self.plan.world_size):
                self._lose(rank, "did not answer: its task was cancelled")

    def _wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for event in self._exited:
            if not event.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def close(self, grace: float = TERMINATE_GRACE_SECONDS) -> None:
        """Ask every rank to exit, end those that do not within ``grace`` seconds, and let the group's tasks,
        queues and channels go, even if an interrupt comes meanwhile."""
        from ..wire.events import EXIT

        try:
            if self._tasks:
                self.send_all(EXIT)
                self._wait_all(grace)
                self.terminate(grace=1.0)
        finally:
            self._closed.set()
            if self._pump.is_alive():
                self._pump.join(timeout=30)  # it may be using a rank's channel: no descriptor is closed twice
            with contextlib.suppress(Exception):
                let_go(self.client, self._tasks, wait=TASKS_END_SECONDS)
            with contextlib.suppress(Exception):
                require_distributed().Variable(self.names["store"], client=self.client).delete()
            for queue in [self._up, *self._downs]:
                if queue is not None:
                    with contextlib.suppress(Exception):
                        queue.close()
            for rank, connection in enumerate(self.connections):
                connection.close()
                self._close_feed(rank)

    @property
    def alive(self) -> bool:
        """Every rank's worker process is running."""
        return bool(self._tasks) and not any(event.is_set() for event in self._exited)

    @property
    def pids(self) -> list[int]:
        """The ranks' worker processes' ids, each on its own host."""
        return [self._pids[rank] for rank in sorted(self._pids)]


def task_failure(rank: int, task: Any) -> Failed:
    """What rank ``rank``'s Dask task that ended in an error reports: the error and where it was raised, as text.

    Example:
        >>> class Task:  # a distributed.Future whose task raised
        ...     def exception(self): return error
        ...     def traceback(self): return error.__traceback__
        >>> try:
        ...     raise AssertionError
        ... except AssertionError as caught:
        ...     error = caught
        >>> failed = task_failure(1, Task())
        >>> failed.exc_type, failed.traceback.splitlines()[-1]
        ('AssertionError', 'AssertionError')
    """
    error = task.exception()
    return Failed(rank, type(error).__name__, str(error),
                  "".join(traceback.format_exception(type(error), error, task.traceback())))  # fmt: skip


def let_go(client: Any, futures: list, wait: float = 0.0) -> None:
    """Drop ``futures``: release those that finished (within ``wait`` seconds) and cancel the rest.

    Nothing finished is cancelled, because the scheduler reports every cancel to every client, and a client that
    is registering at that moment fails to start: distributed's ``Client`` asserts that the scheduler's first
    message to it comes alone. The client that failed would be a Dask worker's first (``get_client()``), made by a
    rank starting there: on a worker that just joined, the rank would fail at once with an empty ``AssertionError``.
    (:meth:`ClusterGroup.terminate` still cancels the tasks of ranks that do not answer: they run.)

    Example:
        >>> class Done:  # a distributed.Future whose task returned
        ...     released = False
        ...     def done(self): return True
        ...     def release(self): self.released = True
        >>> class Client:
        ...     cancelled = []
        ...     def cancel(self, futures): self.cancelled.extend(futures)
        >>> done, client = Done(), Client()
        >>> let_go(client, [done])
        >>> done.released, client.cancelled
        (True, [])
    """
    deadline = time.monotonic() + wait
    while not all(future.done() for future in futures) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)  # each future's state follows its own client (distributed.wait asks the default)
    running = []
    for future in futures:
        if future.done():
            future.release()
        else:
            running.append(future)
    if running:
        client.cancel(running)


def cluster_group_factory(client: Any, placement: Placement) -> Callable[[RunDir], ClusterGroup]:
    """What a worker source calls to make a group for ``placement`` with its output in a given directory."""
    return lambda home: ClusterGroup(client, placement, home)
