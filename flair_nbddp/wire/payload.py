"""Packing what crosses the process boundary: the function and its arguments, and the result.

Everything goes through cloudpickle, so functions and classes defined in a notebook cell (a
file-less ``__main__``) travel by value. Two kinds of object take another path:

* flair corpora, datasets and sentences go through :mod:`flair_nbddp.wire.codec`, which is compact and
  handles span labels (plain pickling of those fails in flair 0.15.1). Each rank checks the bytes it
  read against the parent's hash before decoding them, and keeps a job's corpora lazy
  (:mod:`flair_nbddp.wire.lazy_corpus`) when the job asks for it.
* flair models travel through flair's own ``save``/``load`` state (plain pickling fails for some
  embeddings); in a worker they land on its device, back in the notebook on CPU.

The payload is written once to a file that every rank reads; it is never sent once per worker.

Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "payload.pkl")
    >>> packed = write_payload(path, divmod, (7, 2), {})
    >>> fn, args, kwargs = read_payload(path)
    >>> fn(*args, **kwargs)
    (3, 1)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
import threading
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import cloudpickle

from ..errors import CorpusMismatchError, PayloadWriteError, PoolRefError, ShippingError
from . import codec


def sizes(obj: Any) -> dict[str, int]:
    """A corpus's split sizes, or a dataset's length; empty for anything else.

    Example:
        >>> sizes([1, 2, 3]), sizes(3)
        ({'len': 3}, {})
    """
    if all(hasattr(obj, split) for split in ("train", "dev", "test")):
        return {split: length(getattr(obj, split)) for split in ("train", "dev", "test")}
    size = length(obj)
    return {} if size is None and not isinstance(obj, (str, bytes)) else {"len": size}


def length(obj: Any) -> int | None:
    """``len(obj)``; 0 for None, None for an object without a length.

    Example:
        >>> length([1, 2]), length(None), length(3)
        (2, 0, None)
    """
    try:
        return 0 if obj is None else len(obj)
    except TypeError:
        return None


def is_flair_object(obj: object) -> bool:
    """Whether ``obj`` is an instance of one of flair's classes (a corpus, dataset, sentence, model...).

    Example:
        >>> from flair_nbddp.synthetic import sentiment_corpus
        >>> is_flair_object(sentiment_corpus(2, 1, 1)), is_flair_object([])
        (True, False)
    """
    return _is_flair_class(type(obj))


def _is_flair_class(cls: type) -> bool:
    """Whether ``cls`` is one of flair's own classes (not a subclass of one defined elsewhere)."""
    return cls.__module__.partition(".")[0] == "flair"


def _travels_by_flairs_save(obj: object) -> bool:
    """Whether ``obj`` is a flair model that flair's own ``load`` rebuilds: one of flair's classes, or a subclass
    of one (say, defined in a notebook) that adds no constructor flair's ``load`` cannot call. Any other object,
    a subclass with a constructor of its own among them, travels by cloudpickle."""
    nn = sys.modules.get("flair.nn")  # where flair was never imported, there is no flair model
    if nn is None or not isinstance(obj, nn.Model):
        return False
    for cls in type(obj).__mro__:
        if _is_flair_class(cls):
            return True
        if "__init__" in vars(cls) and "_init_model_with_state_dict" not in vars(cls):
            return False
    return True


def _model_bytes(model: Any) -> bytes:
    state = model._get_state_dict()
    if getattr(model, "model_card", None) is not None:
        state["model_card"] = model.model_card
    buffer = io.BytesIO()
    import torch

    torch.save(state, buffer, pickle_protocol=4)
    return buffer.getvalue()


_MODELS_TO_NOTEBOOK = threading.local()  # set while the parent reads a result: models land on CPU there
_LAZY_CORPORA = threading.local()  # set while a worker reads a payload: its job's lazy_corpus (True, False, None)


def rebuild_model(model_class: type, data: bytes) -> Any:
    """Load a flair model from the bytes of its saved state, in eval mode.

    In a worker it lands on the worker's ``flair.device``. In the notebook (reading a result) it lands on
    CPU, and flair's device there is set to CPU too, so ``predict`` works at once and the kernel takes
    no GPU memory from the workers.
    """
    import flair
    import torch

    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    if not getattr(_MODELS_TO_NOTEBOOK, "active", False):
        return model_class.load(state)
    if flair.device.type != "cpu":
        warnings.warn(
            f"flair_nbddp set flair.device from {flair.device} to cpu in this notebook so the returned "
            f"{model_class.__name__} can predict here without taking GPU memory from the workers. To use a GPU "
            "in the notebook afterwards: model.to('cuda'); flair.device = torch.device('cuda').",
            stacklevel=2,
        )
        flair.device = torch.device("cpu")
    return model_class.load(state)


def rebuild_corpus(data: bytes, digest: str) -> Any:
    """Check that the codec blob this rank read is the one the notebook packed (its sha256), then decode it.

    The bytes are checked, not the decoded corpus: re-encoding it on every rank cost as much as a third of the
    decoding. That decoding rebuilds exactly what was encoded is the codec's own promise, held by its tests.
    """
    read = hashlib.sha256(data).hexdigest()
    if read != digest:
        raise CorpusMismatchError(
            f"the corpus this process read differs from the one packed in the notebook (sha256 {read[:12]} != "
            f"{digest[:12]}): the run's payload file was changed or damaged while the run started. Launch again; "
            "if it recurs, check the disk of the run directory."
        )
    lazy = getattr(_LAZY_CORPORA, "active", False)
    if lazy is not False:
        from .lazy_corpus import decode_lazy, stays_compact

        if lazy or stays_compact(data):  # None: lazy if it is large
            return decode_lazy(data)
    return codec.decode(data)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with flair corpora through the codec and flair models through save/load; ``digests`` maps
    ``id(obj)`` of each corpus and model packed to the sha256 of its bytes (what the run ledger records)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.digests: dict[int, str] = {}

    def reducer_override(self, obj: Any) -> Any:
        if _travels_by_flairs_save(obj):
            data = _model_bytes(obj)
            self.digests[id(obj)] = hashlib.sha256(data).hexdigest()
            return rebuild_model, (type(obj), data)
        if is_flair_object(obj) and codec.supports(obj):
            try:
                data = codec.encode(obj)
            except TypeError:  # content the codec cannot keep exactly: cloudpickle ships it instead
                return super().reducer_override(obj)
            digest = self.digests[id(obj)] = hashlib.sha256(data).hexdigest()
            return rebuild_corpus, (data, digest)
        return super().reducer_override(obj)


class Packed(NamedTuple):
    """What :func:`write_payload` wrote: its size, and the sha256 of each corpus and model in it, by ``id()``."""

    nbytes: int
    digests: dict[int, str]


def _pack(obj: Any) -> tuple[bytes, dict[int, str]]:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=5)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.digests


def dumps(obj: Any) -> bytes:
    """Serialise ``obj`` the way the kit ships everything (see the module docstring)."""
    return _pack(obj)[0]


def _pickles(obj: Any) -> Exception | None:
    try:
        dumps(obj)
    except Exception as error:  # noqa: BLE001 - any pickling failure is what we look for
        return error
    return None


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{index}]", value) for index, value in enumerate(obj)]
    attributes = dict(getattr(obj, "__dict__", None) or {})
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            attributes[slot] = getattr(obj, slot)
    return [(f".{name}", value) for name, value in attributes.items()]


def _variables_of(fn: types.FunctionType) -> list[tuple[str, Any]]:
    """What cloudpickle sends along with a function it ships by value (one defined in a notebook): the
    globals its code reads and the variables it closes over, by name."""
    names: dict[str, None] = {}
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(dict.fromkeys(code.co_names))
        codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    found = [(name, fn.__globals__[name]) for name in names if name in fn.__globals__]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):  # a cell not filled yet
            found.append((name, cell.cell_contents))
    return found


class Unpicklable(NamedTuple):
    """What :func:`find_unpicklable` found.

    Attributes:
        path: where the part sits, from the outermost name, e.g. ``"cfg['lock']"``.
        part: the object that cannot be pickled.
        error: the pickling error.
        via: the functions it was reached through, outermost first: ``(function's path, variable it uses)``.
    """

    path: str
    part: Any
    error: Exception
    via: tuple[tuple[str, str], ...] = ()


def find_unpicklable(obj: Any, path: str = "", depth: int = 6) -> Unpicklable | None:
    """The deepest part of ``obj`` that cannot be pickled, or None if all of it can.

    Descends into containers, attributes, and the variables a notebook function uses.

    Example:
        >>> import threading
        >>> found = find_unpicklable({"cfg": {"lock": threading.Lock()}})
        >>> found.path, type(found.part).__name__
        ("['cfg']['lock']", 'lock')
    """
    error = _pickles(obj)
    if error is None:
        return None
    if depth > 0:
        if isinstance(obj, types.FunctionType):
            for name, value in _variables_of(obj):
                found = find_unpicklable(value, name, depth - 1)
                if found is not None:
                    return found._replace(via=((path or obj.__name__, name), *found.via))
        for suffix, child in _children(obj) if not isinstance(obj, types.FunctionType) else ():
            found = find_unpicklable(child, path + suffix, depth - 1)
            if found is not None:
                return found
    return Unpicklable(path, obj, error)


def _a(type_name: str) -> str:
    return f"{'an' if type_name[:1].lower() in 'aeiou' else 'a'} {type_name}"


def describe_unpicklable(label: str, name: str, obj: Any, where: str = "the training function") -> str | None:
    """A sentence naming what in ``obj`` (known as ``name``) cannot be shipped and how to fix it, or None if it
    all pickles.

    Example:
        >>> import threading
        >>> print(describe_unpicklable("variable 'cfg' (dict)", "cfg", {"lock": threading.Lock()}, "this cell"))
        ... # doctest: +ELLIPSIS
        variable 'cfg' (dict) cannot be sent to the worker processes: cfg['lock'] is a lock that cannot be ...
        >>> lock = threading.Lock()
        >>> def train():
        ...     with lock:
        ...         return 1
        >>> print(describe_unpicklable("the function 'train'", "train", train))  # doctest: +ELLIPSIS
        the function 'train' cannot be sent to the worker processes: train uses the variable 'lock', a lock that ...
    """
    found = find_unpicklable(obj, name)
    if found is None:
        return None
    what = _a(type(found.part).__name__)
    if found.via:
        (holder, variable), *deeper = found.via
        text = f"{holder} uses the variable {variable!r}"
        for holder, used in deeper:
            text += (", which" if holder == variable else f", whose {holder}") + f" uses the variable {used!r}"
            variable = used
        text += f", {what} that" if found.path == variable else f", whose {found.path} is {what} that"
        where = f"the function {holder!r}"
    else:
        text = "it" if found.path == name else f"{found.path} is {what} that"
    return (
        f"{label} cannot be sent to the worker processes: {text} cannot be pickled "
        f"({type(found.error).__name__}: {found.error}). Build it inside {where} instead (every rank then makes "
        "its own), or pass what it is made from."
    )


def _describe_failure(fn: Callable, args: tuple, kwargs: dict, error: Exception) -> str:
    """Name the piece of the call that cannot be pickled (checked one by one only after a failure)."""
    fn_name = getattr(fn, "__name__", "fn")
    pieces = [(f"the function {fn_name!r}", fn_name, fn)]
    pieces += [(f"argument {i} ({type(arg).__name__})", f"args[{i}]", arg) for i, arg in enumerate(args)]
    pieces += [(f"argument {name!r} ({type(value).__name__})", name, value) for name, value in kwargs.items()]
    for label, name, piece in pieces:
        message = describe_unpicklable(label, name, piece)
        if message:
            return message
    return f"the call cannot be sent to the worker processes: {type(error).__name__}: {error}"


def _write_private(path: str | os.PathLike, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def write_payload(path: str | os.PathLike, fn: Callable, args: tuple, kwargs: dict) -> Packed:
    """Pack ``fn(*args, **kwargs)`` into ``path`` (mode 0600); return its size and the digests of what it holds.

    Raises:
        ShippingError: naming the function or argument that cannot be pickled.
        PayloadWriteError: (an ``OSError``) the file cannot be written (e.g. the disk is full); the message
            names the path.
    """
    try:
        data, digests = _pack((fn, tuple(args), dict(kwargs)))
    except PoolRefError:  # says what happened and what to do
        raise
    except Exception as error:  # noqa: BLE001 - re-raised with the culprit named
        raise ShippingError(_describe_failure(fn, tuple(args), dict(kwargs), error)) from error
    _write_or_explain(path, data, "the run's payload")
    return Packed(len(data), digests)


@dataclass
class SharedPayload:
    """A call packed once for several runs (the attempts of a run that restarts): the file kept for them, and what it
    holds (None until the first run packed it)."""

    path: Path
    packed: Packed | None = None

    def write(self, path: str | os.PathLike, fn: Callable, args: tuple, kwargs: dict) -> Packed:
        """:func:`write_payload` for the first run, which keeps the file here too; each later run gets that file at
        ``path``, nothing packed again.

        Raises:
            ShippingError, PayloadWriteError: as :func:`write_payload`, :func:`place_packed`.
        """
        if self.packed is None:
            packed = write_payload(path, fn, args, kwargs)
            place_packed(path, self.path)
            self.packed = packed
        else:
            place_packed(self.path, path)
        return self.packed


def place_packed(packed_file: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put a payload :func:`write_payload` wrote at ``path`` too, nothing packed again: a hard link where the file
    system allows, else a copy.

    Raises:
        PayloadWriteError: it cannot be placed (e.g. the disk is full); the message names both paths.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        os.link(packed_file, path)
    except OSError:
        try:
            shutil.copyfile(packed_file, path)
            os.chmod(path, 0o600)
        except OSError as error:
            raise PayloadWriteError(
                error.errno, f"cannot put the packed call {packed_file} at {path}: {error.strerror}"
            ) from error


def _write_or_explain(path: str | os.PathLike, data: bytes, what: str) -> None:
    try:
        _write_private(path, data)
    except OSError as error:
        raise PayloadWriteError(
            error.errno, f"cannot write {what} ({len(data)} bytes) to {path}: {error.strerror}"
        ) from error


def write_object(path: str | os.PathLike, obj: Any, label: str) -> tuple[int, str]:
    """Pack one object into ``path`` (mode 0600) as :func:`dumps` does; return its size and sha256 hex digest.

    Raises:
        ShippingError: naming the part of ``obj`` (called ``label`` in the message) that cannot be pickled.
        PayloadWriteError: the file cannot be written.
    """
    try:
        data = dumps(obj)
    except Exception as error:  # noqa: BLE001 - re-raised with the culprit named
        message = describe_unpicklable(label, "obj", obj) or f"{label} cannot be sent to the worker processes: {error}"
        raise ShippingError(message) from error
    _write_or_explain(path, data, label)
    return len(data), hashlib.sha256(data).hexdigest()


def loads(data: bytes) -> Any:
    """Unpack what :func:`dumps` packed (in a worker reading a payload: its corpora lazy if the job says so)."""
    return cloudpickle.loads(data)


def read_payload(path: str | os.PathLike, lazy_corpus: bool | None = False) -> tuple[Callable, tuple, dict]:
    """Unpack what :func:`write_payload` wrote: ``(fn, args, kwargs)``; ``lazy_corpus``: flair corpora in it stay
    compact until read (:func:`flair_nbddp.wire.lazy_corpus.decode_lazy`); None: those that are large
    (:func:`flair_nbddp.wire.lazy_corpus.stays_compact`)."""
    return _load_file(path, _LAZY_CORPORA, lazy_corpus)


def write_result(path: str | os.PathLike, value: Any) -> None:
    """Write a worker's return value to ``path`` (mode 0600).

    Raises:
        ShippingError: if the value cannot be pickled, naming its type.
    """
    try:
        data = dumps(value)
    except Exception as error:  # noqa: BLE001 - re-raised with the value named
        raise ShippingError(
            f"the training function returned a {type(value).__name__} that cannot be sent back to the notebook: "
            f"{type(error).__name__}: {error}. Return plain data, a flair model, or a path to a file."
        ) from error
    _write_private(path, data)


def read_result(path: str | os.PathLike) -> Any:
    """Read a value written by :func:`write_result` (in the parent, from its own run directory).

    Flair models in it arrive on CPU (see :func:`rebuild_model`).
    """
    return _load_file(path, _MODELS_TO_NOTEBOOK, True)


def read_value(data: bytes) -> Any:
    """Unpack a value a worker packed with :func:`dumps` (a rank's value of a ``%%ddp_exec`` cell) in the
    notebook: flair models in it arrive on CPU, as in :func:`read_result`."""
    return _with_flag(_MODELS_TO_NOTEBOOK, True, lambda: cloudpickle.loads(data))


def _load_file(path: str | os.PathLike, flag: threading.local, active: bool | None) -> Any:
    """Unpack the file at ``path`` with ``flag.active`` set to ``active`` meanwhile (read by the rebuilders)."""
    with open(path, "rb") as handle:
        return _with_flag(flag, active, lambda: cloudpickle.load(handle))


def _with_flag(flag: threading.local, active: bool | None, load: Callable[[], Any]) -> Any:
    flag.active = active
    try:
        return load()
    finally:
        flag.active = False
