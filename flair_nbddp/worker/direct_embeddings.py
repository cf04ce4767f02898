"""A tagger's transformer word embeddings handed to it as the batch tensor they are made as.

flair's transformer word embeddings compute a batch's token embeddings as one zero-padded tensor (sentences ×
longest sentence × width), then store one vector on each token of the batch; flair's SequenceTagger gathers those
vectors back, token by token, into a zero-padded tensor of the same shape, and after the batch flair clears them
again. That is a few Python calls per token in every batch: on a GPU, more time than the tagger's arithmetic.

In a worker with ``direct_embeddings`` on (the default), a SequenceTagger whose embeddings are one transformer
embedding takes that tensor itself: the same values (upcast to the tagger's weights' type where flair's zero padding
would upcast them), the same shape and layout, so the same arithmetic and gradients after it; its tokens are given
no embedding, so flair's clearing finds nothing on them. It serves a batch only where flair would compute every
embedding of the batch and drop them after it, and nothing else reads them meanwhile: the model trained or predicting
is the tagger itself (not a task of a multitask model, whose other tasks may reuse them), and the storage is
``"none"`` (as ``fine_tune`` and ``predict`` have it) or, in training, the embeddings need gradients (flair always
drops those) and the sentences hold no other embedding. Otherwise it goes flair's way, with one notice per reason on
the rank's stderr (other embeddings stacked with the transformer, a task of a multitask model, a tagger or
embedding class that gathers or stores its own way, a storage that keeps them); a tagger without a transformer's word embeddings, an empty sentence and
embeddings flair finds already made (and reuses) go flair's way silently.

The storage mode is read from flair's own arguments: ``train_custom``'s ``embeddings_storage_mode`` (which
``train`` and ``fine_tune`` pass on) and the tagger's ``predict``'s ``embedding_storage_mode`` (which flair's
evaluations pass on).
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any

_JOB: dict[str, Any] = {"enabled": True, "noticed": set()}
_SCOPES: list[tuple[str, Any]] = []  # (storage mode, model) of the trainings and predictions this rank is inside
_INNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stacked embeddings -> a transformer's name in them


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
    ModelTrainer.train_custom = _in_storage_mode(ModelTrainer.train_custom, "embeddings_storage_mode",
                                                 lambda trainer: trainer.model)  # fmt: skip
    SequenceTagger.predict = _in_storage_mode(SequenceTagger.predict, "embedding_storage_mode", lambda tagger: tagger)


def start_job(enabled: bool) -> None:
    """A job begins: taggers take their embeddings' tensor if ``enabled``."""
    _JOB.update(enabled=enabled, noticed=set())


def _in_storage_mode(method: Callable, parameter: str, model: Callable[[Any], Any]) -> Callable:
    """``method``, run in the embeddings' storage mode its ``parameter`` gives (its default, when not given), for the
    ``model`` of its ``self``."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return method(*args, **kwargs)  # the call's own error, as the method gives it
        bound.apply_defaults()
        _SCOPES.append((bound.arguments[parameter], model(bound.arguments["self"])))
        try:
            return method(*args, **kwargs)
        finally:
            _SCOPES.pop()

    return wrapped


def unserved(tagger: Any) -> str | None:
    """Why ``tagger``'s batches cannot take their embeddings' tensor, whatever the batch: a reason to give, ``""``
    for a tagger without a transformer's word embeddings (nothing of this path's to say), or None when they can."""
    from flair.embeddings.transformer import TransformerBaseEmbeddings
    from flair.models import SequenceTagger

    embeddings = tagger.embeddings
    if not isinstance(embeddings, TransformerBaseEmbeddings):
        if embeddings not in _INNER:
            _INNER[embeddings] = next((type(module).__name__ for module in embeddings.modules()
                                       if isinstance(module, TransformerBaseEmbeddings)), "")  # fmt: skip
        inner = _INNER[embeddings]
        return f"its {inner} is one of its {type(embeddings).__name__}, not its only embedding" if inner else ""
    if not embeddings.token_embedding:
        return ""
    if type(embeddings)._add_embeddings_internal is not TransformerBaseEmbeddings._add_embeddings_internal:
        return f"{type(embeddings).__name__} stores its embeddings its own way"
    if type(tagger)._make_padded_tensor_for_batch is not SequenceTagger._make_padded_tensor_for_batch:
        return f"{type(tagger).__name__} gathers its embeddings its own way"
    if embeddings.embedding_length != embeddings.embedding_length_internal:
        return "its embeddings' width is not their tensor's"
    return None


def _dropped(tagger: Any, sentences: list) -> str | None:
    """Why flair might keep ``tagger``'s embeddings of ``sentences`` after the batch (or let another model read them
    before), or None when it drops them: in ``"none"`` storage; in training, with another storage, where they need
    gradients (flair always drops those) and the sentences hold no other embedding flair would keep."""
    mode, model = _SCOPES[-1] if _SCOPES else (None, None)
    if mode is None:
        return "outside flair's trainer and the tagger's predict, the embeddings' storage is not known"
    if model is not tagger:
        return f"it is part of {type(model).__name__}, whose other parts may read the embeddings it stores"
    if mode == "none":
        return None
    import torch

    embeddings = tagger.embeddings
    trained = embeddings.fine_tune and embeddings.training and torch.is_grad_enabled()
    if trained and any(parameter.requires_grad for parameter in embeddings.parameters()):
        holding = any(sentence._embeddings or sentence.tokens[0]._embeddings for sentence in sentences)
        return "its sentences hold other embeddings flair's storage keeps" if holding else None
    return f"embedding storage {mode!r} keeps each token's embedding between batches"


def token_tensor(tagger: Any, sentences: list) -> tuple[Any, Any] | None:
    """``tagger``'s (zero-padded token embeddings, lengths) for ``sentences``, as flair's ``_prepare_tensors`` makes
    them, from the embedding's batch tensor; None where flair's own way must make them."""
    if not _JOB["enabled"] or not sentences:
        return None
    lengths = [len(sentence.tokens) for sentence in sentences]
    reason = unserved(tagger)
    if reason is None and min(lengths):
        reason = _dropped(tagger, sentences)
    if reason:
        _notice(f"flair_nbddp: {type(tagger).__name__} gathers its embeddings token by token, as flair does: {reason}")
    embeddings = tagger.embeddings
    if reason is not None or not min(lengths) or embeddings._everything_embedded(sentences):
        return None  # flair's way; also for an empty sentence (it fills nothing) and embeddings it finds (it reuses)
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
