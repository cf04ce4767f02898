"""flair's transformer compiled with torch.compile while a job trains (run option ``compile_model``): how a setting
reaches torch, what a bad one says, and that a compiled training trains and leaves flair's plain model behind."""

from __future__ import annotations

import importlib.util

import pytest
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier

import flair_nbddp
from flair_nbddp import ConfigurationError, RunOptions
from flair_nbddp.synthetic import sentiment_corpus
from flair_nbddp.worker import compiled


@pytest.fixture
def job():
    yield compiled
    compiled.start_job(False, "cpu")


def test_a_name_torch_has_not_is_refused_naming_the_modes_and_backends_it_has(job):
    with pytest.raises(ConfigurationError, match="compile_model='reduce_overhead': 'reduce_overhead' is neither a "
                                                 "mode of inductor \\('default', 'reduce-overhead'.*\\) nor a "
                                                 "torch.compile backend here \\(.*'inductor'.*\\)"):  # fmt: skip
        job.start_job("reduce_overhead", "cuda")
    job.start_job("aot_eager", "cpu")
    assert job._JOB["setting"] == "aot_eager"


def test_inductor_on_a_gpu_without_triton_is_refused_with_the_fix(job, monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else found(name, *a))
    for setting in (True, "reduce-overhead"):
        with pytest.raises(ConfigurationError, match=r"needs Triton on GPUs.*\(pip install triton.*compile_model=False"):
            job.start_job(setting, "cuda")
    job.start_job("aot_eager", "cuda")  # no Triton needed
    job.start_job(True, "cpu")  # inductor makes C++ on CPU


@pytest.mark.parametrize("bad", [None, 3, "", 1.0])
def test_a_setting_that_is_no_setting_is_refused(bad):
    with pytest.raises(ConfigurationError, match=f"compile_model={bad!r} is not a setting: give False"):
        RunOptions(compile_model=bad)


def test_the_transformer_is_compiled_for_the_block_only(tiny_model_path):
    model = TextClassifier(TransformerDocumentEmbeddings(tiny_model_path), label_type="sentiment",
                           label_dictionary=sentiment_corpus(4, 1, 1).make_label_dictionary("sentiment"))  # fmt: skip
    keys = list(model.state_dict())
    with compiled.compiled_transformers(model, compiled.compile_call("eager")) as transformers:
        assert transformers == [model.embeddings.model]
        assert model.embeddings.model._compiled_call_impl is not None
        assert list(model.state_dict()) == keys  # checkpoints written meanwhile are flair's
    assert model.embeddings.model._compiled_call_impl is None


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
