"""flair's transformer compiled with torch.compile while a job trains (run option ``compile_model``): how a setting
reaches torch, what a bad one says, and that a compiled training trains and leaves flair's plain model behind."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer

import flair_nbddp
from flair_nbddp import ConfigurationError, RunOptions
from flair_nbddp.synthetic import sentiment_corpus
from flair_nbddp.worker import compiled


@pytest.fixture
def job():
    yield compiled
    compiled.start_job(False, "cpu")


@pytest.fixture
def classifier(tiny_model_path):
    return TextClassifier(TransformerDocumentEmbeddings(tiny_model_path), label_type="sentiment",
                          label_dictionary=sentiment_corpus(4, 1, 1).make_label_dictionary("sentiment"))  # fmt: skip


def test_a_name_torch_has_not_is_refused_before_the_run_naming_the_modes_and_backends_it_has():
    with pytest.raises(ConfigurationError, match="compile_model='reduce_overhead': 'reduce_overhead' is neither a "
                                                 "mode of inductor \\(.*'reduce-overhead'.*\\) nor a torch.compile "
                                                 "backend here \\(.*'inductor'.*\\)"):  # fmt: skip
        flair_nbddp.launch(print, compile_model="reduce_overhead")
    assert compiled.unknown_name("lite") is None and compiled.unknown_name("aot_eager") is None


def test_inductor_on_a_gpu_without_triton_is_refused_with_the_fix(job, monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else found(name, *a))
    for setting in (True, "reduce-overhead"):
        with pytest.raises(ConfigurationError, match=r"needs Triton on GPUs.*\(pip install triton.*compile_model=False"):
            job.start_job(setting, "cuda")
    job.start_job("aot_eager", "cuda")  # no Triton needed
    job.start_job(True, "cpu")  # inductor makes C++ on CPU
    assert job._JOB["setting"] is True


@pytest.mark.parametrize("bad", [None, 3, "", 1.0])
def test_a_setting_that_is_no_setting_is_refused(bad):
    with pytest.raises(ConfigurationError, match=f"compile_model={bad!r} is not a setting: give False"):
        RunOptions(compile_model=bad)


def test_the_transformer_is_compiled_for_the_block_only_and_left_as_it_was(classifier):
    keys, transformer = list(classifier.state_dict()), classifier.embeddings.model
    with compiled.compiled_transformers(classifier, compiled.compile_call("eager")) as transformers:
        assert transformers == [transformer] and transformer._compiled_call_impl is not None
        assert list(classifier.state_dict()) == keys  # checkpoints written meanwhile are flair's
    assert transformer._compiled_call_impl is None
    transformer.compile(backend="eager")  # compiled by the user: so it stays, even after an error
    users = transformer._compiled_call_impl
    with pytest.raises(RuntimeError, match="training failed"), compiled.compiled_transformers(
        classifier, compiled.compile_call("aot_eager")
    ):
        assert transformer._compiled_call_impl is not users
        raise RuntimeError("training failed")
    assert transformer._compiled_call_impl is users


def test_a_training_inside_a_training_keeps_the_outer_ones_compilation(job, classifier, monkeypatch, capsys):
    seen = []

    def train_custom(self, base_path, inner=False):
        if not inner:
            ModelTrainer.train_custom(self, base_path, inner=True)
        transformer = getattr(getattr(self.model, "embeddings", None), "model", None)
        seen.append(transformer is not None and transformer._compiled_call_impl is not None)

    monkeypatch.setattr(ModelTrainer, "train_custom", train_custom)
    job.install()
    job.start_job("eager", "cpu")
    ModelTrainer.train_custom(ModelTrainer(classifier, sentiment_corpus(4, 1, 1)), "out")
    assert seen == [True, True] and classifier.embeddings.model._compiled_call_impl is None
    ModelTrainer.train_custom(ModelTrainer(torch.nn.Linear(2, 2), sentiment_corpus(4, 1, 1)), "out", inner=True)
    notice = "compile_model='eager' compiles nothing in this training: Linear has no transformer embeddings"
    assert seen[-1] is False and notice in capsys.readouterr().out


@pytest.mark.process
def test_a_compiled_training_trains_and_leaves_flairs_model(warm_pool, tiny_model_path, tmp_path):
    from training_jobs import fine_tune_counting_compiled_graphs

    corpus = sentiment_corpus(n_train=48, n_dev=12, n_test=12, seed=4)
    def train(name: str, **options):
        return warm_pool.launch(fine_tune_counting_compiled_graphs, (corpus, tiny_model_path, str(tmp_path / name)),
                                seed=11, dashboard=False, precision="bf16", **options)  # fmt: skip

    eager, traced = train("eager"), train("compiled", compile_model="eager")  # dynamo's graphs, run by torch's ops
    assert eager.value["graphs"] == 0  # the default: flair's eager model
    # training, then evaluation (no gradients), then batches of other lengths: each a graph
    assert traced.value["graphs"] >= 2 and not traced.value["still_compiled"] and traced.value["same_keys"]
    curves = [[result.history(name) for name in ("train/loss", "dev/loss")] for result in (eager, traced)]
    assert len(curves[1][0]) == 2 and curves[0] == curves[1]  # the same ops in the same order: the same losses
    assert flair_nbddp.history(limit=1)[0].options["compile_model"] == "eager"  # the ledger keeps it
    assert train("after").value["graphs"] == 0  # the pool's next job trains eager again
