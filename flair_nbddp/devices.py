"""Which devices a run uses: device type, number of processes, backend, and each rank's environment.

Example:
    >>> plan = resolve_devices(device="cpu", processes=2)
    >>> plan.device_type, plan.world_size, plan.backend
    ('cpu', 2, 'gloo')
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from .errors import DeviceError

DEVICE_ENV = "FLAIR_NBDDP_DEVICE"
PROCESSES_ENV = "FLAIR_NBDDP_PROCESSES"
DEFAULT_CPU_PROCESSES = 2
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class DevicePlan:
    """Where a run's processes go.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
        world_size: number of worker processes (one per GPU on CUDA).
        backend: ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
    """

    device_type: str
    world_size: int
    backend: str

    def mismatch(self, processes: int | None, device: str | None) -> str | None:
        """Why a run asking for ``processes``/``device`` cannot use this plan's workers (None: it can, or
        it left them out).

        Example:
            >>> DevicePlan("cpu", 2, "gloo").mismatch(4, None)
            '2 × cpu, not 4 × cpu'
        """
        have = (self.world_size, self.device_type)
        wanted = (processes or have[0], device or have[1])
        return None if wanted == have else f"{have[0]} × {have[1]}, not {wanted[0]} × {wanted[1]}"

    def device_for(self, rank: int) -> str:
        """The torch device string of ``rank``: ``"cuda:<rank>"`` or ``"cpu"``."""
        return f"cuda:{rank}" if self.device_type == "cuda" else "cpu"

    def rank_environment(self, rank: int, port: int) -> dict[str, str]:
        """Variables a worker needs for ``init_process_group(init_method="env://")``."""
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "PYTHONUNBUFFERED": "1",
        }
        # keep every connection between ranks on loopback (unless the user chose an interface)
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", "lo")
        if self.device_type == "cpu":
            # one process per core share: keep the ranks from oversubscribing the CPU
            env["OMP_NUM_THREADS"] = os.environ.get(
                "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.world_size))
            )
        return env


def visible_gpu_count() -> int:
    """Number of CUDA devices torch can see, without creating a CUDA context in this process."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _env_device() -> str | None:
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if value and value not in DEVICE_TYPES:
        raise DeviceError(f"{DEVICE_ENV}={value!r} is not understood: set it to 'cpu' or 'cuda', or unset it.")
    return value or None


def _env_processes() -> int | None:
    value = os.environ.get(PROCESSES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise DeviceError(f"{PROCESSES_ENV}={value!r} is not a positive integer: set it to e.g. 2, or unset it.")
    return int(value)


def resolve_devices(device: str | None = None, processes: int | None = None) -> DevicePlan:
    """Decide the device type, world size and backend of a run.

    Explicit arguments win over the environment variables ``FLAIR_NBDDP_DEVICE`` (``cpu``/``cuda``) and
    ``FLAIR_NBDDP_PROCESSES``, which win over the defaults: every visible GPU with NCCL, else
    2 CPU processes with gloo.

    Raises:
        DeviceError: (a ``ValueError``) for a device other than cpu/cuda, a non-positive process count, CUDA
            without GPUs, or more CUDA processes than GPUs.
    """
    if device is not None:
        device = str(device).strip().lower()
        if device.startswith("cuda:"):
            raise DeviceError(
                f"device={device!r} names one GPU; a run uses one process per GPU. Pass device='cuda' and "
                "choose GPUs with CUDA_VISIBLE_DEVICES, or processes=N for the first N."
            )
        if device not in DEVICE_TYPES:
            raise DeviceError(f"device={device!r} is not supported: use 'cuda', 'cpu' or None (automatic).")
    device = device or _env_device()
    if processes is None:
        processes = _env_processes()
    elif isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise DeviceError(f"processes={processes!r} must be a positive integer (or None for every device).")

    gpus = visible_gpu_count()
    if device is None:
        device = "cuda" if gpus else "cpu"
    if device == "cuda":
        if gpus == 0:
            raise DeviceError(
                "device='cuda' was asked for, but torch sees no GPU (torch.cuda.is_available() is False). "
                "Use device='cpu' to rehearse on CPU processes, or check CUDA_VISIBLE_DEVICES and the driver."
            )
        processes = processes or gpus
        if processes > gpus:
            raise DeviceError(
                f"processes={processes} but only {gpus} GPU(s) are visible: NCCL needs one GPU per process. "
                f"Use processes<={gpus}, or device='cpu' for CPU processes."
            )
        return DevicePlan("cuda", processes, "nccl")
    return DevicePlan("cpu", processes or DEFAULT_CPU_PROCESSES, "gloo")


def rendezvous_socket() -> socket.socket:
    """A listening TCP socket on 127.0.0.1 at a free port, for rank 0's rendezvous store.

    Rank 0 inherits it (``TCPStore(master_listen_fd=...)``), so the store listens on loopback only and
    no other process can take the port between choosing and binding it.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock
