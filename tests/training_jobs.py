"""Training functions the multi-process tests ship to their workers (importable by reference)."""

from __future__ import annotations


def train_sentiment(model_path: str, base_path: str, epochs: int = 20, batch: int = 4, docs: int = 400, **kw):
    """A tiny-transformer TextClassifier on the generated corpus, built on each rank; long enough to interrupt."""
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    from flair_nbddp.synthetic import sentiment_corpus

    corpus = sentiment_corpus(n_train=docs, n_dev=20, n_test=20, seed=1)
    model = TextClassifier(
        TransformerDocumentEmbeddings(model_path, fine_tune=True),
        label_type="sentiment",
        label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
    )
    scores = ModelTrainer(model, corpus).fine_tune(
        base_path, max_epochs=epochs, mini_batch_size=batch, learning_rate=5e-3, multi_gpu=True, **kw
    )
    return {"test_score": scores["test_score"]}


def train_then_return_a_generator(model_path: str, base_path: str):
    train_sentiment(model_path, base_path, epochs=1, batch=16, docs=64)
    return (line for line in ["not", "picklable"])


def train_ner(corpus, base_path: str, epochs: int = 15):
    """A small SequenceTagger (one-hot word embeddings, an LSTM, no CRF) on a span-labelled corpus."""
    from flair.embeddings import OneHotEmbeddings
    from flair.models import SequenceTagger
    from flair.trainers import ModelTrainer

    embeddings = OneHotEmbeddings.from_corpus(corpus, embedding_length=32, min_freq=1)
    tagger = SequenceTagger(
        hidden_size=32, embeddings=embeddings, tag_dictionary=corpus.make_label_dictionary("ner"),
        tag_type="ner", use_crf=False,
    )
    scores = ModelTrainer(tagger, corpus).train(
        base_path, max_epochs=epochs, mini_batch_size=16, learning_rate=0.1, multi_gpu=True
    )
    return {"test_score": scores["test_score"], "model": tagger}
