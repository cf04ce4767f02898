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


def train_compared(corpus, model_path: str, base_path: str, kind: str):
    """Train on ``corpus`` as the run shipped it (lazy or built) and say which it was: ``kind`` is "train" (a
    classifier on frozen transformer embeddings, stored on the sentences between epochs), "fine_tune" (the
    transformer fine-tuned: nothing stored) or "tagger" (a SequenceTagger on span labels)."""
    from flair.embeddings import OneHotEmbeddings, TransformerDocumentEmbeddings
    from flair.models import SequenceTagger, TextClassifier
    from flair.trainers import ModelTrainer

    options = dict(max_epochs=3, mini_batch_size=8, multi_gpu=True)
    if kind == "tagger":
        tagger = SequenceTagger(
            hidden_size=16, embeddings=OneHotEmbeddings.from_corpus(corpus, embedding_length=16, min_freq=1),
            tag_dictionary=corpus.make_label_dictionary("ner"), tag_type="ner", use_crf=False,
        )  # fmt: skip
        scores = ModelTrainer(tagger, corpus).train(base_path, learning_rate=0.1, **options)
    else:
        classifier = TextClassifier(
            TransformerDocumentEmbeddings(model_path, fine_tune=kind == "fine_tune"),
            label_type="sentiment",
            label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
        )
        trainer = ModelTrainer(classifier, corpus)
        if kind == "fine_tune":
            scores = trainer.fine_tune(base_path, learning_rate=5e-3, **options)
        else:
            scores = trainer.train(base_path, learning_rate=0.1, embeddings_storage_mode="cpu", **options)
    points = corpus.train.datapoints if hasattr(corpus.train, "datapoints") else corpus.train.sentences
    lazy = type(points).__name__ == "LazyDataPoints"
    return {"test_score": scores["test_score"], "lazy": lazy, "kept": len(points._source.kept["s"]) if lazy else None}


def peak_memory_after_reading(corpus) -> dict:
    """Read every sentence of ``corpus`` twice, as two epochs do, then report this process's peak resident memory
    (the kernel's high-water mark of this process image: ``ru_maxrss`` would include the parent's at the fork)."""
    from pathlib import Path

    tokens = 0
    for _ in range(2):
        for sentence in corpus.train:
            tokens += len(sentence)
    labels = corpus.make_label_dictionary("sentiment", add_unk=False).get_items()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"peak_bytes": int(status["VmHWM"].split()[0]) * 1024, "tokens": tokens, "labels": labels}


def read_and_change(corpus) -> dict:
    """What a job sees of a corpus put on the pool, and a change it makes that no later job may see."""
    first = corpus.train[0]
    seen = first.get_label("sentiment").value
    first.set_label("sentiment", "CHANGED")
    return {"first": seen, "size": len(corpus.train), "text": str(first)}


def nap(seconds: float) -> float:
    """Say so on rank 0's output once every rank is in the function, then sleep: a run to interrupt or kill."""
    import time

    print("napping", flush=True)
    time.sleep(seconds)
    return seconds


def fine_tune_counting_tokenizations(corpus, model_path: str, base_path: str, kind: str, ahead: bool = False) -> dict:
    """Fine-tune for 3 epochs (a classifier on document embeddings, or a tagger on word embeddings, both
    transformer) and count the sentences the ranks' tokenizers encoded (the kit's kept inputs, when on): rank 0's and
    every rank's, with the next batch tokenized in the input thread if ``ahead`` (as on GPUs); and rank 0's tagger
    batches that took their embeddings' tensor (``direct_embeddings``)."""
    import torch.distributed as dist
    from flair.embeddings import (
        TransformerDocumentEmbeddings,
        TransformerWordEmbeddings,
    )
    from flair.models import SequenceTagger, TextClassifier
    from flair.trainers import ModelTrainer

    from flair_nbddp.worker import direct_embeddings, fast_inputs, input_thread

    encoded, direct = [], []
    encode, token_tensor = fast_inputs.encode, direct_embeddings.token_tensor

    def counting(tokenizer, store, keys, *args):
        encoded.extend(keys)
        return encode(tokenizer, store, keys, *args)

    def counting_direct(tagger, sentences):
        tensors = token_tensor(tagger, sentences)
        direct.extend([] if tensors is None else [len(sentences)])
        return tensors

    fast_inputs.encode = input_thread._ENCODE = counting
    direct_embeddings.token_tensor = counting_direct
    input_thread._AHEAD = ahead and fast_inputs._JOB.enabled
    try:
        if kind == "tagger":
            model = SequenceTagger(TransformerWordEmbeddings(model_path, subtoken_pooling="mean"),
                                   corpus.make_label_dictionary("ner"), "ner", use_crf=False, use_rnn=False)  # fmt: skip
        else:
            model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                                   label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
        scores = ModelTrainer(model, corpus).fine_tune(base_path, max_epochs=3, mini_batch_size=8,
                                                       learning_rate=5e-3, multi_gpu=True)  # fmt: skip
    finally:
        fast_inputs.encode = input_thread._ENCODE = encode
        direct_embeddings.token_tensor = token_tensor
    everywhere: list = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, encoded)
    every_rank = [name for names in everywhere for name in names]
    return {"test_score": scores["test_score"], "encoded": len(encoded), "distinct": len(set(encoded)),
            "encoded_by_all": len(every_rank), "distinct_by_all": len(set(every_rank)),
            "direct_batches": len(direct)}  # fmt: skip


def fine_tune_noting_dtypes(corpus, model_path: str, base_path: str) -> dict:
    """Fine-tune a classifier for 2 epochs; report the autocast type the transformer ran under in training and in
    evaluation ("off" without autocast), the weights' types and the test score."""
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    seen = {"train": set(), "eval": set()}
    import flair
    import torch

    def note(module, inputs, output):
        device = flair.device.type
        autocast = str(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else "off"
        seen["train" if module.training else "eval"].add(autocast)

    model.embeddings.model.register_forward_hook(note)
    scores = ModelTrainer(model, corpus).fine_tune(base_path, max_epochs=2, mini_batch_size=8, learning_rate=5e-3,
                                                   multi_gpu=True)  # fmt: skip
    weights = {str(parameter.dtype) for parameter in model.parameters()}
    return {"test_score": scores["test_score"], "seen": {k: sorted(v) for k, v in seen.items()}, "weights": sorted(weights)}


def _fail_once(marker: str, how: str):
    """A flair plugin: while the file ``marker`` exists, rank 1 removes it and fails at epoch 3's third batch, after
    the end of epoch 2 was checkpointed. ``how``: ``"raise"`` an error; ``"kill"`` itself (SIGKILL, as by the
    kernel's out-of-memory killer); ``"pause"``: write the pid of the process that started it (on a cluster, its
    Dask worker) to ``marker + ".paused"`` and wait for its node to be lost."""
    import os
    import signal
    import time

    import torch.distributed as dist
    from flair.trainers.plugins import TrainerPlugin

    class FailOnce(TrainerPlugin):
        @TrainerPlugin.hook
        def before_training_batch(self, epoch: int, batch_no: int, **_):
            if epoch == 3 and batch_no == 2 and dist.get_rank() == 1 and os.path.exists(marker):
                os.remove(marker)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if how == "pause":
                    with open(marker + ".paused", "w") as file:
                        file.write(str(os.getppid()))
                    time.sleep(600)
                raise RuntimeError("rank 1 failed in epoch 3")

    return FailOnce()


def fine_tune_failing_once(corpus, model_path: str, base_path: str, marker: str, how: str = "raise") -> dict:
    """Fine-tune a tiny-transformer classifier for 4 epochs, rank 1 failing once in epoch 3 (:func:`_fail_once`)."""
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    scores = ModelTrainer(model, corpus).fine_tune(base_path, max_epochs=4, mini_batch_size=4, learning_rate=5e-3,
                                                   multi_gpu=True, plugins=[_fail_once(marker, how)])  # fmt: skip
    return {"test_score": scores["test_score"]}


def train_ner_failing_once(corpus, base_path: str, marker: str) -> dict:
    """Train a one-hot SequenceTagger with flair's ``train`` for 4 epochs (its embeddings, trainable, stored on the
    evaluated sentences: ``embeddings_storage_mode="cpu"``), rank 1 failing once in epoch 3 (:func:`_fail_once`)."""
    from flair.embeddings import OneHotEmbeddings
    from flair.models import SequenceTagger
    from flair.trainers import ModelTrainer

    tagger = SequenceTagger(hidden_size=16, embeddings=OneHotEmbeddings.from_corpus(corpus, embedding_length=16),
                            tag_dictionary=corpus.make_label_dictionary("ner"), tag_type="ner", use_crf=False)  # fmt: skip
    scores = ModelTrainer(tagger, corpus).train(base_path, max_epochs=4, mini_batch_size=4, learning_rate=0.1,
                                                multi_gpu=True, plugins=[_fail_once(marker, "raise")])  # fmt: skip
    return {"test_score": scores["test_score"]}


def fine_tune_running_out_of_memory(corpus, model_path: str, base_path: str) -> dict:
    """Fine-tune a tiny-transformer classifier; rank 1 runs out of memory (as torch reports it on a GPU) in the
    second batch of epoch 1, while rank 0 goes on into the next collective."""
    import torch
    import torch.distributed as dist
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin

    class OutOfMemory(TrainerPlugin):
        @TrainerPlugin.hook
        def before_training_optimizer_step(self, epoch: int, batch_no: int, **_):  # after the batch's backward pass
            if epoch == 1 and batch_no == 1 and dist.get_rank() == 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    ModelTrainer(model, corpus).fine_tune(base_path, max_epochs=2, mini_batch_size=4, mini_batch_chunk_size=2,
                                          learning_rate=5e-3, multi_gpu=True, plugins=[OutOfMemory()])  # fmt: skip
    return {}


def fail_at_once() -> None:
    """Rank 1 fails as the job begins, every time."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails every time")


def fine_tune_out_of_memory_in_chunks_over_1(corpus, model_path: str, base_path: str) -> dict:
    """Fine-tune a tiny-transformer classifier for 2 epochs in chunks of 4 (batches of 4); rank 1 runs out of
    memory (as torch reports it on a GPU) in epoch 2 while flair computes its batches in chunks of more than 1."""
    import torch
    import torch.distributed as dist
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin

    class OutOfMemory(TrainerPlugin):
        chunk = None

        @TrainerPlugin.hook
        def after_setup(self, mini_batch_chunk_size=None, **_):
            self.chunk = mini_batch_chunk_size

        @TrainerPlugin.hook
        def before_training_optimizer_step(self, epoch: int, batch_no: int, **_):
            if epoch == 2 and batch_no == 1 and dist.get_rank() == 1 and self.chunk > 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    scores = ModelTrainer(model, corpus).fine_tune(base_path, max_epochs=2, mini_batch_size=4, mini_batch_chunk_size=4,
                                                   learning_rate=5e-3, multi_gpu=True, plugins=[OutOfMemory()])  # fmt: skip
    return {"test_score": scores["test_score"]}


def train_classifier_with(corpus, base_path: str, lr: float, epochs: int = 3, hidden: int = 8) -> dict:
    """A sweep's trial: a small RNN TextClassifier on one-hot words, trained with learning rate ``lr``, in a folder of
    its own under ``base_path`` (two trials side by side may draw the same ``lr``; flair rewrites its model files in
    its base path); its model comes back."""
    import tempfile

    from flair.embeddings import DocumentRNNEmbeddings, OneHotEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    words = OneHotEmbeddings.from_corpus(corpus, embedding_length=16, min_freq=1)
    model = TextClassifier(
        DocumentRNNEmbeddings([words], hidden_size=hidden), label_type="sentiment",
        label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
    )
    base = tempfile.mkdtemp(prefix=f"lr-{lr:.6g}-", dir=base_path)
    scores = ModelTrainer(model, corpus).train(base, max_epochs=epochs, mini_batch_size=16, learning_rate=lr,
                                               multi_gpu=True)  # fmt: skip
    return {"test_score": scores["test_score"], "model": model}


def fails_when_told(train, corpus, base_path: str, lr: float, fail: bool = False, epochs: int = 4) -> dict:
    """A sweep's trial: ``train(corpus, base_path, lr=lr)`` for ``epochs``, or a failure when ``fail``."""
    if fail:
        raise ValueError("told to fail")
    return train(corpus, base_path, lr=lr, epochs=epochs)


def fine_tune_counting_compiled_graphs(corpus, model_path: str, base_path: str) -> dict:
    """Fine-tune a classifier for 2 epochs; report the graphs torch.compile made while it trained, whether the
    transformer is still compiled afterwards, the test score, and whether the saved model's state dict has the trained
    model's keys."""
    import torch
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers import ModelTrainer

    model = TextClassifier(TransformerDocumentEmbeddings(model_path), label_type="sentiment",
                           label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False))  # fmt: skip
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    scores = ModelTrainer(model, corpus).fine_tune(base_path, max_epochs=2, mini_batch_size=8, learning_rate=5e-3,
                                                   multi_gpu=True)  # fmt: skip
    saved = TextClassifier.load(f"{base_path}/final-model.pt")
    return {
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        "still_compiled": model.embeddings.model._compiled_call_impl is not None,
        "test_score": scores["test_score"],
        "same_keys": sorted(saved.state_dict()) == sorted(model.state_dict()),
    }
