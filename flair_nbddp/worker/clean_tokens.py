"""flair's clearing of a sentence's embeddings, and removal of its labels of a type, without walking its tokens
where none of them holds any.

After every training batch, and every batch of a prediction, flair clears the embeddings of each sentence of the
batch and of each of its tokens (``store_embeddings(batch, "none")``): 7,360 tokens for 32 IMDB-length reviews, in
every batch, where a document classifier's tokens (and a tagger's, with :mod:`.direct_embeddings`) never hold one.
A classifier's ``predict`` (and so every evaluation) first removes the sentence's labels of the predicted type from
each of its tokens too, where a token label is never of that type.

In a worker with ``skip_clean_tokens`` on (the default):

* a sentence whose tokens flair has just cleared of every embedding (or that a predict call's rank has just made)
  remembers that they hold none, and forgets it as soon as one of its tokens is given an embedding
  (``Token.set_embedding``, which every flair embedding calls) or a token is added to it. While it remembers,
  clearing it clears the sentence's own embeddings and leaves its tokens alone. The memory stays with the sentence
  in its process: a pickled or copied sentence, and one the kit's codec ships, remembers nothing.
* removing a sentence's labels of a type that only the sentence itself carries (flair registers every token's and
  span's label on its sentence too), with no spans known to it, removes them from the sentence and leaves its tokens
  alone.

The end state is flair's; what is trained and predicted is the same. The remembering costs one dictionary entry per
sentence, and a token's ``set_embedding`` one lookup more.
"""

from __future__ import annotations

import functools
from typing import Any

from ..wire.codec import KIT_MARKS

_JOB = {"enabled": True}
_CLEAN = KIT_MARKS + "tokens_clean"  # in a sentence's __dict__, as _MARK: none of its tokens holds an embedding
_MARK = object()  # this process's: a sentence unpickled from another process is not marked


def install() -> None:
    """Have sentences remember tokens cleared of every embedding, and forget it when one is given one (once per
    worker)."""
    from flair.data import DataPoint, Sentence, Token

    clear = Sentence.clear_embeddings
    if getattr(clear, "_flair_nbddp_clean", False):
        return

    @functools.wraps(clear)
    def clear_embeddings(self: Any, embedding_names: list[str] | None = None) -> None:
        if _JOB["enabled"] and self.__dict__.get(_CLEAN) is _MARK:
            DataPoint.clear_embeddings(self, embedding_names)  # the sentence's own; its tokens hold none
            return
        clear(self, embedding_names)
        if embedding_names is None:
            self.__dict__[_CLEAN] = _MARK

    set_embedding = Token.set_embedding

    @functools.wraps(set_embedding)
    def set_token_embedding(self: Any, name: str, vector: Any) -> None:
        set_embedding(self, name, vector)
        if self.sentence is not None:
            self.sentence.__dict__.pop(_CLEAN, None)

    add_token = Sentence._add_token

    @functools.wraps(add_token)
    def _add_token(self: Any, token: Any) -> None:
        self.__dict__.pop(_CLEAN, None)
        add_token(self, token)

    remove = Sentence.remove_labels

    @functools.wraps(remove)
    def remove_labels(self: Any, typename: str) -> None:
        if _JOB["enabled"] and not self._known_spans and all(
            label.data_point is self for label in self.annotation_layers.get(typename, ())
        ):
            DataPoint.remove_labels(self, typename)  # the sentence's own; no token or span carries one of them
            return
        remove(self, typename)

    getstate = Sentence.__getstate__

    @functools.wraps(getstate)
    def __getstate__(self: Any) -> Any:  # pickled or copied: the copy remembers nothing (set_embedding forgets here)
        state = getstate(self)
        if not isinstance(state, dict) or _CLEAN not in state:
            return state
        return {key: value for key, value in state.items() if key != _CLEAN}

    clear_embeddings._flair_nbddp_clean = True
    Sentence.__getstate__ = __getstate__
    Sentence.clear_embeddings = clear_embeddings
    Sentence.remove_labels = remove_labels
    Token.set_embedding = set_token_embedding
    Sentence._add_token = _add_token


def made(points: list) -> None:
    """``points`` were just made here, their tokens holding no embedding (a predict call's chunk): the sentences
    among them remember it."""
    from flair.data import Sentence

    for point in points:
        if isinstance(point, Sentence):
            point.__dict__[_CLEAN] = _MARK


def start_job(enabled: bool) -> None:
    """A job begins: clean sentences' tokens are not walked if ``enabled``."""
    _JOB["enabled"] = enabled
