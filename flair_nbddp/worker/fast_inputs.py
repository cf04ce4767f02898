"""Transformer inputs built once per sentence, not in every batch of every epoch.

flair's transformer embeddings tokenize a batch's sentences each time they embed it: every batch of every epoch,
for training and for every evaluation, on the rank's CPU while its GPU waits (53 % of a DistilBERT step on an
H200, #34). In a worker with fast inputs on (``launch(..., fast_inputs=True)``, the default), flair's own code
still builds the model's inputs, but its tokenizer call goes to a stand-in that tokenizes only the sentences of
the batch it has not seen before (in one call of the real tokenizer, as flair would), keeps each sentence's
sub-token ids compactly (2 bytes a sub-token for a vocabulary under 65,536; word positions too for token
embeddings), and hands flair the batch's encoding, padded exactly as the tokenizer pads. A sentence is known by
its token texts (with the context flair adds around it), the tokenizer by its content and settings, so a warm
pool's next job, or a lazy corpus's rebuilt sentences, find what was kept.

What cannot be served exactly goes flair's own way, with one notice per embedding: OCR boxes or images
(LayoutLM), and tokenizers without a fast (Rust) implementation.

A worker imports it at start; torch and transformers are imported when flair's embeddings first call it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_BUILD = "_TransformerBaseEmbeddings__build_transformer_model_inputs"  # flair's private method, name-mangled
_NO_WORD = -1


@dataclass
class _Job:
    enabled: bool = True
    noticed: set[str] = field(default_factory=set)


_JOB = _Job()
_CACHES: dict[str, dict[bytes, tuple[Any, ...]]] = {}  # by tokenizer fingerprint: each sentence's rows
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its fingerprint


def install() -> None:
    """Route flair's transformer input building through the cache (once per worker, after flair is imported)."""
    from flair.embeddings.transformer import TransformerBaseEmbeddings

    original = getattr(TransformerBaseEmbeddings, _BUILD)
    if getattr(original, "_flair_nbddp_fast_inputs", False):
        return

    def build(self: Any, sentences: list, offsets: list, lengths: list, flair_tokens: list, device: Any) -> Any:
        if not _JOB.enabled:
            return original(self, sentences, offsets, lengths, flair_tokens, device)
        reason = unservable(self)
        if reason:
            if self.name not in _JOB.noticed:
                _JOB.noticed.add(self.name)
                print(f"flair_nbddp: {self.name} builds its inputs in every batch, as flair does: {reason}",
                      file=sys.stderr)  # fmt: skip
            return original(self, sentences, offsets, lengths, flair_tokens, device)
        real = self.tokenizer
        self.__dict__["tokenizer"] = CachingTokenizer(real, keep_word_ids=bool(self.token_embedding))
        try:
            return original(self, sentences, offsets, lengths, flair_tokens, device)
        finally:
            self.__dict__["tokenizer"] = real

    build._flair_nbddp_fast_inputs = True
    setattr(TransformerBaseEmbeddings, _BUILD, build)


def start_job(enabled: bool) -> None:
    """A job begins: inputs are kept if ``enabled``; what earlier jobs kept stays (a pool's corpus reuses it)."""
    global _JOB
    _JOB = _Job(enabled=enabled)


def unservable(embedding: Any) -> str | None:
    """Why ``embedding``'s inputs cannot come from the cache exactly, or None when they can."""
    if embedding.tokenizer_needs_ocr_boxes or embedding.needs_manual_ocr:
        return "its tokenizer takes OCR boxes"
    if embedding.feature_extractor is not None:
        return "it also reads images"
    if not embedding.tokenizer.is_fast:
        return f"its tokenizer ({type(embedding.tokenizer).__name__}) has no fast implementation"
    return None


def fingerprint(tokenizer: Any) -> str:
    """What makes two tokenizers encode alike: the fast tokenizer's full definition and the settings around it."""
    known = _FINGERPRINTS.get(tokenizer)
    if known is None:
        definition = json.loads(tokenizer.backend_tokenizer.to_str())
        for per_call in ("truncation", "padding"):  # set by each call of the tokenizer, not part of what it is
            definition.pop(per_call, None)
        digest = hashlib.blake2b(json.dumps(definition, sort_keys=True).encode(), digest_size=16)
        sides = (tokenizer.padding_side, tokenizer.truncation_side)
        digest.update(repr((type(tokenizer).__name__, tokenizer.model_max_length, sides)).encode())
        known = _FINGERPRINTS[tokenizer] = digest.hexdigest()
    return known


def kept_bytes() -> int:
    """The memory the kept inputs take (their arrays), over every tokenizer."""
    return sum(array.nbytes for cache in _CACHES.values() for rows in cache.values() for row in rows for array in row)


def kept_sentences() -> int:
    """How many (sentence, settings) encodings are kept."""
    return sum(len(cache) for cache in _CACHES.values())


class CachingTokenizer:
    """Stands in for a fast tokenizer during one of flair's input builds: answers flair's batch call from the kept
    rows (tokenizing the sentences it has not seen), and passes every other attribute to the real tokenizer."""

    def __init__(self, real: Any, keep_word_ids: bool) -> None:
        self._real, self._keep_word_ids = real, keep_word_ids
        self._cache = _CACHES.setdefault(fingerprint(real), {})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __call__(
        self, words: list[list[str]], *, stride: int, return_overflowing_tokens: bool, truncation: Any, padding: Any,
        return_tensors: str, is_split_into_words: bool,
    ) -> Any:  # fmt: skip
        settings = repr((stride, return_overflowing_tokens, truncation, self._keep_word_ids)).encode()
        keys = [_key(sentence, settings) for sentence in words]
        missing = {key: sentence for key, sentence in zip(keys, words) if key not in self._cache}
        if missing:
            self._encode(list(missing), list(missing.values()), stride, return_overflowing_tokens, truncation)
        rows = [(sample, row) for sample, key in enumerate(keys) for row in self._cache[key]]
        return self._batch(rows, padding, return_overflowing_tokens)

    def _encode(self, keys: list[bytes], words: list[list[str]], stride: int, overflow: bool, truncation: Any) -> None:
        encoding = self._real(
            words, stride=stride, return_overflowing_tokens=overflow, truncation=truncation, padding=False,
            is_split_into_words=True,
        )  # fmt: skip
        samples = encoding.get("overflow_to_sample_mapping", range(len(words)))
        largest = max((max(ids, default=0) for ids in encoding["input_ids"]), default=0)
        id_type = np.uint16 if largest <= np.iinfo(np.uint16).max else np.int32
        found: dict[int, list[tuple[Any, ...]]] = {}
        for row, sample in enumerate(samples):
            ids = np.asarray(encoding["input_ids"][row], dtype=id_type)
            if self._keep_word_ids:
                word_ids = [_NO_WORD if word is None else word for word in encoding.word_ids(row)]
                found.setdefault(sample, []).append((ids, np.asarray(word_ids, dtype=_word_type(word_ids))))
            else:
                found.setdefault(sample, []).append((ids,))
        for sample, key in enumerate(keys):
            self._cache[key] = tuple(found[sample])

    def _batch(self, rows: list[tuple[int, tuple[Any, ...]]], padding: Any, overflow: bool) -> Any:
        import torch
        from transformers.utils import PaddingStrategy

        length = self._real.model_max_length if padding == PaddingStrategy.MAX_LENGTH else 0
        length = max([length, *(len(row[0]) for _, row in rows)])
        right = self._real.padding_side == "right"
        ids = torch.full((len(rows), length), self._real.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        word_ids: list[list[int | None]] = []
        for index, (_, row) in enumerate(rows):
            size = len(row[0])
            where = slice(0, size) if right else slice(length - size, length)
            ids[index, where] = torch.from_numpy(row[0].astype(np.int64))
            mask[index, where] = 1
            if self._keep_word_ids:
                words = [None if word == _NO_WORD else int(word) for word in row[1]]
                pad = [None] * (length - size)
                word_ids.append(words + pad if right else pad + words)
        data = {"input_ids": ids}
        if "attention_mask" in self._real.model_input_names:
            data["attention_mask"] = mask
        if overflow:
            data["overflow_to_sample_mapping"] = torch.tensor([sample for sample, _ in rows], dtype=torch.long)
        return _kept_encoding_type()(data, word_ids)


@functools.cache
def _kept_encoding_type() -> type:
    from transformers import BatchEncoding

    class KeptEncoding(BatchEncoding):
        """A batch encoding made from kept rows: ``word_ids`` as the tokenizer's own would give them."""

        def __init__(self, data: dict, word_ids: list[list[int | None]]) -> None:
            super().__init__(data)
            self._word_ids = word_ids

        def word_ids(self, batch_index: int = 0) -> list[int | None]:
            return self._word_ids[batch_index]

    return KeptEncoding


def _key(words: list[str], settings: bytes) -> bytes:
    """A sentence's name in the cache: a digest of the settings and its words (one C call for the words, unless a
    word holds the separator itself, when each word's length goes in too)."""
    joined, form = "\x00".join(words), b"\x01"
    if joined.count("\x00") != max(0, len(words) - 1):
        joined, form = "\x00".join(f"{len(word)}:{word}" for word in words), b"\x02"
    return hashlib.blake2b(settings + form + joined.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _word_type(word_ids: list[int]) -> type:
    return np.int16 if max(word_ids, default=0) < np.iinfo(np.int16).max else np.int32
