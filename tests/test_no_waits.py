"""The waits for the GPU removed from flair's step: each answer is the one flair's and transformers' own code gives,
taken from the host instead of the device."""

from __future__ import annotations

import flair
import flair.embeddings.transformer
import flair.trainers.trainer
import pytest
import torch
from flair.embeddings import TransformerDocumentEmbeddings, TransformerWordEmbeddings
from flair.embeddings.transformer import TransformerBaseEmbeddings, TransformerEmbeddings
from flair.models import SequenceTagger, TextClassifier
from transformers.modeling_attn_mask_utils import _prepare_4d_attention_mask_for_sdpa
from transformers.models.distilbert import modeling_distilbert

from flair_nbddp.synthetic import ner_corpus, sentiment_corpus
from flair_nbddp.worker import fast_inputs, input_thread, no_waits
from flair_nbddp.worker.flair_compat import model_subclasses


@pytest.fixture
def restored(monkeypatch):
    """flair's own methods, restored after the test whatever it installs."""
    monkeypatch.setattr(TransformerEmbeddings, "forward", TransformerEmbeddings.forward)
    for cls in model_subclasses():
        if "_prepare_label_tensor" in cls.__dict__:
            monkeypatch.setattr(cls, "_prepare_label_tensor", cls.__dict__["_prepare_label_tensor"])


def test_the_mask_check_answers_from_the_host_with_transformers_own_masks(monkeypatch):
    padded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    full = torch.ones(2, 4, dtype=torch.long)
    flairs = [_prepare_4d_attention_mask_for_sdpa(mask, torch.float32, tgt_len=4) for mask in (padded, full)]
    asked = []
    answering = no_waits._answered_mask_check(lambda *args: asked.append(args) or "transformers' own")
    assert answering(padded.clone(), torch.float32, 4) == "transformers' own"  # no answer: the device is asked
    assert len(asked) == 1

    def device_asked(*_):
        raise AssertionError("the mask check asked the device")

    for mask, all_ones in ((padded, False), (full, True)):
        no_waits.answer_mask_check(torch.nn.Linear(1, 1), mask, all_ones)
    monkeypatch.setattr(torch, "all", device_asked)
    ours = [answering(mask, torch.float32, tgt_len=4) for mask in (padded, full)]
    assert ours[1] is None is flairs[1]
    assert ours[0].dtype == flairs[0].dtype and torch.equal(ours[0], flairs[0])
    assert len(asked) == 1
    monkeypatch.setattr(torch.jit, "is_tracing", lambda: True)  # a traced graph holds the mask, as transformers makes it
    assert answering(full, torch.float32, 4) == "transformers' own" and len(asked) == 2


def test_fast_inputs_tell_the_models_mask_check_the_answer_and_its_outputs_stay_bit_for_bit(tiny_model_path, monkeypatch):
    monkeypatch.setattr(modeling_distilbert, no_waits._MASK_CHECK, getattr(modeling_distilbert, no_waits._MASK_CHECK))
    monkeypatch.setattr(flair.trainers.trainer, "DataLoader", flair.trainers.trainer.DataLoader)
    monkeypatch.setattr(input_thread, "_ENCODE", input_thread._ENCODE)
    monkeypatch.setattr(fast_inputs, "_JOB", fast_inputs._JOB)
    monkeypatch.setattr(fast_inputs, "_STORES", {})
    build = fast_inputs._BUILD
    monkeypatch.setattr(TransformerBaseEmbeddings, build, getattr(TransformerBaseEmbeddings, build))
    embedding = TransformerDocumentEmbeddings(tiny_model_path, cls_pooling="mean")
    sentences = list(sentiment_corpus(n_train=8, n_dev=1, n_test=1, words=(3, 12), seed=4).train)
    same_length = [flair.data.Sentence("a b c"), flair.data.Sentence("d e f")]
    fast_inputs.start_job(False)
    flairs = [embedding.prepare_tensors(batch) for batch in (sentences, same_length)]
    fast_inputs.install()
    fast_inputs.start_job(True)
    ours = [embedding.prepare_tensors(batch) for batch in (sentences, same_length)]
    assert [getattr(tensors["attention_mask"], no_waits._ANSWER) for tensors in ours] == [False, True]
    assert getattr(getattr(modeling_distilbert, no_waits._MASK_CHECK), no_waits._ANSWERING)
    embedding.eval()
    for theirs, kept in zip(flairs, ours):
        assert torch.equal(embedding._forward_tensors(theirs)["document_embeddings"],
                           embedding._forward_tensors(kept)["document_embeddings"])  # fmt: skip


def _embedded(embedding, sentences) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The word embeddings of ``sentences`` in training (dropout drawn from seed 0) and the gradients they give."""
    embedding.train()
    embedding.model.zero_grad()
    torch.manual_seed(0)
    tensors = embedding._forward_tensors(embedding.prepare_tensors(sentences))["token_embeddings"]
    (tensors * torch.linspace(-1, 1, tensors.shape[-1])).sum().backward()
    return tensors.detach(), [param.grad.clone() for param in embedding.model.parameters() if param.grad is not None]


def test_the_layers_picked_by_an_index_on_the_device_are_flairs_bit_for_bit_and_stay_a_list(tiny_model_path, restored,
                                                                                            monkeypatch):
    embedding = TransformerWordEmbeddings(tiny_model_path, layers="-1,-2,0", subtoken_pooling="mean")
    sentences = list(sentiment_corpus(n_train=6, n_dev=1, n_test=1, words=(3, 12), seed=5).train)
    flairs = _embedded(embedding, sentences)
    no_waits.install(model_subclasses())
    truncate, indexes = flair.embeddings.transformer.truncate_hidden_states, []

    def noting_the_index(hidden_states, input_ids):  # flair calls it just before it picks the layers
        indexes.append(embedding.layer_indexes)
        return truncate(hidden_states, input_ids)

    monkeypatch.setattr(flair.embeddings.transformer, "truncate_hidden_states", noting_the_index)
    ours = _embedded(embedding, sentences)
    assert len(indexes) == 1 and torch.equal(indexes[0], torch.tensor([-1, -2, 0]))
    assert torch.equal(flairs[0], ours[0])
    assert len(flairs[1]) == len(ours[1]) > 0 and all(torch.equal(a, b) for a, b in zip(flairs[1], ours[1]))
    assert embedding.layer_indexes == [-1, -2, 0] and embedding.to_params()["layers"] == "-1,-2,0"


@pytest.mark.parametrize("kind", ["classifier", "tagger"])
def test_gold_labels_for_a_gpu_are_made_on_the_host_and_copied_without_waiting(kind, restored, tiny_model_path,
                                                                               monkeypatch):
    no_waits.install(model_subclasses())
    if kind == "classifier":
        corpus = sentiment_corpus(n_train=6, n_dev=1, n_test=1, seed=3)
        model = TextClassifier(TransformerDocumentEmbeddings(tiny_model_path), "sentiment",
                               label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    else:
        corpus = ner_corpus(n_train=6, n_dev=1, n_test=1, seed=3)
        model = SequenceTagger(TransformerWordEmbeddings(tiny_model_path), corpus.make_label_dictionary("ner"), "ner",
                               use_crf=False)  # fmt: skip
    points = list(corpus.train)
    flairs = type(model)._prepare_label_tensor.__wrapped__(model, points)
    copied = []
    monkeypatch.setattr(no_waits, "_to_device", lambda labels, device: copied.append((labels, device)) or labels)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(flair, "device", gpu)
    ours = model._prepare_label_tensor(points)
    assert flair.device == gpu
    assert len(copied) == 1 and copied[0][1] == gpu and copied[0][0].device.type == "cpu"
    assert ours.dtype == flairs.dtype and torch.equal(ours, flairs)
    monkeypatch.setattr(flair, "device", torch.device("cpu"))
    assert torch.equal(model._prepare_label_tensor(points), flairs) and len(copied) == 1  # on the CPU: flair's own
