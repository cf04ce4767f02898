"""The flair canary: every flair name the kit patches, wraps, calls, subclasses or reads is where the kit expects it.

The kit bends flair 0.15.x in its workers (``flair_compat.py``, ``distributed_eval.py``, ``lazy_corpus.py``,
``fast_inputs.py``, ``direct_embeddings.py``, ``token_gathers.py``, ``clean_tokens.py``, ``no_waits.py``,
``precision.py``, ``compiled.py``, ``rank_zero_loggers.py``) and
reads its data structures attribute by attribute (``codec.py``). A flair release that moves or renames one of
these fails here in seconds, naming it, instead of deep inside a multi-process test. Fast tier: nothing starts.
"""

from __future__ import annotations

import importlib
import inspect
import logging

import pytest

# flair names the kit assigns to, wraps or calls, by dotted path
ATTRIBUTES = [
    "flair.device", "flair.set_seed",
    "flair.distributed_utils._ddp_setup", "flair.distributed_utils.torch", "flair.distributed_utils.launch_distributed",
    "flair.trainers.ModelTrainer", "flair.trainers.trainer.DistributedDataParallel",
    "flair.trainers.ModelTrainer._scale_gradients",
    "flair.trainers.trainer.store_embeddings", "flair.training_utils.store_embeddings",
    "flair.trainers.plugins.TrainerPlugin.hook", "flair.trainers.plugins.TrainerPlugin.trainer",
    "flair.trainers.plugins.TrainerPlugin.model", "flair.trainers.plugins.base.TrainingInterrupt",
    "flair.trainers.plugins.metric_records.MetricRecord.is_histogram",
    "flair.trainers.plugins.metric_records.MetricRecord.is_scalar_list",
    "flair.trainers.plugins.metric_records.MetricRecord.joined_name",
    "flair.nn.Model._get_state_dict", "flair.nn.Model.load", "flair.nn.Model.save",
    "flair.models.TextRegressor.forward_labels_and_loss",
    "flair.datasets.DataLoader", "flair.datasets.FlairDatapointDataset",
    "flair.data.Corpus.make_label_dictionary", "flair.data.FlairDataset.is_in_memory", "flair.data.ConcatFlairDataset",
    "flair.data.Sentence.to_tokenized_string", "flair.data.Sentence.to_original_text", "flair.data.Sentence.get_spans",
    "flair.data.DataPoint.add_label", "flair.data.DataPoint.remove_labels", "flair.data.DataPoint.get_labels",
    "flair.data.Span.unlabeled_identifier", "flair.data.Relation.unlabeled_identifier",
    # fast_inputs: the private method that calls the tokenizer, and what decides whether the kit can serve it
    "flair.embeddings.transformer.TransformerBaseEmbeddings._TransformerBaseEmbeddings__build_transformer_model_inputs",
    "flair.embeddings.transformer.TransformerBaseEmbeddings.prepare_tensors",
    # direct_embeddings, token_gathers, clean_tokens: the tagger's gathering and what it reads, the embeddings'
    # forward pieces and module-level loops, the sentence methods whose token walks are skipped
    "flair.models.SequenceTagger._prepare_tensors", "flair.models.SequenceTagger._make_padded_tensor_for_batch",
    "flair.embeddings.transformer.TransformerBaseEmbeddings._add_embeddings_internal",
    "flair.embeddings.transformer.TransformerBaseEmbeddings._forward_tensors",
    "flair.embeddings.base.TokenEmbeddings._everything_embedded",
    "flair.data.Sentence.clear_embeddings", "flair.data.Sentence.remove_labels", "flair.data.Sentence._add_token",
    "flair.data.DataPoint.clear_embeddings", "flair.data.Token.set_embedding",
    # no_waits: the layer selection, the label building and transformers' mask check answered from the host
    "flair.embeddings.transformer.TransformerEmbeddings.forward", "flair.nn.DefaultClassifier._prepare_label_tensor",
    "flair.models.SequenceTagger._prepare_label_tensor",
    "transformers.models.distilbert.modeling_distilbert._prepare_4d_attention_mask_for_sdpa",
    "transformers.modeling_attn_mask_utils.AttentionMaskConverter._expand_mask",
    # precision: what flair's use_amp path creates (the kit sets the autocast type through torch's public setters)
    "torch.cuda.amp.GradScaler",
    # compiled: torch's compiler, as the kit turns it on and off around a training (the transformer it compiles is
    # each TransformerEmbeddings' ``model``, checked in tests/test_compiled.py)
    "torch.nn.Module.compile", "torch._dynamo.reset", "torch._dynamo.list_backends",
    # rank_zero_loggers: flair's test for the rank its loggers attach to, the two loggers bent on the other ranks
    # (TensorboardLogger's constructor; the file-handler function as LogFilePlugin's module names it) and the ones
    # left as they are
    "flair.distributed_utils.is_main_process", "flair.trainers.plugins.base.BasePlugin.attach_to",
    "flair.trainers.plugins.base.BasePlugin.attach_to_all_processes", "flair.trainers.plugins.base.Pluggable.plugins",
    "flair.trainers.plugins.loggers.tensorboard.TensorboardLogger.__init__",
    "flair.trainers.plugins.loggers.log_file.add_file_handler",
    "flair.trainers.plugins.loggers.log_file.LogFilePlugin.close_file_handler",
    "flair.trainers.plugins.loggers.wandb.WandbLogger",
    "flair.trainers.plugins.loggers.clearml_logger.ClearmlLoggerPlugin",
    "flair.trainers.plugins.loggers.loss_file.LossFilePlugin",
    "flair.trainers.plugins.loggers.metric_history.MetricHistoryPlugin",
]  # fmt: skip

# functions the kit calls or wraps, with the parameters it binds or passes by name
PARAMETERS = {
    "flair.trainers.ModelTrainer.train_custom": ("base_path", "max_epochs", "multi_gpu", "plugins", "save_final_model",
                                                 "use_amp", "embeddings_storage_mode"),
    "flair.embeddings.transformer.TransformerBaseEmbeddings._TransformerBaseEmbeddings__build_transformer_model_inputs": (
        "sentences", "offsets", "sentence_lengths", "flair_tokens", "device"),
    "flair.trainers.ModelTrainer.train": ("multi_gpu", "plugins", "embeddings_storage_mode"),
    "flair.trainers.ModelTrainer.fine_tune": ("max_epochs", "mini_batch_size", "mini_batch_chunk_size", "learning_rate",
                                              "multi_gpu", "plugins"),
    "flair.training_utils.store_embeddings": ("data_points", "storage_mode", "dynamic_embeddings"),
    "flair.trainers.ModelTrainer._scale_gradients": ("constant",),
    "flair.nn.Classifier.evaluate": ("data_points", "gold_label_type", "out_path", "embedding_storage_mode",
                                     "mini_batch_size", "return_loss"),
    "flair.models.TextRegressor.evaluate": ("data_points", "gold_label_type", "out_path", "mini_batch_size"),
    "flair.nn.DefaultClassifier.predict": ("embedding_storage_mode", "mini_batch_size", "label_name", "return_loss"),
    "flair.models.SequenceTagger.predict": ("embedding_storage_mode", "mini_batch_size", "label_name", "return_loss"),
    "flair.data.Corpus.__init__": ("train", "dev", "test", "name", "sample_missing_splits"),
    "flair.data.Sentence.__init__": ("text", "use_tokenizer"),
    "flair.data.Label.__init__": ("data_point", "value", "score"),
    "flair.embeddings.transformer.TransformerEmbeddings.forward": ("input_ids",),
    "transformers.modeling_attn_mask_utils._prepare_4d_attention_mask_for_sdpa": ("mask", "dtype", "tgt_len"),
    "transformers.modeling_attn_mask_utils.AttentionMaskConverter._expand_mask": ("mask", "dtype", "tgt_len"),
    "flair.trainers.plugins.loggers.tensorboard.TensorboardLogger.__init__": ("log_dir", "comment", "tracked_metrics"),
    "flair.trainers.plugins.loggers.log_file.add_file_handler": ("log", "output_file"),
    "flair.embeddings.transformer.combine_strided_tensors": ("hidden_states", "overflow_to_sample_mapping",
                                                            "half_stride", "max_length", "default_value"),
    "flair.embeddings.transformer.fill_masked_elements": ("all_token_embeddings", "sentence_hidden_states", "mask",
                                                         "word_ids", "lengths"),
}  # fmt: skip


def resolve(path: str):
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = inspect.getattr_static(found, name) if isinstance(found, type) else getattr(found, name)
        return found
    raise ImportError(path)


@pytest.mark.parametrize("path", ATTRIBUTES)
def test_flair_has_what_the_kit_uses(path):
    try:
        resolve(path)
    except (AttributeError, ImportError) as missing:
        pytest.fail(f"flair no longer has {path} ({missing!r}), which flair_nbddp relies on")


@pytest.mark.parametrize("path", PARAMETERS)
def test_flairs_functions_take_the_parameters_the_kit_names(path):
    parameters = inspect.signature(resolve(path)).parameters
    missing = [name for name in PARAMETERS[path] if name not in parameters]
    assert not missing, f"{path} no longer takes {missing}, which flair_nbddp passes or binds by name"


def test_every_hook_of_the_kits_plugin_is_an_event_flairs_trainer_dispatches():
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin

    from flair_nbddp.worker.flair_compat import StreamingPlugin

    hooks = {event for method in vars(StreamingPlugin).values() for event in getattr(method, "_plugin_hook_events", ())}
    assert len(hooks) >= 8 and hooks <= ModelTrainer.valid_events, sorted(hooks - ModelTrainer.valid_events)
    assert TrainerPlugin.attach_to_all_processes  # the per-batch stop agreement needs the plugin on every rank


def test_flairs_model_classes_are_where_shared_evaluation_wraps_them():
    from flair.models import SequenceTagger, TextClassifier, TextRegressor
    from flair.nn import Classifier, Model

    assert issubclass(TextClassifier, Classifier) and issubclass(SequenceTagger, Classifier)
    assert "evaluate" not in vars(TextClassifier) and "evaluate" not in vars(SequenceTagger)  # Classifier's is theirs
    assert "evaluate" in vars(TextRegressor) and not issubclass(TextRegressor, Classifier)
    assert issubclass(Classifier, Model) and "evaluate" in vars(Classifier)


def test_flairs_data_points_hold_the_attributes_the_codec_reads_and_writes():
    from flair.data import (
        Corpus,
        DataPair,
        DataTriple,
        Label,
        Relation,
        Sentence,
        Token,
    )
    from flair.datasets import FlairDatapointDataset

    sentence = Sentence("Anna met Emil in Oslo .")
    span = sentence[0:1]
    span.add_label("ner", "PER")
    relation = Relation(span, sentence[4:5])
    label = sentence.get_labels("ner")[0]
    expected = {
        sentence: ("tokens", "_known_spans", "_previous_sentence", "_next_sentence", "language_code",
                   "_start_position", "tokenized", "is_document_boundary", "_has_context", "_position_in_dataset",
                   "annotation_layers", "_embeddings", "_metadata"),
        sentence[0]: ("form", "whitespace_after", "_start_position", "_internal_index", "head_id", "tags_proba_dist",
                      "sentence", "idx", "text"),
        span: ("tokens", "initialized", "sentence"),
        relation: ("first", "second"),
        label: ("data_point", "value", "score", "metadata"),
        DataPair(Sentence("a"), Sentence("b")): ("first", "second", "concatenated_data"),
        DataTriple(Sentence("a"), Sentence("b"), Sentence("c")): ("first", "second", "third"),
        FlairDatapointDataset([sentence]): ("datapoints",),
        Corpus(FlairDatapointDataset([sentence]), sample_missing_splits=False): ("_test", "train", "dev", "test"),
    }  # fmt: skip
    missing = [f"{type(obj).__name__}.{name}" for obj, names in expected.items() for name in names
               if not hasattr(obj, name)]  # fmt: skip
    assert not missing, f"flair's data points lost {missing}, which flair_nbddp's codec reads or writes"
    assert isinstance(sentence[0], Token) and isinstance(label, Label)


def test_flairs_logger_is_the_one_the_kit_quiets_and_restores():
    import flair  # noqa: F401 - sets the logger up

    logger = logging.getLogger("flair")
    assert logger.handlers and not logger.propagate


def test_flairs_loggers_attach_to_the_main_process_only():
    """What lets the kit build them without side effects on the other ranks: their hooks never run there."""
    from flair.trainers.plugins.loggers.clearml_logger import ClearmlLoggerPlugin
    from flair.trainers.plugins.loggers.log_file import LogFilePlugin
    from flair.trainers.plugins.loggers.loss_file import LossFilePlugin
    from flair.trainers.plugins.loggers.metric_history import MetricHistoryPlugin
    from flair.trainers.plugins.loggers.tensorboard import TensorboardLogger
    from flair.trainers.plugins.loggers.wandb import WandbLogger

    loggers = (TensorboardLogger, WandbLogger, ClearmlLoggerPlugin, LogFilePlugin, LossFilePlugin, MetricHistoryPlugin)
    on_every_rank = [cls.__name__ for cls in loggers
                     if inspect.getattr_static(cls, "attach_to_all_processes").fget(None)]  # fmt: skip
    assert not on_every_rank, f"flair attaches {on_every_rank} on every rank now: their hooks would log from each"
    assert "add_file_handler(" in inspect.getsource(LogFilePlugin.__init__)  # the name rank_zero_loggers bends
