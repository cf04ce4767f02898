"""Sentences put together from their words' sub-token ids (flair_nbddp/worker/word_pieces.py), against the tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from flair_nbddp.synthetic import tiny_transformer
from flair_nbddp.worker import fast_inputs, word_pieces
from flair_nbddp.worker.kept_inputs import Store, key
from flair_nbddp.worker.word_pieces import WordPieces

# words a tokenizer splits, cases it folds, punctuation inside a word, accents, a word it does not know, a long one
SENTENCES = [
    ["The", "film's", "ending", "was", "un-expected", "!"],
    ["Café", "CAFÉ", "naïve", "zzqxj", "supercalifragilisticexpialidocious", "..."],
    ["a"], ["repeated", "repeated", "repeated", "words", "words"],
]  # fmt: skip


@pytest.fixture(scope="module", params=["word", "wordpiece", "bpe"])
def tokenizer(request, tmp_path_factory):
    return AutoTokenizer.from_pretrained(tiny_transformer(tmp_path_factory.mktemp(request.param), tokenizer=request.param))


def _theirs(tokenizer, sentences, **settings):
    encoding = tokenizer(sentences, is_split_into_words=True, padding=False, **settings)
    return [(ids, encoding.word_ids(row)) for row, ids in enumerate(encoding["input_ids"])]


@pytest.mark.parametrize("truncation", [True, False])
def test_sentences_put_together_from_words_are_the_tokenizers_own_ids_and_word_positions(tokenizer, truncation):
    pieces = WordPieces(tokenizer)
    assert pieces.usable
    ours = pieces.rows(SENTENCES, truncation=truncation, word_ids=True)
    for (ids, positions), rows in zip(_theirs(tokenizer, SENTENCES, truncation=truncation), ours):
        assert len(rows) == 1 and rows[0][0].dtype == np.int64
        assert rows[0][0].tolist() == ids and rows[0][1] == positions
    assert pieces.rows(SENTENCES, truncation=truncation, word_ids=False)[0][0][1] is None


def test_a_sentence_longer_than_the_model_is_left_to_the_tokenizer_unless_it_is_not_cut(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "model_max_length", 6)
    pieces = WordPieces(tokenizer)
    long, short = ["word"] * 10, ["a"]
    assert pieces.rows([long, short], truncation=True, word_ids=False)[0] is None
    assert pieces.rows([short], truncation=True, word_ids=False)[0][0][0].tolist() == _theirs(tokenizer, [short])[0][0]
    whole = pieces.rows([long], truncation=False, word_ids=False)[0][0][0]
    assert whole.tolist() == _theirs(tokenizer, [long], truncation=False)[0][0]


def test_words_beyond_what_it_keeps_are_tokenized_each_time_and_still_right(tokenizer, monkeypatch):
    monkeypatch.setattr(word_pieces, "KEEP_WORDS", 3)
    pieces = WordPieces(tokenizer)
    for _ in range(2):
        ours = pieces.rows(SENTENCES, truncation=True, word_ids=False)
        assert [rows[0][0].tolist() for rows in ours] == [ids for ids, _ in _theirs(tokenizer, SENTENCES, truncation=True)]
    assert len(pieces._words) == 3


def test_a_tokenizer_whose_words_differ_within_a_sentence_is_then_asked_for_every_sentence(tokenizer, monkeypatch):
    monkeypatch.setattr(fast_inputs, "_PIECES", {})
    rows = WordPieces.rows

    def off_by_one(self, sentences, truncation, word_ids):
        return [[(ids + 1, words) for ids, words in found] for found in rows(self, sentences, truncation, word_ids)]

    monkeypatch.setattr(WordPieces, "rows", off_by_one)
    settings = fast_inputs.Settings(stride=0, overflow=False, truncation=True, word_ids=False)
    store = Store(len(tokenizer), tokenizer.all_special_ids, False)
    found = fast_inputs.encode(tokenizer, store, [key(s) for s in SENTENCES], SENTENCES, settings)
    assert [rows[0][0].tolist() for rows in found] == [ids for ids, _ in _theirs(tokenizer, SENTENCES, truncation=True)]
    assert fast_inputs._PIECES[fast_inputs.fingerprint(tokenizer)] is None  # not asked again for this tokenizer
    assert [rows[0][0].tolist() for rows in store.rows([key(s) for s in SENTENCES])] == [r[0][0].tolist() for r in found]
