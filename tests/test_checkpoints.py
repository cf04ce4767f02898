"""Full checkpoints: a training resumed from an epoch's checkpoint ends as the uninterrupted training did, bit for bit;
a checkpoint file is whole or absent, and one that changed is refused."""

from __future__ import annotations

import shutil
import threading
import weakref
from types import SimpleNamespace

import flair
import pytest
import torch
from flair.embeddings import DocumentRNNEmbeddings, OneHotEmbeddings, TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin

from flair_nbddp import ResumeError
from flair_nbddp.synthetic import sentiment_corpus
from flair_nbddp.worker import checkpoint_files, checkpoints


class _Scores(TrainerPlugin):
    """Each epoch's training loss, dev loss and dev score, as flair records them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list] = {}

    @TrainerPlugin.hook
    def metric_recorded(self, record) -> None:
        name = "/".join(record.name)
        if name in ("train/loss", "dev/loss", "dev/score", "bad_epochs"):
            self.seen.setdefault(name, []).append((record.global_step, record.value))


def _train(kind: str, model_path: str, base, resume=None, keep_at=None, every=None):
    """A 4-epoch training of 6 batches an epoch, from scratch or resumed; its curves, test score and final weights.
    ``keep_at``: copy the checkpoint (and best model) written at that ``(epoch, batch)`` to ``base / "kept"``;
    ``every``: a checkpoint every so many steps too."""
    flair.set_seed(7)
    corpus = sentiment_corpus(n_train=48, n_dev=16, n_test=16, seed=7)
    dictionary = corpus.make_label_dictionary("sentiment", add_unk=False)
    if resume is not None:
        flair.set_seed(99)  # a resumed training's own start draws elsewhere: the checkpoint decides
    if kind == "transformer":  # fine_tune: AdamW and a linear schedule with warm-up
        model = TextClassifier(TransformerDocumentEmbeddings(model_path), "sentiment", label_dictionary=dictionary)
    else:  # train: SGD, annealing on plateau, dropout
        embedding = DocumentRNNEmbeddings([OneHotEmbeddings.from_corpus(corpus)], hidden_size=16, dropout=0.3)
        model = TextClassifier(embedding, "sentiment", label_dictionary=dictionary)

    def saved(epoch, batch, steps, path, sha256):
        if (epoch, batch) == keep_at:
            (base / "kept").mkdir()
            shutil.copy(path, base / "kept" / path.name)
            if (base / "best-model.pt").exists():
                shutil.copy(base / "best-model.pt", base / "kept" / "best-model.pt")

    plugin = checkpoints.Checkpointing(base / checkpoint_files.NAME, 0, lambda value: [value], saved, resume=resume,
                                       every=every)  # fmt: skip
    scores = _Scores()
    trainer = ModelTrainer(model, corpus)
    common = dict(max_epochs=4, mini_batch_size=8, epoch=plugin.start_epoch, plugins=[scores, plugin])
    if kind == "transformer":
        result = trainer.fine_tune(base, learning_rate=5e-3, **common)
    else:
        # "rnn-stored": flair's embeddings_storage_mode="cpu", the evaluations' embeddings kept on the dev sentences
        # and reused (so its dev scores do not worsen: no annealing), and so in the checkpoint
        storage = "cpu" if kind == "rnn-stored" else "none"
        result = trainer.train(base, learning_rate=2.0, patience=0, anneal_factor=0.5, embeddings_storage_mode=storage,
                               **common)  # fmt: skip
    return scores.seen, result["test_score"], [weights.clone() for weights in model.state_dict().values()]


@pytest.mark.parametrize(
    "kind, keep_at", [("rnn", (2, 0)), ("rnn", (1, 2)), ("rnn-stored", (1, 2)), ("transformer", (1, 2))],
    ids=["epoch-end-rnn", "mid-epoch-rnn", "mid-epoch-stored-embeddings", "mid-epoch-transformer"],
)  # (a transformer from an epoch's end: tests/test_resume.py, on 2 ranks)
def test_a_training_resumed_from_a_checkpoint_ends_as_the_uninterrupted_one(kind, keep_at, tiny_model_path, tmp_path):
    # (epoch, batch): the end of epoch 2; 2 batches into epoch 2 (every=4 writes one at steps 4, 8, 16 and 20)
    whole = tmp_path / "whole"
    curves, test_score, weights = _train(kind, tiny_model_path, whole, keep_at=keep_at, every=4)
    resumed_base = tmp_path / "resumed"
    shutil.copytree(whole / "kept", resumed_base)  # as the interrupted training left its directory
    checkpoint = checkpoint_files.read(resumed_base / checkpoint_files.NAME)
    epoch, batch = keep_at
    assert (checkpoint["epoch"], checkpoint["batch"], checkpoint["steps"]) == (epoch, batch, epoch * 6 + batch)
    resumed_curves, resumed_test_score, resumed_weights = _train(kind, tiny_model_path, resumed_base, resume=checkpoint)
    # the epochs after the checkpoint's last whole one (the one it is in included), bit for bit
    assert {name: values[epoch:] for name, values in curves.items()} == resumed_curves
    assert resumed_test_score == test_score
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed_weights, strict=True))
    if kind == "rnn":
        assert any(value > 0 for _, value in curves["bad_epochs"])  # the annealing's state mattered


def test_a_checkpoint_is_whole_or_absent_and_one_that_changed_is_refused(tmp_path):
    path = tmp_path / checkpoint_files.NAME
    sha256 = checkpoint_files.write(path, {"format": checkpoint_files.FORMAT, "epoch": 1})
    assert checkpoint_files.read(path, sha256)["epoch"] == 1
    assert [file.name for file in tmp_path.iterdir()] == [checkpoint_files.NAME]  # no partial file left beside it
    path.write_bytes(path.read_bytes()[:-10])  # cut short, as by a full disk outside the kit
    with pytest.raises(ResumeError, match="sha256 differs"):
        checkpoint_files.read(path, sha256)


def test_a_training_resumed_inside_an_epoch_numbers_its_batches_as_the_uninterrupted_one():
    from flair_nbddp.wire.events import Progress
    from flair_nbddp.worker.counters import TrainingCounters
    from flair_nbddp.worker.flair_compat import StreamingPlugin

    resumed = checkpoints.Checkpointing(checkpoint_files.NAME, 0, lambda value: [value], lambda *_: None,
                                        resume={"epoch": 1, "batch": 5, "positions": [{"batches": 5}]})  # fmt: skip
    assert [resumed.batches_before(epoch) for epoch in (1, 2, 3)] == [0, 5, 0]  # 5 batches into epoch 2
    at_an_end = checkpoints.Checkpointing(checkpoint_files.NAME, 0, lambda value: [value], lambda *_: None,
                                          resume={"epoch": 2, "batch": 0, "positions": None})  # fmt: skip
    assert at_an_end.batches_before(3) == 0

    sent = []
    streaming = StreamingPlugin(type("Sender", (), {"send": lambda self, event: sent.append(event)})(), 0,
                                TrainingCounters(), None)  # fmt: skip
    streaming.batches_before = resumed.batches_before
    streaming.after_training_batch(batch=[1, 2], batch_no=0, total_number_of_batches=3, epoch=2)
    [progress] = sent  # flair's first batch of the 3 left: the epoch's 6th of 8
    assert isinstance(progress, Progress) and (progress.epoch, progress.batch, progress.total_batches) == (2, 6, 8)


def test_the_first_checkpoints_pinned_memory_is_made_ahead_in_another_thread(monkeypatch):
    """On a GPU another thread pins a buffer like each GPU tensor a checkpoint copies, all held at once (a block of
    torch's host cache for each copy) and given back; on the CPU nothing is pinned."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # the optimizer's states exist now
    states = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    assert checkpoints._pin_ahead(states) is None  # CPU tensors: nothing to pin

    made, peak, devices = [], [0], []

    def pinned_like(tensor):
        buffer = torch.empty_like(tensor)
        made.append((tuple(tensor.shape), tensor.dtype, threading.current_thread(), weakref.ref(buffer)))
        peak[0] = max(peak[0], sum(alive() is not None for *_, alive in made))
        return buffer

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda tensor: True))  # every tensor "on a GPU"
    monkeypatch.setattr(checkpoints, "_pinned_like", pinned_like)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    thread = checkpoints._pin_ahead(states)
    assert thread is not None
    thread.join()
    copied = []
    checkpoints._map_tensors(states, lambda tensor: copied.append((tuple(tensor.shape), tensor.dtype)))
    # 4 weights and Adam's 3 states each (on a GPU its `step` stays on the CPU, and is not pinned)
    assert sorted(made_like[:2] for made_like in made) == sorted(copied) and len(copied) == 4 + 4 * 3
    assert {pinning for _, _, pinning, _ in made} == {thread} and thread.name == "flair_nbddp-pinned-memory"
    assert peak[0] == len(made) and all(alive() is None for *_, alive in made)  # held at once, then given back
    assert len(devices) == 1


def test_rank_0_pins_ahead_as_the_first_step_ends_and_again_for_states_the_optimizer_makes_later(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    pinned_for, first_pinning = [], threading.Event()

    def pin_ahead(states):
        pinned_for.append(len(states["optimizer"]["state"]))
        thread = threading.Thread(target=first_pinning.wait)
        thread.start()
        return thread

    monkeypatch.setattr(checkpoints, "_pin_ahead", pin_ahead)
    plugins = [checkpoints.Checkpointing(checkpoint_files.NAME, rank, lambda value: [value], lambda *_: None)
               for rank in (0, 1)]  # fmt: skip
    for plugin in plugins:
        plugin._pluggable = SimpleNamespace(model=model, optimizer=optimizer)

    def batch_ends():
        for plugin in plugins:
            plugin.after_training_batch(batch_no=0, total_number_of_batches=9)

    batch_ends()  # a step fp16's gradient scaler skipped: no optimizer states yet, the weights are pinned
    assert pinned_for == [0]
    model[0](torch.ones(1, 3)).sum().backward()  # a step of the first layer only
    optimizer.step()
    batch_ends()  # the optimizer's states now, while the first thread still pins: the next batch
    assert pinned_for == [0]
    first_pinning.set()
    plugins[0]._pinning.join()
    batch_ends()
    batch_ends()  # nothing new
    assert pinned_for == [0, 2]  # rank 0 only, the second time with the states of the first layer's 2 parameters
    plugins[0].finish_writing()  # a checkpoint waits for the pinning first
    assert plugins[0]._pinning is None and plugins[1]._pinning is None
    for plugin in plugins:
        plugin._written_for = (1, 0)  # the first checkpoint, which pinned what it copied
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    batch_ends()  # the second layer's states are new, and the next checkpoint pins them as it copies them
    assert len(optimizer.state) == 4 and pinned_for == [0, 2]


def test_a_plugins_state_is_named_alike_on_every_rank_though_loggers_attach_on_rank_0_only():
    """flair attaches a logger the user passed on rank 0 only: the scheduler after it must keep its name on rank 1,
    or rank 1 would resume without its schedule (its learning rate then differing from rank 0's)."""
    from flair.trainers.plugins import LinearSchedulerPlugin, TensorboardLogger

    def names(plugins: list) -> list[str]:  # the trainer's plugins but the checkpointing one
        return [name for name, _ in checkpoints.Checkpointing._plugins(SimpleNamespace(trainer=SimpleNamespace(
            plugins=plugins)))]  # fmt: skip

    logger = TensorboardLogger.__new__(TensorboardLogger)  # its writer is not wanted here
    schedulers = [LinearSchedulerPlugin(warmup_fraction=0.1), LinearSchedulerPlugin(warmup_fraction=0.2)]
    assert names([logger, *schedulers]) == ["TensorboardLogger:0", "LinearSchedulerPlugin:0", "LinearSchedulerPlugin:1"]
    assert names(schedulers) == ["LinearSchedulerPlugin:0", "LinearSchedulerPlugin:1"]
