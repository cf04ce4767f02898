"""The kept encodings' store: 2 bytes a sub-token and a few dozen a sentence, word positions exact, safe for two
threads."""

from __future__ import annotations

import gc
import threading
import tracemalloc
import weakref

import numpy as np
import pytest
from flair.data import Sentence

from flair_nbddp.worker import kept_inputs
from flair_nbddp.worker.kept_inputs import CHUNK, Store, sentence_key

SPECIALS = [0, 1, 2, 3]  # pad, unk, cls, sep of a BERT-like vocabulary


def _reviews(count: int, vocabulary: int, seed: int = 0) -> list[tuple[bytes, list, list]]:
    """(key, ids, word positions) of generated 250-sub-token sentences: [CLS], words of 1-3 sub-tokens, [SEP]."""
    rng = np.random.default_rng(seed)
    made = []
    for number in range(count):
        sizes = rng.integers(1, 4, size=248)
        words = np.repeat(np.arange(len(sizes)), sizes)[:248].tolist()
        ids = rng.integers(4, vocabulary, size=248).tolist()
        made.append((number.to_bytes(16, "little"), [2, *ids, 3], [None, *words, None]))
    return made


@pytest.mark.parametrize("word_ids", [False, True], ids=["document", "words"])
def test_a_sentence_costs_two_bytes_a_sub_token_and_its_index_a_few_dozen(word_ids):
    reviews = _reviews(6000, vocabulary=30522)
    store = Store(30522, SPECIALS, word_ids=word_ids)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for key, ids, words in reviews:
        assert store.add(key[:8] + key[8:], [(ids, words)])  # a key of its own, as a worker's are
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    sub_tokens = sum(len(ids) for _, ids, _ in reviews)
    assert store.sub_tokens() == sub_tokens
    unused = store._chunks[-1].nbytes - 2 * store._used  # the last chunk's free part, allocated whole
    assert (grown - unused - 2 * sub_tokens) / len(reviews) <= 56  # 2 bytes a sub-token, the rest is the index
    assert abs(store.nbytes - (grown - unused)) / len(reviews) <= 10  # and the store says what it takes
    for key, ids, words in reviews[::997]:
        [(kept_ids, kept_words)] = store.rows([key])[0]
        assert kept_ids.tolist() == ids and kept_words == (words if word_ids else None)


def test_word_positions_that_do_not_follow_from_the_marks_are_kept_in_full():
    store = Store(100, SPECIALS, word_ids=True)
    rows = {
        b"gap".ljust(16): ([2, 10, 11, 12, 3], [None, 0, 0, 2, None]),  # word 1 has no sub-tokens
        b"special inside".ljust(16): ([2, 10, 3, 12, 3], [None, 0, 0, 1, None]),  # a [SEP] within word 0
        b"window".ljust(16): ([2, 11, 12, 13, 3], [None, 4, 5, 5, None]),  # a strided window, mid-sentence
        b"special as word".ljust(16): ([2, 1, 10, 3], [None, 0, 1, None]),  # [UNK] is word 0
        b"no words".ljust(16): ([2, 3], [None, None]),
    }
    for key, row in rows.items():
        assert store.add(key, [row])
    for key, (ids, words) in rows.items():
        [(kept_ids, kept_words)] = store.rows([key])[0]
        assert kept_ids.tolist() == ids and kept_words == words


def test_large_vocabularies_take_four_bytes_and_ids_that_do_not_fit_are_refused():
    store = Store(70000, SPECIALS, word_ids=True)
    assert store.add(b"a" * 16, [([2, 69999, 3], [None, 0, None]), ([2, 5, 3], [None, 0, None])])
    assert [ids.tolist() for ids, _ in store.rows([b"a" * 16])[0]] == [[2, 69999, 3], [2, 5, 3]]
    small = Store(100, SPECIALS, word_ids=True)
    assert not small.add(b"b" * 16, [([2, 40000, 3], [None, 0, None])])  # past the top bit: flair's way
    assert small.rows([b"b" * 16]) == [None] and len(small) == 0


def test_keys_are_found_before_and_after_they_join_the_sorted_index_and_two_threads_keep_each_once():
    reviews = _reviews(5000, vocabulary=500)
    store = Store(500, SPECIALS, word_ids=False)
    half = len(reviews) // 2

    def keep(part):
        for key, ids, _ in part:
            store.add(key, [(ids, None)])

    threads = [threading.Thread(target=keep, args=(reviews[:half + 500],)), threading.Thread(target=keep, args=(reviews[half - 500:],))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store) == len(reviews)
    found = store.rows([key for key, _, _ in reviews] + [b"z" * 16])
    assert found[-1] is None
    assert all(rows[0][0].tolist() == ids for rows, (_, ids, _) in zip(found, reviews))


def _words(sentence: Sentence) -> list[str]:
    """The token texts as flair lists them for its tokenizer: a new list each batch, the same text objects."""
    return [token.text for token in sentence]


def test_a_sentence_is_named_again_only_when_its_words_change_and_its_name_goes_with_it(monkeypatch):
    digest, hashed = kept_inputs.key, []
    monkeypatch.setattr(kept_inputs, "key", lambda words: hashed.append(list(words)) or digest(words))
    sentence = Sentence("a fine film , well made")
    named = sentence_key(sentence, _words(sentence))
    assert sentence_key(sentence, _words(sentence)) == named == digest(_words(sentence)) and len(hashed) == 1
    sentence.tokens[1].form = "poor"  # the same sentence, other words: another name
    assert sentence_key(sentence, _words(sentence)) == digest(["a", "poor", "film", ",", "well", "made"]) != named
    with_context = ["[SEP]", *_words(sentence)]  # as flair adds context around a sentence
    assert sentence_key(sentence, with_context) == digest(with_context) and len(hashed) == 3
    gone = weakref.ref(sentence)
    del sentence
    gc.collect()  # a sentence and its tokens point at each other: the cycle collector frees them
    assert gone() is None  # the memo kept it alive not a moment longer; its weak entry went with it


@pytest.mark.parametrize("word_ids", [False, True], ids=["document", "words"])
def test_ranks_ship_what_they_tokenized_and_keep_each_others_once(word_ids):
    """Two ranks' stores: each ships its own sentences (through pickle, as the all-gather does), keeps the other's
    exactly as they were tokenized, and ships neither the received ones nor its own twice."""
    import pickle

    reviews = _reviews(700, vocabulary=500)
    odd = {
        b"gap".ljust(16): [([2, 10, 11, 12, 3], [None, 0, 0, 2, None])],  # word positions kept in full
        b"windows".ljust(16): [([2, 11, 12, 3], [None, 0, 1, None]), ([2, 13, 3], [None, 2, None])],  # 2 rows
        b"huge".ljust(16): [([2, *[10] * CHUNK, 3], [None, *range(CHUNK), None])],  # a chunk of its own
    }
    ranks = [Store(500, SPECIALS, word_ids=word_ids), Store(500, SPECIALS, word_ids=word_ids)]
    for rank, store in enumerate(ranks):
        for key, ids, words in reviews[rank * 300 : rank * 300 + 400]:  # 100 sentences both tokenized
            store.add(key, [(ids, words if word_ids else None)])
    for key, rows in odd.items():
        ranks[0].add(key, [(ids, words if word_ids else None) for ids, words in rows])
    shipments = [pickle.loads(pickle.dumps(store.ship())) for store in ranks]
    assert [len(shipment) for shipment in shipments] == [403, 400]
    assert Store(500, SPECIALS, word_ids=word_ids).absorb(shipments[0], room=0) == 0  # a full worker takes none
    assert ranks[1].absorb(shipments[0]) == 303 and ranks[0].absorb(shipments[1]) == 300
    assert ranks[1].absorb(shipments[0]) == 0  # held now
    assert len(ranks[0]) == len(ranks[1]) == 703
    wanted = [key for key, _, _ in reviews] + list(odd)
    assert [[(ids.tolist(), words) for ids, words in rows] for rows in ranks[0].rows(wanted)] == [
        [(ids.tolist(), words) for ids, words in rows] for rows in ranks[1].rows(wanted)
    ]
    [(ids, words)] = ranks[1].rows([b"gap".ljust(16)])[0]
    assert ids.tolist() == [2, 10, 11, 12, 3] and words == ([None, 0, 0, 2, None] if word_ids else None)
    assert [len(store.ship()) for store in ranks] == [0, 0]  # nothing new: the received ones stay home
    ranks[1].add(b"later".ljust(16), [([2, 5, 3], [None, 0, None] if word_ids else None)])
    later = ranks[1].ship()
    assert len(later) == 1 and ranks[0].absorb(later) == 1
    empty = Store(500, SPECIALS, word_ids=word_ids)  # a first row without sub-tokens takes no chunk
    empty.add(b"nothing".ljust(16), [([], [] if word_ids else None)])
    received = Store(500, SPECIALS, word_ids=word_ids)
    assert received.absorb(empty.ship()) == 1
    assert [(ids.tolist(), words) for ids, words in received.rows([b"nothing".ljust(16)])[0]] == [
        ([], [] if word_ids else None)
    ]


def test_shipments_of_a_bounded_size_carry_every_sentence_once_in_order():
    reviews = _reviews(300, vocabulary=500)
    store = Store(500, SPECIALS, word_ids=True)
    for key, ids, words in reviews[:125]:
        store.add(key, [(ids, words)])
    store.absorb(_shipped_elsewhere(reviews[250:]))  # received between the ones tokenized here: never shipped on
    for key, ids, words in reviews[125:250]:
        store.add(key, [(ids, words)])
    at_most = 20 * (16 + 250 * 2 + 16)  # 20 sentences of 250 sub-tokens
    pieces = []
    while store.unshipped():
        pieces.append(store.ship(at_most))
    assert [len(piece) for piece in pieces] == [20] * 12 + [10]
    assert all(piece.nbytes <= at_most for piece in pieces)
    assert b"".join(piece.keys for piece in pieces) == b"".join(key for key, _, _ in reviews[:250])
    received = Store(500, SPECIALS, word_ids=True)
    assert sum(received.absorb(piece) for piece in pieces) == 250
    wanted = [key for key, _, _ in reviews[:250]]
    assert [[(ids.tolist(), words) for ids, words in rows] for rows in received.rows(wanted)] == [
        [(ids.tolist(), words) for ids, words in rows] for rows in store.rows(wanted)
    ]
    store.add(b"long".ljust(16), [([2, *[10] * 3000, 3], [None, *range(3000), None])])  # over the bound alone
    assert len(store.ship(at_most)) == 1 and not store.unshipped()
    for key, ids, words in reviews[:40]:  # every other word without sub-tokens: word positions kept in full
        gaps = [None if word is None else 2 * word for word in words]
        store.add(key[:15] + b"g", [(ids, gaps)])
    gapped = store.ship(at_most)
    assert len(gapped.explicit) == len(gapped) < 40 and gapped.nbytes <= at_most


def _shipped_elsewhere(reviews: list) -> object:
    other = Store(500, SPECIALS, word_ids=True)
    for key, ids, words in reviews:
        other.add(key, [(ids, words)])
    return other.ship()
