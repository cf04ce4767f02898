"""A sentence's sub-token ids put together from its words', each distinct word tokenized once per tokenizer.

flair hands its tokenizer sentences already split into words (``is_split_into_words=True``). A fast tokenizer
(``tokenizers``) encodes each word of such a sentence on its own (its normalizer, pre-tokenizer and model see one
word at a time), joins the words' sub-tokens, and adds its special tokens around them. So a sentence's ids are its
words' ids one after another between the tokenizer's leading and trailing special tokens, and each sub-token's word
position is its word's index. :class:`WordPieces` keeps each distinct word's ids (up to :data:`KEEP_WORDS` words)
and puts sentences together from them, with 0.035-0.039 of the tokenizer's CPU time on generated reviews (its Rust
threads included; ``benchmarks/word_pieces.py``), since a corpus repeats its words. A sentence longer than the model's maximum (cut, or
split into strided windows) is left to the tokenizer. The first :data:`CHECKED_SENTENCES` sentences put together
for a tokenizer are compared with the tokenizer's own encoding; if one differs, the tokenizer encodes every
sentence from then on.

Example::

    pieces = WordPieces(tokenizer)
    pieces.rows([["A", "fine", "film"]], truncation=True, word_ids=False)   # [[(ids, None)]]; None: too long
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

KEEP_WORDS = 100_000  # distinct words kept per tokenizer (about 120 bytes each); later ones are tokenized each time
CHECKED_SENTENCES = 16  # sentences compared with the tokenizer's own encoding before its words are trusted


class WordPieces:
    """The sub-token ids of the words ``tokenizer`` (a fast one) has seen, and sentences put together from them."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # its own: no padding, no cutting
        self._backend.no_padding()
        self._backend.no_truncation()
        self._type = np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32)
        probe = self._backend.encode(["a"], is_pretokenized=True)
        inside = [index for index, word in enumerate(probe.word_ids) if word is not None]
        self.usable = bool(inside)  # a tokenizer that makes nothing of a word is left to itself
        ids = probe.ids
        self._prefix = self._bytes(ids[: inside[0]] if inside else [])
        self._suffix = self._bytes(ids[inside[-1] + 1 :] if inside else [])
        self._limit = tokenizer.model_max_length
        self._words: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.unchecked = CHECKED_SENTENCES

    def _bytes(self, ids: list[int]) -> bytes:
        return np.asarray(ids, dtype=self._type).tobytes()

    def rows(self, sentences: list[list[str]], truncation: Any, word_ids: bool) -> list[list[tuple] | None]:
        """Each sentence's one row (ids as int64, word positions if ``word_ids``), or None for one the tokenizer
        would cut (``truncation``) or window: longer than the model's maximum."""
        known = self._words.get
        new = list({word for sentence in sentences for word in sentence if known(word) is None})
        fresh: dict[str, bytes] = {}  # this call's new words, kept below while there is room
        if new:
            encodings = self._backend.encode_batch([[word] for word in new], is_pretokenized=True,
                                                   add_special_tokens=False)  # fmt: skip
            fresh = {word: self._bytes(encoding.ids) for word, encoding in zip(new, encodings)}
            with self._lock:
                room = KEEP_WORDS - len(self._words)
                if room > 0:
                    self._words.update(zip(new[:room], map(fresh.get, new[:room])))
        size, rows = self._type.itemsize, []
        prefix, suffix = len(self._prefix) // size, len(self._suffix) // size
        for sentence in sentences:
            # a word that makes no sub-token is b"" in either dict: it falls through to b"", which is right
            pieces = [known(word) or fresh.get(word, b"") for word in sentence]
            ids = np.frombuffer(b"".join([self._prefix, *pieces, self._suffix]), dtype=self._type).astype(np.int64)
            if truncation and len(ids) > self._limit:
                rows.append(None)
                continue
            positions = None
            if word_ids:
                counts = [len(piece) // size for piece in pieces]
                positions = [None] * prefix + np.repeat(np.arange(len(pieces)), counts).tolist() + [None] * suffix
            rows.append([(ids, positions)])
        return rows
