"""The user-facing way to run: :func:`launch`, :func:`launch_distributed` and :func:`start`.

Every run of the kit starts here or at a pool's ``launch`` (the magic and the panel call these): the options
are checked (:class:`~flair_nbddp.RunOptions`), the devices or the pool (``worker_source.source_for``), a
:class:`~flair_nbddp.Run` is built on that worker source (and recorded in the run ledger), and :func:`launch`
shows it in the view that fits, picked before any worker starts (:mod:`flair_nbddp.engine.watch`), while it waits.
"""

from __future__ import annotations

from typing import Any, Callable

from .ledger.provenance import Provenance
from .options import RunOptions, documented
from .engine.restarts import RestartingRun
from .result import RunResult
from .engine.run import Run
from .engine.watch import launch_and_watch
from .engine.worker_source import WorkerSource, source_for

_START_DECIDES = {  # options start() takes none of
    "dashboard": "start() shows nothing; launch() shows the run",
}


@documented(*_START_DECIDES)
def start(
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    options: RunOptions | None = None,
    pool: WorkerSource | None = None,
    provenance: Provenance | None = None,
    **run_options: Any,
) -> Run | RestartingRun:
    """Start ``fn(*args, **kwargs)`` on every device and return the running :class:`~flair_nbddp.Run` at once.

    For code that must not block (a widget, a loop that watches several things). Arguments and errors as
    for :func:`launch`; nothing is shown: read ``run.state.snapshot()``, or show a
    :class:`~flair_nbddp.notebook.dashboard.Dashboard` of it. With ``max_restarts`` (or ``on_oom="halve_chunk"``)
    it returns a :class:`~flair_nbddp.engine.restarts.RestartingRun`, used the same way: a thread starts the run again
    from its last checkpoint when a rank fails, ``run.current`` is the attempt running now, and ``run.wait()``
    returns the last attempt's result with every attempt listed.

    Run options (keywords, or ``options=RunOptions(...)``; keywords win):
        {run_options}

    Example::

        run = start(train, (corpus,), processes=2)
        run.state.snapshot().status  # 'running'
        run.stop()
        run.wait().status  # 'stopped'
    """
    options = RunOptions.of(run_options, options, where="start(): ", not_here=_START_DECIDES)
    provenance = provenance or Provenance("start")
    if options.max_restarts or options.on_oom == "halve_chunk":
        return RestartingRun(fn, args, kwargs or {}, options, pool, provenance).start()
    return Run(fn, args, kwargs or {}, source_for(options, pool), options, provenance=provenance).start()


@documented()
def launch(
    fn: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    options: RunOptions | None = None,
    pool: WorkerSource | None = None,
    provenance: Provenance | None = None,
    **run_options: Any,
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
        options: a :class:`~flair_nbddp.RunOptions` to start from (keywords given beside it win).
        pool: run on these warm workers instead of starting new ones (a :class:`~flair_nbddp.WorkerPool`,
            or any :class:`~flair_nbddp.engine.worker_source.WorkerSource`); ``processes``/``device``, if given, must
            match.
        provenance: what the run ledger records of how the run was asked for
            (:class:`~flair_nbddp.ledger.provenance.Provenance`: the magic and the panel describe theirs); default a
            call of ``fn`` with its ``args`` and ``kwargs``. Every run is recorded (:func:`flair_nbddp.history`)
            unless ``$FLAIR_NBDDP_LEDGER`` is ``0``.

    Run options (keywords, or ``options=RunOptions(...)``):
        {run_options}

    Raises:
        WorkerError: a rank failed (``.rank``, the remote traceback, ``.result`` with the logs).
        RunTimeoutError, RunHangError: the run exceeded ``timeout`` / made no progress.
        ShippingError: ``fn`` or an argument cannot be sent to the workers (names which one).
        UnknownOptionError: a keyword that is not a run option (names the closest one).
        DeviceError: impossible devices, GPUs or process counts, or ones a given ``pool`` does not have.
        ClusterError: the cluster is unreachable, has too few workers for ``processes``, or its workers lack the
            kit (the message says what it has).
        UnsupportedPlatformError: on Windows (the workers need POSIX).
        DashboardUnavailableError: ``dashboard=True`` outside a Jupyter kernel.
        RunActiveError: another run (of this kernel, another kernel or another user) holds a device it needs, or no
            device is free (the message names the holder); with ``wait_for_devices`` only once that time is spent.

    Each but the first two is raised before any worker starts; all derive from :class:`FlairNbddpError`.

    Example::

        def train(corpus):
            trainer = ModelTrainer(make_classifier(corpus), corpus)
            return trainer.train("out", max_epochs=2, multi_gpu=True)
        result = launch(train, args=(corpus,), processes=2)
        result.value["test_score"], result.world_size  # (0.91, 2)
        result = launch(train, (corpus,), cluster=client)      # one rank per Dask worker of the cluster
    """
    return launch_and_watch(
        fn, args, kwargs, RunOptions.of(run_options, options, where="launch(): "), pool, provenance or Provenance("launch")
    )


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
