"""Three of the four waits for the GPU in each of flair's training steps, removed with every value unchanged.

A rank's CPU prepares the GPU's work while the GPU computes the work already queued, unless the CPU asks for a value
the GPU has not made yet: then it waits until the GPU has finished everything queued, and the GPU idles while
the CPU prepares what comes next. In every training batch, flair 0.15.1's step with a transformer waits four times
(``benchmarks/throughput.py`` with ``BENCH_SYNCS``). Three of those waits ask for something the CPU already has:

* transformers' ``_prepare_4d_attention_mask_for_sdpa`` asks the GPU whether the attention mask is all ones
  (then the model runs without one). With fast inputs the kit built that mask on the host: the answer travels with
  the mask (:func:`answer_mask_check`), and the function takes it from there.
* flair's ``TransformerEmbeddings.forward`` picks its layers with a Python list as index
  (``hidden_states[self.layer_indexes]``), which torch copies to the GPU and waits for. During the forward the index
  is a tensor already on the device, made once (the embedding's ``layer_indexes`` are its list again afterwards).
* flair's ``_prepare_label_tensor`` makes the gold labels with ``torch.tensor(..., device=cuda)``, a copy from
  pageable memory that waits. They are made on the host, as the same list, and go over from pinned memory, as fast
  inputs' ids and masks do (:func:`host_tensor`; flair copies those with ``non_blocking=True``).

The fourth, flair's ``loss.item()`` after each forward pass, stays: its value goes into flair's metric records and
logs, which flair's plugins and the user's read as numbers. One wait a batch lets the CPU prepare a batch's backward
pass, the optimizer step and the next forward pass while the GPU computes; the three above split that into pieces.

The same operations run on the same values, so losses, scores and saved models are bit for bit what they were
(the parity test runs the first two on CPU; the labels' copy is the same list either way).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

_ANSWER = "_flair_nbddp_all_ones"  # on an attention mask the kit built: whether it is all ones
_MASK_CHECK = "_prepare_4d_attention_mask_for_sdpa"  # transformers' function, by the name its models import it
_ANSWERING = "_flair_nbddp_answers"
_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # embedding -> (list, device, index tensor)
_TOLD: weakref.WeakSet = weakref.WeakSet()  # models whose modules' mask checks answer from the mask


def install(model_classes: list[type]) -> None:
    """Bend flair's layer selection, and the label building of ``model_classes`` (flair's, once per worker after
    flair is imported); the mask check of each transformers model is bent when fast inputs first build its inputs
    (:func:`answer_mask_check`)."""
    from flair.embeddings.transformer import TransformerEmbeddings

    if not getattr(TransformerEmbeddings.forward, _ANSWERING, False):
        TransformerEmbeddings.forward = _with_index_on_device(TransformerEmbeddings.forward)
    for cls in model_classes:
        prepare = cls.__dict__.get("_prepare_label_tensor")
        if prepare is not None and not getattr(prepare, _ANSWERING, False):
            cls._prepare_label_tensor = _labels_from_host(prepare)


def answer_mask_check(model: Any, mask: Any, all_ones: bool) -> None:
    """``mask`` (the device copy of an attention mask built on the host) is all ones, or not: ``model``'s mask
    check reads that instead of asking the GPU.

    Example:
        >>> import torch
        >>> mask = torch.ones(2, 3, dtype=torch.long)
        >>> answer_mask_check(torch.nn.Linear(1, 1), mask, True)
        >>> getattr(mask, _ANSWER)
        True
    """
    setattr(mask, _ANSWER, all_ones)
    if model in _TOLD:
        return
    _TOLD.add(model)
    for name in {type(module).__module__ for module in model.modules()}:
        module = sys.modules.get(name)
        if module is not None and getattr(module, _MASK_CHECK, None) is _transformers_mask_check():
            answering = _answered_mask_check(getattr(module, _MASK_CHECK))
            if answering is not None:
                setattr(module, _MASK_CHECK, answering)


def _transformers_mask_check() -> Callable | None:
    try:
        from transformers import modeling_attn_mask_utils
    except ImportError:
        return None
    return getattr(modeling_attn_mask_utils, _MASK_CHECK, None)


def _answered_mask_check(check: Callable) -> Callable | None:
    """``check``, answering from the mask when the kit told it whether the mask is all ones, except while the model
    is traced or compiled (the traced graph must hold the mask, as transformers makes it); None where this
    transformers version has no mask expansion of its own to call."""
    try:
        import torch
        from transformers.modeling_attn_mask_utils import AttentionMaskConverter
        from transformers.utils.import_utils import is_torchdynamo_compiling

        expand = AttentionMaskConverter._expand_mask
    except (ImportError, AttributeError):
        return None

    @functools.wraps(check)
    def answered(mask: Any, dtype: Any, tgt_len: int | None = None) -> Any:
        if torch.jit.is_tracing() or isinstance(mask, torch.fx.Proxy) or is_torchdynamo_compiling():
            return check(mask, dtype, tgt_len)  # before reading the answer: a compiler need not trace the lookup
        all_ones = getattr(mask, _ANSWER, None)
        if all_ones is None:
            return check(mask, dtype, tgt_len)
        return None if all_ones else expand(mask=mask, dtype=dtype, tgt_len=tgt_len)

    setattr(answered, _ANSWERING, True)
    return answered


def _with_index_on_device(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def indexed(self: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        listed = self.__dict__.get("layer_indexes")
        if not isinstance(listed, list):
            return forward(self, input_ids, *args, **kwargs)
        self.__dict__["layer_indexes"] = _index_tensor(self, listed, input_ids.device)
        try:
            return forward(self, input_ids, *args, **kwargs)
        finally:
            self.__dict__["layer_indexes"] = listed

    setattr(indexed, _ANSWERING, True)
    return indexed


def _index_tensor(embedding: Any, listed: list[int], device: Any) -> Any:
    """``listed`` as a tensor on ``device``, made once per embedding (again if its layers or device change)."""
    import torch

    known = _INDEXES.get(embedding)
    if known is None or known[0] != listed or known[1] != device:
        known = _INDEXES[embedding] = (list(listed), device, torch.tensor(listed, dtype=torch.long, device=device))
    return known[2]


def _labels_from_host(prepare: Callable) -> Callable:
    @functools.wraps(prepare)
    def from_host(self: Any, *args: Any, **kwargs: Any) -> Any:
        import flair
        import torch

        device = flair.device
        if device.type != "cuda":
            return prepare(self, *args, **kwargs)
        try:
            flair.device = torch.device("cpu")
            labels = prepare(self, *args, **kwargs)
        finally:
            flair.device = device
        on_host = isinstance(labels, torch.Tensor) and labels.device.type == "cpu"
        return _to_device(labels, device) if on_host else labels

    setattr(from_host, _ANSWERING, True)
    return from_host


def host_tensor(tensor: Any) -> Any:
    """``tensor`` (on the host) in pinned memory where flair's device is a GPU, so that copying it there does not wait;
    as it is elsewhere.

    Example:
        >>> import torch
        >>> host_tensor(torch.zeros(2)).is_pinned()  # flair's device is the CPU here
        False
    """
    import flair

    return tensor.pin_memory() if flair.device.type == "cuda" else tensor


def _to_device(labels: Any, device: Any) -> Any:
    """Host ``labels`` on ``device`` (flair's), copied from pinned memory without waiting."""
    return host_tensor(labels).to(device, non_blocking=True)
