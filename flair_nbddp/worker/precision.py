"""The arithmetic a job's training runs in: ``precision="fp32" | "bf16" | "fp16"``.

* ``fp32``: flair's default, untouched (what a seeded run compares bit for bit with flair's own launcher).
* ``fp16``: flair's own mixed precision, as ``use_amp=True`` gives it: the training forward passes under
  ``torch.autocast`` (float16 on GPUs, with flair's gradient scaler; torch's CPU autocast type, bfloat16, on CPU).
* ``bf16``: the forward passes of training and of every evaluation under bfloat16 autocast, on GPUs and on CPU,
  without a gradient scaler (bfloat16 has float32's range). The weights and the optimizer stay float32.

A job's precision applies to every ``train``/``fine_tune`` it makes; a call's own ``use_amp=True`` asks for fp16.
:func:`inference` gives a :func:`flair_nbddp.predict` call's ranks the same choice: bf16 and fp16 predict under
autocast (fp16 is bfloat16 on CPU, as torch's CPU autocast has it), fp32 as flair does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")
_JOB = {"precision": "fp32"}


def start_job(precision: str) -> None:
    """A job begins in ``precision``."""
    _JOB["precision"] = precision


def install() -> None:
    """Wrap flair's ``train_custom`` (which ``train`` and ``fine_tune`` call) and the ``evaluate`` of every model
    class that defines one (once per worker, after flair is imported)."""
    from flair.trainers import ModelTrainer

    from .flair_compat import model_subclasses

    if getattr(ModelTrainer.train_custom, "_flair_nbddp_precision", False):
        return
    original: Callable = ModelTrainer.train_custom

    @functools.wraps(original)
    def train_custom(self: Any, *args: Any, use_amp: bool = False, **kwargs: Any) -> Any:
        precision = _JOB["precision"]
        if precision == "fp32":
            return original(self, *args, use_amp=use_amp, **kwargs)
        with _bf16_amp() if precision == "bf16" else contextlib.nullcontext():
            return original(self, *args, use_amp=True, **kwargs)

    train_custom._flair_nbddp_precision = True
    ModelTrainer.train_custom = train_custom
    for cls in model_subclasses():
        if "evaluate" in cls.__dict__:
            cls.evaluate = _evaluated_in_bf16(cls.__dict__["evaluate"])


@contextlib.contextmanager
def inference() -> Iterator[None]:
    """Predictions in the job's precision: under autocast for bf16 and fp16, untouched for fp32."""
    precision = _JOB["precision"]
    if precision == "fp32":
        yield
        return
    import flair
    import torch

    device = flair.device.type
    dtype = torch.float16 if precision == "fp16" and device == "cuda" else torch.bfloat16
    with torch.autocast(device_type=device, dtype=dtype):
        yield


def _evaluated_in_bf16(evaluate: Callable) -> Callable:
    @functools.wraps(evaluate)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _JOB["precision"] != "bf16":
            return evaluate(self, *args, **kwargs)
        import flair
        import torch

        with torch.autocast(device_type=flair.device.type, dtype=torch.bfloat16):
            return evaluate(self, *args, **kwargs)

    return wrapped


@contextlib.contextmanager
def _bf16_amp() -> Iterator[None]:
    """flair's ``use_amp`` path, made bfloat16: its autocast's type set to bfloat16, its gradient scaler off."""
    import flair
    import torch

    device = flair.device.type
    get, set_ = _autocast_dtype_accessors(device)
    before, scaler = get(), torch.cuda.amp.GradScaler
    set_(torch.bfloat16)
    torch.cuda.amp.GradScaler = functools.partial(_no_scaler, scaler)
    try:
        yield
    finally:
        set_(before)
        torch.cuda.amp.GradScaler = scaler


def _autocast_dtype_accessors(device: str) -> tuple[Callable, Callable]:
    """Get and set the type ``torch.autocast`` uses on ``device`` when given none (torch 2.4 has one pair for
    every device; before it, one for CPU and one for GPUs)."""
    import torch

    if hasattr(torch, "set_autocast_dtype"):
        return functools.partial(torch.get_autocast_dtype, device), functools.partial(torch.set_autocast_dtype, device)
    if device == "cpu":
        return torch.get_autocast_cpu_dtype, torch.set_autocast_cpu_dtype
    return torch.get_autocast_gpu_dtype, torch.set_autocast_gpu_dtype


def _no_scaler(scaler: type, *args: Any, enabled: bool = True, **kwargs: Any) -> Any:
    return scaler(*args, enabled=False, **kwargs)
