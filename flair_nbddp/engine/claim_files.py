"""The machine's claim directory: what every kernel's runs hold (and wait for), seen by every process of the machine.

Each holding is one file, ``claim-<user>-<pid>-<random>.json``, written by its holder (mode 0644) and kept locked by
it (``flock``) for as long as it holds: the operating system drops the lock when the holder exits, however it exits, so
a file whose lock is gone is no claim (``kill -9`` of a kernel frees its GPUs at once; its owner's next look removes
the file). A run waiting for devices leaves ``wait-...json`` the same way: its place in the queue. The directory is
``$FLAIR_NBDDP_CLAIMS``, default ``<tmp>/flair_nbddp-claims``, made with mode 1777 (like ``/tmp``): every user may
add claims there, and no user but the directory's owner can remove, rename or alter another user's (made by root, by
an administrator, nobody can). Checking and claiming happen under the directory's own lock, so two kernels never both
take a free GPU. Files that are not the kit's, or that cannot be read, are ignored with a warning naming them.

Example:
    >>> import tempfile
    >>> claims = ClaimDir(Path(tempfile.mkdtemp()) / "claims")
    >>> with claims.mutex():
    ...     held = claims.publish("claim", {"label": "run 'train'", "gpus": ["0"], "cpu": 0})
    >>> [record.label for record in claims.live("claim", include_own=True)], oct(claims.path.stat().st_mode & 0o7777)
    (["run 'train'"], '0o1777')
    >>> claims.withdraw(held); claims.live("claim", include_own=True)
    []
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import json
import math
import os
import re
import secrets
import socket
import stat
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, RunActiveError

CLAIMS_ENV = "FLAIR_NBDDP_CLAIMS"
KINDS = ("claim", "wait")
FORMAT = 1
LOCK_TIMEOUT_SECONDS = 10.0  # the directory's lock is held for milliseconds: longer means its holder is stuck
_NAME = re.compile(r"^(claim|wait)-[\w.-]+-\d+-[0-9a-f]+\.json$")
_own: set[str] = set()  # the names of the files this process holds
_warned: set[str] = set()  # files this process has warned about once


def claims_path() -> Path:
    """Where the machine's claims are kept: ``$FLAIR_NBDDP_CLAIMS``, else ``<tmp>/flair_nbddp-claims``.

    Example:
        >>> chosen = os.environ.pop("FLAIR_NBDDP_CLAIMS", None)
        >>> claims_path().name
        'flair_nbddp-claims'
        >>> os.environ.update({"FLAIR_NBDDP_CLAIMS": chosen} if chosen else {})
    """
    return Path(os.environ.get(CLAIMS_ENV) or Path(tempfile.gettempdir()) / "flair_nbddp-claims").absolute()


def user_name() -> str:
    """This process's user, as claims name it."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid without a name (a container's)
        return f"uid {os.getuid()}"


def where_from() -> str:
    """What this process runs: its notebook's path (Jupyter's server tells its kernels), else its script, else its
    program."""
    session = os.environ.get("JPY_SESSION_NAME")
    if session:
        return session
    main = getattr(sys.modules.get("__main__"), "__file__", None) or (sys.argv[0] if sys.argv else "")
    if "ipykernel" in main:  # a kernel whose server did not say which notebook it runs
        return "a Jupyter kernel"
    return main or "python"


@dataclass(frozen=True)
class ClaimRecord:
    """One live holding (or place in the queue) on this machine, as its file says.

    Attributes:
        kind: ``"claim"`` or ``"wait"``.
        label: what holds it, e.g. ``"run 'train'"`` or ``"WorkerPool pool-x1y2"``.
        user, pid, host, where: who: the user, the process (a kernel), and its notebook or script.
        since: when it was taken (seconds since the epoch).
        gpus: the GPUs it holds or asks for (their machine-wide ids); ``("any",)``: any free GPU.
        cpu: the CPU process slots it holds or asks for; ``capacity``: the slots its holder counts.
        units: other things only one run uses at a time (a pool's workers, a Dask worker).
        shared: it was taken with ``share_gpus=True`` beside another run on the same GPU.
        path: its file.
    """

    kind: str
    label: str
    user: str
    pid: int
    host: str
    where: str
    since: float
    gpus: tuple[str, ...] = ()
    cpu: int = 0
    capacity: int = 0
    units: tuple[str, ...] = ()
    shared: bool = False
    path: Path = field(default=Path(), compare=False)

    def holder(self) -> str:
        """How messages name it: ``run 'train' of alice (pid 4242, analysis.ipynb, since 10:02:13)``."""
        clock = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"{self.label} of {self.user} (pid {self.pid}, {self.where}, since {clock})"

    def fields(self) -> dict[str, Any]:
        """What its file holds."""
        return {"format": FORMAT, "kind": self.kind, "label": self.label, "user": self.user, "pid": self.pid,
                "host": self.host, "where": self.where, "since": self.since, "gpus": list(self.gpus), "cpu": self.cpu,
                "capacity": self.capacity, "units": list(self.units), "shared": self.shared}  # fmt: skip

    @classmethod
    def read(cls, path: Path, text: str) -> ClaimRecord | None:
        """The record a claim file holds; None if it holds none of this format (or a time or pid out of range).

        Raises:
            ValueError: (``json``'s, or a field's) it is not JSON, or a field is not of its type.
        """
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("kind") not in KINDS:
            return None
        if not math.isfinite(float(data["since"])) or int(data["pid"]) < 1:
            return None
        return cls(
            kind=data["kind"], label=str(data["label"]), user=str(data["user"]), pid=int(data["pid"]),
            host=str(data["host"]), where=str(data["where"]), since=float(data["since"]),
            gpus=tuple(map(str, data.get("gpus", ()))), cpu=int(data.get("cpu", 0)),
            capacity=int(data.get("capacity", 0)), units=tuple(map(str, data.get("units", ()))),
            shared=bool(data.get("shared", False)), path=path,
        )  # fmt: skip


@dataclass
class Held:
    """A claim file this process wrote, and the open descriptor whose lock keeps it live."""

    path: Path
    fd: int
    record: ClaimRecord


class ClaimDir:
    """The claim directory at ``path`` (default :func:`claims_path`), made on first use."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or claims_path()
        self._checked = False

    def ensure(self) -> Path:
        """Make the directory (mode 1777) if it is missing, and check that this process can claim there (an existing
        one keeps its mode: a private one, 0700, sees only its owner's runs).

        Raises:
            ConfigurationError: it is not a directory, or this user cannot write there (the message says what to
                set instead).
        """
        if self._checked:
            return self.path
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.path.mkdir()
                os.chmod(self.path, 0o1777)  # not the umask's: every user may claim, nobody removes another's
            info = self.path.lstat()
        except OSError as error:
            raise self._unusable(f"it cannot be made ({error.strerror})") from None
        if not stat.S_ISDIR(info.st_mode):
            raise self._unusable("it is not a directory")
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise self._unusable(f"user {user_name()} cannot write there")
        if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            _warn_once(str(self.path), f"the claim directory {self.path} is writable by every user without the "
                       "sticky bit, so anyone can remove another's claims: chmod +t it, or set $FLAIR_NBDDP_CLAIMS to "
                       "a directory of mode 1777")  # fmt: skip
        elif info.st_mode & stat.S_IWOTH and info.st_uid not in (0, os.getuid()):
            _warn_once(str(self.path), f"the claim directory {self.path} belongs to uid {info.st_uid}, who can "
                       "remove other users' claims there (a sticky directory's owner can): an administrator can make "
                       f"it once as root (sudo mkdir -m 1777 {self.path})")  # fmt: skip
        self._checked = True
        return self.path

    def _unusable(self, why: str) -> ConfigurationError:
        return ConfigurationError(
            f"the machine's claim directory {self.path} is unusable: {why}. Set ${CLAIMS_ENV} to a directory every "
            "user of the kit on this machine can write (mode 1777, like /tmp), or to a private one to see only your "
            "own runs"
        )

    @contextlib.contextmanager
    def mutex(self) -> Iterator[None]:
        """Hold the directory's own lock: one process at a time checks and changes the claims.

        Raises:
            RunActiveError: another process has held it for :data:`LOCK_TIMEOUT_SECONDS` (one stopped with Ctrl-Z
                while it held it, say): the message names how to find it.
        """
        fd = os.open(self.ensure(), os.O_RDONLY | os.O_DIRECTORY)
        try:
            deadline = time.monotonic() + LOCK_TIMEOUT_SECONDS
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RunActiveError(
                            f"another process has held the lock of the machine's claim directory {self.path} for "
                            f"{LOCK_TIMEOUT_SECONDS:g} s (one stopped with Ctrl-Z while it held it?): `fuser -v "
                            f"{self.path}` names it; end or continue it, or set ${CLAIMS_ENV} to another directory"
                        ) from None
                    time.sleep(0.005)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def publish(self, kind: str, fields: dict[str, Any]) -> Held:
        """Write and lock a new ``kind`` file for this process (under :meth:`mutex`): it is live until withdrawn
        or until this process exits."""
        record = {"format": FORMAT, "kind": kind, "user": user_name(), "pid": os.getpid(),
                  "host": socket.gethostname(), "where": where_from(), "since": time.time(), **fields}  # fmt: skip
        user = re.sub(r"[^\w.-]", "_", record["user"])
        # a name nobody can guess (nor take first: a container's kernel may have this one's pid and user)
        path = self.ensure() / f"{kind}-{user}-{os.getpid()}-{secrets.token_hex(8)}.json"
        held = self._write(path, record)
        _own.add(path.name)
        return held

    def rewrite(self, held: Held, fields: dict[str, Any]) -> Held:
        """``held`` with ``fields`` changed (under :meth:`mutex`): a new file, locked, takes its place whole."""
        record = {**held.record.fields(), **fields}
        renewed = self._write(held.path, record)
        os.close(held.fd)
        return renewed

    def _write(self, path: Path, record: dict[str, Any]) -> Held:
        """``record`` written to a new file that takes the name ``path``, locked before it has that name (no reader
        sees it unlocked, nor half written)."""
        partial = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)  # never another's file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.fchmod(fd, 0o644)
            data = json.dumps(record).encode()
            written = 0
            while written < len(data):  # a full disk raises
                written += os.write(fd, data[written:])
            os.rename(partial, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        return Held(path, fd, ClaimRecord.read(path, data.decode()))

    def withdraw(self, held: Held) -> None:
        """Remove a file this process published, and drop its lock."""
        _own.discard(held.path.name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(held.path)
        with contextlib.suppress(OSError):
            os.close(held.fd)

    def live(self, kind: str, include_own: bool = False) -> list[ClaimRecord]:
        """The live ``kind`` records of the machine, oldest first (with ``include_own``, this process's too).

        A file whose lock is gone is no claim: its owner's look removes it, others pass it by. Files that are not
        claims, or cannot be read, are passed by with one warning each."""
        records = []
        if not self.path.is_dir():
            return records
        for path in sorted(self.path.iterdir()):
            name = path.name
            if name.startswith(".") or name.startswith(f"{_other(kind)}-"):
                continue
            if not _NAME.match(name):
                _warn_once(str(path), f"{path} is not a flair_nbddp claim; it is ignored (remove it, or keep "
                           f"${CLAIMS_ENV} for the kit's claims alone)")  # fmt: skip
                continue
            record = _read_live(path) if include_own or name not in _own else None
            if record is not None:
                records.append(record)
        return sorted(records, key=lambda record: (record.since, record.path.name))


def _other(kind: str) -> str:
    return next(other for other in KINDS if other != kind)


def _read_live(path: Path) -> ClaimRecord | None:
    """The record of ``path`` if its holder still holds it; a dead holder's file goes if this user owns it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO or a link of someone's does not hold
    except FileNotFoundError:
        return None  # withdrawn meanwhile
    except OSError as error:
        _warn_once(str(path), f"{path} cannot be read ({error.strerror}); it is ignored")
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _warn_once(str(path), f"{path} is not a regular file; it is ignored")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        else:  # nobody holds it: its holder is gone
            if os.fstat(fd).st_uid == os.getuid():
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return None
        text = os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)
    try:
        record = ClaimRecord.read(path, text)
    except (ValueError, KeyError, TypeError) as error:
        record, why = None, f"{type(error).__name__}: {error}"
    else:
        why = f"not a format-{FORMAT} claim, or a field out of range"
    if record is None:
        _warn_once(str(path), f"{path} is not a readable flair_nbddp claim ({why}); it is ignored")
    return record


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
