"""The next training batch read and tokenized in a thread while the device computes this one.

flair's trainer reads its batches from a ``flair.datasets.DataLoader`` on its one thread: each batch's sentences
are built (a lazy corpus builds them from the shipped bytes when read), then embedded, which tokenizes them. In a
worker whose job looks ahead (fast inputs on a GPU: :func:`.fast_inputs.start_job`), the trainer's loader reads
its first batch itself, then hands the rest of the epoch to a thread that reads the next batch and tokenizes its
sentences not kept yet (with its own copy of each embedding's tokenizer, into the kept encodings:
:mod:`.kept_inputs`), one batch ahead. The thread's work runs while the main thread waits for the GPU; when flair
embeds the batch, its sentences are built and their encodings are there.

Reading ahead changes nothing flair draws: the first batch is read on the trainer's thread (a random sampler draws
its order then), the samplers read ahead draw nothing after that (torch's distributed, random and sequential ones;
any other sampler is read on the trainer's thread, as flair does), and building or tokenizing a sentence draws
nothing. The thread tokenizes a data point's own tokens, which is what flair embeds for a sentence (a classifier's,
a tagger's); it leaves data points that are not sentences (a pair classifier's pairs) alone, and stops tokenizing
for an embedding after three batches of which flair used nothing (a model that embeds other text).
"""

from __future__ import annotations

import copy
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from .kept_inputs import sentence_key

_USELESS_AFTER = 3  # batches tokenized ahead for an embedding of which flair used nothing: the thread stops
_KEPT = "_flair_nbddp_kept"  # on a sentence the thread saw kept: the serials of the stores that hold it
END = object()  # what an Ahead gives after its last item


class _Watch:
    """What the thread knows of one embedding in this job."""

    def __init__(self, embedding: Any, store: Any, settings: Any) -> None:
        self.tokenizer = copy.deepcopy(embedding.tokenizer)  # a tokenizer's settings change with each call
        self.store, self.settings = store, settings
        self.ahead: set[bytes] = set()  # keys the thread kept and flair has not asked for yet
        self.batches = self.used = 0


_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # embedding -> _Watch, this job's
_AHEAD = False  # this job reads ahead
_ENCODE: Any = None  # fast_inputs.encode: tokenize sentences into a store


def install(encode: Any) -> None:
    """Give flair's trainer the loader that reads ahead (its module's name only); the thread keeps sentences with
    ``encode(tokenizer, store, keys, words, settings)``."""
    global _ENCODE
    import flair.trainers.trainer

    _ENCODE = encode
    if not issubclass(flair.trainers.trainer.DataLoader, _LookAhead):
        flair.trainers.trainer.DataLoader = _look_ahead_type(flair.trainers.trainer.DataLoader)


def start_job(ahead: bool) -> None:
    """A job begins: it reads ahead if ``ahead``; the last job's embeddings are forgotten."""
    global _AHEAD
    _AHEAD = ahead
    _WATCHED.clear()


def watch(embedding: Any, store: Any, settings: Any) -> None:
    """``embedding`` embeds its data points' own tokens in training: tokenize them ahead for it, into ``store``
    with ``settings`` (from its first use in this job on)."""
    if _AHEAD and embedding not in _WATCHED:
        _WATCHED[embedding] = _Watch(embedding, store, settings)


def count_hits(keys: list[bytes], found: list) -> None:
    """flair asked for ``keys``: note which came from the thread."""
    for watch_ in list(_WATCHED.values()):
        if watch_.ahead:
            hits = [key_ for key_, rows in zip(keys, found) if rows is not None and key_ in watch_.ahead]
            watch_.used += len(hits)
            watch_.ahead.difference_update(hits)


def tokenize_ahead(batch: list) -> None:
    """Keep the encodings of ``batch``'s sentences for every watched embedding (what the thread does with each
    batch it reads). A sentence the thread saw kept in a store is marked with the store's serial and skipped from
    then on: in a built corpus, every epoch after the first costs the thread nothing. (The mark only spares the
    thread: flair's own call still finds each sentence by its words.)"""
    from flair.data import Sentence

    if not _WATCHED or not all(isinstance(point, Sentence) for point in batch):
        return
    for watch_ in list(_WATCHED.values()):
        if watch_.batches >= _USELESS_AFTER and not watch_.used:
            continue
        serial = watch_.store.serial
        fresh = [point for point in batch if serial not in point.__dict__.get(_KEPT, ())]
        if not fresh:
            continue
        words = [[token.text for token in point.tokens] for point in fresh]
        keys = [sentence_key(point, its_words) for point, its_words in zip(fresh, words, strict=True)]
        missing = [index for index, held in enumerate(watch_.store.holds(keys)) if not held]
        if missing:
            chosen = [keys[index] for index in missing]
            _ENCODE(watch_.tokenizer, watch_.store, chosen, [words[index] for index in missing], watch_.settings)
            watch_.ahead.update(chosen)
        for point, held in zip(fresh, watch_.store.holds(keys)):
            if held:
                point.__dict__[_KEPT] = (*point.__dict__.get(_KEPT, ()), serial)
        watch_.batches += 1


class Ahead:
    """Reads ``items`` in a thread, one ahead of the caller, each passed to ``prepare`` before the caller gets it
    (training batches tokenized; a predict call's chunks, :mod:`.predict_rank`). Iterating it, or ``next`` until
    :data:`END`, gives the items; an error of the thread is raised on the caller's."""

    def __init__(self, items: Iterator, prepare: Any = tokenize_ahead) -> None:
        self._items, self._prepare = items, prepare
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="flair_nbddp-inputs", daemon=True)
        self._thread.start()

    def __next__(self) -> Any:
        item, error = self._ready.get()
        if error is not None:
            raise error
        return item

    def __iter__(self) -> Iterator:
        item = next(self)
        while item is not END:
            yield item
            item = next(self)

    def close(self) -> None:
        """Stop reading (the caller left early); the thread ends within a tenth of a second."""
        self._closed.set()
        self._thread.join()

    def _read(self) -> None:
        try:
            for item in self._items:
                self._prepare(item)
                if not self._put((item, None)):
                    return
            self._put((END, None))
        except BaseException as error:  # noqa: BLE001 - raised on the trainer's thread, where it belongs
            self._put((None, error))

    def _put(self, item: tuple) -> bool:
        while not self._closed.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


class _LookAhead:
    """Marks the loader type that reads ahead."""


def _samples_without_drawing(loader: Any) -> bool:
    """Whether the loader's sampler draws nothing after its first batch: torch's distributed, random and
    sequential samplers (the ones flair's trainer makes)."""
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    return loader.batch_sampler is not None and type(loader.sampler) in (
        DistributedSampler, RandomSampler, SequentialSampler
    )  # fmt: skip


def _look_ahead_type(loader: type) -> type:
    class LookAheadLoader(loader, _LookAhead):
        """flair's loader, its batches after the first read and tokenized a batch ahead in a thread."""

        def __iter__(self):
            batches = super().__iter__()
            if not _AHEAD or not _samples_without_drawing(self):
                yield from batches
                return
            first = next(batches, END)  # here: a random sampler draws its order as the first batch is read
            if first is END:
                return
            reader = Ahead(batches)
            try:
                yield first
                yield from reader
            finally:
                reader.close()

    return LookAheadLoader
