"""Round trips of flair corpora, datasets and sentences through ``flair_nbddp.wire.codec``.

Every comparison goes through ``describe()``, which turns a sentence into plain tuples holding everything
flair keeps about it, so ``==`` on two descriptions is an exhaustive comparison.
"""

from __future__ import annotations

import pickle
import re

import cloudpickle
import pytest
import torch
from flair.data import (
    Corpus,
    DataPair,
    DataTriple,
    Label,
    Relation,
    Sentence,
    Span,
    TextPair,
    Token,
)
from flair.datasets import (
    ClassificationDataset,
    ColumnCorpus,
    ColumnDataset,
    FlairDatapointDataset,
)
from torch.utils.data import ConcatDataset, Subset

from flair_nbddp.synthetic import ner_corpus, sentiment_corpus
from flair_nbddp.wire import codec
from flair_nbddp.wire.lazy_corpus import decode_lazy

# -- describing objects as plain data ---------------------------------------------------------------------


def point(data_point) -> tuple:
    """Where a label sits: the sentence, a token, a span or a relation, by token indices."""
    if isinstance(data_point, Sentence):
        return ("sentence", data_point.to_original_text())
    if isinstance(data_point, Token):
        return ("token", data_point.idx, data_point.text)
    if isinstance(data_point, Span):
        return ("span", data_point.tokens[0].idx, data_point.tokens[-1].idx, data_point.text)
    if isinstance(data_point, Relation):
        return ("relation", point(data_point.first), point(data_point.second))
    if isinstance(data_point, DataPair):
        return ("pair", point(data_point.first), point(data_point.second))
    if isinstance(data_point, DataTriple):
        return ("triple", point(data_point.first), point(data_point.second), point(data_point.third))
    raise AssertionError(f"unexpected data point {data_point!r}")


def layers(annotation_layers: dict) -> list:
    """Each layer as ``(type, [(label class, data point, value, score, metadata), ...])``, in order."""
    return [(typename, list(map(describe_label, labels))) for typename, labels in annotation_layers.items()]


def describe_label(label: Label) -> tuple:
    return (type(label), point(label.data_point), label.value, label.score, label.metadata)


def describe(sentence: Sentence) -> tuple:
    """Everything a sentence holds except its embeddings and context links (see ``links``)."""
    assert type(sentence) is Sentence
    tokens = [
        (
            type(token),
            token.text,
            token.whitespace_after,
            token.start_position,
            token.idx,
            token.head_id,
            layers(token.annotation_layers),
            layers(token.tags_proba_dist),
            token._metadata,
            token.sentence is sentence,
        )
        for token in sentence.tokens
    ]
    known = [
        (key, type(part), point(part), layers(part.annotation_layers), part._metadata, part.sentence is sentence)
        for key, part in sentence._known_spans.items()
    ]
    spans = sentence.get_spans()
    return (
        sentence.to_original_text(),
        sentence.to_tokenized_string(),
        sentence.language_code,
        sentence.start_position,
        sentence.is_document_boundary,
        sentence._has_context,
        sentence._position_in_dataset,
        sentence._metadata,
        layers(sentence.annotation_layers),
        tokens,
        known,
        [(point(s), s.text, s.start_position, s.end_position, layers(s.annotation_layers)) for s in spans],
        [(point(relation), layers(relation.annotation_layers)) for relation in sentence.get_relations()],
        [(point(label.data_point), label.value, label.score) for label in sentence.get_labels()],
    )


def describe_point(data_point) -> tuple:
    """A sentence, or a pair/triple as its class, its described sentences and its own labels."""
    if isinstance(data_point, Sentence):
        return describe(data_point)
    members = [getattr(data_point, name) for name in ("first", "second", "third") if hasattr(data_point, name)]
    return (type(data_point), [describe(member) for member in members], layers(data_point.annotation_layers))


def links(sentences: list[Sentence]) -> list[tuple]:
    """Each sentence's context neighbours as positions in ``sentences`` (or their text when outside it)."""
    position = {id(sentence): i for i, sentence in enumerate(sentences)}

    def where(other):
        return None if other is None else position.get(id(other), other.to_original_text())

    return [(where(s._previous_sentence), where(s._next_sentence)) for s in sentences]


def assert_same_dataset(original, rebuilt) -> None:
    assert type(rebuilt) is type(original)
    assert len(rebuilt) == len(original)
    assert [describe_point(p) for p in rebuilt] == [describe_point(p) for p in original]
    sentences = [p for p in original if isinstance(p, Sentence)]
    assert links([p for p in rebuilt if isinstance(p, Sentence)]) == links(sentences)


def assert_same_corpus(original: Corpus, rebuilt: Corpus) -> None:
    assert type(rebuilt) is type(original)
    assert rebuilt.name == original.name
    for split in ("train", "dev", "test"):
        before, after = getattr(original, split), getattr(rebuilt, split)
        assert (after is None) == (before is None), split
        if before is not None:
            assert_same_dataset(before, after)


def round_trip(obj):
    """Decode ``obj``'s encoding, built up front and lazily: re-encoding either must give the same bytes."""
    data = codec.encode(obj)
    rebuilt = codec.decode(data)
    assert codec.encode(rebuilt) == data, "re-encoding the rebuilt object must give the same bytes"
    assert codec.encode(decode_lazy(data)) == data, "re-encoding the lazy object must give the same bytes"
    return rebuilt


# -- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentiment() -> Corpus:
    return sentiment_corpus(n_train=60, n_dev=10, n_test=10, seed=3)


@pytest.fixture(scope="module")
def ner() -> Corpus:
    return ner_corpus(n_train=60, n_dev=10, n_test=10, seed=3)


def relation_sentence() -> Sentence:
    sentence = Sentence("Ada Lovelace was born in London .")
    person, city = sentence[0:2], sentence[5:6]
    person.add_label("ner", "PER", 0.875)
    city.add_label("ner", "LOC")
    Relation(person, city).add_label("relation", "born_in", 0.5)
    return sentence


CONLL = """\
# id = 1\tdomain=news
Ada NNP B-PER
Lovelace NNP I-PER
was VBD O
born VBN O
in IN O
London NNP B-LOC
. . O

Paris NNP B-LOC
is VBZ O
big JJ O
"""


@pytest.fixture()
def column_corpus(tmp_path) -> ColumnCorpus:
    for name in ("train.txt", "dev.txt", "test.txt"):
        (tmp_path / name).write_text(CONLL + "\n" + CONLL, encoding="utf-8")
    return ColumnCorpus(tmp_path, {0: "text", 1: "pos", 2: "ner"}, comment_symbol="#")


def labelled_sentence() -> Sentence:
    sentence = relation_sentence()
    sentence[2].add_label("pos", "VBD", 0.625)
    sentence.add_label("topic", "history")
    return sentence


MUTATIONS = {
    "token text": lambda s: setattr(s[1], "form", "Byron"),
    "whitespace": lambda s: setattr(s[1], "whitespace_after", 2),
    "start position": lambda s: setattr(s[3], "start_position", 99),
    "token label": lambda s: s[2].set_label("pos", "VBN", 0.625),
    "token label score": lambda s: s[2].set_label("pos", "VBD", 0.5),
    "sentence label": lambda s: s.set_label("topic", "science"),
    "span label score": lambda s: s.get_spans("ner")[0].set_label("ner", "PER", 0.75),
    "new span": lambda s: s[2:4].add_label("ner", "MISC"),
    "relation label": lambda s: s.get_relations("relation")[0].set_label("relation", "died_in", 0.5),
    "language": lambda s: setattr(s, "language_code", "de"),
    "metadata": lambda s: s.add_metadata("k", "v"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_describe_and_fingerprint_see_each_difference(mutation):
    original = labelled_sentence()
    changed = codec.decode(codec.encode(original))
    assert describe(changed) == describe(original)
    MUTATIONS[mutation](changed)
    assert describe(changed) != describe(original)
    assert codec.fingerprint(changed) != codec.fingerprint(original)


# -- round trips ------------------------------------------------------------------------------------------


def test_sentiment_corpus_round_trip(sentiment):
    rebuilt = round_trip(sentiment)
    assert_same_corpus(sentiment, rebuilt)
    assert rebuilt.train[0].get_label("sentiment").value in {"POSITIVE", "NEGATIVE"}


def test_ner_corpus_round_trip_keeps_spans(ner):
    with pytest.raises(TypeError, match="tokens"):  # why the codec exists: flair's spans do not unpickle
        pickle.loads(cloudpickle.dumps(ner.train[0]))
    rebuilt = round_trip(ner)
    assert_same_corpus(ner, rebuilt)
    sentence = rebuilt.train[0]
    spans = sentence.get_spans("ner")
    assert spans and all(type(span) is Span and span.sentence is sentence for span in spans)
    # the rebuilt sentence behaves like flair's own: slicing finds the known span, labels go to both layers
    first = spans[0]
    again = sentence[first.tokens[0].idx - 1 : first.tokens[-1].idx]
    assert again is first
    again.add_label("checked", "yes")
    assert [label.data_point for label in sentence.get_labels("checked")] == [first]


def test_multi_label_classification_round_trip():
    sentences = []
    for i in range(12):
        sentence = Sentence(f"review number {i} about sports and politics", language_code="en")
        sentence.add_label("topic", "sports", 0.75)
        sentence.add_label("topic", "politics", 0.25 + i / 100)
        if i % 3 == 0:
            sentence.add_label("topic", "science")
        sentence.add_label("sentiment", "POSITIVE" if i % 2 else "NEGATIVE", 0.5)
        sentences.append(sentence)
    corpus = Corpus(
        FlairDatapointDataset(sentences[:8]),
        FlairDatapointDataset(sentences[8:10]),
        FlairDatapointDataset(sentences[10:]),
        name="multi-label",
        sample_missing_splits=False,
    )
    rebuilt = round_trip(corpus)
    assert_same_corpus(corpus, rebuilt)
    assert [label.value for label in rebuilt.train[0].get_labels("topic")] == ["sports", "politics", "science"]
    assert rebuilt.train[1].get_labels("topic")[1].score == pytest.approx(0.26)
    assert rebuilt.train[0].language_code == "en"


def test_sentence_pairs_round_trip():
    pairs = []
    for i in range(6):
        pair = TextPair(Sentence(f"premise {i} is here"), Sentence(f"hypothesis {i}"))
        pair.add_label("entailment", "yes" if i % 2 else "no", 0.9)
        pairs.append(pair)
    train, test = FlairDatapointDataset(pairs[:4]), FlairDatapointDataset(pairs[4:])
    corpus = Corpus(train, None, test, sample_missing_splits=False)
    rebuilt = round_trip(corpus)
    assert_same_corpus(corpus, rebuilt)
    pair = rebuilt.train[1]
    assert type(pair) is DataPair and pair.__orig_class__ == TextPair
    assert pair.get_label("entailment").value == "yes" and pair.get_label("entailment").data_point is pair
    assert pair.concatenated_data is None
    triple = DataTriple(Sentence("one"), Sentence("two"), Sentence("three")).add_label("order", "ascending")
    assert describe_point(round_trip(triple)) == describe_point(triple)


def test_relations_round_trip():
    sentences = [relation_sentence() for _ in range(3)]
    corpus = Corpus(FlairDatapointDataset(sentences), name="relations", sample_missing_splits=False)
    rebuilt = round_trip(corpus)
    assert_same_corpus(corpus, rebuilt)
    relation = rebuilt.train[0].get_relations("relation")[0]
    assert type(relation) is Relation and relation.tag == "born_in" and relation.score == 0.5
    assert (relation.first.text, relation.second.text) == ("Ada Lovelace", "London")
    assert relation.first in rebuilt.train[0].get_spans("ner")


def test_column_corpus_round_trip(column_corpus):
    rebuilt = round_trip(column_corpus)
    assert type(rebuilt) is ColumnCorpus
    splits = (rebuilt.train, rebuilt.dev, rebuilt.test)
    assert all(type(split) is ConcatDataset and type(split.datasets[0]) is ColumnDataset for split in splits)
    assert_same_corpus(column_corpus, rebuilt)
    # the dataset's own attributes come back too
    original, dataset = column_corpus.train.datasets[0], rebuilt.train.datasets[0]
    assert dataset.path_to_column_file == original.path_to_column_file
    assert dataset.span_level_tag_columns == original.span_level_tag_columns
    assert dataset.column_delimiter == original.column_delimiter
    sentence = rebuilt.train[0]
    assert sentence._metadata["domain"] == "news\n"  # flair keeps the line's end
    assert [token.get_label("pos").value for token in sentence][:3] == ["NNP", "NNP", "VBD"]
    assert [(span.text, span.tag) for span in sentence.get_spans("ner")] == [("Ada Lovelace", "PER"), ("London", "LOC")]
    assert sentence.next_sentence() is rebuilt.train[1] and rebuilt.train[1].previous_sentence() is sentence


def test_classification_dataset_in_memory_round_trip(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("__label__a __label__b first text here\n__label__b second one\n", encoding="utf-8")
    dataset = ClassificationDataset(path, label_type="class", memory_mode="full")
    rebuilt = round_trip(dataset)
    assert_same_dataset(dataset, rebuilt)
    assert (rebuilt.label_type, rebuilt.memory_mode) == ("class", "full")
    assert type(rebuilt.tokenizer) is type(dataset.tokenizer)
    assert [label.value for label in rebuilt[0].get_labels("class")] == ["a", "b"]


def test_context_links_round_trip():
    outside = Sentence("a sentence outside the dataset")
    sentences = [Sentence(f"sentence {i} of a document") for i in range(5)]
    Sentence.set_context_for_sentences(sentences)
    sentences[2].is_document_boundary = True
    sentences[0]._previous_sentence = outside
    dataset = FlairDatapointDataset(sentences)
    rebuilt = round_trip(dataset)
    assert_same_dataset(dataset, rebuilt)
    assert links(rebuilt.datapoints)[0] == ("a sentence outside the dataset", 1)
    assert rebuilt[1].left_context(3) == rebuilt[0].tokens[-3:]
    assert rebuilt[4].previous_sentence() is rebuilt[3]


def test_corpus_with_dev_none(sentiment):
    corpus = Corpus(sentiment.train, None, sentiment.test, name="no-dev", sample_missing_splits=False)
    rebuilt = round_trip(corpus)
    assert rebuilt.dev is None and rebuilt.name == "no-dev"
    assert_same_corpus(corpus, rebuilt)


def test_corpus_of_plain_lists(ner):
    corpus = Corpus(list(ner.train), None, list(ner.test), name="lists", sample_missing_splits=False)
    assert codec.supports(corpus)
    rebuilt = round_trip(corpus)
    assert type(rebuilt.train) is list and rebuilt.dev is None
    assert_same_corpus(corpus, rebuilt)


def test_sampled_splits_keep_sharing_one_dataset(sentiment):
    corpus = Corpus(sentiment.train, name="sampled", sample_missing_splits=True, random_seed=1)
    assert isinstance(corpus.dev, Subset)
    rebuilt = round_trip(corpus)
    assert_same_corpus(corpus, rebuilt)
    assert rebuilt.dev.indices == corpus.dev.indices
    inner = rebuilt.train.dataset
    assert isinstance(inner, Subset) and rebuilt.dev.dataset is inner  # both splits cut from one dataset


def test_unusual_attributes_round_trip():
    sentence = Sentence("They met in Rome .", start_position=40, language_code="it")
    sentence.add_metadata("source", ("doc", 7))
    sentence.add_label("topic", "travel", 0.5, annotator="x")
    sentence[3].add_label("pos", "PROPN")
    sentence[3].add_metadata("lemma", "Roma")
    sentence[0].head_id = 2
    sentence[2].add_tags_proba_dist("pos", [Label(sentence[2], "ADP", 0.75), Label(sentence[2], "ADV", 0.25)])
    sentence.custom_attribute = {"any": "picklable value"}
    truncated = Sentence("drop the first two tokens")
    truncated.tokens = truncated.tokens[2:]  # keeps flair's old _internal_index values
    dataset = FlairDatapointDataset([sentence, truncated])
    rebuilt = round_trip(dataset)
    assert_same_dataset(dataset, rebuilt)
    assert rebuilt[0].custom_attribute == {"any": "picklable value"}
    assert rebuilt[0].get_label("topic").metadata == {"annotator": "x"}
    assert [token.idx for token in rebuilt[1]] == [3, 4, 5]


def test_unusual_texts_round_trip():
    texts = [["nul\x00byte", "new\nline"], ["unit\x1fsep", "é", "漢字", "\ud800"], ["\uffff", "x"]]
    sentences = [Sentence(words) for words in texts] + [Sentence(""), Sentence("  leading spaces  and  gaps ")]
    sentences[0][0].whitespace_after = 300  # beyond one byte
    dataset = FlairDatapointDataset(sentences)
    rebuilt = round_trip(dataset)
    assert_same_dataset(dataset, rebuilt)
    assert len(rebuilt[3]) == 0 and rebuilt[4][0].start_position == 2


def test_embeddings_are_dropped(sentiment):
    sentence = sentiment.train[0]
    before = codec.encode(sentence)
    sentence.set_embedding("document", torch.ones(4))
    sentence[0].set_embedding("word", torch.ones(4))
    try:
        assert codec.encode(sentence) == before
        rebuilt = codec.decode(before)
        assert rebuilt._embeddings == {} and all(token._embeddings == {} for token in rebuilt)
    finally:
        sentence.clear_embeddings()


# -- determinism, fingerprints, size ------------------------------------------------------------------------


def test_encoding_is_deterministic(ner):
    first = codec.encode(ner)
    assert codec.encode(ner) == first
    assert codec.encode(ner_corpus(n_train=60, n_dev=10, n_test=10, seed=3)) == first  # built again: same bytes
    assert codec.encode(ner_corpus(n_train=60, n_dev=10, n_test=10, seed=4)) != first


def test_fingerprint_survives_round_trip(ner, sentiment):
    for corpus in (ner, sentiment):
        fingerprint = codec.fingerprint(corpus)
        assert re.fullmatch("[0-9a-f]{64}", fingerprint)  # a sha256 in hex
        assert codec.fingerprint(codec.decode(codec.encode(corpus))) == fingerprint
    assert codec.fingerprint(ner) != codec.fingerprint(sentiment)


def test_encoded_corpus_is_five_times_smaller_than_cloudpickle():
    corpus = sentiment_corpus(n_train=500, n_dev=0, n_test=0, words=(200, 260), seed=5)
    encoded, pickled = len(codec.encode(corpus)), len(cloudpickle.dumps(corpus))
    assert encoded * 5 <= pickled, (encoded, pickled)


# -- what is supported ----------------------------------------------------------------------------------------


def test_supports_flair_objects(sentiment, column_corpus):
    pair = TextPair(Sentence("a"), Sentence("b"))
    for obj in (
        sentiment, sentiment.train, sentiment.train[0], pair, column_corpus, column_corpus.train,
        FlairDatapointDataset([]), Subset(sentiment.train, [0, 1]), ConcatDataset([sentiment.train, sentiment.dev]),
    ):
        assert codec.supports(obj), obj


def test_does_not_support_other_objects(sentiment, tmp_path):
    (tmp_path / "train.txt").write_text(CONLL, encoding="utf-8")
    lazy = ColumnDataset(tmp_path / "train.txt", {0: "text", 1: "pos", 2: "ner"}, in_memory=False)
    (tmp_path / "classes.txt").write_text("__label__a some text\n__label__b other text\n", encoding="utf-8")
    partial = ClassificationDataset(tmp_path / "classes.txt", label_type="class", memory_mode="partial")
    token_pair = DataPair(Token("a"), Token("b"))
    for obj in (None, 3, "text", [sentiment.train[0]], {"corpus": sentiment}, lazy, partial, token_pair, Token("a")):
        assert not codec.supports(obj), obj
        with pytest.raises(TypeError, match="cloudpickle"):
            codec.encode(obj)
    lazy_corpus = Corpus(lazy, None, None, sample_missing_splits=False)
    assert not codec.supports(lazy_corpus)


def test_unencodable_content_raises_type_error_naming_it():
    sentence, other = Sentence("one two"), Sentence("three four")
    sentence.annotation_layers["pos"] = [Label(other[0], "NUM")]  # a label on another sentence's token
    assert codec.supports(sentence)
    with pytest.raises(TypeError, match=r"cannot encode Sentence .*one two.*cloudpickle"):
        codec.encode(sentence)
    sentence = Sentence("one two")
    sentence[0].whitespace_after = 1.5
    with pytest.raises(TypeError, match="whitespace_after"):
        codec.encode(sentence)


def test_decode_rejects_foreign_bytes():
    with pytest.raises(ValueError, match="not written by"):
        codec.decode(pickle.dumps([1, 2]))
