"""The user-facing way to run: :func:`launch`, :func:`launch_distributed` and :func:`start`.

Every run of the kit starts here, whoever asks (a cell, ``%%ddp_train``, the panel, a pool's ``launch``):
the devices or the pool are checked, a :class:`~flair_nbddp.Run` is built on its worker source (and recorded
in the run ledger), and :func:`launch` shows it in the view that fits (picked before any worker starts) while it
waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from .dashboard import open_view
from .devices import resolve_devices
from .errors import ConfigurationError, DeviceError
from .provenance import Provenance
from .result import RunResult
from .run import DEFAULT_HANG_TIMEOUT, DEFAULT_STOP_TIMEOUT, Run
from .sources import ColdWorkers, WorkerSource


def cold_source(
    processes: int | None, device: str | None, gpus: Sequence[int] | None, cluster: Any = None
) -> ColdWorkers:
    """New workers for one run: on this machine, or one rank per Dask worker of ``cluster`` (a
    ``distributed.Client`` or a scheduler address; see :mod:`flair_nbddp.cluster`)."""
    if cluster is None:
        return ColdWorkers(resolve_devices(device, processes, gpus))
    from .cluster import connect, place
    from .cluster_group import cluster_group_factory

    if gpus is not None:
        raise ConfigurationError(
            "gpus= picks GPUs of this machine; on a cluster every Dask worker with a GPU runs one rank: leave gpus "
            "out (processes= says how many)"
        )
    client = connect(cluster)
    placement = place(client, processes, device)
    return ColdWorkers(placement.plan, cluster_group_factory(client, placement), f" {placement.describe()}")


def _build(
    fn: Callable, args: tuple, kwargs: dict | None, processes: int | None, device: str | None,
    gpus: Sequence[int] | None, pool: WorkerSource | None, cluster: Any = None, **run_options: Any,
) -> Run:  # fmt: skip
    """A run, not started yet, on ``pool`` (checked against ``processes``/``device``/``gpus``) or on cold
    workers, of this machine or of ``cluster``; ``run_options`` are :class:`Run`'s (seed, timeout, stop_timeout,
    hang_timeout, run_dir, distributed_eval, lazy_corpus, output, provenance)."""
    if pool is not None and cluster is not None:
        raise ConfigurationError(
            "pool= and cluster= both say where to run: a pool made with WorkerPool(cluster=...) runs on its cluster "
            "already, so pass only pool=, or only cluster= for new workers"
        )
    if pool is None:
        source: WorkerSource = cold_source(processes, device, gpus, cluster)
    else:
        mismatch = pool.plan.mismatch(processes, device, gpus)
        if mismatch:
            raise DeviceError(
                f"the warm pool runs {mismatch}: leave processes/device/gpus out to run on it, or run without the "
                "pool (launch without pool=, or '%ddp_pool stop' in a notebook)"
            )
        source = pool
    return Run(fn, args, kwargs or {}, source, **run_options)


def start(
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    processes: int | None = None,
    device: str | None = None,
    gpus: Sequence[int] | None = None,
    timeout: float | None = None,
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
    seed: int | None = None,
    run_dir: str | Path | None = None,
    pool: WorkerSource | None = None,
    distributed_eval: bool = True,
    lazy_corpus: bool = True,
    output: str = "rank0",
    provenance: Provenance | None = None,
    cluster: Any = None,
) -> Run:
    """Start ``fn(*args, **kwargs)`` on every device and return the running :class:`~flair_nbddp.Run` at once.

    For code that must not block (a widget, a loop that watches several things). Arguments and errors as
    for :func:`launch`; nothing is shown: read ``run.state.snapshot()``, or show a
    :class:`~flair_nbddp.dashboard.Dashboard` of it.

    Example::

        run = start(train, (corpus,), processes=2)
        run.state.snapshot().status  # 'running'
        run.stop()
        run.wait().status  # 'stopped'
    """
    return _build(
        fn, args, kwargs, processes, device, gpus, pool, cluster, seed=seed, timeout=timeout, stop_timeout=stop_timeout,
        hang_timeout=hang_timeout, run_dir=run_dir, distributed_eval=distributed_eval, lazy_corpus=lazy_corpus,
        output=output, provenance=provenance or Provenance("start"),
    ).start()  # fmt: skip


def launch(
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    processes: int | None = None,
    device: str | None = None,
    gpus: Sequence[int] | None = None,
    timeout: float | None = None,
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
    seed: int | None = None,
    dashboard: bool | None = None,
    run_dir: str | Path | None = None,
    pool: WorkerSource | None = None,
    distributed_eval: bool = True,
    lazy_corpus: bool = True,
    output: str = "rank0",
    provenance: Provenance | None = None,
    cluster: Any = None,
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on one process per device and return a :class:`RunResult`.

    ``fn`` may be defined in a notebook cell, close over notebook variables, and receive a flair corpus
    built in the notebook; it runs inside an initialised process group, so flair's
    ``.train(..., multi_gpu=True)`` works in it.

    Interrupting the kernel (or ``run.stop()``, or the panel's Stop) stops gracefully: every rank stops after
    the same batch, flair saves ``final-model.pt``, and ``launch`` *returns* a result with
    ``status == "stopped"`` and its ``checkpoint``. A second interrupt ends the workers at once and raises
    ``KeyboardInterrupt``.

    Args:
        fn: the function every rank runs.
        args, kwargs: its arguments (packed once, read by every rank).
        processes: number of processes; default every visible GPU, else 2 CPU processes
            (or ``$FLAIR_NBDDP_PROCESSES``).
        device: ``"cuda"`` (NCCL), ``"cpu"`` (gloo), or None for CUDA when GPUs are visible
            (or ``$FLAIR_NBDDP_DEVICE``).
        gpus: run on these GPUs only, one process each, e.g. ``[0, 2]`` (numbered as torch numbers them in
            this kernel); works after the kernel has initialised CUDA, unlike setting ``CUDA_VISIBLE_DEVICES``.
        timeout: seconds after which the run is ended and :class:`RunTimeoutError` raised.
        stop_timeout: seconds a graceful stop may take before the workers are ended.
        hang_timeout: seconds without progress on any rank (no training step, an unchanged call stack)
            after which the run is ended with :class:`RunHangError` showing every rank's stack; None: off.
            A rank stuck in a collective or a tight loop has an unchanging stack; one that loops through
            different Python functions (polling, retrying) looks busy to it: ``timeout`` bounds those.
        seed: the seed given to every rank (``flair.set_seed``); if None, ``$FLAIR_NBDDP_SEED`` or a random
            one. Kept in the result.
        dashboard: None shows the live widget dashboard in a notebook (plain progress lines and the output
            elsewhere); True insists on the widget; False shows nothing but the output lines.
        output: ``"rank0"``: rank 0's output, and every other rank's stderr lines and warnings as they come,
            prefixed ``[rank r]``; ``"all"``: every line of every rank, prefixed. Each rank's full output is
            in its log either way (``RunResult.logs``).
        run_dir: the run's directory (logs, payload, result); default a new private one under
            ``$FLAIR_NBDDP_RUNS`` or the temporary directory. On a pool too: each run has its own.
        pool: run on these warm workers instead of starting new ones (a :class:`~flair_nbddp.WorkerPool`,
            or any :class:`~flair_nbddp.sources.WorkerSource`); ``processes``/``device``, if given, must match.
        distributed_eval: with several processes, each rank evaluates only its share of every split flair
            (or ``fn``) evaluates, and every rank gets the result one process would
            (:mod:`flair_nbddp.distributed_eval`); False: every rank evaluates the whole split, as flair does.
        lazy_corpus: a flair corpus (or dataset) among the arguments stays in its compact shipped form in each
            worker, and each sentence is built when flair reads it (:mod:`flair_nbddp.lazy_corpus`): worker
            memory and start-up do not grow with the corpus. A change the function makes to a sentence lasts
            while it holds that sentence. False: every sentence is built before ``fn`` starts, as in the notebook.
        provenance: what the run ledger records of how the run was asked for
            (:class:`~flair_nbddp.provenance.Provenance`: the magic and the panel describe theirs); default a call
            of ``fn`` with its ``args`` and ``kwargs``. Every run is recorded (:func:`flair_nbddp.history`) unless
            ``$FLAIR_NBDDP_LEDGER`` is ``0``.
        cluster: run on a Dask cluster instead of this machine: a ``distributed.Client`` (``LocalCluster``,
            dask-jobqueue's ``SLURMCluster``/``PBSCluster``, dask-kubernetes, a Gateway, Coiled) or a scheduler
            address. One rank per Dask worker with a GPU (NCCL), else per CPU worker (gloo); ``processes`` picks how
            many. Everything else is as on one machine; events and results travel through the client's connection
            to the scheduler (:mod:`flair_nbddp.cluster`).

    Raises:
        WorkerError: a rank failed (``.rank``, the remote traceback, ``.result`` with the logs).
        RunTimeoutError, RunHangError: the run exceeded ``timeout`` / made no progress.
        ShippingError: ``fn`` or an argument cannot be sent to the workers (names which one).
        DeviceError: impossible devices, GPUs or process counts, or ones a given ``pool`` does not have.
        ClusterError: the cluster is unreachable, has too few workers for ``processes``, or its workers lack the
            kit (the message says what it has).
        UnsupportedPlatformError: on Windows (the workers need POSIX).
        DashboardUnavailableError: ``dashboard=True`` outside a Jupyter kernel.
        RunActiveError: another run of this kernel is still active.
        Each before any worker starts, except the first two. All derive from :class:`FlairNbddpError`.

    Example::

        def train(corpus):
            trainer = ModelTrainer(make_classifier(corpus), corpus)
            return trainer.train("out", max_epochs=2, multi_gpu=True)
        result = launch(train, args=(corpus,), processes=2)
        result.value["test_score"], result.world_size  # (0.91, 2)
        result = launch(train, (corpus,), cluster=client)      # one rank per Dask worker of the cluster
    """
    run = _build(
        fn, args, kwargs, processes, device, gpus, pool, cluster, seed=seed, timeout=timeout, stop_timeout=stop_timeout,
        hang_timeout=hang_timeout, run_dir=run_dir, distributed_eval=distributed_eval, lazy_corpus=lazy_corpus,
        output=output, provenance=provenance or Provenance("launch"),
    )  # fmt: skip
    return watch(run, dashboard)


def watch(run: Run, dashboard: bool | None = None) -> RunResult:
    """Start ``run`` (built, not started), show it in the view that fits while it goes (as :func:`launch` does),
    and return its result; a failed run raises its error.

    Raises:
        DashboardUnavailableError: ``dashboard=True`` outside a Jupyter kernel (before anything starts).
        Whatever ``run.start()`` raises, and the run's error (:class:`WorkerError`...) when it failed.
    """
    view = open_view(run, dashboard)  # before any worker starts: an impossible view must not cost a start
    shown = False  # a run that never started has nothing to show
    try:
        run.start()
        shown = True
        view.start()
        result = run.wait(on_tick=view.poll)
    except BaseException as error:
        if run.active:  # the view failed, or an interrupt came before the run was watched: end it here
            run.kill()
        if shown:
            view.finish(None, error)
        raise
    view.finish(result, result.error)
    if result.error is not None:
        raise result.error
    return result


def launch_distributed(fn: Callable, *args: Any, cluster: Any = None, **kwargs: Any) -> Any:
    """Drop-in for ``flair.distributed_utils.launch_distributed``: run ``fn`` on every device, return rank 0's value.

    Unlike flair's, it works from a notebook, picks a free port, shows the run in the cell (the live
    dashboard in a notebook, rank 0's log and progress lines elsewhere), returns results of any size (a
    flair model arrives usable, on CPU), and raises :class:`WorkerError` as soon as a rank fails. Use
    :func:`launch` for options and the full :class:`RunResult`. ``cluster=`` (a ``distributed.Client`` or a
    scheduler address) runs it on a Dask cluster, as :func:`launch` does; it is not passed on to ``fn``.

    Example::

        from flair_nbddp import launch_distributed
        scores = launch_distributed(train, corpus)
        scores = launch_distributed(train, corpus, cluster=client)
    """
    return launch(fn, args, kwargs, cluster=cluster).value
