"""flair's transformers compiled with ``torch.compile`` while a job trains (run option ``compile_model``).

Opt-in. ``compile_model=False`` (the default) trains flair's eager model. ``True`` compiles with torch's default
(inductor); a string names one of inductor's modes (``torch._inductor.list_mode_options()``; ``"reduce-overhead"``
replays CUDA graphs) or a ``torch.compile`` backend (``torch._dynamo.list_backends()``; ``"aot_eager"`` checks that
a model compiles at all, without generating kernels). A name that is neither is refused before the run starts
(:func:`unknown_name`); an error while compiling fails the run, with torch's message.

What is compiled: the Hugging Face model inside each of flair's ``TransformerEmbeddings`` in the model a
``ModelTrainer`` trains (``module.compile()``: its parameters and state dict keep their names, so checkpoints and
saved models are flair's), for the length of flair's ``train_custom`` (``train`` and ``fine_tune`` call it), the
evaluations flair makes inside it included (a ``train_custom`` called inside another compiles nothing more). Afterwards
each transformer is as it was (eager, or compiled as the user had compiled it), and torch's in-memory compile caches
are cleared for the whole process (a warm worker's next job builds new models); torch keeps compiled kernels on disk,
so a later run of the same model compiles faster. A model without transformer embeddings trains eager, with a notice.

What it gains, measured on an H100 (``benchmarks/throughput.py --precision bf16 --compile-model MODE``): nothing with
inductor's default mode, whose per-kernel launches from Python cost the training thread what eager's did; 1.06-1.23
times the eager bf16 rate over an epoch with ``"reduce-overhead"``, after 20-40 s of compiling. It pays in long runs
with batches of few distinct lengths: CUDA graphs are recorded for every batch shape. Compiled arithmetic (fused
kernels, another random stream for dropout) is not flair's bit for bit, in any precision.

Example:
    >>> compile_call(True), compile_call("reduce-overhead"), compile_call("aot_eager")
    ({}, {'mode': 'reduce-overhead'}, {'backend': 'aot_eager'})
    >>> unknown_name("reduce_overhead")[:60]
    "'reduce_overhead' is neither a mode of inductor ('default', "
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigurationError

_MARK = "_flair_nbddp_compiled"
_JOB: dict[str, Any] = {"setting": False, "call": None, "depth": 0}  # call: torch.compile's keywords, or None


def _modes() -> list[str]:
    from torch._inductor import list_mode_options

    return list(list_mode_options())


def compile_call(setting: bool | str) -> dict[str, str]:
    """``torch.compile``'s keywords for ``compile_model=setting`` (not False)."""
    if setting is True:
        return {}
    return {"mode": setting} if setting in _modes() else {"backend": setting}


def unknown_name(name: str) -> str | None:
    """Why ``compile_model=name`` names nothing torch can compile with (and what to give instead), or None."""
    from torch._dynamo import list_backends

    if name in _modes() or name in list_backends(exclude_tags=()):
        return None
    return (f"{name!r} is neither a mode of inductor ({', '.join(map(repr, _modes()))}) nor a torch.compile backend "
            f"here ({', '.join(map(repr, list_backends()))}); or give True for inductor's default")  # fmt: skip


def start_job(setting: bool | str, device_type: str) -> None:
    """A job begins: its trainings compile as ``setting`` says (False: not at all).

    Raises:
        ConfigurationError: ``setting`` asks for inductor on a GPU without Triton.
    """
    call = None if setting is False else compile_call(setting)
    backend = None if call is None else call.get("backend", "inductor")
    if backend == "inductor" and device_type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigurationError(
            f"compile_model={setting!r}: torch.compile's inductor needs Triton on GPUs, which this environment lacks "
            "(pip install triton: torch's CUDA wheels bring it); or give compile_model=False"
        )
    _JOB.update(setting=setting, call=call, depth=0)


def install() -> None:
    """Wrap flair's ``train_custom`` so that each training of a job that compiles runs its transformers compiled
    (once per worker, after flair is imported)."""
    from flair.trainers import ModelTrainer

    if getattr(ModelTrainer.train_custom, _MARK, False):
        return
    original: Callable = ModelTrainer.train_custom

    @functools.wraps(original)
    def train_custom(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _JOB["call"] is None or _JOB["depth"]:
            return original(self, *args, **kwargs)
        _JOB["depth"] += 1
        try:
            with compiled_transformers(self.model, _JOB["call"]) as transformers:
                if not transformers:
                    print(f"flair_nbddp: compile_model={_JOB['setting']!r} compiles nothing in this training: "
                          f"{type(self.model).__name__} has no transformer embeddings", flush=True)  # fmt: skip
                return original(self, *args, **kwargs)
        finally:
            _JOB["depth"] -= 1

    setattr(train_custom, _MARK, True)
    ModelTrainer.train_custom = train_custom


@contextlib.contextmanager
def compiled_transformers(model: Any, call: dict[str, str]) -> Iterator[list]:
    """The Hugging Face models inside ``model``'s transformer embeddings, compiled with ``torch.compile(**call)``
    until the block ends (yielded); then each is as it was, and torch's compile caches are cleared (for the whole
    process) if any was compiled.

    Example::

        with compiled_transformers(classifier, {"mode": "reduce-overhead"}) as compiled:  # [classifier.embeddings.model]
            ModelTrainer(classifier, corpus).fine_tune("out", max_epochs=1)
    """
    import torch
    from flair.embeddings.transformer import TransformerEmbeddings

    transformers = [module.model for module in model.modules() if isinstance(module, TransformerEmbeddings)]
    before = [transformer._compiled_call_impl for transformer in transformers]
    try:
        for transformer in transformers:
            transformer.compile(**call)
        yield transformers
    finally:
        for transformer, compiled in zip(transformers, before):
            transformer._compiled_call_impl = compiled
        if transformers:
            torch._dynamo.reset()
