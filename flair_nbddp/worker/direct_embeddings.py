"""A tagger's transformer word embeddings handed to it as the batch tensor they are made as.

flair's transformer word embeddings compute a batch's token embeddings as one zero-padded tensor (sentences ×
longest sentence × width), then store one vector on each token of the batch; flair's SequenceTagger gathers those
vectors back, token by token, into a zero-padded tensor of the same shape, and after the batch flair clears them
again. That is a few Python calls per token in every batch: on a GPU, more time than the tagger's arithmetic.

In a worker with ``direct_embeddings`` on (the default), a SequenceTagger whose embeddings are one transformer
embedding takes that tensor itself: the same values (upcast to the tagger's weights' type where flair's zero padding
would upcast them), the same shape and layout, so the same arithmetic and gradients after it; its tokens are given
no embedding, so flair's clearing finds nothing on them. It serves a batch only where flair would compute every
embedding of the batch and drop them after it (``embeddings_storage_mode="none"``, as ``fine_tune`` has it, or a
fine-tuned transformer in training, whose embeddings flair always drops); anything else goes flair's way, with one
notice per reason on the rank's stderr: other embeddings (a stack of several), a tagger that gathers its own way,
embeddings flair keeps between batches (``"cpu"``/``"gpu"`` storage), and batches whose tokens already hold them.

The storage mode is read from flair's own arguments: ``train_custom``'s ``embeddings_storage_mode`` (which
``train`` and ``fine_tune`` pass on) and the tagger's ``predict``'s ``embedding_storage_mode`` (which flair's
evaluations pass on).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

_JOB: dict[str, Any] = {"enabled": True, "noticed": set()}
_MODES: list[str] = []  # the storage modes of the trainings and predictions this rank is inside, the innermost last


def install() -> None:
    """Route flair's SequenceTagger's input tensors through :func:`token_tensor`, and follow the storage mode of
    flair's trainings and of the tagger's predictions (once per worker)."""
    from flair.models import SequenceTagger
    from flair.trainers import ModelTrainer

    original = SequenceTagger._prepare_tensors
    if getattr(original, "_flair_nbddp_direct", False):
        return

    @functools.wraps(original)
    def _prepare_tensors(self: Any, data_points: Any) -> Any:
        sentences = data_points if isinstance(data_points, list) else [data_points]
        direct = token_tensor(self, sentences)
        return original(self, data_points) if direct is None else direct

    _prepare_tensors._flair_nbddp_direct = True
    SequenceTagger._prepare_tensors = _prepare_tensors
    ModelTrainer.train_custom = _in_storage_mode(ModelTrainer.train_custom, "embeddings_storage_mode")
    SequenceTagger.predict = _in_storage_mode(SequenceTagger.predict, "embedding_storage_mode")


def start_job(enabled: bool) -> None:
    """A job begins: taggers take their embeddings' tensor if ``enabled``."""
    _JOB.update(enabled=enabled, noticed=set())


def _in_storage_mode(method: Callable, parameter: str) -> Callable:
    """``method``, run in the embeddings' storage mode its ``parameter`` gives (its default, when not given)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _MODES.append(bound.arguments[parameter])
        try:
            return method(*args, **kwargs)
        finally:
            _MODES.pop()

    return wrapped


def unserved(tagger: Any) -> str | None:
    """Why ``tagger``'s batches cannot take their embeddings' tensor, whatever the batch: a reason to give, ``""``
    for a tagger without a transformer (nothing of this path's to say), or None when they can."""
    from flair.embeddings.transformer import TransformerBaseEmbeddings
    from flair.models import SequenceTagger

    embeddings = tagger.embeddings
    if not isinstance(embeddings, TransformerBaseEmbeddings) or not embeddings.token_embedding:
        inner = [type(module).__name__ for module in embeddings.modules() if isinstance(module, TransformerBaseEmbeddings)]
        return f"its {inner[0]} is one of its {type(embeddings).__name__}, not its only embedding" if inner else ""
    if type(embeddings)._add_embeddings_internal is not TransformerBaseEmbeddings._add_embeddings_internal:
        return f"{type(embeddings).__name__} stores its embeddings its own way"
    if type(tagger)._make_padded_tensor_for_batch is not SequenceTagger._make_padded_tensor_for_batch:
        return f"{type(tagger).__name__} gathers its embeddings its own way"
    if embeddings.embedding_length != embeddings.embedding_length_internal:
        return "its embeddings' width is not their tensor's"
    return None


def token_tensor(tagger: Any, sentences: list) -> tuple[Any, Any] | None:
    """``tagger``'s (zero-padded token embeddings, lengths) for ``sentences``, as flair's ``_prepare_tensors`` makes
    them, from the embedding's batch tensor; None where flair's own way must make them."""
    if not _JOB["enabled"] or not sentences:
        return None
    embeddings = tagger.embeddings
    reason = unserved(tagger)
    mode = _MODES[-1] if _MODES else None
    if reason is None and mode != "none" and not (embeddings.fine_tune and embeddings.training):
        reason = (f"embedding storage {mode!r} keeps each token's embedding between batches" if mode else
                  "outside flair's trainer and the tagger's predict, the embeddings' storage is not known")  # fmt: skip
    if reason:
        _notice(f"flair_nbddp: {type(tagger).__name__} gathers its embeddings token by token, as flair does: {reason}")
    if reason is not None:
        return None
    lengths = [len(sentence.tokens) for sentence in sentences]
    if not min(lengths) or embeddings._everything_embedded(sentences):
        return None  # flair's way: it fills nothing for an empty sentence, and reuses embeddings it finds
    import flair
    import torch

    tensors = embeddings.prepare_tensors(sentences, device=embeddings.force_device)
    with torch.enable_grad() if embeddings.fine_tune and embeddings.training else torch.no_grad():
        padded = embeddings._forward_tensors(tensors)["token_embeddings"].to(flair.device)
    if min(lengths) < max(lengths):  # flair's padding, in the tagger's weights' type, sets the type of the whole
        padded = padded.to(torch.promote_types(padded.dtype, tagger.linear.weight.dtype))
    return padded.contiguous(), torch.LongTensor(lengths)


def _notice(text: str) -> None:
    if text not in _JOB["noticed"]:
        _JOB["noticed"].add(text)
        print(text, file=sys.stderr)
