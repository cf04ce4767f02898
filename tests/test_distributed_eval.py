"""Distributed evaluation: each rank evaluates its share, and every rank gets exactly one process's result.

The multi-process tests train one model of each kind for a few epochs on 2 gloo ranks (the trainer's dev and
test evaluations are shared out too), evaluate it there on an odd-sized split, a one-sentence split and an
empty one, and compare with ``evaluate`` of the returned model in this process, on the whole split.
"""

from __future__ import annotations

import math
import re

import eval_jobs
import pytest
import torch

from flair_nbddp.worker import distributed_eval

KINDS = eval_jobs.KINDS


def _single_process(model, points, label_type, out_path):
    """``evaluate`` here, with one thread as in each worker (so float sums run in the same order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return eval_jobs.summary(eval_jobs.evaluated(model, points, label_type, out_path))
    finally:
        torch.set_num_threads(threads)


# -- without processes: where predictions sit, and the batches -------------------------------------------
def _roundtrip(point, fresh):
    located = distributed_eval._labels_of(point)
    for where, value, score, metadata in located:
        distributed_eval._part(fresh, where).add_label("predicted", value, score, **metadata)
    return located


def test_predicted_labels_travel_by_position_to_an_equal_sentence():
    from flair.data import Relation, Sentence

    def sentence():
        return Sentence("Anna met Bruno in Lisbon .")

    predicted = sentence()
    predicted.add_label("predicted", "POSITIVE", 0.75)
    predicted[4].add_label("predicted", "NOUN", 0.5, source="tagger")
    Relation(predicted[0:1], predicted[4:5]).add_label("predicted", "VISITED", 0.9)
    predicted[2:3].add_label("predicted", "PER", 0.8)
    fresh = sentence()
    located = _roundtrip(predicted, fresh)
    assert [where for where, *_ in located] == [(), ("token", 4), ("relation", (0, 1), (4, 5)), ("span", 2, 3)]
    identifiers = [(label.labeled_identifier, label.score, label.metadata) for label in fresh.get_labels("predicted")]
    assert identifiers == [
        (label.labeled_identifier, label.score, label.metadata) for label in predicted.get_labels("predicted")
    ]
    assert fresh[4].get_label("predicted").metadata == {"source": "tagger"}


def test_a_pair_keeps_its_own_label():
    from flair.data import Sentence, TextPair

    pair, fresh = (TextPair(Sentence("a b"), Sentence("c d")) for _ in range(2))
    pair.add_label("predicted", "SAME", 0.6)
    assert _roundtrip(pair, fresh) == [((), "SAME", 0.6, {})]
    assert fresh.get_label("predicted").value == "SAME"


def test_a_label_pointing_into_another_sentence_cannot_be_located():
    from flair.data import Sentence

    point, other = Sentence("a b"), Sentence("c d")
    point.annotation_layers["predicted"] = [other.get_label("x")]  # a label on a data point elsewhere
    assert distributed_eval._labels_of(point) is None


def test_the_shares_are_flairs_own_evaluation_batches():
    from flair.data import Sentence

    points = [Sentence(f"sentence {i}") for i in range(10)]
    batches = distributed_eval._batches(points, 4)
    assert [len(batch) for batch in batches] == [4, 4, 2] and batches[2][1] is points[9]
    assert distributed_eval._batches([], 4) == []


@pytest.fixture
def store_of_two_ranks(monkeypatch):
    """This process as one rank of two, agreeing through a real TCPStore (the other rank is played by the test)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    monkeypatch.setattr(distributed_eval, "AGREEMENT_SECONDS", 0.3)
    monkeypatch.setattr(distributed_eval, "_JOB", distributed_eval._Job(key="job", enabled=True))

    def as_rank(rank):
        monkeypatch.setattr(distributed_eval, "_WORLD", distributed_eval._World(rank, 2, None, store))
        return store

    return as_rank


def test_ranks_share_only_the_same_evaluation_at_the_same_moment(store_of_two_ranks):
    store = store_of_two_ranks(0)
    store.set("job/evaluate/1/call/1", "dev")  # rank 1 arrived, evaluating the dev split
    store.add("job/evaluate/1/arrived", 1)
    assert distributed_eval._all_ranks_evaluate("job/evaluate/1", "dev") is True
    store.set("job/evaluate/2/call/1", "test")  # rank 1 arrived with another split: each evaluates its own
    store.add("job/evaluate/2/arrived", 1)
    assert distributed_eval._all_ranks_evaluate("job/evaluate/2", "dev") is False


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_evaluating_alone_gives_up_waiting_and_every_rank_follows_its_decision(store_of_two_ranks, rank):
    import time

    store = store_of_two_ranks(rank)
    started = time.monotonic()
    assert distributed_eval._all_ranks_evaluate("job/evaluate/1", "dev") is False
    assert 0.3 <= time.monotonic() - started < 5
    assert store.get("job/evaluate/1/decision") == b"whole"  # a rank arriving now evaluates its whole split too


def test_a_rank_stops_waiting_at_once_when_the_others_have_returned(store_of_two_ranks):
    import time

    store = store_of_two_ranks(1)
    store.set("job/returned/0", "1")
    started = time.monotonic()
    assert distributed_eval._all_ranks_evaluate("job/evaluate/1", "dev") is False
    assert time.monotonic() - started < 0.2  # not the 0.3 s of waiting


def test_one_process_evaluates_as_flair_does():
    assert not distributed_eval._active()  # no process group here: evaluate is flair's own


# -- on 2 gloo ranks ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_out(warm_pool, tiny_model_path, tmp_path_factory):
    base = tmp_path_factory.mktemp("distributed-eval")
    result = warm_pool.launch(eval_jobs.evaluate_everywhere, (KINDS, tiny_model_path, str(base)), processes=2, device="cpu",
                    dashboard=False, seed=3)  # fmt: skip
    return result.value, base


@pytest.mark.process
@pytest.mark.parametrize("kind", KINDS)
def test_shared_out_evaluation_equals_one_process_on_the_whole_split(shared_out, tiny_model_path, kind, tmp_path):
    value, _ = shared_out
    outcome = value[kind]
    corpus, _, label_type = eval_jobs.build(kind, tiny_model_path)
    batches = {"test": math.ceil(outcome["sizes"][1] / eval_jobs.BATCH), "one": 1, "none": 0}
    for name, points in eval_jobs.splits(corpus).items():
        reference_file = tmp_path / f"{name}.tsv"
        expected = _single_process(outcome["model"], points, label_type, reference_file)
        got = outcome["every_rank"][name]
        assert got[0] == expected, f"{kind}/{name}: rank 0's result differs from one process's"
        assert got[1] == got[0], f"{kind}/{name}: the ranks got different results"
        # rank 0 wrote the file, every line as one process writes it; rank 1 wrote none
        assert outcome["written"][name] == [0]
        assert outcome["files"][name] == reference_file.read_text()
        # no batch twice, none left out: rank r computed batches r, r + 2, ...
        assert outcome["computed_here"][name] == [math.ceil(batches[name] / 2), batches[name] // 2]
    # varied predictions make the equality telling
    if kind == "relation":  # flair leaves out pairs with no relation, gold or predicted
        assert 0 < outcome["files"]["test"].count(" - Pred: VISITED") < outcome["sizes"][1]
    elif kind != "regression":
        pattern = r"^\S+ \S+ (\S+)$" if kind.startswith("tagger") else r"^ - Pred: (.*)$"  # token gold predicted
        predicted = set(re.findall(pattern, outcome["files"]["test"], flags=re.M))
        assert len(predicted) >= 2, outcome["files"]["test"][:500]
    else:
        assert outcome["every_rank"]["one"][0][0] == "ValueError"  # flair's own error on one point, on every rank


@pytest.mark.process
@pytest.mark.parametrize("kind", KINDS)
def test_a_shared_out_evaluation_leaves_the_random_streams_where_flairs_own_does(shared_out, kind):
    # what the training after it draws (dropout, shuffling) must be flair's: tests/test_parity.py shows the curves
    assert shared_out[0][kind]["streams_as_flairs"] == {name: [True, True] for name in ("test", "one", "none")}


@pytest.mark.process
@pytest.mark.parametrize("kind", KINDS)
def test_the_trainers_dev_and_test_evaluations_are_shared_out(shared_out, kind):
    outcome = shared_out[0][kind]
    dev, test = outcome["sizes"]
    every_batch = outcome["epochs"] * math.ceil(dev / eval_jobs.BATCH) + math.ceil(test / eval_jobs.BATCH)
    computed = outcome["computed_in_training"]
    assert sum(computed) == every_batch and abs(computed[0] - computed[1]) <= outcome["epochs"] + 1, computed


@pytest.mark.process
def test_without_distributed_eval_every_rank_evaluates_the_whole_split(warm_pool, tiny_model_path, tmp_path):
    result = warm_pool.launch(eval_jobs.evaluate_everywhere, (("tagger",), tiny_model_path, str(tmp_path)), processes=2,
                    device="cpu", dashboard=False, seed=3, distributed_eval=False)  # fmt: skip
    outcome = result.value["tagger"]
    assert outcome["computed_in_training"] == [0, 0] and outcome["computed_here"]["test"] == [0, 0]
    assert outcome["written"]["test"] == [0, 1]  # flair's own way: every rank writes its file
    corpus, _, label_type = eval_jobs.build("tagger", tiny_model_path)
    expected = _single_process(outcome["model"], eval_jobs.splits(corpus)["test"], label_type, None)
    assert outcome["every_rank"]["test"] == [expected, expected]


@pytest.mark.process
def test_a_rank_evaluating_alone_evaluates_the_whole_split_without_waiting(warm_pool, tiny_model_path, tmp_path):
    result = warm_pool.launch(eval_jobs.evaluate_on_rank_0_only, ("text", tiny_model_path, str(tmp_path)), processes=2,
                    device="cpu", dashboard=False, seed=3)  # fmt: skip
    corpus, _, label_type = eval_jobs.build("text", tiny_model_path)
    reference_file = tmp_path / "reference.tsv"
    expected = _single_process(result.value["model"], eval_jobs.splits(corpus)["test"], label_type, reference_file)
    assert eval_jobs.summary(result.value["result"]) == expected
    assert result.value["file"] == reference_file.read_text()
    assert "TextClassifier.evaluate ran on the whole split on this rank: the other ranks were not evaluating" in result.log
    assert result.elapsed < distributed_eval.AGREEMENT_SECONDS  # rank 1 had returned: no waiting it out


@pytest.mark.process
def test_a_model_with_its_own_evaluate_is_evaluated_whole_with_one_notice(warm_pool, tiny_model_path):
    result = warm_pool.launch(eval_jobs.evaluate_a_pair_regressor_twice, (tiny_model_path,), processes=2, device="cpu",
                    dashboard=False, seed=3)  # fmt: skip
    assert len(result.value) == 2 and result.value[0] == result.value[1]
    notice = "flair_nbddp: TextPairRegressor.evaluate runs on the whole split on every rank"
    assert result.log.count(notice) == 1, result.log[-3000:]


@pytest.mark.process
def test_a_model_whose_prediction_draws_random_numbers_is_evaluated_whole_with_one_notice(warm_pool, tiny_model_path):
    result = warm_pool.launch(eval_jobs.evaluate_a_classifier_whose_prediction_draws, (tiny_model_path,), processes=2,
                    device="cpu", dashboard=False, seed=3)  # fmt: skip
    value = result.value
    corpus, _, label_type = eval_jobs.build("text", tiny_model_path)
    assert value["result"] == _single_process(value["model"], eval_jobs.splits(corpus)["test"], label_type, None)
    # shared out, the draws of the training after it would change: the split was evaluated whole, as flair does
    assert value["as_flairs"] == [True, True]
    assert value["computed"] == [0, 0]  # the shares were thrown away: nothing was replayed
    notice = "DrawingClassifier.evaluate runs on the whole split on every rank: its prediction draws random numbers"
    assert result.log.count(notice) == 1, result.log[-3000:]


@pytest.mark.process
def test_a_split_evaluated_on_rank_0_alone_is_never_mixed_with_the_next_shared_one(tiny_model_path, tmp_path):
    from flair_nbddp import WorkerPool

    corpus, _, label_type = eval_jobs.build("text", tiny_model_path)
    with WorkerPool(2, "cpu") as pool:
        for _ in range(2):  # the same run directory twice on a warm pool: no state of the first job leaks
            result = pool.launch(eval_jobs.evaluate_dev_on_rank_0_then_test, ("text", tiny_model_path, str(tmp_path)),
                                 dashboard=False, seed=3, run_dir=tmp_path / "run")  # fmt: skip
            model = result.value["model"]
            assert result.value["dev"] == _single_process(model, list(corpus.dev), label_type, None)
            assert result.value["test"] == _single_process(model, eval_jobs.splits(corpus)["test"], label_type, None)
            # rank 1's test split met rank 0's dev split: each rank evaluated its own whole, nothing was mixed
            assert [(tmp_path / f"computed-{rank}").read_text() for rank in (0, 1)] == ["0", "0"]
            assert result.elapsed < distributed_eval.AGREEMENT_SECONDS  # rank 1 had returned: no waiting it out
            notice = "ran on the whole split on this rank: the other ranks were not evaluating the same split"
            assert notice in result.log
