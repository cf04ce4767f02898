"""A tagger's transformer embeddings taken as their batch tensor, and clean sentences' tokens left alone when flair
clears them: the same training, bit for bit, with less of flair's per-token Python."""

from __future__ import annotations

import copy
import pickle
import tempfile
from pathlib import Path

import flair
import flair.embeddings.transformer as transformer
import pytest
import torch
from flair.data import DataPair, Dictionary, Sentence, Token
from flair.embeddings import (
    OneHotEmbeddings,
    StackedEmbeddings,
    TransformerDocumentEmbeddings,
    TransformerWordEmbeddings,
)
from flair.models import SequenceTagger, TextClassifier, TextPairClassifier
from flair.trainers import ModelTrainer

from flair_nbddp.synthetic import ner_corpus, sentiment_corpus
from flair_nbddp.wire import codec
from flair_nbddp.worker import clean_tokens, direct_embeddings, token_gathers


@pytest.fixture
def paths(monkeypatch):
    """The paths installed in this process for the test (flair's own methods restored after it), and counters of
    the tagger batches they served, of the tokens given or cleared of an embedding, and of flair's own loops run."""
    for owner, name in ((SequenceTagger, "_prepare_tensors"), (SequenceTagger, "predict"),
                        (ModelTrainer, "train_custom"), (Sentence, "__getstate__"), (Sentence, "clear_embeddings"),
                        (Sentence, "remove_labels"), (Sentence, "_add_token"),
                        (Token, "set_embedding"), (Token, "clear_embeddings"), (transformer, "combine_strided_tensors"),
                        (transformer, "fill_masked_elements")):  # fmt: skip
        monkeypatch.setattr(owner, name, getattr(owner, name))
    counts = {"served": 0, "flairs": 0, "tokens set": 0, "tokens cleared": 0}
    served = direct_embeddings.token_tensor

    def counting(tagger, sentences):
        tensors = served(tagger, sentences)
        counts["served" if tensors is not None else "flairs"] += 1
        return tensors

    monkeypatch.setattr(direct_embeddings, "token_tensor", counting)
    set_embedding, clear = Token.set_embedding, Token.clear_embeddings

    def set_counted(self, name, vector):
        counts["tokens set"] += 1
        set_embedding(self, name, vector)

    def clear_counted(self, names=None):
        counts["tokens cleared"] += 1
        clear(self, names)

    monkeypatch.setattr(Token, "set_embedding", set_counted)
    monkeypatch.setattr(Token, "clear_embeddings", clear_counted)
    counts["flair's loops"] = 0
    for name in ("combine_strided_tensors", "fill_masked_elements"):
        loop = getattr(transformer, name)

        def looped(*args, _loop=loop):
            counts["flair's loops"] += 1
            return _loop(*args)

        monkeypatch.setattr(transformer, name, looped)
    direct_embeddings.install()
    token_gathers.install()
    clean_tokens.install()
    yield counts
    for path in (direct_embeddings, token_gathers, clean_tokens):
        path.start_job(True)


def _fine_tuned(model, corpus, base, enabled: bool, epochs: int = 2) -> list[torch.Tensor]:
    for path in (direct_embeddings, token_gathers, clean_tokens):
        path.start_job(enabled)
    ModelTrainer(model, corpus).fine_tune(str(base), max_epochs=epochs, mini_batch_size=8, learning_rate=5e-3,
                                          save_final_model=False)  # fmt: skip
    return [weights.clone() for weights in model.state_dict().values()]


TAGGERS = {
    "linear, first sub-token": dict(use_crf=False, use_rnn=False, reproject_embeddings=False, pooling="first"),
    "CRF and RNN, mean of sub-tokens": dict(use_crf=True, use_rnn=True, reproject_embeddings=True, pooling="mean"),
    "CRF, first and last sub-token": dict(
        use_crf=True, use_rnn=False, reproject_embeddings=False, pooling="first_last"
    ),
}


def _tagger(model_path: str, corpus, use_crf: bool, use_rnn: bool, reproject_embeddings: bool, pooling: str):
    flair.set_seed(7)
    embeddings = TransformerWordEmbeddings(model_path, fine_tune=True, layers="-1", subtoken_pooling=pooling)
    return SequenceTagger(embeddings, corpus.make_label_dictionary("ner", add_unk=False), "ner", use_crf=use_crf,
                          use_rnn=use_rnn, reproject_embeddings=reproject_embeddings, hidden_size=8)  # fmt: skip


@pytest.mark.parametrize("kind", TAGGERS)
def test_a_tagger_takes_its_transformers_batch_tensor_and_trains_bit_for_bit_as_flairs(
    paths, tiny_model_path, tmp_path, kind
):
    corpus = ner_corpus(n_train=32, n_dev=8, n_test=8, seed=3, words=8)  # sentences of 8 to 21 words: padding
    flairs = _fine_tuned(_tagger(tiny_model_path, corpus, **TAGGERS[kind]), corpus, tmp_path / "flair", enabled=False)
    assert paths["served"] == 0 and paths["tokens set"] > 0
    paths.update(served=0, flairs=0, **{"tokens set": 0})
    ours = _fine_tuned(_tagger(tiny_model_path, corpus, **TAGGERS[kind]), corpus, tmp_path / "direct", enabled=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, flairs, strict=True))
    # every batch of 2 epochs (4 of 8) and of the evaluations (dev and test: 1 each, each epoch's dev), no token
    # given an embedding
    assert paths == {**paths, "served": 2 * 4 + 2 + 1, "flairs": 0, "tokens set": 0}


def test_its_predictions_are_flairs(paths, tiny_model_path):
    corpus = ner_corpus(n_train=24, n_dev=1, n_test=1, seed=4, words=6)
    tagger = _tagger(tiny_model_path, corpus, **TAGGERS["CRF and RNN, mean of sub-tokens"]).eval()

    def predicted(enabled: bool) -> list:
        direct_embeddings.start_job(enabled)
        sentences = [Sentence(sentence.to_tokenized_string()) for sentence in corpus.train]
        tagger.predict(sentences, mini_batch_size=5, return_probabilities_for_all_classes=True)
        return [[(label.data_point.unlabeled_identifier, label.value, label.score) for label in sentence.get_labels()]
                for sentence in sentences]  # fmt: skip

    assert predicted(True) == predicted(False)
    assert paths["served"] == 5  # 24 sentences in batches of 5


def test_clean_sentences_tokens_are_left_alone_and_classifiers_train_bit_for_bit_as_flairs(
    paths, tiny_model_path, tmp_path
):
    def sentiment():
        return sentiment_corpus(n_train=32, n_dev=8, n_test=8, words=(20, 30), seed=3)

    def classifier(corpus):
        flair.set_seed(7)
        return TextClassifier(TransformerDocumentEmbeddings(tiny_model_path, fine_tune=True), label_type="sentiment",
                              label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip

    corpus = sentiment()
    tokens = sum(len(sentence) for split in (corpus.train, corpus.dev, corpus.test) for sentence in split)
    flairs = _fine_tuned(classifier(corpus), corpus, tmp_path / "flair", enabled=False)
    walked, paths["tokens cleared"] = paths["tokens cleared"], 0
    corpus = sentiment()  # the same sentences, new to this process
    ours = _fine_tuned(classifier(corpus), corpus, tmp_path / "clean", enabled=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, flairs, strict=True))
    # flair walked every token of every batch and evaluation, each epoch; left alone, each sentence's tokens are
    # walked once, at its first clearing
    assert walked >= 2 * tokens and paths["tokens cleared"] == tokens

    points = []
    for first, second in zip(corpus.train[::2], corpus.train[1::2]):
        pair = DataPair(Sentence(first.to_tokenized_string()), Sentence(second.to_tokenized_string()))
        pair.add_label("same", str(first.get_label("sentiment").value == second.get_label("sentiment").value))
        points.append(pair)
    dictionary = Dictionary(add_unk=False)
    for value in ("True", "False"):
        dictionary.add_item(value)
    pairs = flair.data.Corpus(train=points, dev=points[:4], test=points[:4], sample_missing_splits=False)

    def pair_classifier():
        flair.set_seed(7)
        return TextPairClassifier(TransformerDocumentEmbeddings(tiny_model_path, fine_tune=True), "same",
                                  label_dictionary=dictionary)  # fmt: skip

    flairs = _fine_tuned(pair_classifier(), pairs, tmp_path / "pairs-flair", enabled=False)
    ours = _fine_tuned(pair_classifier(), pairs, tmp_path / "pairs-clean", enabled=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, flairs, strict=True))


def test_a_sentence_forgets_its_tokens_are_clean_once_one_is_given_an_embedding_or_added(paths):
    sentence = Sentence("a fine film")
    sentence.tokens[1].set_embedding("static", torch.ones(2))
    sentence.clear_embeddings()
    assert all(not token._embeddings for token in sentence) and paths["tokens cleared"] == 3
    sentence.clear_embeddings()  # clean: its tokens are not walked
    assert paths["tokens cleared"] == 3
    sentence.tokens[2].set_embedding("static", torch.ones(2))
    sentence.set_embedding("document", torch.ones(2))
    sentence.clear_embeddings()
    assert not sentence.tokens[2]._embeddings and not sentence._embeddings and paths["tokens cleared"] == 6
    added = Token("again")
    added.set_embedding("static", torch.ones(2))
    sentence._add_token(added)  # as flair adds each token it makes
    sentence.clear_embeddings()
    assert not added._embeddings and paths["tokens cleared"] == 10
    clean_tokens.start_job(False)  # off: flair's walk every time
    sentence.clear_embeddings()
    assert paths["tokens cleared"] == 14
    # the memory stays with the sentence in this process: a copy, a pickle and the codec's shipment carry none of it
    clean_tokens.start_job(True)
    sentence.clear_embeddings()
    for other in (copy.copy(sentence), pickle.loads(pickle.dumps(sentence)), codec.decode(codec.encode(sentence))):
        assert not [name for name in vars(other) if name.startswith(codec.KIT_MARKS)]
        walked = paths["tokens cleared"]
        other.clear_embeddings()
        assert paths["tokens cleared"] == walked + 4


def test_what_the_direct_path_cannot_serve_goes_flairs_way_with_one_notice(paths, tiny_model_path, tmp_path, capsys):
    corpus = ner_corpus(n_train=16, n_dev=4, n_test=4, seed=3)
    dictionary = corpus.make_label_dictionary("ner", add_unk=False)
    sentences = list(corpus.train)
    # flair keeps the embeddings between batches ("cpu" storage): its evaluation gathers them token by token
    tagger = _tagger(tiny_model_path, corpus, **TAGGERS["linear, first sub-token"])
    for _ in range(2):
        tagger.evaluate(sentences, gold_label_type="ner", mini_batch_size=8, embedding_storage_mode="cpu")
    assert paths["served"] == 0 and paths["flairs"] == 4
    notices = capsys.readouterr().err.count("embedding storage 'cpu' keeps each token's embedding between batches")
    assert notices == 1
    # ...and then finds them stored: flair's way, as flair reuses them
    tagger.evaluate(sentences, gold_label_type="ner", mini_batch_size=8, embedding_storage_mode="none")
    assert paths["served"] == 0 and paths["flairs"] == 6
    # a transformer among other embeddings: flair's way, said once
    stacked = StackedEmbeddings([TransformerWordEmbeddings(tiny_model_path), OneHotEmbeddings.from_corpus(corpus)])
    SequenceTagger(stacked, dictionary, "ner", use_crf=False).predict(sentences, mini_batch_size=8)
    assert capsys.readouterr().err.count("its TransformerWordEmbeddings is one of its StackedEmbeddings") == 1
    # a task of a multitask model, whose other tasks may read what it stores; a frozen transformer whose embeddings
    # flair's "cpu" storage keeps (said above already): flair's way
    tagger.train()
    flairs = paths["flairs"]

    class MultitaskModel:  # stands for flair's: the model trained, of which the tagger is one task
        pass

    for scope in (("none", MultitaskModel()), ("cpu", tagger)):
        direct_embeddings._SCOPES.append(scope)
        try:
            tagger.forward_loss(sentences[:8])
        finally:
            direct_embeddings._SCOPES.pop()
        for parameter in tagger.embeddings.parameters():
            parameter.requires_grad = False
    errors = capsys.readouterr().err
    assert errors.count("it is part of MultitaskModel, whose other parts may read the embeddings it stores") == 1
    assert paths["served"] == 0 and paths["flairs"] == flairs + 2
    # a tagger without a transformer: flair's way, nothing to say
    SequenceTagger(OneHotEmbeddings.from_corpus(corpus), dictionary, "ner", use_crf=False).predict(sentences)
    assert "gathers its embeddings" not in capsys.readouterr().err
    assert paths["served"] == 0


def test_removing_labels_only_the_sentence_carries_leaves_its_tokens_alone(paths, monkeypatch):
    walked = []
    remove = Token.remove_labels

    def remove_counted(self, typename):
        walked.append(typename)
        remove(self, typename)

    monkeypatch.setattr(Token, "remove_labels", remove_counted)

    def removed(enabled: bool) -> list:
        clean_tokens.start_job(enabled)
        walked.clear()
        review = Sentence("Anna met Bruno in Oslo")
        review.add_label("sentiment", "POSITIVE")
        review.remove_labels("sentiment")  # only the sentence carries one: its tokens are left alone
        first = len(walked)
        tagged = Sentence("Anna met Bruno in Oslo")
        tagged.tokens[1].add_label("pos", "VERB")
        tagged.add_label("pos", "SENTENCE")
        tagged.remove_labels("pos")  # a token carries one: flair's walk
        spanned = Sentence("Anna met Bruno in Oslo")
        spanned[4:5].add_label("ner", "LOC")
        spanned[0:1]  # a span made and known to the sentence, without a label: flair's walk forgets it
        spanned.add_label("sentiment", "NEGATIVE")
        spanned.remove_labels("sentiment")
        states = [(sentence.annotation_layers, [token.annotation_layers for token in sentence],
                   sorted(sentence._known_spans)) for sentence in (review, tagged, spanned)]  # fmt: skip
        return [first, len(walked) - first, repr(states)]

    ours, flairs = removed(True), removed(False)
    assert ours[0] == 0 and flairs[0] == 5  # the review's 5 tokens
    assert ours[1:] == flairs[1:] and ours[1] == 10


GATHERED = {
    "first sub-token": dict(subtoken_pooling="first"),
    "last sub-token": dict(subtoken_pooling="last"),
    "first and last, two layers": dict(subtoken_pooling="first_last", layers="-1,-2"),
    "long sentences, strided": dict(subtoken_pooling="first", allow_long_sentences=True,
                                    transformers_tokenizer_kwargs={"model_max_length": 16}),
    "strided, last sub-token": dict(subtoken_pooling="last", allow_long_sentences=True,
                                    transformers_tokenizer_kwargs={"model_max_length": 12}),
    "document, mean of strided windows": dict(cls_pooling="mean", allow_long_sentences=True,
                                              transformers_tokenizer_kwargs={"model_max_length": 16}),
}  # fmt: skip


@pytest.mark.parametrize("kind", GATHERED)
def test_embeddings_gathered_in_one_operation_are_flairs_with_flairs_gradients(paths, kind):
    from flair_nbddp.synthetic import tiny_transformer

    model = tiny_transformer(Path(tempfile.mkdtemp()) / "wordpiece", tokenizer="wordpiece")
    sentences = list(sentiment_corpus(n_train=6, n_dev=1, n_test=1, words=(3, 30), seed=2).train)
    sentences.append(Sentence(["plain", " ", "words"]))  # a word the tokenizer makes nothing of: a zero row
    document = kind.startswith("document")
    made = TransformerDocumentEmbeddings if document else TransformerWordEmbeddings
    embedding = made(model, fine_tune=True, **GATHERED[kind])

    def embedded(enabled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        token_gathers.start_job(enabled)
        embedding.zero_grad()
        tensors = embedding.prepare_tensors(sentences)
        out = embedding._forward_tensors(tensors)["document_embeddings" if document else "token_embeddings"]
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        return out.detach(), [parameter.grad.clone() for parameter in embedding.parameters()]

    embedding.eval()  # no dropout: the two passes must see the same arithmetic
    ours, ours_grads = embedded(True)
    assert paths["flair's loops"] == 0
    flairs, flairs_grads = embedded(False)
    assert paths["flair's loops"] >= 1
    assert ours.dtype == flairs.dtype and torch.equal(ours, flairs)
    assert document or (not ours[-1, 1].any() and ours[-1, 2].any())
    assert all(torch.equal(a, b) for a, b in zip(ours_grads, flairs_grads, strict=True))
