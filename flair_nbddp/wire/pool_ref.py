"""Objects put on a warm pool: packed once, read once by each worker, then used by any number of jobs.

Packing a corpus of 50,000 IMDB-length reviews takes seconds, and every launch that gets the corpus packs it
again. :meth:`flair_nbddp.WorkerPool.put` packs it once, into a file of the pool's own directory, and returns
a :class:`PoolRef`. A job that receives the ref (as an argument, or anywhere inside one) ships a few bytes
naming that file; each worker reads and checks the file on its first job that needs it and keeps the bytes,
and every such job decodes its own copy from them (lazily, for a corpus: :mod:`flair_nbddp.wire.lazy_corpus`),
so one job's changes never reach the next.

A ref is a snapshot: changing the object in the notebook after ``put`` does not change what the workers
have. Put it again for the new content (and release the old ref). :meth:`PoolRef.matches` tells whether an
object is still the one put and its splits are the same ones (what ``%%ddp_train`` and the panel check
before they use a ref in place of a notebook corpus); it cannot see changes inside the sentences.

A ref that is released, or that the notebook no longer holds, is dropped: its file goes once the job that was
started before is over (that job may still read it), and the workers let its bytes go before their next job.

Example::

    ref = pool.put(corpus)                        # packed once
    for lr in (1e-3, 3e-3, 1e-2):
        pool.launch_distributed(train, ref, lr)   # nothing packed again
    ref.release()                                 # the workers drop their copy before their next job
"""

from __future__ import annotations

import hashlib
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import CorpusMismatchError, PoolRefError
from . import payload
from .payload import length, sizes

_WORKER_COPIES: dict[str, bytes] = {}  # in a worker: the bytes of each ref it has read, by ref id
_WORKER_KEPT: dict[str, Any] = {}  # in a worker: the one decoded object of each ref passed as kept(ref), by ref id
HOST_DIR: str | None = None  # in a worker on a cluster: where its host keeps the refs' files (named by id)


def _shape(obj: Any) -> tuple | None:
    """What :meth:`PoolRef.matches` compares: the object and, for a corpus, its splits, held weakly, with their
    lengths; None if the object cannot be held weakly (then nothing can be said)."""
    parts = [obj]
    if all(hasattr(obj, split) for split in ("train", "dev", "test")):
        parts += [obj.train, obj.dev, obj.test]
    try:
        return tuple((None, None) if part is None else (weakref.ref(part), length(part)) for part in parts)
    except TypeError:
        return None


def trackable(obj: Any) -> bool:
    """Whether :meth:`PoolRef.matches` can recognise ``obj`` later: it (and a corpus's splits) can be held weakly.

    Example:
        >>> from flair_nbddp.synthetic import sentiment_corpus
        >>> trackable(sentiment_corpus(4, 1, 1)), trackable([1, 2])
        (True, False)
    """
    return _shape(obj) is not None


class PoolRef:
    """What :meth:`flair_nbddp.WorkerPool.put` returns: a handle on an object the pool's workers keep.

    Pass it to a job where the object would go; the job gets the workers' copy. Attributes: ``nbytes`` (packed
    size), ``type_name``, ``put_at`` (a ``time.time()``), ``pack_seconds``, ``released``, ``trackable`` (whether
    :meth:`matches` can tell the object apart: False for objects that cannot be held weakly, such as lists).

    Example::

        ref = pool.put(corpus)
        ref                          # <PoolRef Corpus, 24.1 MB packed in 4.6 s at 12:03:11 on WorkerPool ...>
        pool.launch(train, (ref,))
    """

    def __init__(self, pool: Any, path: Path, obj: Any, nbytes: int, digest: str, pack_seconds: float) -> None:
        self.id = path.stem
        self.path = path
        self.nbytes, self.digest, self.pack_seconds = nbytes, digest, pack_seconds
        self.type_name = type(obj).__name__
        self.of_flair = payload.is_flair_object(obj)  # cold workers import flair early
        self.put_at = time.time()
        self.released = False
        self._pool = weakref.ref(pool)
        self._shape = _shape(obj)
        self.sizes = sizes(obj)

    @classmethod
    def put(cls, pool: Any, directory: Path, obj: Any) -> PoolRef:
        """Pack ``obj`` into a new file of ``directory`` and return its ref (see :meth:`WorkerPool.put`)."""
        directory.mkdir(mode=0o700, exist_ok=True)
        path = directory / f"{uuid.uuid4().hex}.pkl"
        began = time.perf_counter()
        try:
            nbytes, digest = payload.write_object(path, obj, f"the {type(obj).__name__} given to put()")
        except BaseException:  # a full disk, an interrupt: no half-written file stays behind
            path.unlink(missing_ok=True)
            raise
        return cls(pool, path, obj, nbytes, digest, time.perf_counter() - began)

    @property
    def trackable(self) -> bool:
        """Whether :meth:`matches` can recognise the object (see :func:`trackable`)."""
        return self._shape is not None

    def matches(self, obj: Any) -> bool:
        """Whether ``obj`` is the object put, with the same splits of the same lengths (a corpus downsampled or
        filtered since, or a new object, does not match). Changes inside its sentences are not seen."""
        if self.released or self._shape is None:
            return False
        shape = _shape(obj)
        return shape is not None and len(shape) == len(self._shape) and all(
            (held() if held is not None else None) is (now() if now is not None else None) and length == length_now
            for (held, length), (now, length_now) in zip(self._shape, shape)
        )

    @property
    def pool(self) -> Any:
        """The pool it was put on (None once that pool is gone)."""
        return self._pool()

    def held(self) -> Any:
        """The object put, while the notebook still holds it; None once it is gone (or if it cannot be held weakly)."""
        return None if self._shape is None else self._shape[0][0]()

    def release(self) -> None:
        """Drop the object: the workers let their copies go before their next job, and its file goes once the
        job started before is over. Idempotent."""
        pool = self._pool()
        if pool is not None:
            pool.drop(self)
        else:  # the pool is gone, and its workers with it
            self.released = True
            self.path.unlink(missing_ok=True)

    def __reduce__(self) -> tuple[Callable, tuple]:
        if self.released:
            raise PoolRefError(
                f"{self.describe()} was released (or its pool closed): its workers no longer have it. Put the "
                "object on the pool again (ref = pool.put(obj), or %ddp_pool put NAME) and pass the new ref"
            )
        return _worker_copy, (self.id, str(self.path), self.digest)

    def __flair_nbddp_record__(self) -> dict:
        """What the run ledger records of a run given this ref: the object put, by type, sizes and sha256."""
        return {"type": self.type_name, **self.sizes, "sha256": self.digest, "put_on_pool": True}

    def describe(self) -> str:
        """``PoolRef Corpus, 24.1 MB packed in 4.6 s at 12:03:11``."""
        at = time.strftime("%H:%M:%S", time.localtime(self.put_at))
        return f"PoolRef {self.type_name}, {self.nbytes / 1e6:.1f} MB packed in {self.pack_seconds:.1f} s at {at}"

    def __repr__(self) -> str:
        pool = self._pool()
        where = "released" if self.released else f"on {pool.status().split(';')[0]}" if pool else "its pool is gone"
        return f"<{self.describe()}, {where}>"


def _worker_copy(ref_id: str, path: str, digest: str) -> Any:
    """In a worker: the object of a ref, decoded afresh from the bytes this worker read once."""
    data = _WORKER_COPIES.get(ref_id)
    if HOST_DIR is not None:  # the notebook's path is not this host's
        path = str(Path(HOST_DIR) / f"{ref_id}.pkl")
    if data is None:
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            raise PoolRefError(
                f"the object put on the pool is gone ({path} was deleted: the ref was released or the pool "
                "closed). Put it on the pool again and pass the new ref"
            ) from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise CorpusMismatchError(
                f"the object put on the pool ({path}) differs from the one packed in the notebook: the file was "
                "changed or damaged. Put it on the pool again"
            )
        _WORKER_COPIES[ref_id] = data
    return payload.loads(data)


class Kept:
    """A ref that reaches a job as the worker's one decoded object, kept for its next jobs (:func:`kept`)."""

    def __init__(self, ref: PoolRef) -> None:
        self.ref = ref
        self.of_flair = ref.of_flair

    def __reduce__(self) -> tuple[Callable, tuple]:
        _, args = self.ref.__reduce__()  # a released ref is refused here, as anywhere
        return _worker_kept, args


def kept(ref: PoolRef) -> Kept:
    """``ref`` decoded once per worker and the same object handed to each job that gets it, instead of a fresh copy
    per job: for what a job only reads, such as the model of :func:`flair_nbddp.predict`, loaded on the worker's
    device once. Released with the ref."""
    return Kept(ref)


def _worker_kept(ref_id: str, path: str, digest: str) -> Any:
    if ref_id not in _WORKER_KEPT:
        _WORKER_KEPT[ref_id] = _worker_copy(ref_id, path, digest)
        _WORKER_COPIES.pop(ref_id, None)  # decoded once for good: the bytes would only double its memory
    return _WORKER_KEPT[ref_id]


def keep_only(ref_ids: Iterable[str]) -> None:
    """In a worker, before a job: drop the bytes and kept objects of every ref not in ``ref_ids`` (released since)."""
    keep = set(ref_ids)
    for ref_id in [ref_id for ref_id in _WORKER_COPIES if ref_id not in keep]:
        del _WORKER_COPIES[ref_id]
    for ref_id in [ref_id for ref_id in _WORKER_KEPT if ref_id not in keep]:
        del _WORKER_KEPT[ref_id]
