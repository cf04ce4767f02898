"""The encodings a worker keeps: one compact store per tokenizer and settings, for the sentences it has tokenized.

A sentence's encoding is one row of sub-token ids (a sentence longer than the model, one row per strided window).
A :class:`Store` keeps the rows in fixed-size chunks of one integer type: 2 bytes a sub-token for a vocabulary of up
to 65,536 entries. Word embeddings also need each sub-token's word position; a store that keeps them marks, in the
top bit of an id, the sub-tokens that begin a word (2 bytes a sub-token still, for vocabularies up to 32,768), and
keeps a row's word positions in full only when they do not follow from the marks (a word with no sub-tokens, a
special token inside a word). Its index costs about 36 bytes a sentence: sorted arrays of 16-byte keys, with the
newest in a dict until there are enough of them to merge.

Every method takes the store's lock: a worker's main thread and its input thread (:mod:`.input_thread`) share it.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

CHUNK = 1 << 20  # sub-tokens a chunk holds; a row never spans two
_KEY = np.dtype("V16")
_MERGE_AT = 256  # newest keys held in a dict before they join the sorted arrays (or a 32nd of those, if more)

_SERIALS = itertools.count()
_ROW_BYTES = 16  # what a row costs beyond its sub-tokens: its start, its length, its first word
_SENTENCE_BYTES = 40  # what a sentence costs beyond its rows: its key in the index, its first row, where it came from
_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sentence -> (the words it was named by, its key)

Row = tuple[np.ndarray, Optional[list[Optional[int]]]]  # ids (int64), word positions (or None when not kept)


@dataclass(frozen=True)
class Shipment:
    """Sentences of one store in their stored form, for another rank's store of the same tokenizer and settings:
    their keys (16 bytes each), rows per sentence, each row's length, every row's values one after another, each
    row's first word less one (stores with word positions), and the word positions kept in full, by row."""

    keys: bytes
    rows: np.ndarray
    lengths: np.ndarray
    stored: np.ndarray
    bases: np.ndarray
    explicit: dict[int, np.ndarray]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """What the shipment's arrays take."""
        arrays = (self.rows, self.lengths, self.stored, self.bases, *self.explicit.values())
        return len(self.keys) + sum(array.nbytes for array in arrays)


class _Column:
    """A growing array of one type, its spare capacity at most a quarter of what it holds."""

    def __init__(self, dtype: type) -> None:
        self.data, self.size = np.empty(64, dtype), 0

    def append(self, value: int) -> None:
        if self.size == len(self.data):
            grown = np.empty(len(self.data) * 5 // 4, self.data.dtype)
            grown[: self.size] = self.data
            self.data = grown
        self.data[self.size] = value
        self.size += 1

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class Store:
    """The rows kept for one tokenizer with one set of call settings.

    ``vocabulary`` bounds the ids (``len(tokenizer)``), ``special_ids`` are the tokenizer's special tokens (the
    sub-tokens outside any word), and ``word_ids`` says whether rows keep their word positions. ``serial`` tells
    this store from every other the worker made, as long as it lives.

    >>> store = Store(vocabulary=100, special_ids=[1, 2], word_ids=True)
    >>> store.add(b"k" * 16, [([1, 7, 8, 9, 2], [None, 0, 0, 1, None])])
    True
    >>> [(ids.tolist(), words) for ids, words in store.rows([b"k" * 16])[0]]
    [([1, 7, 8, 9, 2], [None, 0, 0, 1, None])]
    """

    def __init__(self, vocabulary: int, special_ids: Sequence[int], word_ids: bool) -> None:
        self.word_ids = word_ids
        self.serial = next(_SERIALS)
        room = vocabulary * 2 if word_ids else vocabulary  # a word mark takes the top bit
        self._type = np.uint16 if room <= 1 << 16 else np.int32
        self._mark = (1 << 15 if self._type is np.uint16 else 1 << 30) if word_ids else 0
        self._largest = (1 << 15 if self._type is np.uint16 else 1 << 30) - 1 if word_ids else np.iinfo(self._type).max
        self._specials = np.asarray(sorted(special_ids), dtype=np.int64)
        self._chunks: list[np.ndarray] = []
        self._used = CHUNK  # of the last chunk: a first row opens one
        self._starts, self._lengths = _Column(np.int64), _Column(np.int32)
        self._bases = _Column(np.int32)  # per row: its first word's position, less one (kept with word ids only)
        self._explicit: dict[int, np.ndarray] = {}  # row -> word positions that do not follow from the marks
        self._explicit_bytes = 0
        self._first_rows = _Column(np.int32)  # per sentence, in the order kept; one more at the end
        self._first_rows.append(0)
        self._sorted_keys, self._sorted_sentences = np.empty(0, _KEY), np.empty(0, np.int32)
        self._newest: dict[bytes, int] = {}
        self._local = _Column(np.bool_)  # per sentence: tokenized here (not received from another rank)
        self._shipped = 0  # the sentences before this one that were tokenized here went out in a shipment
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._first_rows.size - 1

    @property
    def nbytes(self) -> int:
        """What the kept rows and their index take: sub-tokens (of the last chunk, what is used), row and sentence
        tables, keys (the newest at what a dict entry and its key cost), word positions kept in full."""
        with self._lock:
            used = sum(chunk.nbytes for chunk in self._chunks[:-1])
            used += self._used * self._chunks[-1].itemsize if self._chunks else 0
            columns = (self._starts, self._lengths, self._bases, self._first_rows, self._local)
            tables = sum(column.nbytes for column in columns)
            index = self._sorted_keys.nbytes + self._sorted_sentences.nbytes + 120 * len(self._newest)
            return used + tables + index + self._explicit_bytes

    def sub_tokens(self) -> int:
        """How many sub-tokens are kept."""
        return int(self._lengths.data[: self._lengths.size].sum())

    def rows(self, keys: Sequence[bytes]) -> list[list[Row] | None]:
        """Each key's rows, or None for a key not kept."""
        with self._lock:
            return [None if sentence is None else self._rows_of(sentence) for sentence in self._find(keys)]

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key's rows are kept (without reading them)."""
        with self._lock:
            return [sentence is not None for sentence in self._find(keys)]

    def add(self, key: bytes, rows: Sequence[tuple[Sequence[int], Sequence[int | None] | None]]) -> bool:
        """Keep a sentence's rows (ids, and word positions if this store keeps them); False if its ids do not fit
        (the sentence then goes flair's way each time)."""
        arrays = [np.asarray(ids, dtype=np.int64) for ids, _ in rows]
        if any(len(ids) and (ids.min() < 0 or ids.max() > self._largest) for ids in arrays):
            return False
        with self._lock:
            if self._find([key])[0] is not None:
                return True  # the other thread kept it meanwhile
            for ids, (_, words) in zip(arrays, rows):
                self._add_row(ids, words)
            self._kept(key, local=True)
        return True

    def _kept(self, key: bytes, local: bool) -> None:
        """The rows just placed are ``key``'s: index the sentence."""
        self._first_rows.append(self._starts.size)
        self._local.append(local)
        self._newest[key] = len(self) - 1
        if len(self._newest) >= max(_MERGE_AT, len(self._sorted_keys) // 32):
            self._merge()

    def ship(self, at_most: int | None = None) -> Shipment:
        """The sentences tokenized here since the last shipment (none received from elsewhere), in their stored
        form, for the other ranks' stores (:meth:`absorb`): those whose sub-tokens and rows take ``at_most`` bytes,
        if given (at least one sentence; the rest go in the next shipments, :meth:`unshipped`)."""
        with self._lock:
            sentences = self._shipped + np.flatnonzero(self._local.data[self._shipped : len(self)])
            if at_most is not None and len(sentences):
                fitting = int(np.searchsorted(np.cumsum(self._sizes(sentences)), at_most, side="right"))
                sentences = sentences[: max(1, fitting)]
            self._shipped = int(sentences[-1]) + 1 if len(sentences) else len(self)
            keys = self._keys_of(sentences)
            first = self._first_rows.data
            rows = [range(int(first[sentence]), int(first[sentence + 1])) for sentence in sentences]
            flat = [row for sentence_rows in rows for row in sentence_rows]
            stored = [self._stored(row) for row in flat]
            return Shipment(
                keys=keys,
                rows=np.fromiter((len(sentence_rows) for sentence_rows in rows), np.int32, len(rows)),
                lengths=np.fromiter((len(values) for values in stored), np.int32, len(stored)),
                stored=np.concatenate(stored) if stored else np.empty(0, self._type),
                bases=self._bases.data[flat].copy() if self.word_ids else np.empty(0, np.int32),
                explicit={index: self._explicit[row] for index, row in enumerate(flat) if row in self._explicit},
            )

    def unshipped(self) -> bool:
        """Whether sentences tokenized here wait for a shipment."""
        with self._lock:
            return bool(self._local.data[self._shipped : len(self)].any())

    def _sizes(self, sentences: np.ndarray) -> np.ndarray:
        """What each of the sentences numbered ``sentences`` (ascending) takes in a shipment: its key, sub-tokens,
        rows and word positions kept in full."""
        first = self._first_rows.data
        low, high = int(first[sentences[0]]), int(first[sentences[-1] + 1])  # the rows they span
        row_bytes = self._lengths.data[low:high].astype(np.int64) * np.dtype(self._type).itemsize + _ROW_BYTES
        for row, positions in self._explicit.items():
            if low <= row < high:
                row_bytes[row - low] += positions.nbytes
        ends = np.concatenate([[0], np.cumsum(row_bytes)])
        return 16 + ends[first[sentences + 1] - low] - ends[first[sentences] - low]

    def absorb(self, shipment: Shipment, room: int | None = None) -> int:
        """Keep a shipment's sentences that this store does not hold, while what they add stays within ``room``
        bytes (any, if None); how many. The shipment comes from a store of the same tokenizer and settings (hence
        of the same vocabulary and integer type)."""
        keys = [shipment.keys[at : at + 16] for at in range(0, len(shipment.keys), 16)]
        ends = np.cumsum(shipment.lengths)
        row = kept = grown = 0
        with self._lock:
            held = self._find(keys)
            for name, count, known in zip(keys, shipment.rows.tolist(), held):
                if room is not None and grown >= room:
                    break
                if known is None:
                    for index in range(row, row + count):
                        values = shipment.stored[ends[index] - shipment.lengths[index] : ends[index]]
                        base = int(shipment.bases[index]) if self.word_ids else 0
                        words = shipment.explicit.get(index)
                        self._place(values, base, words)
                        grown += values.nbytes + _ROW_BYTES + (0 if words is None else 4 * len(words))  # positions: int32
                    self._kept(name, local=False)
                    grown += _SENTENCE_BYTES
                    kept += 1
                row += count
        return kept

    def _add_row(self, ids: np.ndarray, words: Sequence[int | None] | None) -> None:
        if not self.word_ids:
            self._place(ids, 0, None)
            return
        marks, base = _word_marks(words)
        positions = _as_array(words)
        explicit = None if np.array_equal(self._decode_words(ids, marks, base), positions) else positions
        self._place(ids | (marks.astype(np.int64) * self._mark), base, explicit)

    def _place(self, stored: np.ndarray, base: int, explicit: np.ndarray | None) -> None:
        """Append a row in its stored form: ids with their word marks, first word less one, and its word positions
        when they do not follow from the marks."""
        row = self._starts.size
        if explicit is not None:
            self._explicit[row] = explicit.astype(np.int32)
            self._explicit_bytes += self._explicit[row].nbytes
        if not len(stored):  # no sub-tokens (a tokenizer without special tokens, a sentence of none): no chunk
            self._starts.append(0)
            self._lengths.append(0)
            if self.word_ids:
                self._bases.append(base)
            return
        if self._used + len(stored) > CHUNK:  # a row longer than a chunk gets one of its own size
            self._chunks.append(np.empty(max(CHUNK, len(stored)), self._type))
            self._used = 0
        chunk = len(self._chunks) - 1
        self._chunks[chunk][self._used : self._used + len(stored)] = stored
        self._starts.append(chunk * CHUNK + self._used if len(stored) <= CHUNK else -1 - chunk)
        self._lengths.append(len(stored))
        if self.word_ids:
            self._bases.append(base)
        self._used += len(stored)

    def _find(self, keys: Sequence[bytes]) -> list[int | None]:
        found: list[int | None] = [self._newest.get(key) for key in keys]
        if len(self._sorted_keys):
            wanted = np.frombuffer(b"".join(keys), dtype=_KEY)
            where = np.minimum(np.searchsorted(self._sorted_keys, wanted), len(self._sorted_keys) - 1)
            hit = self._sorted_keys[where] == wanted
            for index in np.flatnonzero(hit):
                found[index] = int(self._sorted_sentences[where[index]])
        return found

    def _merge(self) -> None:
        keys = np.frombuffer(b"".join(self._newest), dtype=_KEY)
        order = np.argsort(keys)
        keys, sentences = keys[order], np.fromiter(self._newest.values(), np.int32)[order]
        where = np.searchsorted(self._sorted_keys, keys)
        self._sorted_keys = np.insert(self._sorted_keys, where, keys)
        self._sorted_sentences = np.insert(self._sorted_sentences, where, sentences)
        self._newest = {}

    def _stored(self, row: int) -> np.ndarray:
        """A row's values as kept (ids with their word marks), a view of its chunk."""
        start, length = int(self._starts.data[row]), int(self._lengths.data[row])
        if not length:
            return np.empty(0, self._type)
        if start >= 0:
            return self._chunks[start // CHUNK][start % CHUNK : start % CHUNK + length]
        return self._chunks[-1 - start][:length]  # a row with a chunk of its own

    def _keys_of(self, sentences: np.ndarray) -> bytes:
        """The keys of the sentences numbered ``sentences``, 16 bytes each, in that order."""
        names = {sentence: name for name, sentence in self._newest.items()}
        order = np.empty(len(self), np.int64)
        order[self._sorted_sentences] = np.arange(len(self._sorted_sentences))
        return b"".join(
            names[sentence] if sentence in names else self._sorted_keys[order[sentence]].tobytes()
            for sentence in sentences.tolist()
        )

    def _rows_of(self, sentence: int) -> list[Row]:
        rows = []
        for row in range(int(self._first_rows.data[sentence]), int(self._first_rows.data[sentence + 1])):
            stored = self._stored(row).astype(np.int64)
            if not self.word_ids:
                rows.append((stored, None))
                continue
            marks = stored >= self._mark
            ids = stored & (self._mark - 1)
            words = self._explicit.get(row)
            if words is None:
                words = self._decode_words(ids, marks, int(self._bases.data[row]))
            rows.append((ids, [None if word < 0 else int(word) for word in words]))
        return rows

    def _decode_words(self, ids: np.ndarray, marks: np.ndarray, base: int) -> np.ndarray:
        """Word positions from the marks: each mark begins the next word; an unmarked special token is in none (-1)."""
        words = base + np.cumsum(marks)
        words[~marks & np.isin(ids, self._specials)] = -1
        return words


def _word_marks(words: Sequence[int | None] | None) -> tuple[np.ndarray, int]:
    """Which sub-tokens begin a word (a word position unlike the last one seen), and the row's first word less one."""
    positions = _as_array(words)
    inside = np.flatnonzero(positions >= 0)
    marks = np.zeros(len(positions), dtype=bool)
    if not len(inside):
        return marks, 0
    seen = positions[inside]
    marks[inside] = np.concatenate([[True], seen[1:] != seen[:-1]])
    return marks, int(seen[0]) - 1


def _as_array(words: Sequence[int | None] | None) -> np.ndarray:
    return np.asarray([-1 if word is None else word for word in words or ()], dtype=np.int64)


def key(words: list[str]) -> bytes:
    """A sentence's name in a store: a digest of its words (one C call for the words, unless a word holds the
    separator itself, when each word's length goes in too)."""
    joined, form = "\x00".join(words), b"\x01"
    if joined.count("\x00") != max(0, len(words) - 1):
        joined, form = "\x00".join(f"{len(word)}:{word}" for word in words), b"\x02"
    return hashlib.blake2b(form + joined.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def sentence_key(sentence: Any, words: list[str]) -> bytes:
    """:func:`key` of ``words``, the token texts that stand for ``sentence`` (flair's, with any context around it),
    remembered while the sentence lives: named again only when its words differ from those it was named by.

    Comparing them costs a pointer a word while the sentence's tokens are unchanged (flair hands out the same text
    objects each time), against hashing every character of the sentence: 32 reviews of 230 words are named in
    0.05 ms instead of 0.26 ms, in every batch. ``words`` is kept as it is given: the caller leaves it unchanged.
    Remembering costs about 300 bytes a sentence and 8 bytes a word (a few percent of what flair's sentence and
    tokens cost) until the sentence is freed: a lazy corpus's sentences go once the garbage collector frees their
    batch.

    Example:
        >>> from flair.data import Sentence
        >>> sentence = Sentence("a good film")
        >>> sentence_key(sentence, [t.text for t in sentence]) == key(["a", "good", "film"])
        True
        >>> sentence.tokens[1].form = "bad"
        >>> sentence_key(sentence, [t.text for t in sentence]) == key(["a", "bad", "film"])
        True
    """
    named = _NAMES.get(sentence)
    if named is not None and named[0] == words:
        return named[1]
    name = key(words)
    _NAMES[sentence] = (words, name)
    return name
