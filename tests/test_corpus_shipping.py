"""A span-labelled corpus built in the parent reaches every rank intact and trains there."""

import pytest
from training_jobs import train_ner

from flair_nbddp import launch_distributed
from flair_nbddp.synthetic import ner_corpus

pytestmark = [pytest.mark.process, pytest.mark.usefixtures("no_leftover_processes")]


def test_ner_tagger_trains_on_two_ranks_from_a_corpus_built_in_the_parent(tmp_path, monkeypatch):
    import pickle

    monkeypatch.setenv("FLAIR_NBDDP_SEED", "0")  # launch_distributed takes no seed: the environment gives one

    corpus = ner_corpus(n_train=300, n_dev=40, n_test=40, seed=2)
    with pytest.raises(TypeError):  # why the codec exists: flair 0.15.1 span labels do not pickle
        pickle.loads(pickle.dumps(corpus.train[0]))
    value = launch_distributed(train_ner, corpus, str(tmp_path / "ner"))
    assert value["test_score"] >= 0.8, value
    # the tagger that came back is the one rank 0 scored: it gets the same test score in the parent
    in_parent = value["model"].evaluate(corpus.test, gold_label_type="ner", mini_batch_size=32)
    assert in_parent.main_score == pytest.approx(value["test_score"])
    from flair.data import Sentence

    sentence = Sentence("yesterday Anna met Bruno in Lisbon .")
    value["model"].predict(sentence)
    assert {(span.text, span.tag) for span in sentence.get_spans("ner")} >= {("Lisbon", "LOC"), ("Anna", "PER")}
