"""Packing what crosses the process boundary: the function and its arguments, and the result.

Everything goes through cloudpickle, so functions and classes defined in a notebook cell (a
file-less ``__main__``) travel by value. Two kinds of object take another path:

* flair corpora, datasets and sentences go through :mod:`flair_nbddp.codec`, which is compact and
  handles span labels (plain pickling of those fails in flair 0.15.1). Each rank re-encodes what it
  rebuilt and checks it against the parent's hash.
* flair models travel through flair's own ``save``/``load`` state (plain pickling fails for some
  embeddings) and arrive on CPU.

The payload is written once to a file that every rank reads; it is never sent once per worker.

Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "payload.pkl")
    >>> write_payload(path, divmod, (7, 2), {})
    >>> fn, args, kwargs = read_payload(path)
    >>> fn(*args, **kwargs)
    (3, 1)
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any, Callable

import cloudpickle


class ShippingError(TypeError):
    """Something the run needs cannot be sent to the workers (or back); the message names it."""


class CorpusMismatchError(RuntimeError):
    """A worker rebuilt a corpus whose content differs from the parent's."""


def _is_flair_object(obj: object) -> bool:
    return type(obj).__module__.partition(".")[0] == "flair"


def _is_flair_model(obj: object) -> bool:
    from flair.nn import Model

    return isinstance(obj, Model)


def _model_bytes(model: Any) -> bytes:
    state = model._get_state_dict()
    if getattr(model, "model_card", None) is not None:
        state["model_card"] = model.model_card
    buffer = io.BytesIO()
    import torch

    torch.save(state, buffer, pickle_protocol=4)
    return buffer.getvalue()


def rebuild_model(model_class: type, data: bytes) -> Any:
    """Load a flair model from the bytes of its saved state, on CPU and in eval mode."""
    import flair
    import torch

    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    device, flair.device = flair.device, torch.device("cpu")
    try:
        return model_class.load(state)
    finally:
        flair.device = device


def rebuild_corpus(data: bytes, digest: str) -> Any:
    """Decode a codec blob and check that re-encoding what was rebuilt gives the parent's hash."""
    from . import codec

    obj = codec.decode(data)
    rebuilt = codec.fingerprint(obj)
    if rebuilt != digest:
        raise CorpusMismatchError(
            f"the {type(obj).__name__} rebuilt in this process differs from the one built in the notebook "
            f"(content hash {rebuilt[:12]} != {digest[:12]}). This is a bug in flair_nbddp's corpus codec: "
            "please report it; meanwhile build the corpus inside the training function."
        )
    return obj


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with flair corpora through the codec and flair models through save/load."""

    def reducer_override(self, obj: Any) -> Any:
        if _is_flair_object(obj):
            if _is_flair_model(obj):
                return rebuild_model, (type(obj), _model_bytes(obj))
            from . import codec

            if codec.supports(obj):
                data = codec.encode(obj)
                return rebuild_corpus, (data, hashlib.sha256(data).hexdigest())
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """Serialise ``obj`` the way the kit ships everything (see the module docstring)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


def _describe_failure(fn: Callable, args: tuple, kwargs: dict, error: Exception) -> str:
    """Name the piece of the call that cannot be pickled (checked one by one only after a failure)."""
    pieces = [("the function", fn)]
    pieces += [(f"positional argument {i}", arg) for i, arg in enumerate(args)]
    pieces += [(f"keyword argument {name!r}", value) for name, value in kwargs.items()]
    for label, piece in pieces:
        try:
            dumps(piece)
        except Exception as piece_error:  # noqa: BLE001 - any pickling failure is what we look for
            return (
                f"{label} ({type(piece).__name__}) cannot be sent to the worker processes: "
                f"{type(piece_error).__name__}: {piece_error}. Build it inside the training function instead, "
                "or pass what it is made from."
            )
    return f"the call cannot be sent to the worker processes: {type(error).__name__}: {error}"


def _write_private(path: str | os.PathLike, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def write_payload(path: str | os.PathLike, fn: Callable, args: tuple, kwargs: dict) -> int:
    """Pack ``fn(*args, **kwargs)`` into ``path`` (mode 0600) and return its size in bytes.

    Raises:
        ShippingError: naming the function or argument that cannot be pickled.
        OSError: if the file cannot be written (e.g. the disk is full); the message names the path.
    """
    try:
        data = dumps((fn, tuple(args), dict(kwargs)))
    except Exception as error:  # noqa: BLE001 - re-raised with the culprit named
        raise ShippingError(_describe_failure(fn, tuple(args), dict(kwargs), error)) from error
    try:
        _write_private(path, data)
    except OSError as error:
        raise OSError(error.errno, f"cannot write the run's payload ({len(data)} bytes) to {path}: {error.strerror}")
    return len(data)


def read_payload(path: str | os.PathLike) -> tuple[Callable, tuple, dict]:
    """Unpack what :func:`write_payload` wrote: ``(fn, args, kwargs)``."""
    with open(path, "rb") as handle:
        return cloudpickle.load(handle)


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
    """Read a value written by :func:`write_result` (in the parent, from its own run directory)."""
    with open(path, "rb") as handle:
        return cloudpickle.load(handle)
