"""What the run ledger records of a call: where it came from, its code, and its parameters described.

A parameter is kept as it is when it is plain data (numbers, short strings, lists and dicts of them). A flair
corpus or dataset is kept as its sizes and the sha256 of the bytes shipped to the workers, never its content;
anything else as its type. Values whose name says they are secret (``token``, ``password``, ``api_key``...) and
strings that look like an access token (``hf_...``, ``sk-...``, ``ghp_...``, ``AKIA...``) are masked, and so is
the password of a URL.

Example:
    >>> from flair_nbddp.synthetic import sentiment_corpus
    >>> describe({"lr": 0.1, "hf_token": "hf_abc", "corpus": sentiment_corpus(8, 2, 2)})
    {'lr': 0.1, 'hf_token': '***', 'corpus': {'type': 'Corpus', 'train': 8, 'dev': 2, 'test': 2}}
"""

from __future__ import annotations

import hashlib
import inspect
import marshal
import math
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Callable

from ..wire.payload import is_flair_object, sizes

SECRET = re.compile(
    r"token|secret|passw|pwd|passphrase|credential|auth(?!or)|cookie|bearer|(^|[_-])key$|_?key_|api_?key|access_?key",
    re.IGNORECASE,
)  # a parameter's name
TOKEN = re.compile(r"^(hf_|sk-|sk_|ghp_|gho_|ghs_|github_pat_|xox[abp]-|glpat-|AKIA|ASIA)[A-Za-z0-9_\-]{8,}$")
URL_PASSWORD = re.compile(r"(://[^/:@\s]*):[^/@\s]*@")  # scheme://user:password@host
MAX_TEXT = 500  # characters of a string parameter kept
MAX_ITEMS = 50  # items of a list or dict kept; a longer one is recorded by its type and length
MAX_DEPTH = 4


@dataclass(frozen=True)
class Provenance:
    """How a run was asked for, as the ledger records it (the magic and the panel fill in theirs).

    Attributes:
        origin: ``"launch"``, ``"start"``, ``"%%ddp_train"``, ``"panel"`` or ``"sweep"``.
        name: recorded instead of the function's name.
        source: recorded instead of the function's source (the magic's cell).
        params: described instead of the call's ``args``/``kwargs`` (the magic's notebook variables).
        options: recorded with the run's own options (the magic's line).
        trial: a sweep's trial: its study, number, parameters and state (:func:`flair_nbddp.sweep`).
    """

    origin: str = "launch"
    name: str | None = None
    source: str | None = None
    params: dict | None = None
    options: dict = field(default_factory=dict)
    trial: dict = field(default_factory=dict)


def describe(value: Any, digests: dict[int, str] | None = None, depth: int = 0) -> Any:
    """``value`` as JSON-ready data for the ledger; ``digests`` maps ``id(obj)`` to the sha256 its packing gave.

    Example:
        >>> describe([1, "a", None, 2.5]), describe(object())
        ([1, 'a', None, 2.5], {'type': 'object'})
        >>> describe(["hf_aBcDeFgHiJkLmN", "https://me:pa55@hub.example.org/x"])
        ['***', 'https://me:***@hub.example.org/x']
    """
    digests = digests or {}
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        if TOKEN.match(value.strip()):
            return "***"
        value = URL_PASSWORD.sub(r"\1:***@", value)
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + f"... ({len(value)} characters)"
    if isinstance(value, PurePath):
        return str(value)
    recorded = getattr(type(value), "__flair_nbddp_record__", None)  # a PoolRef: the object put, described when put
    if recorded is not None:
        return recorded(value)
    if is_flair_object(value):
        described = {"type": type(value).__name__, **sizes(value)}
        return described if id(value) not in digests else {**described, "sha256": digests[id(value)]}
    if depth < MAX_DEPTH and isinstance(value, (list, tuple)) and len(value) <= MAX_ITEMS:
        return [describe(item, digests, depth + 1) for item in value]
    if depth < MAX_DEPTH and isinstance(value, dict) and len(value) <= MAX_ITEMS:
        return {
            str(key): "***" if SECRET.search(str(key)) and item is not None else describe(item, digests, depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple, dict, set)):
        return {"type": type(value).__name__, "len": len(value)}
    return {"type": type(value).__name__}


def describe_call(args: tuple, kwargs: dict, digests: dict[int, str] | None = None) -> dict:
    """The call's arguments described: ``{"args": [...], "kwargs": {...}}``."""
    return {"args": describe(list(args), digests), "kwargs": describe(dict(kwargs), digests)}


def sha256_text(text: str) -> str:
    """The sha256 hex digest of a source text, as the ledger keeps it."""
    return hashlib.sha256(text.encode()).hexdigest()


def source_of(fn: Callable) -> tuple[str | None, str | None]:
    """``fn``'s source (a notebook cell's function too) and a sha256 of it; without a source, the hash of its
    compiled code (None for a callable that has none).

    Example:
        >>> source, digest = source_of(sizes)
        >>> source.startswith("def sizes"), len(digest)
        (True, 64)
    """
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        return None, None if code is None else hashlib.sha256(marshal.dumps(code)).hexdigest()
    return source, sha256_text(source)
