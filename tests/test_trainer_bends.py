"""What the workers change in flair's trainer for speed gives flair's numbers exactly. Fast tier."""

from __future__ import annotations

import pytest
import torch
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer

from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer
from flair_nbddp.worker import flair_compat


@pytest.fixture
def flairs_own(monkeypatch):
    """flair's ``_scale_gradients``, restored after the test."""
    original = ModelTrainer._scale_gradients
    monkeypatch.setattr(ModelTrainer, "_scale_gradients", original)
    return original


def test_gradients_scaled_together_are_flairs_bit_for_bit(flairs_own, tmp_path):
    corpus = sentiment_corpus(n_train=8, n_dev=2, n_test=2)
    model = TextClassifier(
        TransformerDocumentEmbeddings(tiny_transformer(tmp_path / "model"), fine_tune=True),
        label_type="sentiment", label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
    )  # fmt: skip
    model.train()
    model.forward_loss(list(corpus.train))[0].backward()
    trainer = ModelTrainer(model, corpus)
    unused = next(param for param in model.parameters() if param.grad is not None)
    unused.grad = None  # a parameter without a gradient is left alone, as flair's loop leaves it
    before = [None if param.grad is None else param.grad.clone() for param in model.parameters()]

    flairs_own(trainer, 3)  # 3: products that round
    flairs = [None if param.grad is None else param.grad.clone() for param in model.parameters()]
    for param, grad in zip(model.parameters(), before):
        param.grad = None if grad is None else grad.clone()
    flair_compat.scale_gradients_together()
    trainer._scale_gradients(3)

    ours = [param.grad for param in model.parameters()]
    assert sum(grad is not None for grad in ours) > 10
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ours, flairs, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(flairs, before) if a is not None)  # it did scale
