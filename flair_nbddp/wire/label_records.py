"""A data point's predicted labels as a compact record: what a rank sends back for each input it predicted.

A rank predicts on its own copies of the notebook's data points. What comes back is not the pickled point but its
labels of one type, as plain tuples: for each label, what it is attached to (the point itself, a span or a token,
by token positions, with the character offsets a JSON Lines file needs), its value and its score; and, when every
class's probability was asked for, each token's distribution. :func:`apply` puts a record on the notebook's own
point exactly as flair's ``predict`` would have left it: the type's old labels removed, the new ones added.

Example:
    >>> from flair.data import Sentence
    >>> sentence = Sentence("Berlin is big")
    >>> sentence[0:1].add_label("ner", "LOC", 0.98)
    >>> record = record_of(sentence, "ner")
    >>> record
    ((('s', 0, 1, 0, 6, 'LOC', 0.98),), None)
    >>> fresh = Sentence("Berlin is big")
    >>> apply(fresh, record, "ner")
    >>> [(label.data_point.text, label.value) for label in fresh.get_labels("ner")]
    [('Berlin', 'LOC')]
    >>> as_json(record)
    {'labels': [{'value': 'LOC', 'score': 0.98, 'start': 0, 'end': 6}]}
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError

Label = tuple  # (target, first token, end token, first character, end character, value, score)
Record = tuple  # (labels, per-token distributions or None)


def _target(point: Any, label: Any) -> tuple[str, int, int, int, int]:
    """What ``label`` is attached to: ``("p", -1, -1, -1, -1)`` the point itself, ``("s", ...)`` a span,
    ``("t", ...)`` a token, with token positions (from 0, end excluded) and character offsets."""
    from flair.data import Span, Token

    target = label.data_point
    if target is point:
        return "p", -1, -1, -1, -1
    if isinstance(target, Span):
        return "s", target.tokens[0].idx - 1, target.tokens[-1].idx, target.start_position, target.end_position
    if isinstance(target, Token):
        return "t", target.idx - 1, target.idx, target.start_position, target.end_position
    raise ConfigurationError(
        f"the model predicts {type(target).__name__} labels ({label.value!r}), which flair_nbddp.predict cannot "
        "send back yet (it sends labels of data points, spans and tokens). Predict with model.predict in the notebook"
    )


def record_of(point: Any, label_name: str, distributions: bool = False) -> Record:
    """The labels of type ``label_name`` on ``point`` (and on its spans and tokens), and, with ``distributions``,
    each token's probability for every class (a tagger's ``return_probabilities_for_all_classes``)."""
    labels = tuple((*_target(point, label), label.value, float(label.score)) for label in point.get_labels(label_name))
    dists = None
    if distributions and hasattr(point, "tokens"):
        dists = tuple(
            tuple((label.value, float(label.score)) for label in token.tags_proba_dist.get(label_name, ()))
            for token in point.tokens
        )
        dists = dists if any(dists) else None  # a classifier's every class is among its labels, not per token
    return labels, dists


def apply(point: Any, record: Record, label_name: str) -> None:
    """Make ``point``'s labels of type ``label_name`` the record's, as flair's ``predict`` leaves them."""
    from flair.data import Label as FlairLabel

    labels, dists = record
    point.remove_labels(label_name)
    for target, first, end, _, _, value, score in labels:
        if target == "p":
            point.add_label(label_name, value, score)
        elif target == "s":
            point[first:end].add_label(label_name, value, score)
        else:
            point[first].add_label(label_name, value, score)
    if dists is not None:
        for token, dist in zip(point.tokens, dists):
            if dist:
                token.add_tags_proba_dist(label_name, [FlairLabel(token, value, score) for value, score in dist])


def as_json(record: Record) -> dict:
    """The record as a JSON Lines row's fields: ``labels``, each with its value and score, and for a span or token
    its character offsets; with distributions, ``probabilities``: each token's ``{class: probability}``."""
    rows = []
    for target, _, _, start, end, value, score in record[0]:
        row: dict[str, Any] = {"value": value, "score": score}
        if target != "p":
            row.update(start=start, end=end)
        rows.append(row)
    fields: dict[str, Any] = {"labels": rows}
    if record[1] is not None:
        fields["probabilities"] = [dict(dist) for dist in record[1]]
    return fields
