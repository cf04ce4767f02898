"""The worker process: ``python -m flair_nbddp.worker``, one per rank, started by the launcher.

Lifecycle: read the launch spec from stdin, listen to the parent, set the device, unpack the payload,
join the process group, seed, run the function, write rank 0's result, leave the group. Stdout and
stderr are the rank's log file (the parent tails rank 0's into the cell). Never imports IPython or
ipywidgets.

The channel to the parent carries events up and requests down (:data:`~flair_nbddp.events.STOP`); when
it closes, the parent is gone (the kernel died or restarted) and the worker exits at once.
``SIGUSR1`` writes every thread's Python stack to the rank's stacks file (the hang watchdog uses it).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any

from .events import STOP, STOP_REQUESTED, EventSender, Failed, Finished, Heartbeat, ResultReady, Started

HEARTBEAT_SECONDS = 1.0


def _listen_to_parent(sender: EventSender, on_stop: threading.Event) -> None:
    """Handle the parent's requests; exit as soon as its end of the channel closes."""

    def listen() -> None:
        try:
            while True:
                if sender.connection.recv() == STOP:
                    on_stop.set()
        except (EOFError, OSError):
            os._exit(3)

    threading.Thread(target=listen, name="flair_nbddp-parent", daemon=True).start()


class _Vitals:
    """What the heartbeat reports; filled in as the worker gets going (imports come first)."""

    device: Any = None
    counters: Any = None

    def memory_bytes(self) -> int:
        if self.device is not None and self.device.type == "cuda":
            import torch

            return int(torch.cuda.memory_allocated(self.device))
        import psutil

        return int(psutil.Process().memory_info().rss)


def _main_thread_activity() -> int:
    """A hash of the functions on the main thread's stack (line numbers left out: a spinning loop is stuck)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    functions = []
    while frame is not None:
        functions.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    return hash(tuple(functions))


def _start_heartbeat(sender: EventSender, rank: int, vitals: _Vitals) -> None:
    """Every second from start-up on: liveness, throughput and the main thread's activity."""

    def beat() -> None:
        while True:
            counters = vitals.counters
            sender.send(
                Heartbeat(
                    rank,
                    counters.step if counters else 0,
                    counters.samples if counters else 0,
                    counters.samples_per_second if counters else 0.0,
                    vitals.memory_bytes(),
                    activity=_main_thread_activity(),
                )
            )
            pause.wait(HEARTBEAT_SECONDS)

    pause = threading.Event()
    threading.Thread(target=beat, name="flair_nbddp-heartbeat", daemon=True).start()


def _join_process_group(spec: dict) -> None:
    import torch.distributed as dist

    # rank 0 serves the store on the loopback socket the parent bound for it
    store = dist.TCPStore(
        "127.0.0.1",
        spec["port"],
        spec["world_size"],
        spec["rank"] == 0,
        timeout=datetime.timedelta(seconds=spec["rendezvous_timeout"]),
        master_listen_fd=spec.get("listen_fd"),
    )
    dist.init_process_group(spec["backend"], store=store, rank=spec["rank"], world_size=spec["world_size"])


def _return_value(spec: dict, value: Any) -> None:
    from . import flair_compat, payload

    try:
        payload.write_result(spec["result"], value)
    except payload.ShippingError as error:
        if flair_compat.SAVED_MODELS:
            saved = ", ".join(str(path.resolve()) for path in flair_compat.SAVED_MODELS)
            raise payload.ShippingError(f"{error} The trained model is safe: rank 0 saved {saved}.") from error
        raise


def run(spec: dict, sender: EventSender, vitals: _Vitals) -> None:
    """Everything a rank does between start-up and exit (see the module docstring)."""
    rank, world_size = spec["rank"], spec["world_size"]
    sys.path[:0] = [entry for entry in spec["sys_path"] if entry not in sys.path]

    import flair
    import torch
    import torch.distributed as dist

    from . import flair_compat, payload

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    flair.device = vitals.device = device
    vitals.counters = flair_compat.TrainingCounters()
    flair_compat.allow_cpu_ddp()
    flair_compat.instrument_trainer(sender, rank, world_size, vitals.counters)

    fn, args, kwargs = payload.read_payload(spec["payload"])
    _join_process_group(spec)
    sender.send(Started(rank, os.getpid(), str(device)))
    flair_compat.seed_everything(spec["seed"])

    value = fn(*args, **kwargs)

    if rank == 0:
        _return_value(spec, value)
        sender.send(ResultReady(0, spec["result"]))
    sender.send(Finished(rank))
    dist.destroy_process_group()


def main() -> None:
    """Entry point of ``python -m flair_nbddp.worker`` (the spec arrives as JSON on stdin)."""
    spec = json.loads(sys.stdin.read())
    sender = EventSender.from_fd(spec["fd"])
    _listen_to_parent(sender, STOP_REQUESTED)
    vitals = _Vitals()
    _start_heartbeat(sender, spec["rank"], vitals)
    stacks = open(spec["stacks"], "w")  # noqa: SIM115 - stays open for faulthandler until exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        run(spec, sender, vitals)
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the parent
        formatted = traceback.format_exc()
        print(formatted, file=sys.stderr, flush=True)
        sender.send(Failed(spec["rank"], type(error).__name__, str(error), formatted))
        # skip interpreter teardown: a collective's peers may be gone, and destroying the group could hang
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
