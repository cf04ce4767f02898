"""A :func:`flair_nbddp.predict` call's inputs: what the user gave, checked, and how a rank reads its chunks of it.

Three kinds, each shipped once in the call's payload and read by every rank:

* :class:`DataPoints`: flair data points (``Sentence`` objects, pairs, a dataset or a corpus split). They travel as
  a flair dataset through the codec and a rank builds only those of its chunks (a lazy corpus); the labels come
  back to the notebook's own objects.
* :class:`Texts`: a list of strings; a rank makes each a ``Sentence`` (with ``use_tokenizer``).
* :class:`TextFile`: a text file, one text a line (UTF-8). The notebook reads it once for where each line starts and
  keeps only those offsets; each rank reads its lines from the file itself (on a cluster, the path must be there too).

Example:
    >>> inputs = read_inputs(["a short one", "a somewhat longer text"])
    >>> len(inputs), inputs.lengths().tolist(), inputs.text(1)
    (2, [11, 22], 'a somewhat longer text')
    >>> [sentence.text for sentence in inputs.points([1, 0])]
    ['a somewhat longer text', 'a short one']
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigurationError


class Inputs:
    """Base of the three kinds: ``len``, each input's length (for dealing), a rank's points, the notebook's text."""

    in_place = False  # the predictions land on the user's own objects
    use_tokenizer: Any = True

    def __len__(self) -> int:
        raise NotImplementedError

    def lengths(self) -> np.ndarray:
        """Each input's length in characters (tokens for data points): chunks of alike lengths pad little."""
        raise NotImplementedError

    def points(self, indices: Sequence[int]) -> list:
        """In a rank: the data points to predict for these inputs, in that order."""
        raise NotImplementedError

    def text(self, index: int) -> Any:
        """In the notebook: input ``index``'s text (a pair's two texts), for a JSON Lines row."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What the run ledger records of the inputs."""
        return {"type": type(self).__name__, "len": len(self)}

    def _sentence(self, text: str) -> Any:
        from flair.data import Sentence

        return Sentence(text, use_tokenizer=self.use_tokenizer)


class DataPoints(Inputs):
    """flair data points: labels go back onto these very objects."""

    in_place = True

    def __init__(self, points: Any) -> None:
        self.dataset = points
        self.first_type = type(points[0]).__name__

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def lengths(self) -> np.ndarray:
        return np.fromiter((_tokens(self.dataset[index]) for index in range(len(self))), np.int64, len(self))

    def points(self, indices: Sequence[int]) -> list:
        return [self.dataset[int(index)] for index in indices]

    def text(self, index: int) -> Any:
        point = self.dataset[index]
        if hasattr(point, "first") and hasattr(point, "second"):
            return [point.first.to_original_text(), point.second.to_original_text()]
        return point.to_original_text()

    def describe(self) -> dict:
        return {"type": self.first_type, "len": len(self)}

    def __reduce__(self) -> tuple:
        """Ship the points as a flair dataset (through the codec: compact, and built lazily in the ranks)."""
        from flair.datasets import FlairDatapointDataset

        dataset = self.dataset
        if isinstance(dataset, list):
            dataset = FlairDatapointDataset(dataset)
        return _data_points, (dataset, self.first_type)


def _data_points(dataset: Any, first_type: str) -> DataPoints:
    inputs = DataPoints.__new__(DataPoints)
    inputs.dataset, inputs.first_type = dataset, first_type
    return inputs


def _tokens(point: Any) -> int:
    if hasattr(point, "first") and hasattr(point, "second"):
        return len(point.first) + len(point.second)
    return len(point)


class Texts(Inputs):
    """Strings: each becomes a new ``Sentence``."""

    def __init__(self, texts: list[str], use_tokenizer: Any = True) -> None:
        self.texts, self.use_tokenizer = texts, use_tokenizer

    def __len__(self) -> int:
        return len(self.texts)

    def lengths(self) -> np.ndarray:
        return np.fromiter(map(len, self.texts), np.int64, len(self.texts))

    def points(self, indices: Sequence[int]) -> list:
        return [self._sentence(self.texts[int(index)]) for index in indices]

    def text(self, index: int) -> str:
        return self.texts[index]


class TextFile(Inputs):
    """A file of one text a line: the notebook keeps where each line starts, never the texts."""

    def __init__(self, path: Path, use_tokenizer: Any = True) -> None:
        self.path, self.use_tokenizer = path, use_tokenizer
        starts = [0]
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise ConfigurationError(
                        f"{path}, line {number:,}, is not UTF-8 ({error.reason} at byte {error.start}): predict() "
                        "reads text files as UTF-8. Convert it first (iconv -f latin1 -t utf-8), or pass its lines as "
                        "strings"
                    ) from None
                starts.append(starts[-1] + len(line))
        self.starts = np.asarray(starts, dtype=np.int64)  # one more than lines: where the next would begin
        self._handle: Any = None

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def _line(self, index: int) -> str:
        if self._handle is None:
            try:
                self._handle = open(self.path, "rb")  # noqa: SIM115 - kept open while the chunks are read
            except FileNotFoundError:
                raise ConfigurationError(
                    f"{self.path} is not on this machine ({os.uname().nodename}): a text file given to predict() is "
                    "read by every rank. Put it where every worker sees it, or pass its lines as a list of strings"
                ) from None
        self._handle.seek(int(self.starts[index]))
        return self._handle.read(int(self.starts[index + 1] - self.starts[index])).decode("utf-8").rstrip("\r\n")

    def points(self, indices: Sequence[int]) -> list:
        return [self._sentence(self._line(int(index))) for index in indices]

    def text(self, index: int) -> str:
        return self._line(index)

    def describe(self) -> dict:
        return {"type": "file", "path": str(self.path), "len": len(self)}

    def close(self) -> None:
        """Let go of the file (the notebook's side, once the call is over)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handle": None}


def read_inputs(data: Any, use_tokenizer: Any = True) -> Inputs:
    """The inputs of a predict call, checked: data points, strings, or a path to a text file.

    Raises:
        ConfigurationError: no inputs, a path that is not a file, a list that mixes kinds, or something else.
    """
    if isinstance(data, os.PathLike):
        return _file(data, use_tokenizer)
    if isinstance(data, str):
        if _names_a_file(data):
            return _file(data, use_tokenizer)
        raise ConfigurationError(
            "predict() was given one string, which names no file here. Pass a list of texts (['first text', "
            "'second text']), or the path of an existing text file with one text a line"
        )
    cannot = ConfigurationError(
        f"predict() cannot read inputs from {type(data).__name__}: give a list of Sentences (or other data points "
        "the model takes), a flair dataset or corpus split, a list of strings, or a path to a text file"
    )
    if isinstance(data, (dict, set, frozenset)):
        raise cannot
    try:
        count = len(data)
        first = data[0] if count else None
    except (TypeError, KeyError, IndexError):
        raise cannot from None
    if count == 0:
        raise ConfigurationError(
            "predict() was given no inputs (an empty list or dataset): there is nothing to predict"
        )
    if isinstance(first, str):
        strange = next((item for item in data if not isinstance(item, str)), None)
        if strange is not None:
            raise ConfigurationError(
                f"predict() was given a list of strings with a {type(strange).__name__} among them: give only strings, "
                "or only data points"
            )
        return Texts(list(data), use_tokenizer)
    from flair.data import DataPoint

    if not isinstance(first, DataPoint):
        raise ConfigurationError(
            f"predict() cannot predict on {type(first).__name__} items: give flair Sentences (or other data points the "
            "model takes), a flair dataset or corpus split, a list of strings, or a path to a text file"
        )
    if isinstance(data, (list, tuple)):
        strange = next((item for item in data if not isinstance(item, DataPoint)), None)
        if strange is not None:
            raise ConfigurationError(
                f"predict() was given data points with a {type(strange).__name__} among them: give only data points"
            )
        return DataPoints(list(data))
    return DataPoints(data)


def _names_a_file(text: str) -> bool:
    """Whether a string given as the inputs is a path: one that exists, or one that looks like a path (no spaces, a
    folder or a text file's suffix), so that a missing file gets its own message."""
    if "\n" in text or len(text) > 4096:
        return False
    try:
        if Path(text).expanduser().exists():
            return True
    except (OSError, RuntimeError, ValueError):  # too long a name, an unknown ~user, a NUL: a text
        return False
    return not any(space in text for space in " \t") and (os.sep in text or text.endswith((".txt", ".tsv", ".csv")))


def _file(given: str | os.PathLike, use_tokenizer: Any) -> TextFile:
    try:
        path = Path(given).expanduser()
        if not path.exists():
            raise ConfigurationError(f"predict() was given {path}, which does not exist: give the path of a text file "
                                     "with one text a line")  # fmt: skip
        if not path.is_file():
            raise ConfigurationError(f"predict() was given {path}, which is not a file: give the path of a text file "
                                     "with one text a line")  # fmt: skip
        inputs = TextFile(path.resolve(), use_tokenizer)
    except (OSError, RuntimeError, ValueError) as error:  # no permission, an unknown ~user, a NUL in the name
        raise ConfigurationError(f"predict() cannot read {str(given)!r}: {error}") from None
    if not len(inputs):
        raise ConfigurationError(f"{path} is empty: there is nothing to predict")
    return inputs
