"""One rank's share of a :func:`flair_nbddp.predict` call: :func:`predict_share` is the function the call launches.

The notebook cut the inputs into chunks of alike lengths (:mod:`flair_nbddp.predicting.dealing`). Each rank takes
the next chunk nobody has taken from a counter in the ranks' shared store, so a fast rank takes more and none
waits for another. A thread takes and builds the next chunk (its sentences made or decoded, and on a GPU tokenized
for the model's transformers, :func:`.fast_inputs.look_ahead_for`) while flair's ``predict`` runs the current one
in the job's precision (:func:`.precision.inference`). Each finished chunk goes up the event channel as compact
records (:class:`~flair_nbddp.wire.events.Predicted`), never as pickled sentences. A stop ends the share after the
chunk in hand. Rank 0 returns last: its process serves the store the others take chunks from.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..wire import label_records
from ..wire.events import STOP_REQUESTED, EventSender, Predicted
from ..wire.predict_inputs import Inputs
from . import clean_tokens, fast_inputs, input_thread, precision

_JOB: dict[str, Any] = {}


def start_job(sender: EventSender, rank: int, store: Any, key: str, counters: Any) -> None:
    """In a worker, before each job: the channel, the shared store and the counters a predict call's share uses."""
    _JOB.update(sender=sender, rank=rank, store=store, key=key, counters=counters)


@dataclass(frozen=True)
class Settings:
    """flair ``predict``'s arguments that the call passes on, and the label type the records read."""

    mini_batch_size: int
    label_name: str
    all_probabilities: bool = False


def _taken(inputs: Inputs, chunks: list, counter: str) -> Iterator[tuple[int, list]]:
    """The chunks this rank takes from the shared counter, each with its data points, until none is left or a stop
    came."""
    while not STOP_REQUESTED.is_set():
        number = _JOB["store"].add(counter, 1) - 1
        if number >= len(chunks):
            return
        points = inputs.points(chunks[number])
        clean_tokens.made(points)
        yield number, points


def predict_share(model: Any, inputs: Inputs, chunks: list, settings: Settings) -> int:
    """Predict chunks until none is left (or a stop came), sending each one's records up; the count predicted."""
    sender: EventSender = _JOB["sender"]
    counters = _JOB["counters"]
    model.eval()
    fast_inputs.look_ahead_for(model)
    predicted = 0
    taken = _taken(inputs, chunks, f"flair_nbddp/{_JOB['key']}/predict-next")
    reader = input_thread.Ahead(taken, prepare=lambda chunk: input_thread.tokenize_ahead(chunk[1]))
    try:
        for number, points in reader:
            counters.batch_started()
            with precision.inference():
                model.predict(
                    points, mini_batch_size=settings.mini_batch_size, label_name=settings.label_name,
                    return_probabilities_for_all_classes=settings.all_probabilities,
                )  # fmt: skip
            records = tuple(label_records.record_of(point, settings.label_name, settings.all_probabilities)
                            for point in points)  # fmt: skip
            sender.send(Predicted(_JOB["rank"], number, records))
            counters.batch_done(len(points))
            predicted += len(points)
            if STOP_REQUESTED.is_set():
                break
    finally:
        reader.close()
    _all_done(f"flair_nbddp/{_JOB['key']}/predict-done")
    return predicted


def _all_done(key: str) -> None:
    """Say this rank is done, and on rank 0 (whose process serves the shared store) wait until every rank is: a rank
    that finished first must not take the store away while another still asks it for a chunk."""
    import torch.distributed as dist

    store = _JOB["store"]
    store.add(key, 1)
    if _JOB["rank"] == 0:
        while store.add(key, 0) < dist.get_world_size():
            time.sleep(0.01)
