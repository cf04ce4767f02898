"""Distributed evaluation inside the workers: each rank predicts its share, every rank gets one process's result.

flair 0.15.1 evaluates the whole split on every rank. Here, whenever several ranks run, ``evaluate`` of a
:class:`flair.nn.Classifier` (``TextClassifier``, ``SequenceTagger``, ``TextPairClassifier``,
``RelationClassifier``...) or a ``TextRegressor`` goes in two phases:

1. **Share.** The split is cut into flair's own evaluation batches (the same ``DataLoader`` with the same
   ``mini_batch_size``), and rank r runs the model on batches r, r + N, r + 2N... only: the batch-level step
   flair's ``evaluate`` makes (``predict`` for classifiers, ``forward_labels_and_loss`` for the regressor), on
   the same batches, so every prediction and batch loss is bit for bit what one process computes. Each rank
   records its batches' predicted labels (by position: the data point, a token, a span, a relation), losses
   and counts; one ``all_gather_object`` over the CPU (gloo) group gives every rank all of them.
2. **Replay.** flair's own ``evaluate`` then runs on every rank over the whole split, with that step
   replaced by one that puts the recorded predictions back and returns the recorded loss. So scores,
   reports, the loss (summed in the same order) and the ``out_path`` file are flair's, unchanged; only rank 0
   writes the file. Every rank gets the same result, so best-model choice, annealing and early stopping agree.

Training after an evaluation draws on where it left the random number streams, so the evaluation must leave
them exactly as flair's own would on that rank (else a seeded run drifts from flair's from the second epoch).
The share runs between a snapshot and a restore of every stream, each batch's step counting the data-loader
iterators it made (``SequenceTagger.predict`` makes one per batch), and the replayed step draws as many
(``random_streams.py``): flair's ``evaluate`` draws its own loader's seed itself. A model whose step draws
anything else is evaluated whole, as flair does, for the rest of the job, with one notice.

No sample is evaluated twice and none is left out: uneven shares, fewer batches than ranks and empty shares
are just fewer batches for some ranks.

Before sharing, the ranks agree through the rendezvous store that they all evaluate the same split now: a rank
that calls ``evaluate`` alone (``if rank == 0: model.evaluate(...)``) waits until the others have returned from
the function, or ``AGREEMENT_SECONDS``, then evaluates the whole split itself, as flair would; ranks that
evaluate different splits at the same moment each evaluate their own whole. A model class
whose ``evaluate`` is its own (``TextPairRegressor``, ``EntityMentionLinker``), or whose predictions sit
where they cannot be located, is evaluated whole on every rank, with one notice naming the class.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import EvaluationShareError
from . import random_streams

AGREEMENT_SECONDS = 30.0
_POLL_SECONDS = 0.005  # a store check is one loopback round trip
_log = logging.getLogger("flair")


@dataclass
class _Job:
    """What this worker's current job says about evaluation."""

    key: str = ""
    enabled: bool = False
    calls: int = 0
    depth: int = 0  # sharded evaluations running now (a model's evaluate may call its parent's)
    sharded_inside: bool = False
    noticed: frozenset = frozenset()
    whole: frozenset = frozenset()  # model classes whose splits are evaluated whole for the rest of the job
    computed: int = 0  # batches of shared-out evaluations this rank computed


@dataclass
class _World:
    rank: int
    size: int
    group: Any  # the CPU (gloo) group for the gathering
    store: Any  # the rendezvous store, for agreeing


_JOB = _Job()
_WORLD: _World | None = None


def install(rank: int, world_size: int, control_group: Any, store: Any) -> None:
    """Wrap the ``evaluate`` of flair's models in this worker (once, after flair is imported)."""
    global _WORLD
    from flair.models import (
        TextRegressor,  # flair.models: every built-in model class, for the notices
    )
    from flair.nn import Classifier

    from .flair_compat import model_subclasses

    _WORLD = _World(rank, world_size, control_group, store)
    Classifier.evaluate = _sharded(Classifier.evaluate, _Predictions())
    TextRegressor.evaluate = _sharded(TextRegressor.evaluate, _RegressionScores())
    for cls in model_subclasses():
        if "evaluate" in cls.__dict__ and cls not in (Classifier, TextRegressor):
            cls.evaluate = _whole(cls.evaluate, cls.__name__)


def start_job(key: str, enabled: bool) -> None:
    """A job begins: evaluations are shared out if ``enabled`` and several ranks run; ``key`` names the job."""
    global _JOB
    _JOB = _Job(key=key, enabled=enabled)


def end_job() -> None:
    """This rank returned from the job's function: a rank evaluating alone stops waiting for it."""
    if _WORLD is not None and _WORLD.size > 1 and _JOB.key:
        _WORLD.store.set(f"{_JOB.key}/returned/{_WORLD.rank}", "1")


def batches_computed() -> int:
    """How many evaluation batches this rank has computed in shared-out evaluations of the current job.

    With 2 ranks and a split of 10 batches, one evaluation adds 5 on each rank (the whole split: 10 on both
    with ``distributed_eval=False``, which this does not count, nor a share thrown away to evaluate whole).
    """
    return _JOB.computed


def _active() -> bool:
    return _WORLD is not None and _WORLD.size > 1 and _JOB.enabled and dist.is_initialized()


def _notice(name: str, message: str) -> None:
    """Say ``message`` about model class ``name``, once per job."""
    if name not in _JOB.noticed:
        _JOB.noticed |= {name}
        _log.info(f"flair_nbddp: {name}.evaluate {message}")


def _whole(evaluate: Callable, name: str) -> Callable:
    """A model class's own ``evaluate``: flair's, with a notice unless it shared out an evaluation inside."""

    @functools.wraps(evaluate)
    def whole(self: Any, *args: Any, **kwargs: Any) -> Any:
        before, _JOB.sharded_inside = _JOB.sharded_inside, False
        try:
            result = evaluate(self, *args, **kwargs)
            if _active() and not _JOB.sharded_inside:
                _notice(
                    name,
                    "runs on the whole split on every rank: the kit shares out the evaluation of flair's Classifier "
                    "and TextRegressor models only",
                )
            return result
        finally:
            _JOB.sharded_inside = before or _JOB.sharded_inside

    return whole


def _sharded(evaluate: Callable, step: _Step) -> Callable:
    signature = inspect.signature(evaluate)

    @functools.wraps(evaluate)
    def sharded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _active() or _JOB.depth:
            return evaluate(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        _JOB.calls += 1
        if not _all_ranks_evaluate(f"{_JOB.key}/evaluate/{_JOB.calls}", _call_fingerprint(self, call.arguments)):
            _notice(
                type(self).__name__,
                "ran on the whole split on this rank: the other ranks were not evaluating the same split now (call "
                "evaluate on every rank to share it out; distributed_eval=False spares the wait for them)",
            )
            return evaluate(*call.args, **call.kwargs)
        if _WORLD.rank != 0:
            call.arguments["out_path"] = None  # rank 0 writes the file, once
        _JOB.depth += 1
        try:
            records = None if type(self) in _JOB.whole else _share(step, self, call.arguments)
            if records is None:
                return evaluate(*call.args, **call.kwargs)
            _JOB.sharded_inside = True
            with step.replaying(self, records):
                return evaluate(*call.args, **call.kwargs)
        finally:
            _JOB.depth -= 1

    return sharded


def _batches(data_points: Any, mini_batch_size: int) -> list[list]:
    """flair's evaluation batches of ``data_points``: what ``evaluate``'s own loader yields."""
    from flair.datasets import DataLoader, FlairDatapointDataset
    from torch.utils.data import Dataset

    dataset = data_points if isinstance(data_points, Dataset) else FlairDatapointDataset(data_points)
    return list(DataLoader(dataset, batch_size=mini_batch_size))


def _share(step: _Step, model: Any, arguments: dict) -> list | None:
    """Every batch's record and draws: this rank computes its share, the others' are gathered. None (with a
    notice, and for the rest of the job) where this model's splits must be evaluated whole. The random streams
    end where they began: the replay draws what flair's steps draw."""
    streams = random_streams.snapshot()
    try:
        batches = _batches(arguments["data_points"], arguments["mini_batch_size"])
        mine = {
            index: random_streams.loader_draws(functools.partial(step.record, model, batch, arguments))
            for index, batch in enumerate(batches)
            if index % _WORLD.size == _WORLD.rank
        }
        gathered: list = [None] * _WORLD.size
        dist.all_gather_object(gathered, mine, group=_WORLD.group)
    finally:
        random_streams.restore(streams)
    records = {index: record for share in gathered for index, record in share.items()}
    why = _why_whole(records, len(batches))
    if why:
        _JOB.whole |= {type(model)}
        _notice(type(model).__name__, f"runs on the whole split on every rank: {why}")
        return None
    _JOB.computed += len(mine)
    return [records[index] for index in range(len(batches))]


def _why_whole(records: dict[int, tuple[Any, int | None]], batches: int) -> str | None:
    """Why the gathered ``records`` of a split of ``batches`` batches cannot be replayed; None if they can."""
    if len(records) != batches:
        return "the ranks cut the split into different batches"
    if any(record is None for record, _ in records.values()):
        return "some of its predictions are on objects the kit cannot locate"
    if any(draws is None for _, draws in records.values()):
        return (
            "its prediction draws random numbers, which a shared-out evaluation would draw in another order than "
            "flair's (changing its predictions and the training after it)"
        )
    return None


def _call_fingerprint(model: Any, arguments: dict) -> str:
    """What must be the same on every rank for their evaluations to be one: the model class, the gold label
    type, the batch size, and the split (its length and its first and last data points)."""
    points = arguments["data_points"]
    ends = [getattr(points[index], "text", "") for index in ((0, len(points) - 1) if len(points) else ())]
    return repr((type(model).__name__, arguments["gold_label_type"], arguments["mini_batch_size"], len(points), ends))


def _all_ranks_evaluate(key: str, fingerprint: str) -> bool:
    """Whether every rank is in this very evaluation now.

    Every rank says it arrived and what it evaluates; the decision is the store's ``compare_set`` on one key,
    so the first to decide wins and every rank follows it: rank 0 decides "share" once all arrived with the
    same evaluation, or "whole" if they evaluate different things; any rank decides "whole" when the
    ``AGREEMENT_SECONDS`` are up or rank 0 (for rank 0: every other rank) has returned from the function.
    """
    store, size, rank = _WORLD.store, _WORLD.size, _WORLD.rank
    store.set(f"{key}/call/{rank}", fingerprint)
    store.add(f"{key}/arrived", 1)
    decision_key, deadline = f"{key}/decision", time.monotonic() + AGREEMENT_SECONDS
    while not store.check([decision_key]):
        if rank == 0 and store.add(f"{key}/arrived", 0) == size:
            same = all(store.get(f"{key}/call/{other}").decode() == fingerprint for other in range(1, size))
            _decide(decision_key, "share" if same else "whole")
        elif time.monotonic() > deadline or _others_returned():
            _decide(decision_key, "whole")
        else:
            time.sleep(_POLL_SECONDS)
    return store.get(decision_key) == b"share"


def _decide(decision_key: str, decision: str) -> None:
    """Set the decision unless a rank set it first."""
    _WORLD.store.compare_set(decision_key, "", decision)


def _others_returned() -> bool:
    """Rank 0: every other rank has returned from the function; another rank: rank 0 has."""
    others = range(1, _WORLD.size) if _WORLD.rank == 0 else (0,)
    return any(_WORLD.store.check([f"{_JOB.key}/returned/{rank}"]) for rank in others)


class _Step:
    """The batch-level step of one ``evaluate``: computed for this rank's batches, then replayed for all."""

    method: str

    def record(self, model: Any, batch: list, arguments: dict) -> Any:
        raise NotImplementedError

    def replay(self, record: Any, batch: list, arguments: tuple, keywords: dict) -> Any:
        raise NotImplementedError

    def replaying(self, model: Any, records: list) -> _Replay:
        return _Replay(self, model, records)


class _Replay:
    """While flair's ``evaluate`` runs, ``model.<step>`` hands back the recorded batches, in order."""

    def __init__(self, step: _Step, model: Any, records: list) -> None:
        self.step, self.model, self.records, self.next = step, model, records, 0

    def __call__(self, batch: list, *args: Any, **kwargs: Any) -> Any:
        record, draws = self.records[self.next]
        self.next += 1
        random_streams.draw_loader_iterators(draws)  # as flair's own step would
        return self.step.replay(record, batch, args, kwargs)

    def __enter__(self) -> None:
        self.model.__dict__[self.step.method] = self

    def __exit__(self, *exc: object) -> None:
        del self.model.__dict__[self.step.method]
        if exc[0] is None and self.next != len(self.records):
            raise EvaluationShareError(
                f"{type(self.model).__name__}.evaluate took {self.next} of the {len(self.records)} batches the ranks "
                "shared out: launch with distributed_eval=False to evaluate as flair does"
            )


@dataclass
class _Tensor:
    """A recorded tensor (a batch's loss, count or scores), rebuilt on the device flair uses."""

    value: torch.Tensor


def _recorded(value: Any) -> Any:
    return _Tensor(value.detach().cpu()) if isinstance(value, torch.Tensor) else value


def _rebuilt(value: Any) -> Any:
    import flair

    return value.value.to(flair.device) if isinstance(value, _Tensor) else value


class _Predictions(_Step):
    """``Classifier.evaluate``: ``predict(batch, label_name="predicted", ...)`` per batch."""

    method = "predict"

    def record(self, model: Any, batch: list, arguments: dict) -> Any:
        for point in batch:
            point.remove_labels("predicted")
        with torch.no_grad():
            outcome = model.predict(
                batch,
                embedding_storage_mode=arguments["embedding_storage_mode"],
                mini_batch_size=arguments["mini_batch_size"],
                label_name="predicted",
                return_loss=arguments["return_loss"],
            )
        labels = [_labels_of(point) for point in batch]
        for point in batch:
            point.remove_labels("predicted")
        if any(located is None for located in labels):
            return None
        if isinstance(outcome, tuple):  # (loss, count)
            return labels, tuple(_recorded(part) for part in outcome)
        # a loss alone; or, with return_loss=False, sentences flair does not look at
        return labels, _recorded(outcome) if isinstance(outcome, torch.Tensor) else None

    def replay(self, record: Any, batch: list, arguments: tuple, keywords: dict) -> Any:
        labels, outcome = record
        for point, located in zip(batch, labels, strict=True):
            for where, value, score, metadata in located:
                _part(point, where).add_label("predicted", value, score, **metadata)
        return tuple(_rebuilt(part) for part in outcome) if isinstance(outcome, tuple) else _rebuilt(outcome)


class _RegressionScores(_Step):
    """``TextRegressor.evaluate``: ``forward_labels_and_loss(batch)`` per batch."""

    method = "forward_labels_and_loss"

    def record(self, model: Any, batch: list, arguments: dict) -> Any:
        with torch.no_grad():
            scores, loss = model.forward_labels_and_loss(batch)
        return _recorded(scores), _recorded(loss)

    def replay(self, record: Any, batch: list, arguments: tuple, keywords: dict) -> Any:
        scores, loss = record
        return _rebuilt(scores), _rebuilt(loss)


def _labels_of(point: Any) -> list | None:
    """``point``'s predicted labels in the order it holds them, each where it sits: ``()`` the point itself,
    ``("token", i)``, ``("span", start, end)``, ``("relation", (start, end), (start, end))``; None if a label
    sits elsewhere."""
    from flair.data import Relation, Span, Token

    def where(target: Any) -> tuple | None:
        if target is point:
            return ()
        if isinstance(target, Token):
            return ("token", target.idx - 1)
        if isinstance(target, Span):
            return ("span", target.tokens[0].idx - 1, target.tokens[-1].idx)
        if isinstance(target, Relation):
            return ("relation", where(target.first)[1:], where(target.second)[1:])
        return None

    located = []
    for label in point.annotation_layers.get("predicted", []):
        position = where(label.data_point)
        if position is None or getattr(label.data_point, "sentence", point) is not point:
            return None
        located.append((position, label.value, label.score, dict(label.metadata)))
    return located


def _part(point: Any, where: tuple) -> Any:
    from flair.data import Relation

    if not where:
        return point
    if where[0] == "token":
        return point[where[1]]
    if where[0] == "span":
        return point[where[1] : where[2]]
    (first_start, first_end), (second_start, second_end) = where[1], where[2]
    return Relation(point[first_start:first_end], point[second_start:second_end])
