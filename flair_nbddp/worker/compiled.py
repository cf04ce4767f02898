"""flair's transformers compiled with ``torch.compile`` while a job trains (run option ``compile_model``).

Opt-in. ``compile_model=False`` (the default) trains flair's eager model. ``True`` compiles with torch's default
(inductor); a string names one of inductor's modes (:data:`MODES`; ``"reduce-overhead"`` replays CUDA graphs) or a
``torch.compile`` backend (``torch._dynamo.list_backends()``; ``"aot_eager"`` checks that a model compiles at all,
without generating kernels). An error while compiling fails the run, with torch's message.

What is compiled: the Hugging Face model inside each of flair's ``TransformerEmbeddings`` in the model a
``ModelTrainer`` trains (``module.compile()``: its parameters and state dict keep their names, so checkpoints and
saved models are flair's), for the length of flair's ``train_custom`` (``train`` and ``fine_tune`` call it), the
evaluations flair makes inside it included. Afterwards the model is flair's eager one again, and torch's in-memory
compile caches are cleared (a warm worker's next job builds new models); torch keeps compiled kernels on disk, so a
later run of the same model compiles faster.

What it gains, measured on an H100 (``benchmarks/README.md``, "Compiling the transformer"): nothing with inductor's
default mode, whose per-kernel launches from Python cost the training thread what eager's did; 1.06-1.23 times the
eager bf16 rate over an epoch with ``"reduce-overhead"``, after 20-40 s of compiling. It pays in long runs with
batches of few distinct lengths: CUDA graphs are recorded for every batch shape. Compiled arithmetic (fused
kernels, another random stream for dropout) is not flair's bit for bit, in any precision.

Example:
    >>> compile_call(True), compile_call("reduce-overhead"), compile_call("aot_eager")
    ({}, {'mode': 'reduce-overhead'}, {'backend': 'aot_eager'})
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigurationError

_MARK = "_flair_nbddp_compiled"
_JOB: dict[str, Any] = {"setting": False}
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # inductor's, by name


def compile_call(setting: bool | str) -> dict[str, str]:
    """``torch.compile``'s keywords for ``compile_model=setting`` (not False)."""
    if setting is True:
        return {}
    return {"mode": setting} if setting in MODES else {"backend": setting}


def start_job(setting: bool | str, device_type: str) -> None:
    """A job begins: its trainings compile as ``setting`` says (False: not at all).

    Raises:
        ConfigurationError: ``setting`` names neither a mode of inductor nor a backend this worker has, or asks for
            inductor on a GPU without Triton.
    """
    problem = setting is not False and _cannot(compile_call(setting), device_type)
    if problem:
        raise ConfigurationError(f"compile_model={setting!r}: {problem}")
    _JOB["setting"] = setting


def _cannot(call: dict[str, str], device_type: str) -> str | None:
    """Why this worker cannot compile as ``call`` says (and what to do), or None."""
    from torch._dynamo import list_backends

    backend = call.get("backend", "inductor")
    known = list_backends(exclude_tags=())
    if backend not in known:
        return (f"{backend!r} is neither a mode of inductor ({', '.join(map(repr, MODES))}) nor a torch.compile "
                f"backend here ({', '.join(map(repr, known))}); or give True for inductor's default")  # fmt: skip
    if backend == "inductor" and device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return ("torch.compile's inductor needs Triton on GPUs, which this environment lacks (pip install triton: "
                "torch's CUDA wheels bring it); or give compile_model=False")  # fmt: skip
    return None


def install() -> None:
    """Wrap flair's ``train_custom`` so that each training of a job that compiles runs its transformers compiled
    (once per worker, after flair is imported)."""
    from flair.trainers import ModelTrainer

    if getattr(ModelTrainer.train_custom, _MARK, False):
        return
    original: Callable = ModelTrainer.train_custom

    @functools.wraps(original)
    def train_custom(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _JOB["setting"] is False:
            return original(self, *args, **kwargs)
        with compiled_transformers(self.model, compile_call(_JOB["setting"])):
            return original(self, *args, **kwargs)

    setattr(train_custom, _MARK, True)
    ModelTrainer.train_custom = train_custom


@contextlib.contextmanager
def compiled_transformers(model: Any, call: dict[str, str]) -> Iterator[list]:
    """The Hugging Face models inside ``model``'s transformer embeddings, compiled with ``torch.compile(**call)``
    until the block ends (yielded).

    Example::

        with compiled_transformers(classifier, {"mode": "reduce-overhead"}) as compiled:  # [classifier.embeddings.model]
            ModelTrainer(classifier, corpus).fine_tune("out", max_epochs=1)
    """
    import torch
    from flair.embeddings.transformer import TransformerEmbeddings

    transformers = [module.model for module in model.modules() if isinstance(module, TransformerEmbeddings)]
    for transformer in transformers:
        transformer.compile(**call)
    try:
        yield transformers
    finally:
        for transformer in transformers:
            transformer._compiled_call_impl = None
        torch._dynamo.reset()
