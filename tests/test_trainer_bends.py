"""What the workers change in flair's trainer for speed gives flair's numbers exactly. Fast tier."""

from __future__ import annotations

import flair
import pytest
import torch
import torch.distributed as dist
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer

from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer
from flair_nbddp.worker import flair_compat, one_rank


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

    versions = [grad._version for grad in ours if grad is not None]
    trainer._scale_gradients(1)  # one rank: each product would be its factor
    assert [grad._version for grad in ours if grad is not None] == versions  # so no gradient was written


@pytest.fixture
def world_of_one(monkeypatch):
    """A gloo process group of one rank in this process, and flair's DDP wrapper restored after the test."""
    from flair.trainers import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "DistributedDataParallel", trainer_module.DistributedDataParallel)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_trains_without_ddp_and_gives_ddps_numbers_bit_for_bit(world_of_one, tmp_path):
    corpus = sentiment_corpus(n_train=12, n_dev=4, n_test=4)
    path = tiny_transformer(tmp_path / "model")

    def fine_tune() -> tuple[ModelTrainer, dict, dict, float]:
        flair.set_seed(5)
        model = TextClassifier(TransformerDocumentEmbeddings(path, fine_tune=True), label_type="sentiment",
                               label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
        initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        trainer = ModelTrainer(model, corpus)
        scores = trainer.fine_tune(tmp_path / "out", max_epochs=2, mini_batch_size=4, mini_batch_chunk_size=2,
                                   multi_gpu=True, save_final_model=False)  # fmt: skip
        return trainer, initial, model.state_dict(), scores["test_score"]

    flair_compat.allow_cpu_ddp()
    with_ddp, initial, ddps, ddps_score = fine_tune()
    one_rank.install()
    without, _, ours, our_score = fine_tune()

    assert isinstance(with_ddp.ddp_model, torch.nn.parallel.DistributedDataParallel)
    assert isinstance(without.ddp_model, one_rank.OneRank)
    assert ours.keys() == ddps.keys() and all(torch.equal(ours[name], ddps[name]) for name in ours)
    assert our_score == ddps_score
    assert sum(not torch.equal(initial[name], ours[name]) for name in ours) > 10  # it trained
