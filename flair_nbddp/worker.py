"""The worker process: ``python -m flair_nbddp.worker``, one per rank, started by a WorkerGroup.

Lifecycle: read the spec from stdin, listen to the parent, set the device, join the process group,
bend flair once it is imported, then run jobs: the spec's first one, and in a pool every job the parent sends after it. Each job is
checked (a tiny all-reduce over every rank), seeded, run, and its rank-0 result written to a file.
Stdout and stderr are the rank's log file (the parent tails rank 0's into the cell). Never imports
IPython or ipywidgets.

The channel to the parent carries events up and requests down (a job, STOP, EXIT); when it closes,
the parent is gone (the kernel died or restarted) and the worker exits at once. ``SIGUSR1`` writes
every thread's Python stack to the rank's stacks file (the hang watchdog uses it).
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import importlib.abc
import importlib.util
import json
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from typing import Any, Callable

from .events import EXIT, STOP, STOP_REQUESTED, EventSender, Failed, Finished, Heartbeat, ResultReady, Started

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
    idle = False  # a pool worker waiting for its next job sends no heartbeats

    def __init__(self) -> None:
        self.flair_logger = _LoggerState()

    def memory_bytes(self) -> int:
        if self.device is not None and self.device.type == "cuda":
            import torch

            return int(torch.cuda.memory_allocated(self.device))
        import psutil

        return int(psutil.Process().memory_info().rss)


def _listen_to_parent(sender: EventSender, jobs: queue.Queue) -> None:
    """Route the parent's requests; exit as soon as its end of the channel closes."""

    def listen() -> None:
        try:
            while True:
                message = sender.connection.recv()
                if message == STOP:
                    STOP_REQUESTED.set()
                else:
                    jobs.put(None if message == EXIT else message)
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
    return Heartbeat(
        rank,
        counters.step if counters else 0,
        counters.samples if counters else 0,
        counters.samples_per_second if counters else 0.0,
        vitals.memory_bytes(),
        activity=_main_thread_activity(),
    )


def _start_heartbeat(sender: EventSender, rank: int, vitals: _Vitals) -> None:
    """Every second from start-up on: liveness, throughput and the main thread's activity."""

    def beat() -> None:
        while True:
            if not vitals.idle:
                sender.send(_heartbeat(rank, vitals))
            pause.wait(HEARTBEAT_SECONDS)

    pause = threading.Event()
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


def _bend_flair(spec: dict, sender: EventSender, vitals: _Vitals) -> None:
    """Point flair at this rank's device and instrument its trainer (once flair is imported)."""
    import flair

    from . import flair_compat

    flair.device = vitals.device
    flair_compat.allow_cpu_ddp()
    flair_compat.instrument_trainer(sender, spec["rank"], spec["world_size"], vitals.counters, vitals.control_group)
    vitals.flair_logger.remember()  # with the handlers flair's import configured


def set_up(spec: dict, sender: EventSender, vitals: _Vitals) -> None:
    """Pick the device and join the process group (once per worker).

    flair is bent as soon as it is imported, by the job or by its payload: a job that never imports flair
    does not pay for it (seconds per worker).
    """
    sys.path[:0] = [entry for entry in spec["sys_path"] if entry not in sys.path]

    import torch
    import torch.distributed as dist

    from .counters import TrainingCounters

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    vitals.device, vitals.counters = device, TrainingCounters()
    vitals.flair_logger.remember()
    # rank 0 serves the store on the loopback socket the parent bound for it
    store = dist.TCPStore(
        "127.0.0.1",
        spec["port"],
        spec["world_size"],
        spec["rank"] == 0,
        timeout=datetime.timedelta(seconds=spec["rendezvous_timeout"]),
        master_listen_fd=spec["listen_fd"],
    )
    dist.init_process_group(spec["backend"], store=store, rank=spec["rank"], world_size=spec["world_size"])
    if spec["world_size"] > 1:  # on CPU tensors: a collective on the GPU's group would make every batch wait for it
        vitals.control_group = dist.new_group(backend="gloo")
    _when_imported("flair", lambda: _bend_flair(spec, sender, vitals))


def _check_health(world_size: int, device: Any) -> None:
    """A tiny all-reduce over every rank before a job: the group is whole and answers."""
    import torch
    import torch.distributed as dist

    ones = torch.ones(1, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(ones)
    if int(ones.item()) != world_size:
        raise RuntimeError(f"health check failed: the all-reduce summed to {ones.item()}, not {world_size}")


def _return_value(job: dict, value: Any) -> None:
    from . import payload

    try:
        payload.write_result(job["result"], value)
    except payload.ShippingError as error:
        saved_models = sys.modules["flair_nbddp.flair_compat"].SAVED_MODELS if "flair" in sys.modules else []
        if saved_models:
            saved = ", ".join(str(path.resolve()) for path in saved_models)
            raise payload.ShippingError(f"{error} The trained model is safe: rank 0 saved {saved}.") from error
        raise


def _reset_between_jobs(vitals: _Vitals) -> None:
    STOP_REQUESTED.clear()
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
    if vitals.device is not None and vitals.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def run_job(spec: dict, job: dict, sender: EventSender, vitals: _Vitals) -> None:
    """One job: fresh state, health check, seed, ``fn(*args, **kwargs)``, rank 0's result."""
    from . import payload

    rank = spec["rank"]
    _reset_between_jobs(vitals)
    fn, args, kwargs = payload.read_payload(job["payload"])
    # a shipped corpus is millions of objects that live as long as the job: keep the cyclic collector
    # from rescanning them at every full collection (~11 s each for 50,000 IMDB-length documents).
    # No collection first: the last job's garbage went while the worker waited (_release_memory).
    gc.freeze()
    try:
        _check_health(spec["world_size"], vitals.device)
        sender.send(Started(rank, os.getpid(), str(vitals.device)))
        _seed_everything(job["seed"])

        value = fn(*args, **kwargs)

        if rank == 0:
            _return_value(job, value)
            sender.send(ResultReady(0, job["result"]))
    finally:
        gc.unfreeze()  # a warm worker must be able to free this job's objects
    sender.send(_heartbeat(rank, vitals))  # the result's per-rank figures are the final ones, not a second old
    sender.send(Finished(rank))


def _seed_everything(seed: int) -> None:
    """The same seed on every rank (flair's corpus check samples with ``random``): what ``flair.set_seed`` does."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def main() -> None:
    """Entry point of ``python -m flair_nbddp.worker`` (the spec arrives as JSON on stdin)."""
    spec = json.loads(sys.stdin.read())
    sender = EventSender.from_fd(spec["fd"])
    jobs: queue.Queue = queue.Queue()
    _listen_to_parent(sender, jobs)
    vitals = _Vitals()
    _start_heartbeat(sender, spec["rank"], vitals)
    # private like every file of the run; stays open for faulthandler until exit
    stacks = os.fdopen(os.open(spec["stacks"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    job = spec["job"]
    try:
        set_up(spec, sender, vitals)
        while job is not None:
            run_job(spec, job, sender, vitals)
            if not spec["stay"]:
                break
            vitals.idle = True
            _release_memory(vitals)  # now, not on the next job's way to its first batch
            job = jobs.get()
            vitals.idle = False
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the parent
        formatted = traceback.format_exc()
        print(formatted, file=sys.stderr, flush=True)
        sender.send(Failed(spec["rank"], type(error).__name__, str(error), formatted))
        # skip interpreter teardown: a collective's peers may be gone, and destroying the group could hang
        os._exit(1)
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
