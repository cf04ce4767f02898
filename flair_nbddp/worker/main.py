"""The worker process: :func:`main` with the channel's descriptor as its argument, one per rank, started by a
WorkerGroup (the parent's copy of the kit first on its path).

Lifecycle: read the :class:`~flair_nbddp.wire.events.WorkerSpec` from the channel, listen to the parent, then
run every :class:`~flair_nbddp.wire.events.Job` it sends until it says EXIT. Stdout and stderr go to
``rank<r>.log`` of the job's run directory while the job runs (the parent tails rank 0's into the cell),
and to the group's own log between jobs. The first job sets the worker up (device, process group, flair
bent once it is imported), so what set-up prints lands in that job's log. Each job is then unpacked,
checked (a tiny all-reduce over every rank), seeded and run, and rank 0 writes its result to a file.
Never imports IPython or ipywidgets.

The channel carries events up and requests down (the spec, jobs, STOP, EXIT); when it closes, the
parent is gone (the kernel died or restarted) and the worker exits at once. ``SIGUSR1`` writes every
thread's Python stack to the rank's stacks file (the hang watchdog uses it).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import importlib
import importlib.abc
import importlib.util
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from ..errors import HealthCheckError
from ..engine.rundir import RunDir
from ..wire import lazy_corpus, payload, pool_ref
from ..wire.events import (
    EXIT,
    STOP,
    STOP_REQUESTED,
    EventSender,
    Failed,
    Finished,
    Heartbeat,
    Job,
    ResultReady,
    Started,
    WorkerSpec,
)
from . import (
    allocator,
    checkpoint_files,
    clean_tokens,
    compiled,
    ddp_exec,
    direct_embeddings,
    distributed_eval,
    fast_inputs,
    no_waits,
    one_rank,
    precision,
    predict_rank,
    process_name,
    rank_zero_loggers,
    token_gathers,
)
from .counters import TrainingCounters

HEARTBEAT_SECONDS = 1.0


class _LoggerState:
    """The ``flair`` logger as set up, restored before every job.

    flair disables its logger on ranks > 0 and never re-enables it, and a failed training can leave its
    log-file handler attached: on a warm worker the next job would inherit both.
    """

    def __init__(self) -> None:
        self._handlers: list = []
        self._level = 0

    def remember(self) -> None:
        log = logging.getLogger("flair")
        self._handlers, self._level = list(log.handlers), log.level

    def restore(self) -> None:
        log = logging.getLogger("flair")
        for handler in [h for h in log.handlers if h not in self._handlers]:
            log.removeHandler(handler)
            handler.close()
        log.disabled, log.level = False, self._level


class _Vitals:
    """What the heartbeat reports, and what a job resets; filled in as the worker gets going."""

    device: Any = None
    counters: Any = None
    control_group: Any = None  # gloo group of every rank for the per-batch stop agreement (None: one process)
    store: Any = None  # the rendezvous store (a TCPStore), which the ranks also agree through
    warnings_handler: Any = None  # the current job's copy of flair's warnings to its stderr file
    nvml = True  # False once NVML could not be read: the heartbeat stops asking every second
    idle = True  # a worker waiting for its next job sends no heartbeats

    def __init__(self) -> None:
        self.flair_logger = _LoggerState()

    def memory(self) -> tuple[int, int, int | None]:
        """Resident host memory, torch's GPU memory, and the GPU's utilisation in percent (None without NVML)."""
        import psutil

        host = int(psutil.Process().memory_info().rss)
        if self.device is None or self.device.type != "cuda":
            return host, 0, None
        import torch

        utilization: int | None = None
        if self.nvml:
            try:
                utilization = int(torch.cuda.utilization(self.device))
            except Exception:  # noqa: BLE001 - no nvidia-ml-py, or NVML cannot read this GPU: it stays so
                self.nvml = False
        return host, int(torch.cuda.memory_allocated(self.device)), utilization


def _listen_to_parent(sender: EventSender, jobs: queue.Queue) -> None:
    """Route the parent's requests; exit as soon as its end of the channel closes."""

    def listen() -> None:
        try:
            while True:
                message = sender.connection.recv()
                if message == STOP:
                    STOP_REQUESTED.set()
                    ddp_exec.interrupt_cell()  # a %%ddp_exec cell running: KeyboardInterrupt inside it
                elif message == EXIT:
                    jobs.put(None)
                else:  # a new job: a STOP for it can only come after it, even one sent during set-up
                    STOP_REQUESTED.clear()
                    jobs.put(message)
        except (EOFError, OSError):
            os._exit(3)

    threading.Thread(target=listen, name="flair_nbddp-parent", daemon=True).start()


def _main_thread_activity() -> int:
    """A hash of the functions on the main thread's stack (line numbers left out: a spinning loop is stuck)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    functions = []
    while frame is not None:
        functions.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    return hash(tuple(functions))


def _heartbeat(rank: int, vitals: _Vitals) -> Heartbeat:
    """This rank's vitals now: step, samples, throughput, memory, the main thread's activity."""
    counters = vitals.counters
    host, gpu, utilization = vitals.memory()
    return Heartbeat(
        rank,
        counters.step if counters else 0,
        counters.samples if counters else 0,
        counters.samples_per_second if counters else 0.0,
        host,
        gpu,
        utilization,
        activity=_main_thread_activity(),
    )


def _start_heartbeat(sender: EventSender, rank: int, vitals: _Vitals) -> None:
    """Every second from start-up on: liveness, throughput and the main thread's activity."""

    def beat() -> None:
        while True:
            if not vitals.idle:
                sender.send(_heartbeat(rank, vitals))
            time.sleep(HEARTBEAT_SECONDS)

    threading.Thread(target=beat, name="flair_nbddp-heartbeat", daemon=True).start()


def _when_imported(name: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` right after module ``name`` is first imported (at once if it already is)."""
    if name in sys.modules:
        callback()
        return

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            load = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                load(module)
                callback()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterImport())


def _attach_warnings(vitals: _Vitals) -> None:
    """Put the job's warnings handler on flair's logger (again: importing flair replaces the logger's handlers)."""
    log = logging.getLogger("flair")
    if vitals.warnings_handler is not None and vitals.warnings_handler not in log.handlers:
        log.addHandler(vitals.warnings_handler)


def _bend_flair(spec: WorkerSpec, sender: EventSender, vitals: _Vitals) -> None:
    """Point flair at this rank's device and instrument its trainer (once flair is imported)."""
    import flair

    from . import flair_compat

    flair.device = vitals.device
    flair_compat.allow_cpu_ddp()
    one_rank.install()
    rank_zero_loggers.install()
    flair_compat.scale_gradients_together()
    flair_compat.instrument_trainer(sender, spec.rank, spec.world_size, vitals.counters, vitals.control_group)
    distributed_eval.install(spec.rank, spec.world_size, vitals.control_group, vitals.store)
    lazy_corpus.keep_stored_embeddings()
    fast_inputs.install()
    direct_embeddings.install()
    token_gathers.install()
    clean_tokens.install()
    no_waits.install(flair_compat.model_subclasses())
    precision.install()
    compiled.install()
    vitals.flair_logger.remember()  # with the handlers flair's import configured (which dropped any other)
    _attach_warnings(vitals)


def _preload(modules: tuple[str, ...]) -> None:
    """Import what the first job needs while the parent packs it. A module that fails to import is left for
    the job, which imports it again and reports the error where the cell shows it."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - reported by the job's own import
            return


def set_up(spec: WorkerSpec, sender: EventSender, vitals: _Vitals) -> None:
    """Pick the device and join the process group (once per worker).

    flair is bent as soon as it is imported, by the job or by its payload: a job that never imports flair
    does not pay for it (seconds per worker).
    """
    import torch
    import torch.distributed as dist
    from torch.torch_version import TorchVersion

    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    vitals.device, vitals.counters = device, TrainingCounters()
    vitals.flair_logger.remember()
    # rank 0 serves the store on the socket its parent bound for it (loopback, or its cluster worker's address);
    # before torch 2.8 the libuv store (the default from 2.4) cannot serve an inherited socket, and the other one
    # (the default before) can
    vitals.store = store = dist.TCPStore(
        spec.host,
        spec.port,
        spec.world_size,
        spec.rank == 0,
        timeout=datetime.timedelta(seconds=spec.rendezvous_timeout),
        master_listen_fd=int(sys.argv[2]) if len(sys.argv) > 2 else None,  # rank 0: the socket it inherited
        use_libuv=TorchVersion(torch.__version__) >= (2, 8),
    )
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size)
    if spec.world_size > 1:  # on CPU tensors: a collective on the GPU's group would make every batch wait for it
        vitals.control_group = dist.new_group(backend="gloo")
    _when_imported("flair", lambda: _bend_flair(spec, sender, vitals))


def _check_health(world_size: int, device: Any) -> None:
    """A tiny all-reduce over every rank before a job: the group is whole and answers."""
    import torch
    import torch.distributed as dist

    ones = torch.ones(1, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(ones)
    if int(ones.item()) != world_size:
        raise HealthCheckError(f"health check failed: the all-reduce summed to {ones.item()}, not {world_size}")


def _return_value(job: Job, value: Any) -> None:
    try:
        payload.write_result(job.result, value)
    except payload.ShippingError as error:
        saved_models = sys.modules["flair_nbddp.worker.flair_compat"].SAVED_MODELS if "flair" in sys.modules else []
        if saved_models:
            saved = ", ".join(str(path.resolve()) for path in saved_models)
            raise type(error)(f"{error} The trained model is safe: rank 0 saved {saved}.") from error
        raise


def _reset_between_jobs(vitals: _Vitals) -> None:
    vitals.counters.reset()
    vitals.flair_logger.restore()
    if "flair" in sys.modules:
        import flair

        from . import flair_compat

        flair_compat.SAVED_MODELS.clear()
        flair.device = vitals.device


def _release_memory(vitals: _Vitals) -> None:
    """Free a finished job's cycles and cached GPU memory while the worker waits for the next job."""
    gc.collect()
    allocator.give_back_free_memory()
    if vitals.device is not None and vitals.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


class _WarningsToStderrFile(logging.Handler):
    """flair's warnings and errors (its logger writes to stdout) copied to the rank's stderr file, which the
    parent shows for every rank."""

    def __init__(self, path: os.PathLike) -> None:
        super().__init__(logging.WARNING)
        self._path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with open(self._path, "a", encoding="utf-8") as handle:
                handle.write(f"{record.levelname}: {record.getMessage()}\n")
        except Exception:  # noqa: BLE001 - as any logging handler: report it, never fail the training
            self.handleError(record)


@contextlib.contextmanager
def _output_to(run_dir: RunDir, rank: int) -> Iterator[None]:
    """For a while, send this process's stdout (Python's and native code's) to ``rank<r>.log``, and its stderr
    through ``tee`` to ``rank<r>.log`` and ``rank<r>.stderr``. ``tee`` is a process of its own: it drains
    what the worker wrote even if the worker dies, so a crash's last words are never lost."""
    log, stderr = run_dir.log(rank), run_dir.stderr(rank)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.close(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))  # private before tee opens it
    read_end, write_end = os.pipe()
    try:
        # a session of its own: ending the worker's process group must not cut off what tee has still to write
        tee = subprocess.Popen(
            ["tee", "-a", str(log), str(stderr)], stdin=read_end, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(read_end)
    try:
        os.dup2(log_fd, 1)
        os.dup2(write_end, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (log_fd, write_end, *saved):
            os.close(fd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            tee.wait(timeout=5)  # it exits with the pipe's last writer (a child of the job may hold it longer)


def run_job(spec: WorkerSpec, job: Job, sender: EventSender, vitals: _Vitals) -> None:
    """One job: fresh state, health check, seed, ``fn(*args, **kwargs)``, rank 0's result."""
    rank = spec.rank
    _reset_between_jobs(vitals)  # restores flair's logger: the warnings handler goes on after it
    vitals.warnings_handler = _WarningsToStderrFile(RunDir(Path(job.run_dir)).stderr(rank))
    _attach_warnings(vitals)
    pool_ref.keep_only(job.shared)  # what was released since the last job goes
    fn, args, kwargs = payload.read_payload(job.payload, job.lazy_corpus)
    # a shipped corpus is millions of objects that live as long as the job: keep the cyclic collector
    # from rescanning them at every full collection (~11 s each for 50,000 IMDB-length documents).
    # No collection first: the last job's garbage went while the worker waited (_release_memory). One after it,
    # over what is not frozen (nothing yet), resets the collector's measure of long-lived objects: without it
    # the next full collection waits for garbage a quarter the size of everything frozen, and the sentences a
    # lazy corpus builds and drops (cycles: each token points to its sentence) would pile up until then.
    gc.freeze()
    gc.collect()
    try:
        _check_health(spec.world_size, vitals.device)
        sender.send(Started(rank, os.getpid(), str(vitals.device), socket.gethostname()))
        _seed_everything(job.seed)
        ddp_exec.begin_job(rank, spec.world_size, vitals.device, vitals.store, job.key)
        predict_rank.start_job(sender, rank, vitals.store, job.key, vitals.counters)
        distributed_eval.start_job(f"flair_nbddp/{job.key}", job.distributed_eval)
        fast_inputs.start_job(job.fast_inputs, ahead=vitals.device.type != "cpu")
        direct_embeddings.start_job(job.direct_embeddings)
        token_gathers.start_job(job.direct_embeddings)
        clean_tokens.start_job(job.skip_clean_tokens)
        precision.start_job(job.precision)
        compiled.start_job(job.compile_model, vitals.device.type)
        checkpoint_files.start_job(job.run_dir, job.resume, job.resume_sha256, job.chunk_size, job.checkpoint_every)
        try:
            value = fn(*args, **kwargs)
        finally:
            distributed_eval.end_job()

        if rank == 0:
            _return_value(job, value)
            sender.send(ResultReady(0, job.result))
    finally:
        gc.unfreeze()  # a warm worker must be able to free this job's objects
        logging.getLogger("flair").removeHandler(vitals.warnings_handler)
        vitals.warnings_handler = None
    sender.send(_heartbeat(rank, vitals))  # the result's per-rank figures are the final ones, not a second old
    vitals.idle = True  # no heartbeat of this job may reach the next one's state


def _seed_everything(seed: int) -> None:
    """The same seed on every rank (flair's corpus check samples with ``random``): what ``flair.set_seed`` does."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def memory_report(error: BaseException, vitals: _Vitals) -> dict | None:
    """For an out-of-memory error (torch's on a GPU, Python's ``MemoryError`` on the host): the device, the memory
    in use and its total (GiB), flair's batch sizes and the batch being trained; None for any other error."""
    if not (isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"):
        return None
    report: dict[str, Any] = {"device": str(vitals.device), **vitals.counters.batch_sizes}
    if vitals.counters.epoch:
        report.update(epoch=vitals.counters.epoch, batch=vitals.counters.batch)
    gib = 2.0**30
    try:
        if vitals.device is not None and vitals.device.type == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(vitals.device)
            report.update(in_use_gib=(total - free) / gib, total_gib=total / gib)
        else:
            import psutil

            report.update(in_use_gib=psutil.Process().memory_info().rss / gib,
                          total_gib=psutil.virtual_memory().total / gib)  # fmt: skip
    except Exception:  # noqa: BLE001 - the report goes without the figures it could not read
        pass
    return report


def _report_and_exit(
    rank: int, sender: EventSender, error: BaseException, formatted: str | None = None, memory: dict | None = None
) -> None:
    """Send ``Failed`` (the traceback printed to stderr, unless ``formatted`` says it was) and exit at once."""
    if formatted is None:
        formatted = traceback.format_exc()
        print(formatted, file=sys.stderr, flush=True)
    sender.send(Failed(rank, type(error).__name__, str(error), formatted, memory))
    # skip interpreter teardown: a collective's peers may be gone, and destroying the group could hang
    os._exit(1)


def serve(spec: WorkerSpec, job: Job, sender: EventSender, vitals: _Vitals) -> None:
    """Run ``job`` with this process's output in its run directory, setting the worker up first if it is new
    (so that what set-up prints, or the error it fails with, lands in that job's log). ``Finished`` or
    ``Failed`` goes up only once the output is all in the files: the parent reads them one last time then."""
    failure: tuple[BaseException, str] | None = None
    with _output_to(RunDir(Path(job.run_dir)), spec.rank):
        try:
            if vitals.device is None:
                set_up(spec, sender, vitals)
            run_job(spec, job, sender, vitals)
        except BaseException as error:  # noqa: BLE001 - every failure is reported to the parent
            failure = error, traceback.format_exc()
            print(failure[1], file=sys.stderr, flush=True)
    if failure is not None:
        _report_and_exit(spec.rank, sender, *failure, memory_report(failure[0], vitals))
    sender.send(Finished(spec.rank))


def main() -> None:
    """A worker's life: the spec, then jobs, all from the channel whose descriptor is ``sys.argv[1]`` (rank 0's
    store serves on the listening socket ``sys.argv[2]``)."""
    connection = Connection(int(sys.argv[1]))
    spec: WorkerSpec = connection.recv()
    process_name.set_name(process_name.rank_name(spec.rank))  # its name in ps and top: "flair_nbddp r0"
    sender = EventSender(connection)
    jobs: queue.Queue = queue.Queue()
    _listen_to_parent(sender, jobs)
    vitals = _Vitals()
    allocator.keep_freed_blocks()
    _start_heartbeat(sender, spec.rank, vitals)
    sys.path[:0] = [entry for entry in spec.sys_path if entry not in sys.path]  # notebook-local modules import
    pool_ref.HOST_DIR = spec.shared_dir
    ddp_exec.install_interrupts()  # a STOP interrupts a %%ddp_exec cell, and nothing else
    try:
        # private like every file of the run; stays open for faulthandler until exit
        stacks = os.fdopen(os.open(spec.stacks, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        _preload(spec.preload)
        job = jobs.get()
        while job is not None:
            vitals.idle = False
            serve(spec, job, sender, vitals)
            try:
                job = jobs.get_nowait()  # a cold worker's EXIT is already here: leave without tidying up
            except queue.Empty:
                _release_memory(vitals)  # now, not on the next job's way to its first batch
                job = jobs.get()
    except BaseException as error:  # noqa: BLE001 - e.g. a run directory that cannot be written
        _report_and_exit(spec.rank, sender, error)
    if vitals.device is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    _leave()


def _leave() -> None:
    """Exit now, as the interpreter would but for its teardown: what was registered to run at exit runs (flushing
    logging's files, a W&B run's finish) and the output is flushed, but the objects the jobs left are not collected
    and freed one by one, which after a training takes seconds (3 s and more for a small model on 2 CPU ranks)
    while the notebook waits for the worker to be gone."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

