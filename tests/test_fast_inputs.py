"""Inputs built once: with fast inputs, flair's transformer embeddings get exactly the inputs flair builds, for
every kind of model, pooling, tokenizer and sentence the kit serves, and the tokenizer sees each sentence once."""

from __future__ import annotations

import random
import threading

import flair.trainers.trainer
import flair.training_utils
import pytest
import torch
from flair.data import DataPair, Dictionary, Sentence
from flair.embeddings import TransformerDocumentEmbeddings, TransformerWordEmbeddings
from flair.embeddings.transformer import TransformerBaseEmbeddings
from flair.models import SequenceTagger, TextClassifier, TextPairClassifier
from transformers.models.distilbert import modeling_distilbert
from transformers.models.roberta import modeling_roberta

import flair_nbddp
from flair_nbddp.synthetic import ner_corpus, sentiment_corpus, tiny_transformer
from flair_nbddp.worker import fast_inputs, input_thread, no_waits, word_pieces
from flair_nbddp.worker.kept_inputs import key


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("fast-inputs")
    return {kind: tiny_transformer(base / kind, tokenizer=kind) for kind in ("word", "wordpiece", "bpe")}


@pytest.fixture
def fast(monkeypatch):
    """fast_inputs installed in this process for the test (flair's own method restored after it)."""
    monkeypatch.setattr(TransformerBaseEmbeddings, fast_inputs._BUILD, getattr(TransformerBaseEmbeddings, fast_inputs._BUILD))
    monkeypatch.setattr(flair.trainers.trainer, "DataLoader", flair.trainers.trainer.DataLoader)
    monkeypatch.setattr(fast_inputs, "_STORES", {})
    monkeypatch.setattr(fast_inputs, "_PIECES", {})
    monkeypatch.setattr(word_pieces, "CHECKED_SENTENCES", 2)  # the rest of a test's sentences: from their words
    for module in (modeling_distilbert, modeling_roberta):  # their mask checks answer from the kit's masks
        monkeypatch.setattr(module, no_waits._MASK_CHECK, getattr(module, no_waits._MASK_CHECK))
    fast_inputs.install()
    yield fast_inputs
    fast_inputs.start_job(True)


def _sentences(kind: str, count: int = 12, words: tuple[int, int] = (3, 30)) -> list:
    if kind == "ner":
        return list(ner_corpus(n_train=count, n_dev=1, n_test=1, seed=3).train)
    return list(sentiment_corpus(n_train=count, n_dev=1, n_test=1, words=words, seed=3).train)


def _prepared(embedding, batches, enabled: bool, seed: int = 5) -> list[dict]:
    """flair's inputs for each batch, with fast inputs on or off (the same random draws either way)."""
    fast_inputs.start_job(enabled)
    random.seed(seed)
    return [embedding.prepare_tensors(batch) for batch in batches]


def _assert_same(theirs: list[dict], ours: list[dict]) -> None:
    for flairs, kept in zip(theirs, ours, strict=True):
        assert flairs.keys() == kept.keys()
        for name, value in flairs.items():
            assert value.dtype == kept[name].dtype and torch.equal(value, kept[name]), name


EMBEDDINGS = {
    "document, cls pooling": lambda model: TransformerDocumentEmbeddings(model, cls_pooling="cls"),
    "document, mean pooling": lambda model: TransformerDocumentEmbeddings(model, cls_pooling="mean"),
    "words, first sub-token": lambda model: TransformerWordEmbeddings(model, subtoken_pooling="first"),
    "words, mean of sub-tokens": lambda model: TransformerWordEmbeddings(model, subtoken_pooling="mean"),
    "words, first and last": lambda model: TransformerWordEmbeddings(model, subtoken_pooling="first_last"),
    "long sentences, strided": lambda model: TransformerWordEmbeddings(
        model, allow_long_sentences=True, transformers_tokenizer_kwargs={"model_max_length": 16}
    ),
    "context, with dropout": lambda model: TransformerWordEmbeddings(model, use_context=4, context_dropout=0.5),
    "padded to the maximum": lambda model: TransformerDocumentEmbeddings(
        model, force_max_length=True, transformers_tokenizer_kwargs={"model_max_length": 64}
    ),
}


@pytest.mark.parametrize("tokenizer", ["word", "wordpiece", "bpe"])
@pytest.mark.parametrize("made", EMBEDDINGS, ids=list(EMBEDDINGS))
def test_the_inputs_are_flairs_own_bit_for_bit_and_each_sentence_is_tokenized_once(
    models, fast, made, tokenizer, monkeypatch
):
    embedding = EMBEDDINGS[made](models[tokenizer])
    embedding.train()  # context dropout draws: the same draws either way
    sentences = _sentences("ner" if "words" in made or "context" in made else "text", words=(3, 40))
    batches = [sentences[:5], sentences[5:9], sentences[9:], sentences[2:7]]  # the last: seen, in other batches
    theirs = _prepared(embedding, batches, enabled=False)
    calls, encode = [], fast.encode

    def counting(tokenizer, store, keys, words, settings):  # a sentence not kept yet, from its words or tokenized
        calls.append([list(sentence) for sentence in words])
        return encode(tokenizer, store, keys, words, settings)

    monkeypatch.setattr(fast, "encode", counting)
    first = _prepared(embedding, batches, enabled=True)
    again = _prepared(embedding, batches, enabled=True)
    _assert_same(theirs, first)
    _assert_same(theirs, again)
    # the sentences checked against the tokenizer were put together alike from their words
    assert fast._PIECES[fast.fingerprint(embedding.tokenizer)] is not None
    tokenized = [words for call in calls for words in call]
    assert len(calls) <= len(batches) and len(tokenized) == len({tuple(words) for words in tokenized})
    if "context" not in made:  # context dropout makes new variants of a sentence: each is tokenized once
        assert len(tokenized) == len(sentences)


def _losses(model, batches, enabled: bool) -> list[float]:
    """Each batch's training loss, the embeddings computed afresh (flair's trainer drops them after each batch)."""
    fast_inputs.start_job(enabled)
    torch.manual_seed(0)
    random.seed(0)
    model.train()
    losses = []
    for batch in batches:
        losses.append(model.forward_loss(batch)[0].item())
        flair.training_utils.store_embeddings(batch, "none")  # by attribute: the kit may wrap it
    return losses


@pytest.mark.parametrize("kind", ["classifier", "tagger", "pair classifier"])
def test_a_models_losses_are_the_same_with_inputs_built_once(models, fast, kind):
    if kind == "tagger":
        corpus = ner_corpus(n_train=12, n_dev=1, n_test=1, seed=3)
        dictionary = corpus.make_label_dictionary("ner", add_unk=False)
        model = SequenceTagger(TransformerWordEmbeddings(models["wordpiece"]), dictionary, "ner", use_crf=False)
        points = list(corpus.train)
    elif kind == "classifier":
        corpus = sentiment_corpus(n_train=12, n_dev=1, n_test=1, seed=3)
        dictionary = corpus.make_label_dictionary("sentiment", add_unk=False)
        model = TextClassifier(TransformerDocumentEmbeddings(models["bpe"]), "sentiment", label_dictionary=dictionary)
        points = list(corpus.train)
    else:
        sentences = _sentences("text", count=24)
        points = []
        for first, second in zip(sentences[::2], sentences[1::2]):
            pair = DataPair(Sentence(first.to_tokenized_string()), Sentence(second.to_tokenized_string()))
            same = first.get_label("sentiment").value == second.get_label("sentiment").value
            pair.add_label("same", "yes" if same else "no")
            points.append(pair)
        dictionary = Dictionary(add_unk=False)
        for value in ("yes", "no"):
            dictionary.add_item(value)
        model = TextPairClassifier(TransformerDocumentEmbeddings(models["wordpiece"]), "same", label_dictionary=dictionary)
    batches = [points[:6], points[6:]]
    assert _losses(model, batches, enabled=True) == _losses(model, batches, enabled=False)
    assert fast_inputs.kept_sentences() >= len(points)


def test_what_cannot_be_served_exactly_goes_flairs_way_with_one_notice(models, fast, capsys):
    embedding = TransformerDocumentEmbeddings(models["word"])
    embedding.__dict__["tokenizer_needs_ocr_boxes"] = True  # as LayoutLM's: boxes go with the words
    assert fast_inputs.unservable(embedding) == "its tokenizer takes OCR boxes"
    embedding.__dict__["tokenizer_needs_ocr_boxes"] = False
    slow = type("SlowTokenizer", (), {"is_fast": False})()
    real = embedding.tokenizer
    embedding.__dict__["tokenizer"] = slow
    try:
        assert fast_inputs.unservable(embedding) == "its tokenizer (SlowTokenizer) has no fast implementation"
    finally:
        embedding.__dict__["tokenizer"] = real
    assert fast_inputs.unservable(embedding) is None


def test_past_the_bound_sentences_go_flairs_way_with_one_notice_and_the_inputs_stay_flairs(models, fast, capsys,
                                                                                         monkeypatch):
    embedding = TransformerDocumentEmbeddings(models["wordpiece"])
    sentences = _sentences("text", count=40, words=(20, 60))
    batches = [sentences[:20], sentences[20:], sentences[10:30]]
    theirs = _prepared(embedding, batches, enabled=False)
    monkeypatch.setattr(fast_inputs, "KEEP_AT_MOST", 0)  # full from the start
    _assert_same(theirs, _prepared(embedding, batches, enabled=True))
    assert fast_inputs.kept_sentences() == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "kept encodings reached" in line]
    assert len(notices) == 1


def test_what_earlier_jobs_kept_stays_until_the_bound_and_then_goes_first(models, fast, monkeypatch):
    sentences = _sentences("text", count=8)
    first, second = (TransformerDocumentEmbeddings(models[kind]) for kind in ("wordpiece", "bpe"))
    fast_inputs.start_job(True)
    first.prepare_tensors(sentences)
    fast_inputs.start_job(False)  # a job in between, flair's way
    fast_inputs.start_job(True)
    second.prepare_tensors(sentences)
    assert fast_inputs.kept_sentences() == 16  # both tokenizers' encodings stay
    monkeypatch.setattr(fast_inputs, "KEEP_AT_MOST", fast_inputs.kept_bytes())  # full now
    second.prepare_tensors(_sentences("text", count=8, words=(31, 40)))  # new sentences: the first's store goes
    assert list(fast_inputs._STORES.values()) == [fast_inputs.store_for(second.tokenizer, fast_inputs._settings(second))]
    assert fast_inputs.kept_sentences() == 16


@pytest.mark.process
@pytest.mark.parametrize("kind", ["classifier", "tagger"])
def test_training_with_inputs_built_once_is_bit_for_bit_flairs_and_tokenizes_each_sentence_once(
    warm_pool, models, tmp_path, kind
):
    from training_jobs import fine_tune_counting_tokenizations

    corpus = (ner_corpus if kind == "tagger" else sentiment_corpus)(n_train=48, n_dev=12, n_test=12, seed=4)
    model = models["wordpiece" if kind == "tagger" else "bpe"]
    def train(fast: bool, name: str, ahead: bool = False, **options):
        return warm_pool.launch(fine_tune_counting_tokenizations, (corpus, model, str(tmp_path / name), kind, ahead),
                                seed=11, dashboard=False, fast_inputs=fast, **options)  # fmt: skip

    results = {True: train(True, "fast", ahead=True), False: train(False, "flair's")}  # ahead: as on GPUs
    again = train(True, "again")
    curves = {fast: {name: result.history(name) for name in ("train/loss", "dev/loss", "dev/score")}
              for fast, result in results.items()}  # fmt: skip
    assert len(curves[True]["dev/score"]) == 3 and curves[True] == curves[False]  # every epoch, bit for bit
    assert results[True].value["test_score"] == results[False].value["test_score"]
    kept = results[True].value
    # each sentence of the corpus encoded once in 3 epochs, by one rank: the ranks ship what they encoded at each
    # epoch's end, and flair's sampler deals them other training sentences in the next
    assert kept["encoded_by_all"] == kept["distinct_by_all"] and 48 + 12 <= kept["encoded_by_all"] <= 48 + 12 + 12
    assert 0 < kept["encoded"] < kept["encoded_by_all"]
    assert results[False].value["encoded"] == 0
    # the pool's next job with the same sentences and tokenizer encodes nothing: the workers kept the inputs
    assert again.value["encoded"] == 0 and again.history("dev/score") == curves[True]["dev/score"]
    if kind == "tagger":  # its transformer's batch tensor taken, on a lazy corpus too, with the same curves
        assert results[True].value["direct_batches"] > 0 and results[False].value["direct_batches"] > 0
        lazy = train(True, "lazy", lazy_corpus=True)
        assert lazy.value["direct_batches"] > 0 and lazy.history("dev/score") == curves[True]["dev/score"]


@pytest.mark.process
def test_each_precision_runs_the_forward_passes_it_names_and_fp32_is_flairs(warm_pool, tiny_model_path, tmp_path):
    from training_jobs import fine_tune_noting_dtypes

    corpus = sentiment_corpus(n_train=48, n_dev=12, n_test=12, seed=4)
    results = {
        precision: warm_pool.launch(fine_tune_noting_dtypes, (corpus, tiny_model_path, str(tmp_path / precision)),
                                    seed=11, dashboard=False, precision=precision)  # fmt: skip
        for precision in ("fp32", "bf16", "fp16")
    }
    seen = {precision: result.value["seen"] for precision, result in results.items()}
    assert seen["fp32"] == {"train": ["off"], "eval": ["off"]}
    assert seen["bf16"] == {"train": ["torch.bfloat16"], "eval": ["torch.bfloat16"]}
    # flair's use_amp: autocast in training only, in torch's type for the device (bfloat16 on CPU)
    assert seen["fp16"] == {"train": ["torch.bfloat16"], "eval": ["off"]}
    assert all(result.value["weights"] == ["torch.float32"] for result in results.values())  # the weights stay fp32
    fp32, bf16 = (results[name].history("train/loss") for name in ("fp32", "bf16"))
    assert fp32 != bf16 and all(abs(b - a) < 0.1 * a for (_, a), (_, b) in zip(fp32, bf16))  # close, not the same
    record = flair_nbddp.history(limit=1)[0]
    assert record.options["precision"] == "fp16"  # the ledger keeps each run's precision


def test_a_sentence_is_known_by_its_words_even_when_a_word_holds_the_separator():
    from flair_nbddp.worker.kept_inputs import key

    assert key(["a", "b"]) == key(["a", "b"]) != key(["a", "c"])
    assert len({key(["a\x00b"]), key(["a", "b"]), key(["3:a", "b"])}) == 3


def _trained(model_path, base, enabled: bool, ahead: bool | None, kind: str = "classifier") -> tuple[list, dict]:
    """Two epochs of flair's own trainer in this process: the trained weights, and who tokenized what."""
    from flair.trainers import ModelTrainer

    import flair

    tokenized = {"main": 0, "ahead": 0}
    encode = fast_inputs.encode

    def counting(tokenizer, store, keys, *args):
        tokenized["main" if threading.current_thread() is threading.main_thread() else "ahead"] += len(keys)
        return encode(tokenizer, store, keys, *args)

    flair.set_seed(3)
    corpus = sentiment_corpus(n_train=64, n_dev=8, n_test=8, seed=3)
    if kind == "classifier":
        model = TextClassifier(TransformerDocumentEmbeddings(model_path), "sentiment",
                               label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    else:  # a model that embeds other text than its data points: pairs of them, joined
        points = []
        for first, second in zip(corpus.train[::2], corpus.train[1::2]):
            pair = DataPair(first, second)
            pair.add_label("same", str(first.get_label("sentiment").value == second.get_label("sentiment").value))
            points.append(pair)
        dictionary = Dictionary(add_unk=False)
        for value in ("True", "False"):
            dictionary.add_item(value)
        model = TextPairClassifier(TransformerDocumentEmbeddings(model_path), "same", label_dictionary=dictionary)
        corpus = flair.data.Corpus(train=points, dev=points[:4], test=points[:4], sample_missing_splits=False)
    fast_inputs.start_job(enabled, ahead=ahead)
    fast_inputs.encode = input_thread._ENCODE = counting
    try:
        ModelTrainer(model, corpus).fine_tune(str(base), max_epochs=2, mini_batch_size=8, learning_rate=5e-3,
                                              save_final_model=False)  # fmt: skip
    finally:
        fast_inputs.encode = input_thread._ENCODE = encode
    return [weights.clone() for weights in model.state_dict().values()], tokenized


def test_the_input_thread_tokenizes_the_next_batch_ahead_and_training_stays_flairs_bit_for_bit(models, fast, tmp_path):
    flairs, _ = _trained(models["wordpiece"], tmp_path / "flair", enabled=False, ahead=False)
    ours, tokenized = _trained(models["wordpiece"], tmp_path / "ahead", enabled=True, ahead=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, flairs, strict=True))
    # 64 sentences in 8 batches: the first on the main thread, which also tokenizes the next two if the thread read
    # them before flair first embedded a batch (it learns the embedding then); dev and test on the main thread; the
    # rest in the thread; each sentence once
    assert 40 <= tokenized["ahead"] <= 56 and tokenized["main"] + tokenized["ahead"] == 64 + 8 + 8


def test_the_input_thread_stops_for_a_model_that_embeds_other_text_than_its_data_points(models, fast, tmp_path):
    flairs, _ = _trained(models["wordpiece"], tmp_path / "flair", enabled=False, ahead=False, kind="pairs")
    ours, tokenized = _trained(models["wordpiece"], tmp_path / "ahead", enabled=True, ahead=True, kind="pairs")
    assert all(torch.equal(a, b) for a, b in zip(ours, flairs, strict=True))
    assert tokenized["ahead"] == 0  # a pair is not a sentence: nothing foreseen


def test_the_input_thread_stops_for_an_embedding_after_three_batches_flair_never_asked_for(models, fast):
    embedding = TransformerDocumentEmbeddings(models["wordpiece"])
    fast_inputs.start_job(True, ahead=True)
    settings = fast_inputs._settings(embedding)
    input_thread.watch(embedding, fast_inputs.store_for(embedding.tokenizer, settings), settings)
    sentences = _sentences("text", count=40)
    for start in range(0, 40, 5):  # batches whose sentences flair never embeds (it would embed other text)
        input_thread.tokenize_ahead(sentences[start : start + 5])
    assert fast_inputs.kept_sentences() == 15


def test_the_input_thread_spends_nothing_on_sentences_it_saw_kept(models, fast, monkeypatch):
    embedding = TransformerDocumentEmbeddings(models["wordpiece"])
    fast_inputs.start_job(True, ahead=True)
    settings = fast_inputs._settings(embedding)
    input_thread.watch(embedding, fast_inputs.store_for(embedding.tokenizer, settings), settings)
    sentences = _sentences("text", count=10)
    looked_at = []
    holds = fast_inputs.Store.holds
    monkeypatch.setattr(fast_inputs.Store, "holds", lambda store, keys: looked_at.extend(keys) or holds(store, keys))
    input_thread.tokenize_ahead(sentences[:5])  # an epoch's first batch: looked up, tokenized, kept
    seen = len(looked_at)
    input_thread.tokenize_ahead(sentences[:5])  # the same sentences in the next epoch: nothing to do
    assert len(looked_at) == seen and fast_inputs.kept_sentences() == 5
    input_thread.tokenize_ahead(sentences[3:8])  # only the three it has not seen
    assert set(looked_at[seen:]) == {key([t.text for t in point]) for point in sentences[5:8]}
    assert fast_inputs.kept_sentences() == 8
    fast_inputs._STORES.clear()  # its store let go (full): the marks name a store that is gone
    fast_inputs.start_job(True, ahead=True)
    input_thread.watch(embedding, fast_inputs.store_for(embedding.tokenizer, settings), settings)
    seen = len(looked_at)
    input_thread.tokenize_ahead(sentences[:5])  # looked up in the new store (by the keys they were named by) and kept
    assert looked_at[seen:seen + 5] == [key([t.text for t in point]) for point in sentences[:5]]
    assert fast_inputs.kept_sentences() == 5


def test_a_reader_ends_its_thread_when_the_trainer_leaves_an_epoch_early_and_raises_what_reading_raised():
    reader = input_thread.Ahead(iter([[1], [2], [3], [4]]))
    assert next(reader) == [1]
    reader.close()  # as a stop leaves flair's batch loop
    assert not reader._thread.is_alive()

    def broken():
        yield [1]
        raise ValueError("a sentence could not be built")

    reader = input_thread.Ahead(broken())
    assert next(reader) == [1]
    with pytest.raises(ValueError, match="could not be built"):
        next(reader)
    prepared = []
    assert list(input_thread.Ahead(iter([(0, "a"), (1, "b")]), prepare=prepared.append)) == [(0, "a"), (1, "b")]
    assert prepared == [(0, "a"), (1, "b")]  # each item prepared in the thread before the caller got it
