"""The embeddings flair left stored on a corpus's data points that a resumed training could not compute again.

With ``embeddings_storage_mode="cpu"`` or ``"gpu"`` (``ModelTrainer.train``'s default), flair keeps the embeddings
its evaluations computed on the evaluated sentences, and an embedding's ``embed`` skips a sentence that has one
already: a trainable embedding's (not ``static_embeddings``) is then reused, as it was when stored, by every later
evaluation. A training resumed in new processes would compute it afresh from the later weights, and its dev and
test scores would differ from the uninterrupted training's. A full checkpoint therefore carries, for each rank, the
stored embeddings of trainable embeddings (:func:`collect`), and the resumed training puts them back on the same
sentences (:func:`restore`) before its first epoch. Static embeddings (word vectors, a frozen transformer) are
left out: computed again they are the same numbers.

Data points are named by their split and position, or, in a lazy corpus (:mod:`flair_nbddp.wire.lazy_corpus`),
by where the corpus builds them from (only the built ones can hold embeddings). Nothing here draws a random number
(no data loader is made).

Example::

    names = changing_names(trainer.model)        # {"one-hot"}: the trainable embeddings' names
    stored = collect(trainer.corpus, names)        # {}: nothing evaluated yet
    restore(trainer.corpus, stored)                # each sentence gets back what it held
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import flair
import torch

from ..wire.lazy_corpus import built_points, kept_point, lazy_key

SPLITS = ("train", "dev", "test")


def changing_names(model: torch.nn.Module) -> frozenset[str]:
    """The names under which ``model``'s trainable embeddings (``static_embeddings`` False) store embeddings."""
    from flair.embeddings import Embeddings

    return frozenset(
        module.name for module in model.modules() if isinstance(module, Embeddings) and not module.static_embeddings
    )


def collect(corpus: Any, names: frozenset[str]) -> dict[tuple, dict]:
    """``{point's key: its stored embeddings of those names}`` for every data point of ``corpus`` holding one; the
    tensors copied to the CPU."""
    stored = {}
    if not names:
        return stored
    for key, point in _points(corpus):
        held = {
            place: {name: vector.detach().to("cpu", copy=True) for name, vector in part._embeddings.items()
                    if name in names}
            for place, part in _parts(point, every_token=False)
        }  # fmt: skip
        held = {place: vectors for place, vectors in held.items() if vectors}
        if held:
            stored[key] = held
    return stored


def restore(corpus: Any, stored: dict[tuple, dict], storage_mode: str = "cpu") -> None:
    """Put :func:`collect`'s embeddings back on ``corpus``'s data points (in a lazy corpus, built and kept for the
    rest of the job), on flair's device with ``storage_mode="gpu"``."""
    device = flair.device if storage_mode == "gpu" else torch.device("cpu")
    for key, held in stored.items():
        point = kept_point(getattr(corpus, key[1]), key[2:]) if key[0] == "built" else getattr(corpus, key[0])[key[1]]
        parts = dict(_parts(point))
        for place, vectors in held.items():
            for name, vector in vectors.items():
                parts[place].set_embedding(name, vector.to(device))


def _points(corpus: Any) -> Iterator[tuple[tuple, Any]]:
    """Every data point of ``corpus`` that can hold embeddings, with its key."""
    for split_name in SPLITS:
        split = getattr(corpus, split_name, None)
        if split is None:
            continue
        built = built_points(split)
        if built is not None:  # a lazy corpus: only its built points can hold embeddings
            for point in built:
                yield ("built", split_name, *lazy_key(point)), point
        else:
            for position in range(len(split)):
                yield (split_name, position), split[position]


def _parts(point: Any, every_token: bool = True) -> Iterator[tuple[tuple, Any]]:
    """The parts of a data point that hold embeddings, each with its place in the point: a sentence, its tokens;
    a pair's members (and the pair as one sentence). ``every_token=False``: a sentence's tokens only if its first
    holds an embedding (an embedding embeds every token of a sentence at once; flair's own
    ``identify_dynamic_embeddings`` looks at the first token too), so a corpus without any costs a look a sentence."""
    if hasattr(point, "tokens"):
        yield (), point
        if every_token or (point.tokens and point.tokens[0]._embeddings):
            for index, token in enumerate(point.tokens):
                yield (index,), token
        return
    yield ("pair",), point
    for member in ("first", "second", "third", "concatenated_data"):
        sentence = getattr(point, member, None)
        if sentence is not None:
            for place, part in _parts(sentence, every_token):
                yield (member, *place), part
