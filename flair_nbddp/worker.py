"""The worker process: ``python -m flair_nbddp.worker``, one per rank, started by the launcher.

Lifecycle: read the launch spec from stdin, watch the parent, set the device, unpack the payload,
join the process group, seed, run the function, write rank 0's result, leave the group. Stdout and
stderr are the rank's log file (the parent tails rank 0's into the cell). Never imports IPython or
ipywidgets.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from typing import Any

from .events import EventSender, Failed, Finished, Heartbeat, ResultReady, Started

HEARTBEAT_SECONDS = 1.0


def _watch_parent(sender: EventSender) -> None:
    """Exit as soon as the parent's end of the channel closes (the kernel died or restarted)."""

    def watch() -> None:
        try:
            while True:
                sender.connection.recv()
        except (EOFError, OSError):
            os._exit(3)

    threading.Thread(target=watch, name="flair_nbddp-parent-watch", daemon=True).start()


def _memory_bytes(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


def _start_heartbeat(sender: EventSender, rank: int, device: Any, counters: Any) -> None:
    def beat() -> None:
        while True:
            sender.send(
                Heartbeat(rank, counters.step, counters.samples, counters.samples_per_second, _memory_bytes(device))
            )
            stop.wait(HEARTBEAT_SECONDS)

    stop = threading.Event()
    threading.Thread(target=beat, name="flair_nbddp-heartbeat", daemon=True).start()


def run(spec: dict, sender: EventSender) -> None:
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
    flair.device = device
    counters = flair_compat.TrainingCounters()
    flair_compat.allow_cpu_ddp()
    flair_compat.instrument_trainer(sender, rank, world_size, counters)

    fn, args, kwargs = payload.read_payload(spec["payload"])
    dist.init_process_group(spec["backend"], init_method="env://", rank=rank, world_size=world_size)
    sender.send(Started(rank, os.getpid(), str(device)))
    _start_heartbeat(sender, rank, device, counters)
    flair_compat.seed_everything(spec["seed"])

    value = fn(*args, **kwargs)

    if rank == 0:
        payload.write_result(spec["result"], value)
        sender.send(ResultReady(0, spec["result"]))
    sender.send(Finished(rank))
    dist.destroy_process_group()


def main() -> None:
    """Entry point of ``python -m flair_nbddp.worker`` (the spec arrives as JSON on stdin)."""
    spec = json.loads(sys.stdin.read())
    sender = EventSender.from_fd(spec["fd"])
    _watch_parent(sender)
    try:
        run(spec, sender)
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
