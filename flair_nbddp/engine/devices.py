"""Which devices a run uses: device type, number of processes, the GPUs, backend, and each rank's environment.

Example:
    >>> plan = resolve_devices(device="cpu", processes=2)
    >>> plan.device_type, plan.world_size, plan.backend
    ('cpu', 2, 'gloo')
    >>> str(plan)
    '2 × cpu (gloo)'
"""

from __future__ import annotations

import functools
import os
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import DeviceError, UnsupportedPlatformError

DEVICE_ENV = "FLAIR_NBDDP_DEVICE"
PROCESSES_ENV = "FLAIR_NBDDP_PROCESSES"
DEFAULT_CPU_PROCESSES = 2
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class DevicePlan:
    """Where a run's processes go.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
        world_size: number of worker processes (one per GPU on CUDA, unless they share them).
        backend: ``"nccl"`` on CUDA, ``"gloo"`` on CPU, and on CUDA when ranks share GPUs (NCCL cannot).
        gpus: the GPUs chosen with ``gpus=`` (or, when ranks share them, every GPU they share), as torch numbers
            them in this process: rank r runs on ``gpus[r % len(gpus)]``; None: the first ``world_size`` GPUs
            torch sees.
        cpu_share: on CPU, how many processes the cores are shared between (``OMP_NUM_THREADS`` of each is the
            cores over it, or over the run's processes if more); None: the CPU's process slots (:func:`cpu_slots`),
            so that runs side by side never oversubscribe the cores (threads spinning for cores made two one-process
            runs side by side 30 times slower) and a run's arithmetic does not depend on what else runs. A pool lent
            in slices shares them between all its workers.

    Example:
        >>> plan = DevicePlan("cuda", 4, "gloo", (0,))      # resolve_devices("cuda", 4, share_gpus=True), 1 GPU
        >>> str(plan), plan.device_for(3)
        ('4 × cuda sharing GPU 0 (gloo)', 'cuda:0')
    """

    device_type: str
    world_size: int
    backend: str
    gpus: tuple[int, ...] | None = None
    cpu_share: int | None = None

    def __str__(self) -> str:
        chosen = f" {','.join(map(str, self.gpus))}" if self.gpus is not None else ""
        if self.shares_gpus:
            chosen = f" sharing GPU{'s' if len(self.gpus) > 1 else ''}{chosen}"
        return f"{self.world_size} × {self.device_type}{chosen} ({self.backend})"

    @property
    def shares_gpus(self) -> bool:
        """True when several ranks run on one GPU (``share_gpus=True`` with more ranks than GPUs): a rehearsal."""
        return self.device_type == "cuda" and self.backend == "gloo"

    def rehearsal_notice(self) -> str | None:
        """What a run sharing GPUs says once as it starts; None for any other plan.

        Example:
            >>> DevicePlan("cuda", 2, "gloo", (0,)).rehearsal_notice()
            'rehearsal: 2 ranks share GPU 0 over gloo; speed is not representative'
        """
        if not self.shares_gpus:
            return None
        gpus = f"GPU{'s' if len(self.gpus) > 1 else ''} {','.join(map(str, self.gpus))}"
        return f"rehearsal: {self.world_size} ranks share {gpus} over gloo; speed is not representative"

    def mismatch(
        self, processes: int | None, device: str | None, gpus: Sequence[int] | None = None
    ) -> str | None:
        """Why a run asking for ``processes``/``device``/``gpus`` cannot use this plan's workers (None: it can,
        or it left them out).

        Example:
            >>> DevicePlan("cpu", 2, "gloo").mismatch(4, None)
            '2 × cpu (gloo), not 4 processes'
            >>> DevicePlan("cuda", 2, "nccl", (0, 2)).mismatch(None, None, [0, 1])
            '2 × cuda 0,2 (nccl), not GPUs 0,1'
        """
        wanted = []
        if processes is not None and processes != self.world_size:
            wanted.append(f"{processes} process{'es' if processes != 1 else ''}")
        if device is not None and device != self.device_type:
            wanted.append(f"device {device!r}")
        if gpus is not None and (
            self.device_type != "cuda" or tuple(gpus) != (self.gpus or tuple(range(self.world_size)))
        ):
            wanted.append(f"GPUs {','.join(map(str, gpus))}")
        return f"{self}, not {' and '.join(wanted)}" if wanted else None

    def device_for(self, rank: int) -> str:
        """The torch device string of ``rank``: ``"cuda:<rank>"`` or ``"cpu"`` (with ``gpus``, each worker sees
        only the chosen GPUs, in their order, so rank r's is its ``cuda:r``; ranks sharing them take them in
        turn, ``cuda:<rank % len(gpus)>``)."""
        if self.device_type != "cuda":
            return "cpu"
        return f"cuda:{rank % len(self.gpus) if self.gpus else rank}"

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
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", loopback_interface())
        env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", loopback_interface())
        if self.gpus is not None:
            # a fresh process counts its GPUs from this, whatever torch in the kernel has counted already
            env["CUDA_VISIBLE_DEVICES"] = ",".join(cuda_visible_entry(gpu) for gpu in self.gpus)
        if self.device_type == "cpu":
            # one process per core share: keep the ranks (and runs side by side) from oversubscribing the CPU
            share = max(self.world_size, self.cpu_share or cpu_slots())
            env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // share)))
        return env


# the folder that holds this kit: first on a worker's path, so that it runs the notebook's kit (not another
# version a working directory or PYTHONPATH might hold)
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # .../flair_nbddp/engine/devices.py


def worker_environment() -> dict[str, str]:
    """This process's environment as its workers start with it (before their rank's variables): with the kit's
    root first on ``PYTHONPATH``.

    Example:
        >>> worker_environment()["PYTHONPATH"].split(os.pathsep)[0] == PACKAGE_ROOT
        True
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env


@functools.cache
def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    return interface_of("127.0.0.1") or "lo"


def interface_of(address: str) -> str | None:
    """The network interface holding ``address`` on this machine (None if none does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return None


def require_posix() -> None:
    """Refuse to start workers where they cannot run: they need POSIX (``os.killpg``, ``SIGUSR1``, ``pass_fds``).

    Raises:
        UnsupportedPlatformError: on Windows, naming what works instead.
    """
    import platform
    import signal

    missing = [name for module, name in ((os, "killpg"), (signal, "SIGUSR1")) if not hasattr(module, name)]
    if missing:
        raise UnsupportedPlatformError(
            f"flair_nbddp needs a POSIX system (Linux; macOS is untested) for its worker processes: they use "
            f"os.killpg, SIGUSR1 and inherited descriptors, and {platform.system() or 'this system'} has no "
            f"{' or '.join(missing)}. On Windows run the notebook server in WSL 2 (CUDA works there), or on a Linux "
            "machine."
        )


def cuda_visible_entry(gpu: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of what torch in this process calls GPU ``gpu``."""
    inherited = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return inherited[gpu] if gpu < len(inherited) else str(gpu)


def gpu_names() -> list[str]:
    """``["0: NVIDIA H200", ...]``: the GPUs torch sees, for messages (initialises CUDA in this process)."""
    import torch

    return [f"{index}: {torch.cuda.get_device_name(index)}" for index in range(visible_gpu_count())]


def visible_gpu_count() -> int:
    """Number of CUDA devices torch can see, without creating a CUDA context in this process."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def env_device() -> str | None:
    """``$FLAIR_NBDDP_DEVICE`` (``cpu`` or ``cuda``), or None when unset."""
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if value and value not in DEVICE_TYPES:
        raise DeviceError(f"{DEVICE_ENV}={value!r} is not understood: set it to 'cpu' or 'cuda', or unset it.")
    return value or None


def cpu_slots() -> int:
    """How many CPU processes runs side by side may have at once, over every run of the machine's kernels (a run of
    more processes holds them all): ``$FLAIR_NBDDP_PROCESSES``, else 2. Each CPU process gets that share of the cores
    (``OMP_NUM_THREADS``): a lone one-process run too (``FLAIR_NBDDP_PROCESSES=1`` gives it every core).

    Example:
        >>> cpu_slots()                                  # with FLAIR_NBDDP_PROCESSES unset
        2
    """
    return env_processes() or DEFAULT_CPU_PROCESSES


def env_processes() -> int | None:
    """``$FLAIR_NBDDP_PROCESSES`` (a positive integer), or None when unset."""
    value = os.environ.get(PROCESSES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise DeviceError(f"{PROCESSES_ENV}={value!r} is not a positive integer: set it to e.g. 2, or unset it.")
    return int(value)


def _check_gpus(gpus: Sequence[int], device: str | None, processes: int | None, share: bool) -> tuple[int, ...]:
    if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Sequence) or not gpus:
        raise DeviceError(f"gpus={gpus!r} must be a non-empty list of GPU numbers, e.g. gpus=[0, 2].")
    if any(isinstance(gpu, bool) or not isinstance(gpu, int) for gpu in gpus):
        raise DeviceError(f"gpus={list(gpus)!r} must hold GPU numbers (integers), e.g. gpus=[0, 2].")
    chosen = tuple(gpus)
    if len(set(chosen)) != len(chosen):
        raise DeviceError(f"gpus={list(chosen)} names a GPU twice: NCCL needs one GPU per process.")
    if device not in (None, "cuda"):
        raise DeviceError(f"gpus={list(chosen)} chooses GPUs, but device={device!r}: leave one of them out.")
    if processes is not None and processes != len(chosen) and not (share and processes > len(chosen)):
        raise DeviceError(
            f"gpus={list(chosen)} runs one process per GPU ({len(chosen)}), not processes={processes}: "
            "leave processes out"
            + (f", or add share_gpus=True to rehearse {processes} ranks on them." if processes > len(chosen) else ".")
        )
    count = visible_gpu_count()
    unknown = [gpu for gpu in chosen if not 0 <= gpu < count]
    if unknown:
        there = ", ".join(gpu_names()) if count else "none (torch.cuda.is_available() is False)"
        raise DeviceError(
            f"gpus={list(chosen)}: there is no GPU {', '.join(map(str, unknown))}. The GPUs torch sees here: {there}."
        )
    return chosen


def resolve_devices(
    device: str | None = None, processes: int | None = None, gpus: Sequence[int] | None = None,
    share_gpus: bool = False,
) -> DevicePlan:  # fmt: skip
    """Decide the device type, world size, GPUs and backend of a run.

    Explicit arguments win over the environment variables ``FLAIR_NBDDP_DEVICE`` (``cpu``/``cuda``) and
    ``FLAIR_NBDDP_PROCESSES``, which win over the defaults: every visible GPU with NCCL, else
    2 CPU processes with gloo. ``gpus=[0, 2]`` runs one process on each of those GPUs (as torch numbers them
    here), also after this process has initialised CUDA: each worker is started with only them visible.
    ``share_gpus=True`` lets more CUDA processes than GPUs run, the GPUs taken in turn, over gloo (NCCL takes one
    rank per GPU): a rehearsal of a multi-GPU run. With as many GPUs as processes it changes nothing, and where the
    run lands on CPU (no GPU, ``FLAIR_NBDDP_DEVICE=cpu``) neither: CPU ranks share the CPU anyway.

    Example:
        >>> resolve_devices("cpu", 2, share_gpus=True)     # on CPU: nothing to share
        DevicePlan(device_type='cpu', world_size=2, backend='gloo', gpus=None, cpu_share=None)

    Raises:
        DeviceError: (a ``ValueError``) for a device other than cpu/cuda, a non-positive process count, CUDA
            without GPUs, more CUDA processes than GPUs without ``share_gpus``, or GPUs that are not there (the
            message lists those that are).
        UnsupportedPlatformError: on Windows (the workers need POSIX).
    """
    require_posix()
    if device is not None:
        device = str(device).strip().lower()
        if device.startswith("cuda:"):
            raise DeviceError(
                f"device={device!r} names one GPU; a run uses one process per GPU. Pass gpus=[{device[5:]}] "
                "(or gpus=[0, 2] for several), or processes=N for the first N."
            )
        if device not in DEVICE_TYPES:
            raise DeviceError(f"device={device!r} is not supported: use 'cuda', 'cpu' or None (automatic).")
    if gpus is not None:
        chosen = _check_gpus(gpus, device, processes, share_gpus)
        return cuda_plan(processes or len(chosen), len(chosen), chosen)
    device = device or env_device()
    if processes is None:
        processes = env_processes()
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
        if processes > gpus and not share_gpus:
            raise DeviceError(
                f"processes={processes} but only {gpus} GPU(s) are visible: NCCL needs one GPU per process. "
                f"Use processes<={gpus}, device='cpu' for CPU processes, or share_gpus=True to rehearse {processes} "
                f"ranks on {'it' if gpus == 1 else 'them'} over gloo."
            )
        return cuda_plan(processes, gpus)
    plan = DevicePlan("cpu", processes or DEFAULT_CPU_PROCESSES, "gloo")
    cores = os.cpu_count() or 1
    if plan.world_size > cores:
        warnings.warn(
            f"{plan.world_size} CPU processes on {cores} cores: they take turns on the cores, so the run is slower "
            f"than with processes={cores} (fine for a rehearsal of a larger run)", RuntimeWarning, stacklevel=2,
        )  # fmt: skip
    return plan


def cuda_plan(processes: int, visible: int, chosen: tuple[int, ...] | None = None) -> DevicePlan:
    """``processes`` CUDA ranks on the ``chosen`` GPUs (None: the ``visible`` ones): one on each of the first over
    NCCL, or, with more ranks than GPUs, sharing them all over gloo.

    Example:
        >>> str(cuda_plan(2, 4)), str(cuda_plan(4, 2)), str(cuda_plan(3, 1, (2,)))
        ('2 × cuda (nccl)', '4 × cuda sharing GPUs 0,1 (gloo)', '3 × cuda sharing GPU 2 (gloo)')
    """
    if processes > visible:
        return DevicePlan("cuda", processes, "gloo", chosen or tuple(range(visible)))
    return DevicePlan("cuda", processes, "nccl", chosen)


def rendezvous_socket(host: str = "127.0.0.1") -> socket.socket:
    """A listening TCP socket on ``host`` (default 127.0.0.1) at a free port, for rank 0's rendezvous store.

    Rank 0 inherits it (``TCPStore(master_listen_fd=...)``), so the store listens on that address only
    (loopback on one machine, a cluster worker's own address) and no other process can take the port between
    choosing and binding it.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock
