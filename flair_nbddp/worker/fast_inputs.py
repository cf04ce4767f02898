"""Transformer inputs built once per sentence, not in every batch of every epoch.

flair's transformer embeddings tokenize a batch's sentences each time they embed it: every batch of every epoch,
for training and for every evaluation, on the rank's CPU while its GPU waits (53 % of a DistilBERT step on an
H200). In a worker with fast inputs on (``launch(..., fast_inputs=True)``, the default), flair's own code
still builds the model's inputs, but its tokenizer call goes to a stand-in that tokenizes only the sentences of
the batch it has not seen before (put together from their words' ids, each word tokenized once, :mod:`.word_pieces`;
or in one call of the real tokenizer, as flair would), keeps each sentence's
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

from . import input_thread, no_waits
from .kept_inputs import Row, Store, sentence_key
from .word_pieces import WordPieces

_BUILD = "_TransformerBaseEmbeddings__build_transformer_model_inputs"  # flair's private method, name-mangled


KEEP_AT_MOST = 2 << 30  # bytes of kept encodings per worker; sentences beyond go flair's way, with one notice


@dataclass
class _Job:
    enabled: bool = True
    noticed: set[str] = field(default_factory=set)
    used: set[tuple[str, bytes]] = field(default_factory=set)  # the stores this job read


_JOB = _Job()
_STORES: dict[tuple[str, bytes], Store] = {}  # by tokenizer fingerprint and call settings
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its fingerprint
_PIECES: dict[str, WordPieces | None] = {}  # by tokenizer fingerprint: its words' ids (None: tokenized whole)


def install() -> None:
    """Route flair's transformer input building through the kept encodings (once per worker, after flair is
    imported), and let flair's training loader show the input thread its next batch."""
    from flair.embeddings.transformer import TransformerBaseEmbeddings

    original = getattr(TransformerBaseEmbeddings, _BUILD)
    if getattr(original, "_flair_nbddp_fast_inputs", False):
        return

    def build(self: Any, sentences: list, offsets: list, lengths: list, flair_tokens: list, device: Any) -> Any:
        if not _JOB.enabled:
            return original(self, sentences, offsets, lengths, flair_tokens, device)
        reason = unservable(self)
        if reason:
            _notice(self.name, f"{self.name} builds its inputs in every batch, as flair does: {reason}")
            return original(self, sentences, offsets, lengths, flair_tokens, device)
        if self.training and not self.context_length:  # what the input thread can foresee: a sentence's own tokens
            _look_ahead(self)
        real = self.tokenizer
        caching = CachingTokenizer(real, sentences, keep_word_ids=bool(self.token_embedding))
        self.__dict__["tokenizer"] = caching
        try:
            inputs = original(self, sentences, offsets, lengths, flair_tokens, device)
        finally:
            self.__dict__["tokenizer"] = real
        if caching.mask_all_ones is not None and "attention_mask" in inputs:
            no_waits.answer_mask_check(self.model, inputs["attention_mask"], caching.mask_all_ones)
        return inputs

    build._flair_nbddp_fast_inputs = True
    setattr(TransformerBaseEmbeddings, _BUILD, build)
    input_thread.install(encode)


def start_job(enabled: bool, ahead: bool = False) -> None:
    """A job begins: encodings are kept if ``enabled``, and the next training batch is tokenized in the input
    thread if ``ahead`` too (the worker says so where its device is not the CPU, whose cores the training needs).
    What earlier jobs kept stays (a pool's next job on the same corpus reads it) while it fits in
    ``KEEP_AT_MOST``."""
    global _JOB
    _JOB = _Job(enabled=enabled)
    input_thread.start_job(ahead=enabled and ahead)


def look_ahead_for(model: Any) -> None:
    """A :func:`flair_nbddp.predict` call's rank: let :func:`.input_thread.tokenize_ahead` tokenize the next chunk's
    sentences for every transformer embedding of ``model`` that embeds a sentence's own tokens (no context) and whose
    inputs the kept encodings serve; a job that does not read ahead (on CPU) leaves them to flair's call."""
    from flair.embeddings.transformer import TransformerBaseEmbeddings

    if not _JOB.enabled:
        return
    for module in model.modules():
        if isinstance(module, TransformerBaseEmbeddings) and not module.context_length and not unservable(module):
            _look_ahead(module)


def _look_ahead(embedding: Any) -> None:
    """Have the input thread tokenize ahead for ``embedding``, into its tokenizer's store."""
    settings = _settings(embedding)
    input_thread.watch(embedding, store_for(embedding.tokenizer, settings), settings)


def enabled() -> bool:
    """Whether this job keeps encodings (``fast_inputs``)."""
    return _JOB.enabled


def unservable(embedding: Any) -> str | None:
    """Why ``embedding``'s inputs cannot come from the kept encodings exactly, or None when they can."""
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


def shipments(at_most: int | None = None) -> dict[tuple[str, bytes], Any]:
    """This job's stores' sentences tokenized here since the last call, by store name (for the other ranks): about
    ``at_most`` bytes of them, if given, the rest left for the next calls (:func:`unshipped`)."""
    shipped = {}
    for name in sorted(_JOB.used):
        if name in _STORES and (at_most is None or at_most > 0):
            shipped[name] = _STORES[name].ship(at_most)
            at_most = None if at_most is None else at_most - shipped[name].nbytes
    return shipped


def unshipped() -> bool:
    """Whether sentences of this job's stores tokenized here wait for a shipment."""
    return any(_STORES[name].unshipped() for name in _JOB.used if name in _STORES)


def absorb(shipments_: list[dict[tuple[str, bytes], Any]]) -> int:
    """Keep the other ranks' shipments in the stores of the same tokenizer and settings, within ``KEEP_AT_MOST`` in
    all (when they reach it, what only earlier jobs read is let go first); how many sentences were new here. A store
    this worker does not have (a tokenizer it never used) takes nothing."""
    kept = 0
    for shipped in shipments_:
        for name, shipment in shipped.items():
            if name in _STORES:
                kept += _STORES[name].absorb(shipment, room=_room())
    return kept


def _room() -> int:
    """The bytes left under ``KEEP_AT_MOST``; when none are, what only earlier jobs read is let go first."""
    if kept_bytes() >= KEEP_AT_MOST:
        for unused in set(_STORES) - _JOB.used:
            _STORES.pop(unused, None)  # the other thread may have let it go meanwhile
    return max(0, KEEP_AT_MOST - kept_bytes())


def kept_bytes() -> int:
    """The memory the kept encodings take (sub-tokens and index), over every store."""
    return sum(store.nbytes for store in list(_STORES.values()))


def kept_sentences() -> int:
    """How many (sentence, tokenizer, settings) encodings are kept."""
    return sum(len(store) for store in list(_STORES.values()))


def store_for(tokenizer: Any, settings: Settings) -> Store:
    """The store of ``tokenizer``'s encodings with ``settings`` (made empty on first use)."""
    name = (fingerprint(tokenizer), repr(settings).encode())
    _JOB.used.add(name)
    store = _STORES.get(name)
    if store is None:
        store = _STORES.setdefault(name, Store(len(tokenizer), tokenizer.all_special_ids, settings.word_ids))
    return store


def encode(tokenizer: Any, store: Store, keys: list[bytes], words: list[list[str]], settings: Settings) -> list:
    """Tokenize ``words``, keep each sentence's rows in ``store`` while there is room, and return each sentence's
    rows. A sentence is put together from its words' ids where it can be (:mod:`.word_pieces`); the rest go to the
    tokenizer in one call, as flair makes it, unpadded (and so do the first sentences put together, to check them)."""
    pieces = _pieces_for(tokenizer)
    found = [None] * len(words) if pieces is None else pieces.rows(words, settings.truncation, settings.word_ids)
    checked: list[int] = []
    if pieces is not None and pieces.unchecked > 0:
        checked = [index for index, rows in enumerate(found) if rows is not None][: pieces.unchecked]
        pieces.unchecked -= len(checked)
    asked = [index for index, rows in enumerate(found) if rows is None or index in checked]
    for index, rows in zip(asked, _tokenize(tokenizer, [words[i] for i in asked], settings)):
        if found[index] is not None and not _same(rows, found[index]):
            _PIECES[fingerprint(tokenizer)] = None
            _notice("pieces", f"flair_nbddp: {type(tokenizer).__name__} encodes a word within a sentence otherwise "
                              "than alone; its sentences are tokenized whole")  # fmt: skip
            return encode(tokenizer, store, keys, words, settings)
        found[index] = rows
    room = _room() > 0
    if not room:
        _notice("room", f"flair_nbddp: the kept encodings reached {KEEP_AT_MOST >> 20} MB in this worker; "
                        "sentences not kept yet are tokenized in each batch, as flair does")  # fmt: skip
    for name, rows in zip(keys, found):
        if room:
            store.add(name, rows)
    return [[(np.asarray(ids, dtype=np.int64), None if word_ids is None else list(word_ids)) for ids, word_ids in rows]
            for rows in found]  # fmt: skip


def _tokenize(tokenizer: Any, words: list[list[str]], settings: Settings) -> list[list[tuple]]:
    """Each sentence's rows (ids, word positions or None) from the tokenizer itself, in one call."""
    if not words:
        return []
    encoding = tokenizer(
        words, stride=settings.stride, return_overflowing_tokens=settings.overflow, truncation=settings.truncation,
        padding=False, is_split_into_words=True,
    )  # fmt: skip
    samples = encoding.get("overflow_to_sample_mapping", range(len(words)))
    found: list[list] = [[] for _ in words]
    for row, sample in enumerate(samples):
        found[sample].append((encoding["input_ids"][row], encoding.word_ids(row) if settings.word_ids else None))
    return found


def _same(rows: list[tuple], other: list[tuple]) -> bool:
    def plain(words: Any) -> list | None:
        return None if words is None else list(words)

    return len(rows) == len(other) and all(
        np.array_equal(ids, other_ids) and plain(words) == plain(other_words)
        for (ids, words), (other_ids, other_words) in zip(rows, other)
    )


def _pieces_for(tokenizer: Any) -> WordPieces | None:
    """The words ``tokenizer`` has seen (None for one whose sentences are tokenized whole)."""
    name = fingerprint(tokenizer)
    if name not in _PIECES:
        pieces = WordPieces(tokenizer)
        _PIECES[name] = pieces if pieces.usable else None
    return _PIECES[name]


@dataclass(frozen=True)
class Settings:
    """The tokenizer call's settings flair derives from an embedding, and whether word positions are kept."""

    stride: int
    overflow: bool
    truncation: Any
    word_ids: bool


def _settings(embedding: Any) -> Settings:
    return Settings(embedding.stride, embedding.allow_long_sentences, embedding.truncate, bool(embedding.token_embedding))


def _notice(name: str, text: str) -> None:
    if name not in _JOB.noticed:
        _JOB.noticed.add(name)
        print(text, file=sys.stderr)


class CachingTokenizer:
    """Stands in for a fast tokenizer during one of flair's input builds for ``sentences``: answers flair's batch
    call (their words, one list a sentence) from the kept encodings (tokenizing the sentences not kept yet), and
    passes every other attribute to the real tokenizer."""

    def __init__(self, real: Any, sentences: list, keep_word_ids: bool) -> None:
        self._real, self._sentences, self._keep_word_ids = real, sentences, keep_word_ids
        self.mask_all_ones: bool | None = None  # whether the attention mask of the batch it built is all ones

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __call__(
        self, words: list[list[str]], *, stride: int, return_overflowing_tokens: bool, truncation: Any, padding: Any,
        return_tensors: str, is_split_into_words: bool,
    ) -> Any:  # fmt: skip
        settings = Settings(stride, return_overflowing_tokens, truncation, self._keep_word_ids)
        store = store_for(self._real, settings)
        keys = [sentence_key(sentence, its_words) for sentence, its_words in zip(self._sentences, words, strict=True)]
        found = store.rows(keys)
        input_thread.count_hits(keys, found)
        missing = [index for index, rows in enumerate(found) if rows is None]
        if missing:
            encoded = encode(self._real, store, [keys[i] for i in missing], [words[i] for i in missing], settings)
            for index, rows in zip(missing, encoded):
                found[index] = rows
        return self._batch([(sample, row) for sample, rows in enumerate(found) for row in rows],
                           padding, return_overflowing_tokens)  # fmt: skip

    def _batch(self, rows: list[tuple[int, Row]], padding: Any, overflow: bool) -> Any:
        import torch
        from transformers.utils import PaddingStrategy

        length = self._real.model_max_length if padding == PaddingStrategy.MAX_LENGTH else 0
        length = max([length, *(len(ids) for _, (ids, _) in rows)])
        right = self._real.padding_side == "right"
        ids = np.full((len(rows), length), self._real.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), length), dtype=np.int64)
        word_ids: list[list[int | None]] = []
        for index, (_, (row, words)) in enumerate(rows):
            where = slice(0, len(row)) if right else slice(length - len(row), length)
            ids[index, where] = row
            mask[index, where] = 1
            if self._keep_word_ids:
                pad = [None] * (length - len(row))
                word_ids.append(words + pad if right else pad + words)
        data = {"input_ids": no_waits.host_tensor(torch.from_numpy(ids))}
        if "attention_mask" in self._real.model_input_names:
            data["attention_mask"] = no_waits.host_tensor(torch.from_numpy(mask))
            self.mask_all_ones = bool(mask.all())
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
