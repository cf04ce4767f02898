"""A corpus that stays in the codec's compact form in a worker and builds each sentence when it is read.

A decoded corpus costs about 120 MB of worker memory per 1,000 IMDB-length documents (flair's objects: a
``Token`` with five dicts per word); its encoded form costs about 0.5 MB. :func:`decode_lazy` rebuilds the
object around the sentences as :func:`flair_nbddp.wire.codec.decode` does (the ``Corpus``, its datasets,
``Subset``\\ s...), but every list of sentences or pairs in it becomes a :class:`LazyDataPoints`: a sequence
that builds item ``i`` from the bytes when it is read, and lets it go when nothing holds it any more. So
flair's data loader, its evaluation, ``make_label_dictionary`` and its same-corpus check on every rank read
the corpus as before, and a worker's memory holds the batches in flight, not the corpus.

What is read while something holds it (a batch, a variable) is that same object when read again. Sentences
flair keeps state on between epochs, the embeddings it stores with ``embeddings_storage_mode="cpu"`` or
``"gpu"``, are kept built for the rest of the job (:func:`keep_stored_embeddings` watches flair's
``store_embeddings``), so training with stored embeddings behaves as on a built corpus.

The rule that comes with it: a change a job makes to a sentence (``add_label``...) lasts while the job
holds that sentence. To change the corpus, change it in the notebook before the launch, or launch with
``lazy_corpus=False`` (every sentence is built up front and stays).

Corpora whose sentences link to their neighbours (flair's context: ``_previous_sentence``) or whose side
table refers to sentences are built up front as before (:func:`decode_lazy` falls back on its own).

Example:
    >>> from flair_nbddp.wire import codec
    >>> from flair_nbddp.synthetic import sentiment_corpus
    >>> corpus = decode_lazy(codec.encode(sentiment_corpus(n_train=50, n_dev=5, n_test=5)))
    >>> type(corpus.train.datapoints).__name__, len(corpus.train)
    ('LazyDataPoints', 50)
    >>> corpus.train[3] is corpus.train[3]          # the same object while something holds it
    True
"""

from __future__ import annotations

import copy
import functools
import pickletools
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset

from . import codec
from .codec import _Decoder

__all__ = ["LazyDataPoints", "decode_lazy", "keep_stored_embeddings", "stays_compact"]

# each built sentence or pair -> (its source, table, index), so that flair's store_embeddings can keep it
_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Source:
    """One decoded blob: builds sentences and pairs on demand, and remembers those still held or kept."""

    def __init__(self, decoder: _Decoder) -> None:
        self.decoder = decoder
        self.alive = {"s": weakref.WeakValueDictionary(), "g": weakref.WeakValueDictionary()}
        self.kept: dict[str, dict[int, Any]] = {"s": {}, "g": {}}
        self.lists: dict[int, LazyDataPoints] = {}

    def get(self, table: str, index: int) -> Any:
        """Sentence (``"s"``) or pair (``"g"``) ``index``: the one held or kept, else a new one."""
        point = self.kept[table].get(index)
        if point is None:
            point = self.alive[table].get(index)
        if point is None:
            if table == "s":
                point = self.decoder.sentence(index)
            else:
                point = self.decoder.group(index, functools.partial(self.get, "s"))
            self.alive[table][index] = point
            _ORIGINS[point] = (self, table, index)
        return point

    def keep(self, table: str, index: int) -> Any:
        """Build (or find) a point and keep it for the source's life."""
        point = self.kept[table][index] = self.get(table, index)
        return point

    def data_points(self, index: int) -> LazyDataPoints:
        if index not in self.lists:
            self.lists[index] = LazyDataPoints(self, self.decoder.item_codes(index))
        return self.lists[index]


class _Table:
    """What the root's unpickler resolves ``("s", i)`` or ``("g", i)`` with: a point the root holds is kept."""

    def __init__(self, source: _Source, table: str) -> None:
        self.source, self.table = source, table

    def __getitem__(self, index: int) -> Any:
        return self.source.keep(self.table, index)


class _Lists:
    def __init__(self, source: _Source) -> None:
        self.source = source

    def __getitem__(self, index: int) -> LazyDataPoints:
        return self.source.data_points(index)


class LazyDataPoints(Sequence):
    """A list of sentences (or pairs of sentences) that builds each one when it is read.

    Indexing, slicing (a list of the items), iteration, ``len`` and ``in`` work as on a list; it cannot be
    changed (no ``append`` or item assignment): build the corpus you want in the notebook, or wrap the dataset
    in a ``torch.utils.data.Subset``. Pickled, or encoded by :mod:`flair_nbddp.wire.codec` (say, in a returned
    value), it is the list of its items.

    Example:
        >>> from flair_nbddp.wire import codec
        >>> from flair_nbddp.synthetic import ner_corpus
        >>> corpus = decode_lazy(codec.encode(ner_corpus(n_train=20, n_dev=5, n_test=5)))
        >>> items = corpus.train.datapoints
        >>> len(items), len(items[2:5]), items[-1].get_spans("ner") == items[19].get_spans("ner")
        (20, 3, True)
    """

    def __init__(self, source: _Source, codes: np.ndarray) -> None:
        self._source = source
        self._codes = codes

    def __len__(self) -> int:
        return len(self._codes)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._item(code) for code in self._codes[index].tolist()]
        return self._item(int(self._codes[index]))

    def __iter__(self) -> Iterator[Any]:
        for code in self._codes.tolist():
            yield self._item(code)

    def _item(self, code: int) -> Any:
        return self._source.get("s", code) if code >= 0 else self._source.get("g", -1 - code)

    def __reduce__(self) -> tuple[Callable, tuple]:
        return list, (list(self),)

    def built(self) -> list:
        """Its items that are built now (held somewhere, or kept): the only ones that can carry embeddings."""
        members = set(self._codes.tolist())
        found = {}
        for table in ("s", "g"):
            for index, point in [*self._source.kept[table].items(), *self._source.alive[table].items()]:
                if (index if table == "s" else -1 - index) in members:
                    found[id(point)] = point
        return list(found.values())

    def __flair_nbddp_datapoints__(self) -> list:
        """Its items as a list: what :mod:`flair_nbddp.wire.codec` encodes in its place."""
        return list(self)

    def __repr__(self) -> str:
        return f"<LazyDataPoints: {len(self)} items, built when read>"


BUILT_BYTES_PER_TOKEN = 500  # a built Token with its share of its sentence (tracemalloc: 454-472 bytes)
BUILD_UP_TO_BYTES = 1 << 30  # lazy_corpus=None: a corpus whose built form fits this in a worker is built


def stays_compact(data: bytes) -> bool:
    """The choice of ``lazy_corpus=None`` for one encoded corpus: lazy if its sentences, built, would take more than
    :data:`BUILD_UP_TO_BYTES` (1 GiB) of a worker's memory (about 9,000 IMDB-length reviews), else built up front,
    as flair's own script has them: no sentence is built again in every epoch on the training's thread.

    Example:
        >>> from flair_nbddp.wire import codec
        >>> from flair_nbddp.synthetic import sentiment_corpus
        >>> stays_compact(codec.encode(sentiment_corpus(n_train=50, n_dev=5, n_test=5)))
        False
    """
    return codec.token_count(data) * BUILT_BYTES_PER_TOKEN > BUILD_UP_TO_BYTES


def decode_lazy(data: bytes) -> Any:
    """Rebuild what :func:`flair_nbddp.wire.codec.encode` encoded, its lists of data points lazy (see the module).

    Falls back to :func:`flair_nbddp.wire.codec.decode` (everything built) where sentences link to their neighbours
    or the side table refers to sentences.
    """
    decoder = _Decoder(data)
    if decoder.linked or not _extras_stand_alone(decoder):
        return decoder.decode()
    decoder.read_extras({})
    decoder.extras = _FreshExtras(decoder.extras)
    source = _Source(decoder)
    return decoder.root({"s": _Table(source, "s"), "g": _Table(source, "g"), "l": _Lists(source)})


def _extras_stand_alone(decoder: _Decoder) -> bool:
    """Whether the side table refers to no sentence, pair or list (pickle's persistent ids)."""
    data = bytes(decoder.sections["extras"])
    return not data or not any(opcode.name in ("PERSID", "BINPERSID") for opcode, _, _ in pickletools.genops(data))


class _FreshExtras(dict):
    """The side table, handing out a copy of each value: a sentence built again must not share, say, the
    ``_metadata`` dict a job changed on its earlier copy."""

    def get(self, key: Any, default: Any = None) -> Any:
        return copy.deepcopy(super().get(key, default))

    def __getitem__(self, key: Any) -> Any:
        return copy.deepcopy(super().__getitem__(key))


def _holds_embeddings(point: Any) -> bool:
    if point._embeddings:
        return True
    if hasattr(point, "tokens"):
        members = [point]
    else:  # a pair or triple: its sentences, and the pair as one sentence (flair's default for pair classifiers)
        members = [getattr(point, name, None) for name in ("first", "second", "third", "concatenated_data")]
        members = [member for member in members if member is not None]
    for sentence in members:
        if sentence._embeddings or any(token._embeddings for token in sentence.tokens):
            return True
        if any(span._embeddings for span in sentence._known_spans.values()):
            return True
    return False


def keep_embedded(data_points: Any, storage_mode: str) -> None:
    """Keep the built points of a lazy corpus that flair left embeddings on (storage mode other than "none")."""
    if storage_mode == "none" or not isinstance(data_points, list):
        return
    for point in data_points:
        origin = _ORIGINS.get(point)
        if origin is not None and _holds_embeddings(point):
            source, table, index = origin
            source.kept[table][index] = point


def lazy_key(point: Any) -> tuple[str, int]:
    """Where its lazy corpus builds ``point`` from: ``("s", index)`` for a sentence, ``("g", index)`` for a pair."""
    _, table, index = _ORIGINS[point]
    return table, index


def kept_point(dataset: Any, key: tuple[str, int]) -> Any:
    """The point :func:`lazy_key` named, of the lazy corpus ``dataset`` is made from, built and kept for the job."""
    return _lazy_lists(dataset)[0]._source.keep(*key)


class _BuiltPoints(Dataset):
    """The built points of a lazy split, as a dataset: flair iterates it as it would the split, with the same
    draw from torch's random generator (a DataLoader takes one as it starts), so training stays identical."""

    def __init__(self, points: list) -> None:
        self.points = points

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> Any:
        return self.points[index]


def built_points(dataset: Any) -> list | None:
    """The built points of a dataset made of lazy lists (through ``Subset``/``ConcatDataset`` too); None for a
    list, or a dataset holding anything else.

    Example:
        >>> from flair_nbddp.wire import codec
        >>> from flair_nbddp.synthetic import sentiment_corpus
        >>> corpus = decode_lazy(codec.encode(sentiment_corpus(n_train=30, n_dev=5, n_test=5)))
        >>> held = corpus.train[4]
        >>> built_points(corpus.train) == [held], built_points([held])
        (True, None)
    """
    if isinstance(dataset, list):
        return None
    lists = _lazy_lists(dataset)
    return None if lists is None else [point for lazy in lists for point in lazy.built()]


def _lazy_lists(dataset: Any) -> list[LazyDataPoints] | None:
    inner = getattr(dataset, "datasets", None) or ([dataset.dataset] if hasattr(dataset, "dataset") else None)
    if inner is not None:  # Subset, ConcatDataset: made of lazy lists if every part is
        parts = [_lazy_lists(part) for part in inner]
        return None if any(part is None for part in parts) else [lazy for part in parts for lazy in part]
    lazy = [value for value in getattr(dataset, "__dict__", {}).values() if isinstance(value, LazyDataPoints)]
    return lazy or None


def keep_stored_embeddings() -> None:
    """Wrap flair's ``store_embeddings`` (in every flair module that imported it) with :func:`keep_embedded`.

    Called in a worker once flair is imported; calling it again changes nothing.
    """
    import flair.training_utils

    original = flair.training_utils.store_embeddings
    if getattr(original, "__wrapped__", None) is not None:
        return

    @functools.wraps(original)
    def store_embeddings(data_points: Any, storage_mode: str, *args: Any, **kwargs: Any) -> None:
        built = built_points(data_points)
        if built is None:
            original(data_points, storage_mode, *args, **kwargs)
        else:  # flair would build the whole split at once, each epoch, to find no embeddings on what it built
            original(_BuiltPoints(built), storage_mode, *args, **kwargs)
        keep_embedded(data_points if built is None else built, storage_mode)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").partition(".")[0] == "flair" and vars(module).get("store_embeddings") is original:
            module.store_embeddings = store_embeddings
