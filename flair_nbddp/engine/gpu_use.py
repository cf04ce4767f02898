"""The machine's GPUs as NVML sees them: their ids, and who uses their memory, for claims across kernels and users.

A GPU is named machine-wide by its UUID (``GPU-8f3e...``), whatever ``CUDA_VISIBLE_DEVICES`` a kernel has, and shown
by the number ``nvidia-smi`` gives it. A ``CUDA_VISIBLE_DEVICES`` entry that is a number is taken as that number of
NVML's (PCI) order, as torch takes it: on a machine with GPUs of different kinds, set ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
so that CUDA counts them the same way. Without NVML (no driver, no ``nvidia-ml-py``) a GPU is its entry, and no
other program's use is seen.

Example:
    >>> gpu_id("3", None), gpu_label("3", None)           # no NVML: the entry names the GPU
    ('3', '3')
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuUse:
    """One GPU now: its number (``nvidia-smi``'s), UUID, name, memory in bytes, utilisation in percent, and the
    processes computing on it with the bytes each uses (None where NVML does not say)."""

    index: int
    uuid: str
    name: str
    memory_used: int
    memory_total: int
    utilization: int | None
    processes: tuple[tuple[int, int | None], ...]


@functools.cache
def _nvml():
    """The initialised ``pynvml`` module, or None where NVML cannot be used."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: no NVML
        return None
    return pynvml


def machine_gpus() -> list[GpuUse] | None:
    """Every GPU of the machine with its use now, in ``nvidia-smi``'s order; None without NVML."""
    nvml = _nvml()
    if nvml is None:
        return None
    found = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nvml.NVMLError:
                utilization = None
            try:  # computing on it (a desktop's display server only draws there)
                users = {entry.pid: entry.usedGpuMemory for entry in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            except nvml.NVMLError:
                users = {}
            uuid, name = nvml.nvmlDeviceGetUUID(handle), nvml.nvmlDeviceGetName(handle)
            found.append(GpuUse(index, _text(uuid), _text(name), int(memory.used), int(memory.total), utilization,
                                tuple(sorted(users.items()))))  # fmt: skip
    except nvml.NVMLError:
        return None
    return found


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def gpu_id(entry: str, gpus: list[GpuUse] | None) -> str:
    """The machine-wide id of the GPU a ``CUDA_VISIBLE_DEVICES`` ``entry`` names (a number, a UUID or its unique
    start): its UUID where NVML knows it, else the entry itself."""
    for gpu in gpus or ():
        if (entry.isdigit() and int(entry) == gpu.index) or (not entry.isdigit() and gpu.uuid.startswith(entry)):
            return gpu.uuid
    return entry


def gpu_label(gpu: str, gpus: list[GpuUse] | None) -> str:
    """How messages name the GPU of machine-wide id ``gpu``: its ``nvidia-smi`` number where known."""
    return next((str(found.index) for found in gpus or () if found.uuid == gpu), gpu)
