"""The next training batch tokenized while the device computes this one.

flair's trainer reads its batches from a ``flair.datasets.DataLoader``. In a worker, the trainer's loader reads one
batch ahead when the job looks ahead (fast inputs on a GPU: :func:`.fast_inputs.start_job`): as it hands batch *k*
to the trainer it hands batch *k+1*'s sentences to a thread, which tokenizes those not kept yet, with its own copy
of each embedding's tokenizer, into the kept encodings (:mod:`.kept_inputs`). The fast tokenizer's work runs
without the interpreter lock, so it overlaps the main thread's wait for the GPU; when flair then embeds batch
*k+1*, its encodings are there.

Reading ahead changes nothing flair draws: the sampler's order is fixed when the loader starts, and reading a
sentence draws no random numbers. The thread tokenizes a data point's own tokens, which is what flair embeds for a
sentence (a classifier's, a tagger's); an embedding whose model embeds other text (a pair classifier joins its two
sentences) gets none of its sentences from the thread, which stops tokenizing for it after three batches.
"""

from __future__ import annotations

import copy
import queue
import threading
import weakref
from typing import Any

from .kept_inputs import key

_USELESS_AFTER = 3  # batches tokenized ahead for an embedding with no sentence of them used: the thread stops
_END = object()


class _Watch:
    """What the thread knows of one embedding in this job."""

    def __init__(self, embedding: Any, store: Any, settings: Any) -> None:
        self.tokenizer = copy.deepcopy(embedding.tokenizer)  # a tokenizer's settings change with each call
        self.store, self.settings = store, settings
        self.ahead: set[bytes] = set()  # keys the thread kept and flair has not asked for yet
        self.batches = self.used = 0


class _Item:
    """A batch's sentences for one embedding, queued; ``done`` is set once the thread has kept them."""

    def __init__(self, watch_: _Watch, words: list[list[str]]) -> None:
        self.watch, self.words = watch_, words
        self.keys = [key(sentence) for sentence in words]
        self.done = threading.Event()


_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # embedding -> _Watch, this job's
_WORK: queue.Queue = queue.Queue(maxsize=2)
_PENDING: list[_Item] = []  # queued or being tokenized
_THREAD: threading.Thread | None = None
_AHEAD = False  # this job reads ahead
_ENCODE: Any = None  # fast_inputs.encode: tokenize sentences into a store


def install(encode: Any) -> None:
    """Give flair's trainer the loader that reads one batch ahead (its module's name only); the thread keeps
    sentences with ``encode(tokenizer, store, keys, words, settings)``."""
    global _ENCODE
    import flair.trainers.trainer

    _ENCODE = encode
    if not issubclass(flair.trainers.trainer.DataLoader, _LookAhead):
        flair.trainers.trainer.DataLoader = _look_ahead_type(flair.trainers.trainer.DataLoader)


def start_job(ahead: bool) -> None:
    """A job begins: it reads ahead if ``ahead``; the last job's embeddings, and anything queued for them, are
    forgotten."""
    global _AHEAD
    _AHEAD = ahead
    _WATCHED.clear()
    while True:
        try:
            _finish(_WORK.get_nowait())
        except queue.Empty:
            return


def watch(embedding: Any, store: Any, settings: Any) -> None:
    """``embedding`` embeds its data points' own tokens in training: tokenize them ahead for it, into ``store``
    with ``settings`` (from its first use in this job on)."""
    if _AHEAD and embedding not in _WATCHED:
        _WATCHED[embedding] = _Watch(embedding, store, settings)


def count_hits(keys: list[bytes], found: list) -> None:
    """flair asked for ``keys``: note which came from the thread."""
    for watch_ in list(_WATCHED.values()):
        if watch_.ahead:
            hits = [key for key, rows in zip(keys, found) if rows is not None and key in watch_.ahead]
            watch_.used += len(hits)
            watch_.ahead.difference_update(hits)


def wait_for(keys: list[bytes]) -> bool:
    """If any of ``keys`` is queued for the thread, wait until the thread has kept them (so that no sentence is
    tokenized twice) and say so."""
    waited = False
    for item in list(_PENDING):
        if not set(item.keys).isdisjoint(keys):
            item.done.wait()
            waited = True
    return waited


def foresee(batch: list) -> None:
    """Queue ``batch``'s sentences for the thread (skipped when it is two batches behind)."""
    from flair.data import Sentence

    if not _WATCHED or not all(isinstance(point, Sentence) for point in batch):
        return
    words = [[token.text for token in point.tokens] for point in batch]
    for embedding, watch_ in list(_WATCHED.items()):
        if watch_.batches >= _USELESS_AFTER and not watch_.used:
            continue
        item = _Item(watch_, words)
        _PENDING.append(item)
        try:
            _WORK.put_nowait(item)
        except queue.Full:
            _finish(item)
            return
        _ensure_thread()


def _ensure_thread() -> None:
    global _THREAD
    if _THREAD is None or not _THREAD.is_alive():
        _THREAD = threading.Thread(target=_serve, name="flair_nbddp-inputs", daemon=True)
        _THREAD.start()


def _serve() -> None:
    while True:
        item = _WORK.get()
        try:
            watch_ = item.watch
            missing = [index for index, rows in enumerate(watch_.store.rows(item.keys)) if rows is None]
            if missing:
                chosen = [item.keys[index] for index in missing]
                words = [item.words[index] for index in missing]
                _ENCODE(watch_.tokenizer, watch_.store, chosen, words, watch_.settings)
                watch_.ahead.update(chosen)
            watch_.batches += 1
        finally:
            _finish(item)


def _finish(item: _Item) -> None:
    item.done.set()
    if item in _PENDING:
        _PENDING.remove(item)


class _LookAhead:
    """Marks the loader type that reads ahead."""


def _look_ahead_type(loader: type) -> type:
    class LookAheadLoader(loader, _LookAhead):
        """flair's loader, handing the next batch to the input thread as it yields this one."""

        def __iter__(self):
            batches = super().__iter__()
            if not _AHEAD:
                yield from batches
                return
            ahead = next(batches, _END)
            while ahead is not _END:
                batch, ahead = ahead, next(batches, _END)
                if ahead is not _END:
                    foresee(ahead)
                yield batch

    return LookAheadLoader
