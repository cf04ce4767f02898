"""flair's loggers log once, from rank 0: built on another rank they leave no event file, no handler and make no
call; on rank 0 and in a run of one process they are flair's own. The fast tier plays the rank by answering
torch's ``get_rank`` (flair's ``is_main_process`` reads it); the process test trains on two gloo ranks."""

from __future__ import annotations

import logging
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist
from flair.trainers.plugins import TrainerPlugin
from flair.trainers.plugins.base import Pluggable
from flair.trainers.plugins.loggers import log_file
from flair.trainers.plugins.loggers.clearml_logger import ClearmlLoggerPlugin
from flair.trainers.plugins.loggers.log_file import LogFilePlugin
from flair.trainers.plugins.loggers.loss_file import LossFilePlugin
from flair.trainers.plugins.loggers.metric_history import MetricHistoryPlugin
from flair.trainers.plugins.loggers.tensorboard import TensorboardLogger
from flair.trainers.plugins.loggers.wandb import WandbLogger

from flair_nbddp.synthetic import sentiment_corpus
from flair_nbddp.worker import rank_zero_loggers

EVENT_FILES = "events.out.tfevents.*"


@pytest.fixture
def bent(monkeypatch):
    """The bend installed; flair's own functions back after the test."""
    monkeypatch.setattr(TensorboardLogger, "__init__", TensorboardLogger.__init__)
    monkeypatch.setattr(log_file, "add_file_handler", log_file.add_file_handler)
    rank_zero_loggers.install()


def _as_rank(monkeypatch, rank: int) -> None:
    """This process answers as ``rank`` of a group of two (what flair's ``is_main_process`` asks)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)


@pytest.fixture
def flair_logger():
    """flair's logger; any handler a test leaves on it is closed and removed afterwards."""
    log = logging.getLogger("flair")
    before = list(log.handlers)
    yield log
    for handler in [h for h in log.handlers if h not in before]:
        log.removeHandler(handler)
        handler.close()


def _attached(plugin: TrainerPlugin) -> bool:
    pluggable = Pluggable()
    plugin.attach_to(pluggable)
    return plugin in pluggable.plugins


# -- fast tier ----------------------------------------------------------------------------------------------
def test_tensorboard_on_another_rank_makes_no_directory_no_event_file_and_is_not_attached(bent, monkeypatch, tmp_path):
    _as_rank(monkeypatch, 1)
    monkeypatch.chdir(tmp_path)  # where log_dir=None would put flair's runs/ directory
    logger = TensorboardLogger(log_dir=str(tmp_path / "tb"), comment="-x", tracked_metrics=[("macro avg", "f1-score")])
    default = TensorboardLogger()
    assert list(tmp_path.iterdir()) == []
    assert logger.writer is None and default.writer is None
    assert (logger.log_dir, logger.comment, logger.tracked_metrics) == (str(tmp_path / "tb"), "-x",
                                                                        [("macro avg", "f1-score")])  # fmt: skip
    assert logger.get_state()["log_dir"] == str(tmp_path / "tb")  # what flair's model card keeps
    assert not _attached(logger)  # flair's own rule: its hooks, which need the writer, run on rank 0 only


@pytest.mark.parametrize("rank", [0, None])  # rank 0 of two; a single process without a process group
def test_tensorboard_on_rank_0_and_on_one_rank_is_flairs_own(bent, monkeypatch, tmp_path, rank):
    if rank is not None:
        _as_rank(monkeypatch, rank)
    logger = TensorboardLogger(log_dir=str(tmp_path / "tb"))
    try:
        assert len(list((tmp_path / "tb").glob(EVENT_FILES))) == 1 and logger.writer is not None
        assert _attached(logger)
    finally:
        logger.writer.close()


def test_a_bent_tensorboard_logger_has_the_attributes_of_flairs_own(bent, monkeypatch, tmp_path):
    flairs = TensorboardLogger(log_dir=str(tmp_path / "tb"))
    flairs.writer.close()
    _as_rank(monkeypatch, 1)
    assert vars(TensorboardLogger(log_dir=str(tmp_path / "other"))).keys() == vars(flairs).keys()


def test_training_log_on_another_rank_gets_no_handler_and_keeps_rank_0s_lines(bent, monkeypatch, tmp_path,
                                                                              flair_logger):  # fmt: skip
    (tmp_path / "training.log").write_text("rank 0's first lines\n")
    handlers = list(flair_logger.handlers)
    _as_rank(monkeypatch, 1)
    plugin = LogFilePlugin(base_path=tmp_path)
    flair_logger.warning("a line of rank 1")
    assert flair_logger.handlers == handlers
    assert (tmp_path / "training.log").read_text() == "rank 0's first lines\n"
    assert not _attached(plugin) and plugin.get_state()["base_path"] == str(tmp_path)


@pytest.mark.parametrize("rank", [0, None])
def test_training_log_on_rank_0_and_on_one_rank_is_flairs_own(bent, monkeypatch, tmp_path, flair_logger, rank):
    if rank is not None:
        _as_rank(monkeypatch, rank)
    plugin = LogFilePlugin(base_path=tmp_path)
    assert plugin.log_handler in flair_logger.handlers and _attached(plugin)
    flair_logger.warning("a line of rank 0")
    plugin.close_file_handler()
    assert plugin.log_handler not in flair_logger.handlers
    assert (tmp_path / "training.log").read_text().endswith("a line of rank 0\n")


def test_wandb_clearml_and_the_others_do_nothing_on_another_rank(bent, monkeypatch, tmp_path, flair_logger):
    _as_rank(monkeypatch, 1)
    wandb = mock.MagicMock()
    handlers = list(flair_logger.handlers)
    plugins = [WandbLogger(wandb), ClearmlLoggerPlugin("a-task-id"), MetricHistoryPlugin(),
               LossFilePlugin(tmp_path / "base", epoch=0)]  # fmt: skip
    assert not any(_attached(plugin) for plugin in plugins)
    assert wandb.mock_calls == [] and flair_logger.handlers == handlers
    # LossFilePlugin only touches loss.tsv (flair's trainer has made the directory on every rank by then)
    assert [path.name for path in (tmp_path / "base").iterdir()] == ["loss.tsv"]
    assert (tmp_path / "base" / "loss.tsv").read_text() == ""


def test_a_plugin_a_user_marks_as_a_logger_is_attached_on_rank_0_only(monkeypatch):
    class Marked(TrainerPlugin):
        @property
        def attach_to_all_processes(self) -> bool:
            return False

    _as_rank(monkeypatch, 1)
    assert not _attached(Marked())
    _as_rank(monkeypatch, 0)
    assert _attached(Marked())


# -- two ranks ----------------------------------------------------------------------------------------------
def train_with_loggers(corpus, base_path: str, log_dir: str, epochs: int = 2) -> dict:
    """A small RNN classifier trained with flair's TensorBoard logger and a plugin of the user's marked as a
    logger (it notes which ranks its hook ran on); every rank notes which files flair's logger writes to."""
    from flair.embeddings import DocumentRNNEmbeddings, OneHotEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins.loggers.tensorboard import TensorboardLogger

    rank = dist.get_rank()

    class Marked(TrainerPlugin):
        @TrainerPlugin.hook
        def after_training_epoch(self, epoch: int, **_):
            Path(base_path, f"marked-rank{rank}-epoch{epoch}").touch()

        @property
        def attach_to_all_processes(self) -> bool:
            return False

    class Handlers(TrainerPlugin):  # on every rank
        @TrainerPlugin.hook
        def after_setup(self, **_):
            files = [h.baseFilename for h in logging.getLogger("flair").handlers if hasattr(h, "baseFilename")]
            Path(base_path, f"handlers-rank{rank}.txt").write_text("\n".join(files))

    words = OneHotEmbeddings.from_corpus(corpus, embedding_length=16, min_freq=1)
    model = TextClassifier(DocumentRNNEmbeddings([words], hidden_size=8), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    scores = ModelTrainer(model, corpus).train(
        base_path, max_epochs=epochs, mini_batch_size=8, learning_rate=0.1, multi_gpu=True,
        plugins=[TensorboardLogger(log_dir=log_dir), Marked(), Handlers()],
    )  # fmt: skip
    return {"test_score": scores["test_score"]}


@pytest.mark.process
def test_two_ranks_write_one_event_file_with_flairs_epochs_and_one_training_log(warm_pool, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    corpus = sentiment_corpus(n_train=48, n_dev=12, n_test=12, seed=3)
    base, log_dir = tmp_path / "base", tmp_path / "tb"
    warm_pool.launch(train_with_loggers, (corpus, str(base), str(log_dir)), seed=5, dashboard=False)

    event_files = sorted(log_dir.glob(EVENT_FILES))
    assert len(event_files) == 1, event_files
    events = EventAccumulator(str(event_files[0]))
    events.Reload()
    for tag in ("train/loss", "dev/loss"):  # flair's epoch numbers, once each
        assert [event.step for event in events.Scalars(tag)] == [1, 2], tag
    # flair counts rank 0's batches: its half of 48 sentences in batches of 8, twice
    assert [event.step for event in events.Scalars("train/batch_loss")] == [1, 2, 3, 4, 5, 6]

    assert sorted(path.name for path in base.glob("marked-*")) == ["marked-rank0-epoch1", "marked-rank0-epoch2"]
    assert (base / "handlers-rank0.txt").read_text() == str(base / "training.log")
    assert (base / "handlers-rank1.txt").read_text() == ""
    log = (base / "training.log").read_text()
    assert log.count("EPOCH 1 done") == 1 and log.count("EPOCH 2 done") == 1
