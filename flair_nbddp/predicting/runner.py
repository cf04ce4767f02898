""":func:`predict`: a trained flair model run over many inputs on every device, its labels back in the notebook in
order.

The call checks everything it can before a worker starts (the model, the inputs, the label type, the output's
folder), cuts the inputs into chunks (:mod:`.dealing`), and launches :func:`flair_nbddp.worker.predict_rank.
predict_share` on the ranks as an ordinary run (devices, pools, clusters, timeouts, precision and the run ledger as
for :func:`flair_nbddp.launch`; the ledger records it with origin ``"predict"``). While it runs, the cell's thread
takes the chunks the ranks send back (:mod:`.collector`) and drives the live view: a progress bar with texts done,
texts per second, the time left and Stop. The view is chosen by the notebook package, above this one
(:func:`show_predictions_with`); elsewhere nothing is shown.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from ..engine.run import Run
from ..engine.worker_source import WorkerSource, source_for
from ..errors import (
    ConfigurationError,
    LedgerWarning,
    PoolRefError,
    PredictionsWriteError,
    RunStateError,
    UnknownOptionError,
)
from ..ledger.provenance import Provenance
from ..ledger.store import Ledger
from ..options import RunOptions, documented
from ..wire.pool_ref import PoolRef, kept
from ..wire.predict_inputs import Inputs, TextFile, read_inputs
from ..worker.predict_rank import Settings, predict_share
from .collector import Collector, open_output
from .dealing import chunk_size, deal, window_size
from .result import Predictions

TAKE_SECONDS = 0.05  # how often the chunks the ranks sent are put in place

_PREDICT_DECIDES = {  # run options predict() takes none of, and why
    "output": "predict()'s output= is the JSON Lines file its predictions go to",
    "max_restarts": "predict() does not restart; a stopped call says how far it got (predictions.done): "
    "predict the rest with data[predictions.done:]",
    "restart_timeout": "predict() does not restart",
    "on_oom": "predict() does not restart: pass a smaller mini_batch_size",
    "resume": "predict() has no checkpoints: predict the rest with data[predictions.done:]",
    "resume_force": "predict() has no checkpoints",
    "checkpoint_every": "predict() has no checkpoints",
    "compile_model": "it compiles a training's transformers; predict() runs flair's own predict",
    "distributed_eval": "it shares out a training's evaluations; predict() shares out everything already",
}


class PredictCall:
    """A predict call: its run, its progress as the view shows it, ``stop()``, and ``wait()`` for its outcome.

    :func:`predict` returns one at once with ``wait=False`` (the cell is free, so the view's Stop button works);
    otherwise it waits for it itself.

    Example::

        call = predict(model, "texts.txt", output="tags.jsonl", wait=False)
        call.received, call.texts_per_second          # while it runs
        predictions = call.wait()
    """

    def __init__(self, run: Run, inputs: Inputs, chunks: list, label_name: str, path: Path | None,
                 view: PredictView) -> None:  # fmt: skip
        self.run, self.inputs, self.chunks, self.label_name, self.path = run, inputs, chunks, label_name, path
        self.view = view
        self.total = len(inputs)
        self.received = 0  # inputs whose predictions came back, in any order
        self.first_at: float | None = None  # when the first chunk came back
        self.first_count = 0
        self.status = "starting"
        self.background = False
        self._collector: Collector | None = None
        self._taker: threading.Thread | None = None  # puts the chunks in place as they come
        self._take_error: BaseException | None = None
        self._outcome: Predictions | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None  # waits for the run, with wait=False

    @property
    def texts_per_second(self) -> float:
        """Inputs predicted a second since the first chunk came back (0 until the second one)."""
        if self.first_at is None or self.received <= self.first_count:
            return 0.0
        return (self.received - self.first_count) / max(time.time() - self.first_at, 1e-9)

    @property
    def eta(self) -> float | None:
        """Seconds left at the current pace (None until it is known)."""
        rate = self.texts_per_second
        return (self.total - self.received) / rate if rate else None

    def stop(self) -> None:
        """Stop every rank after the chunk in hand; the call returns what is done."""
        self.run.stop()

    def wait(self) -> Predictions:
        """Block until the call ends and return its :class:`Predictions` (raises the run's error if a rank failed).

        Raises:
            RunStateError: the call was not started.
        """
        if self._thread is not None:
            self._thread.join()
            if self._error is not None:
                raise self._error
        if self._outcome is None:
            raise RunStateError("this predict call was not started")
        return self._outcome

    def _start(self, background: bool) -> None:
        """Start the run, then take its chunks on a thread of their own; the view shows it; in the background, a
        thread waits for it too."""
        try:
            self.run.start()
        except BaseException:
            self._close_inputs()
            raise
        try:
            try:  # after the start: a refusal empties no file
                handle = open_output(self.path) if self.path is not None else None
            except OSError as error:
                raise PredictionsWriteError(f"cannot write {self.path}: {error}. Write elsewhere") from error
            self._collector = Collector(self.inputs, self.chunks, self.label_name,
                                        keep=not self.inputs.in_place and handle is None, output=handle)  # fmt: skip
            taker = threading.Thread(target=self._take, name="flair_nbddp-predictions", daemon=True)
            taker.start()
            self._taker = taker
            self.background = background
            self.view.start(self)
        except BaseException:  # an interrupt, a file that cannot be written, a view that cannot show
            self.run.kill()
            self._close()
            raise
        if background:
            self._thread = threading.Thread(target=self._watch_in_background, name="flair_nbddp-predict", daemon=True)
            self._thread.start()
        else:
            self._outcome = self._watch()

    def _watch_in_background(self) -> None:
        try:
            self._outcome = self._watch()
        except BaseException as error:  # noqa: BLE001 - raised by wait(), on the thread that asks
            self._error = error

    def _take(self) -> None:
        """The chunks put in place as they come, until the run has ended and every chunk is taken. On a thread of its
        own, which an interrupt never reaches: a row is written and counted in ``done`` together, or not at all."""
        try:
            while True:
                # read before taking: every chunk came in before the run ended (each rank's chunks precede its end
                # on its channel), so what is taken next is the last of them; read after, a run that ends and
                # concludes in between would leave its last chunks untaken
                over = self.run.ended or not self.run.active  # ended, or ended and concluded already (a kill)
                for event in self.run.state.take_predicted():
                    self._collector.take(event.chunk, event.records)  # type: ignore[union-attr]
                    if self.first_at is None:
                        self.first_at, self.first_count = time.time(), len(event.records)
                    self.received += len(event.records)
                if over:
                    return
                time.sleep(TAKE_SECONDS)
        except BaseException as error:  # noqa: BLE001 - a file that cannot be written: the run ends, the call raises it
            self._take_error = self._write_error(error) if isinstance(error, OSError) else error
            self.run.kill()

    def _write_error(self, error: OSError) -> PredictionsWriteError:
        done = self._collector.done if self._collector is not None else 0
        return PredictionsWriteError(
            f"writing {self.path} failed ({error}); it holds the first {done:,} rows, in input order. Free space, or "
            f"write elsewhere and predict the rest with data[{done}:]"
        )

    def _tick(self) -> None:
        self.status = self.run.state.status
        self.view.poll(self)

    def _watch(self) -> Predictions:
        """Wait for the run while the view shows it; the outcome, shown in the view."""
        try:
            result = self.run.wait(on_tick=self._tick)
            self._join_taker()
        except BaseException as error:
            if self.run.active:  # the view failed, or an interrupt came before the run was watched: end it here
                self.run.kill()
            self.view.finish(self, None, error)
            raise
        finally:
            self._close()
        self.status = result.status
        error = self._take_error or result.error
        if error is not None:
            self.view.finish(self, None, error)
            raise error
        done = self._collector.done  # type: ignore[union-attr]
        sentences = (
            [self.inputs[index] for index in range(done)] if self.inputs.in_place  # type: ignore[index]
            else self._collector.kept or []  # type: ignore[union-attr]
        )  # fmt: skip
        predictions = Predictions(
            status="finished" if done == self.total else "stopped", done=done, total=self.total,
            label_name=self.label_name, sentences=sentences, output=self.path, elapsed=result.elapsed, run=result,
        )  # fmt: skip
        _ledger_scores(self.run, predictions)
        self.view.finish(self, predictions)
        return predictions

    def _join_taker(self) -> None:
        """Wait until every chunk is in place; the run has ended, so an interrupt now cannot cost it anything."""
        while self._taker is not None and self._taker.is_alive():
            try:
                self._taker.join()
            except KeyboardInterrupt:
                continue

    def _close(self) -> None:
        """Once the chunks are all taken (the run has ended): the output file closed, the input file let go."""
        try:
            self._join_taker()
            if self._collector is not None and self._collector.output is not None:
                try:
                    self._collector.output.close()  # what is still buffered is written now
                except OSError as error:
                    self._take_error = self._take_error or self._write_error(error)
        finally:
            self._close_inputs()

    def _close_inputs(self) -> None:
        if isinstance(self.inputs, TextFile):
            self.inputs.close()


class PredictView:
    """What :func:`predict` drives: ``start`` once the ranks are starting, ``poll`` about ten times a second,
    ``finish`` with the outcome (``predictions`` None if the call raised)."""

    def start(self, call: PredictCall) -> None:
        """Show the view; called on the cell's thread."""

    def poll(self, call: PredictCall) -> None:
        """Update it from ``call``."""

    def finish(self, call: PredictCall, predictions: Predictions | None, error: BaseException | None = None) -> None:
        """Show the outcome."""


PredictViewChooser = Callable[["bool | None"], PredictView]
_chooser: PredictViewChooser = lambda dashboard: PredictView()  # noqa: E731 - replaced when the notebook package loads


def show_predictions_with(chooser: PredictViewChooser) -> None:
    """Make ``chooser(dashboard)`` pick the view of every predict call from now on."""
    global _chooser
    _chooser = chooser


@dataclasses.dataclass(frozen=True)
class _Model:
    """The model as shipped (itself, or a pool's kept copy), and the notebook's object to check it against."""

    shipped: Any
    held: Any


def _model(model: Any, pool: WorkerSource | None) -> _Model:
    import flair.nn

    if isinstance(model, PoolRef):
        if pool is None or model.pool is not getattr(pool, "pool", pool):
            raise ConfigurationError(
                "predict() was given a PoolRef as the model: pass the pool it was put on too (pool.predict(ref, "
                "data), or predict(ref, data, pool=pool)), or pass the model itself"
            )
        if model.released:
            raise PoolRefError(
                f"{model.describe()} was released: put the model on the pool again (ref = pool.put(model))"
            )
        held = model.held()
        if not model.of_flair or held is not None and not isinstance(held, flair.nn.Model):
            raise ConfigurationError(f"the PoolRef holds a {model.type_name}, not a flair model that predicts")
        return _Model(kept(model), held)
    if not isinstance(model, flair.nn.Model) or not callable(getattr(model, "predict", None)):
        raise ConfigurationError(
            f"predict() needs a flair model that predicts (a TextClassifier, SequenceTagger, TextPairClassifier...), "
            f"not {type(model).__name__}. To use a model saved to a file, load it first: TextClassifier.load(path)"
        )
    return _Model(model, model)


def _check_model(held: Any, inputs: Inputs, label_name: str | None) -> str:
    """The label type the call predicts, once the model and the inputs are known to fit together."""
    known = getattr(held, "label_type", None) if held is not None else None
    if label_name is not None and known is not None and label_name != known:
        raise ConfigurationError(
            f"the {type(held).__name__} predicts {known!r} labels, not {label_name!r}: leave label_name out, or pass "
            f"label_name={known!r}"
        )
    if held is not None:
        if "Pair" in type(held).__name__ and not inputs.in_place:
            raise ConfigurationError(
                f"a {type(held).__name__} predicts on pairs of texts: give flair DataPair objects "
                "(flair.data.TextPair(Sentence(first), Sentence(second))), not texts"
            )
        context = next((module for module in held.modules() if getattr(module, "context_length", 0)), None)
        if context is not None:
            raise ConfigurationError(
                f"the model's {type(context).__name__} reads each sentence's neighbours (context_length="
                f"{context.context_length}), which shared-out prediction would change: predict with model.predict "
                "in the notebook, or use a model trained without use_context"
            )
    return label_name or known or "label"


def _output_path(output: str | Path | None, inputs: Inputs) -> Path | None:
    """The JSON Lines file to write, checked: a new or writable file in an existing folder, not the input file."""
    if output is None:
        return None
    if not isinstance(output, (str, os.PathLike)):
        raise ConfigurationError(f"output= takes the path of a JSON Lines file to write, not {type(output).__name__}")
    try:
        path = Path(output).expanduser()
        problem = (
            "is a folder: give the path of the JSON Lines file to write" if path.is_dir()
            else f"its folder {path.parent} does not exist. Create it first (Path({str(path.parent)!r}).mkdir("
            "parents=True)), or write elsewhere" if not path.parent.is_dir()
            else "cannot be written here (permissions): write elsewhere"
            if not os.access(path if path.exists() else path.parent, os.W_OK)
            else "is the input file itself: write the predictions elsewhere"
            if isinstance(inputs, TextFile) and path.exists() and path.samefile(inputs.path)
            else None
        )  # fmt: skip
    except (OSError, RuntimeError, ValueError) as error:  # no permission to look, an unknown ~user, a NUL
        problem = f"cannot be used: {error}"
    if problem:
        raise ConfigurationError(f"output={str(output)!r}: {problem}")
    return path


def _refused_in_options(options: RunOptions) -> None:
    """A run option predict() decides, set in ``options=RunOptions(...)`` rather than as a keyword."""
    default = RunOptions()
    for name, reason in _PREDICT_DECIDES.items():
        if getattr(options, name) != getattr(default, name):
            raise UnknownOptionError(f"predict(): {name}= is not taken here: {reason}")


def _ledger_scores(run: Run, predictions: Predictions) -> None:
    """The call's own figures in its ledger row: inputs given and predicted, and texts per second."""
    ledger = Ledger.default()
    if ledger is None or run.record_id is None:
        return
    scores = {"inputs": predictions.total, "predicted": predictions.done,
              "texts_per_second": round(predictions.texts_per_second, 2)}  # fmt: skip
    try:
        ledger.update(run.record_id, scores=scores, samples_per_second=predictions.texts_per_second)
    except Exception as error:  # noqa: BLE001 - a ledger that cannot be written costs the call nothing
        warnings.warn(f"the run ledger did not take the predict call's figures: {error}", LedgerWarning, stacklevel=3)


@documented(*_PREDICT_DECIDES)
def predict(
    model: Any,
    data: Any,
    *,
    mini_batch_size: int = 32,
    label_name: str | None = None,
    return_probabilities_for_all_classes: bool = False,
    use_tokenizer: Any = True,
    output: str | Path | None = None,
    wait: bool = True,
    options: RunOptions | None = None,
    pool: WorkerSource | None = None,
    **run_options: Any,
) -> Predictions | PredictCall:
    """Predict with ``model`` on every device: flair's ``model.predict(data)``, shared out over the ranks.

    The inputs are dealt to the ranks in chunks of alike lengths; each rank loads the model once (through flair's
    own save and load, or from the pool's kept copy of a :class:`~flair_nbddp.PoolRef`), builds its chunks' inputs
    ahead while it predicts, and sends the labels back as compact records. They are put in place in input order.
    With the default ``precision="fp32"`` every label is the one ``model.predict`` gives in the notebook.

    Args:
        model: a trained flair model (a ``TextClassifier``, ``SequenceTagger``, ``TextPairClassifier``...), or a
            :class:`~flair_nbddp.PoolRef` of one on ``pool`` (loaded once per worker and kept for the next call).
        data: a list of ``Sentence`` objects (or other data points the model takes, e.g. pairs), a flair dataset
            or corpus split (their labels are added to those very objects, as flair's ``predict`` does), a list of
            strings, or a path to a UTF-8 text file with one text a line (new ``Sentence`` objects, in input order).
        mini_batch_size, return_probabilities_for_all_classes: as for flair's ``predict``.
        label_name: the label type to predict; it must be the model's own (``model.label_type``, the default).
        use_tokenizer: how texts become sentences, as flair's ``Sentence`` takes it (True: flair's default
            tokenizer, False: split on spaces, or a tokenizer).
        output: a JSON Lines file to write (created or replaced): one row per input, in input order, with its text
            and its labels (value, score, and the character offsets of a span). The notebook then holds neither
            all the inputs of a file nor all the predictions of texts.
        wait: False: return a :class:`PredictCall` at once and go on in the background (the cell is free, so the
            view's Stop button works; ``call.wait()`` gives the :class:`Predictions`). Labels put in place arrive
            while it runs: read them after ``wait()``.
        options, pool: as for :func:`flair_nbddp.launch`.

    Run options (keywords, or ``options=RunOptions(...)``; keywords win):
        {run_options}

    The kernel's interrupt (or, with ``wait=False``, the view's Stop button or ``call.stop()``) stops every rank after
    the chunk in hand and the call returns what is done: ``predictions.status == "stopped"``, and the first
    ``predictions.done`` inputs hold their predictions (with ``output``, the file holds exactly those rows). A second
    interrupt ends the workers at once.

    Raises:
        ConfigurationError: before any worker starts: a model that is not a flair model, no inputs, a path that
            does not exist, a label type the model does not predict, texts for a pair classifier, an output folder
            that does not exist.
        WorkerError: a rank failed (its traceback, as for :func:`flair_nbddp.launch`).
        FlairNbddpError: whatever :func:`flair_nbddp.launch` raises for the run options (``DeviceError``,
            ``RunActiveError``, ``ClusterError``...).

    Example::

        predictions = predict(tagger, sentences, processes=2)     # labels added to the sentences, in place
        predictions = predict(classifier, "reviews.txt", output="reviews.jsonl", precision="bf16")
        predictions.done, predictions.texts_per_second
    """
    options = RunOptions.of(run_options, options, where="predict(): ", not_here=_PREDICT_DECIDES)
    _refused_in_options(options)
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
        raise ConfigurationError(f"mini_batch_size must be a positive whole number, not {mini_batch_size!r}")
    if label_name is not None and not isinstance(label_name, str):
        raise ConfigurationError(f"label_name must be a label type (a string), not {type(label_name).__name__}")
    chosen = _model(model, pool)
    inputs = read_inputs(data, use_tokenizer)
    label_name = _check_model(chosen.held, inputs, label_name)
    path = _output_path(output, inputs)
    if options.lazy_corpus is None:  # each rank builds only the inputs of its own chunks
        options = dataclasses.replace(options, lazy_corpus=True)
    view = _chooser(options.dashboard)  # before any worker starts: an impossible view must not cost a start
    chunk = chunk_size(mini_batch_size)
    chunks = deal(inputs.lengths(), chunk, window_size(len(inputs), chunk))
    settings = Settings(mini_batch_size, label_name, return_probabilities_for_all_classes)
    model_name = type(chosen.held).__name__ if chosen.held is not None else "model"
    provenance = Provenance(
        "predict", name=f"predict {model_name}",
        source=f"flair_nbddp.predict({model_name}, {inputs.describe()}, mini_batch_size={mini_batch_size})",
        params={"model": chosen.held if chosen.held is not None else model, "inputs": inputs.describe(),
                "mini_batch_size": mini_batch_size, "label_name": label_name,
                "return_probabilities_for_all_classes": return_probabilities_for_all_classes,
                "output": None if path is None else str(path)},
    )  # fmt: skip
    run = Run(predict_share, (chosen.shipped, inputs, chunks, settings), {}, source_for(options, pool), options,
              provenance=provenance, stop_notice="stopping every rank after the chunk in hand",
              stop_recycles=False)  # fmt: skip  # a stopped share returns cleanly: a pool keeps its workers and model
    call = PredictCall(run, inputs, chunks, label_name, path, view)
    call._start(background=not wait)
    return call if not wait else call.wait()
