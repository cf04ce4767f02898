"""The run ledger: every run of the kit kept in one SQLite file, across kernels and restarts.

The notebook's process writes it while a run goes (:mod:`~flair_nbddp.engine.recorder`): a row when the run starts,
its metrics in batches, its end. :func:`history` reads it back, newest first, as :class:`RunRecord` objects;
a run whose kernel died before it ended reads as ``"lost"`` the next time the ledger is opened.

Where: ``$FLAIR_NBDDP_HOME/runs.sqlite``, default ``~/.flair_nbddp/runs.sqlite`` (created 0700 and 0600).
``FLAIR_NBDDP_LEDGER=0`` turns recording off. Several kernels may write at once: the file is in SQLite's WAL
mode and every write waits for a busy file, then retries. It holds what describes a run (code, parameters,
sizes and hashes of corpora, versions, metrics), never a corpus or a model, and no environment.

Example::

    from flair_nbddp import history
    history(limit=3)        # [RunRecord(#12 train: finished, 2 × cpu (gloo), 2026-12-03 19:02, 31.2 s, ...), ...]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from ..errors import ConfigurationError, LedgerError
from ..engine.state import MetricPoint

HOME_ENV = "FLAIR_NBDDP_HOME"
SWITCH_ENV = "FLAIR_NBDDP_LEDGER"
FILE_NAME = "runs.sqlite"
SCHEMA_VERSION = 3  # 2: checkpoints, resumed_from; 3: trial
BUSY_SECONDS = 10.0  # how long a write waits for another kernel's
ATTEMPTS = 3  # a write that still finds the file busy is tried again this many times in all
ENDED = ("finished", "stopped", "failed", "lost")
_T = TypeVar("_T")


def kit_home() -> Path:
    """The kit's own directory: ``$FLAIR_NBDDP_HOME``, default ``~/.flair_nbddp`` (the run ledger, sweeps' studies).

    Example:
        >>> (kit_home() / "runs.sqlite") == ledger_path()     # with FLAIR_NBDDP_LEDGER unset
        True
    """
    return Path(os.environ.get(HOME_ENV, "").strip() or Path.home() / ".flair_nbddp").expanduser().absolute()


def ledger_path() -> Path | None:
    """The ledger's file, or None when ``$FLAIR_NBDDP_LEDGER`` is ``0`` (or ``off``, ``false``, ``no``).

    Example:
        >>> ledger_path().name                       # with FLAIR_NBDDP_LEDGER unset
        'runs.sqlite'
    """
    if os.environ.get(SWITCH_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    return kit_home() / FILE_NAME


def _this_boot() -> str:
    """This machine's boot and this process's pid namespace (Linux): pids are comparable only within both."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = "".join(filter(str.isdigit, os.readlink("/proc/self/ns/pid")))
    except OSError:
        return "-"
    return f"{boot}/{namespace}"


def process_identity(pid: int | None = None) -> str:
    """``"<pid>:<start time>:<boot>/<pid namespace>"`` of a process (default this one): a pid reused by a later
    process, after a reboot or in another container differs."""
    process = psutil.Process(pid)
    return f"{process.pid}:{process.create_time():.2f}:{_this_boot()}"


def owner_alive(identity: str) -> bool | None:
    """Whether the process of :func:`process_identity` ``identity`` still runs; None when this process cannot
    tell (another container's pid namespace).

    Example:
        >>> owner_alive(process_identity()), owner_alive("1:12.00:another-boot/1")
        (True, False)
    """
    pid, started, boot = (identity.split(":", 2) + ["", ""])[:3]
    if boot != _this_boot():
        same_machine = boot.partition("/")[0] == _this_boot().partition("/")[0]
        return None if same_machine else False  # a pid namespace of its own: cannot tell; else rebooted since
    try:
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 1.0
    except (psutil.Error, ValueError):
        return False


@dataclass
class RunRecord:
    """One run as the ledger keeps it (what :func:`history` returns).

    Attributes:
        id: the run's number in the ledger (``RunResult.record_id``).
        started_at, ended_at: ``time.time()`` values (``ended_at`` None while it runs).
        status: ``"running"``, ``"finished"``, ``"stopped"``, ``"failed"``, or ``"lost"`` (its kernel died).
        error: the failure in a line or a few (None unless failed or lost).
        name: the function's name (``"%%ddp_train"`` for a cell of the magic).
        origin: ``"launch"``, ``"start"``, ``"%%ddp_train"``, ``"%%ddp_exec"``, ``"exec"``, ``"panel"`` or ``"sweep"``;
            ``workers``: ``"ColdWorkers"``, ``"WorkerPool"``, or another worker source's class.
        source, source_hash: the function's source (the cell's, for the magic) and its sha256.
        params: the call as described for the record: ``{"args": [...], "kwargs": {...}}`` (the magic:
            ``{"variables": {...}}``); a corpus is ``{"type": "Corpus", "train": n, "dev": n, "test": n,
            "sha256": ...}``; values named like secrets are masked.
        options: the run's options (timeouts, ``distributed_eval``...) and the magic's line.
        seed, world_size, device_type, backend, devices, host: where and how it ran.
        versions: python, torch, flair, transformers and flair_nbddp.
        final_metrics, scores: every metric's last value; the numbers worth comparing (the value's numeric entries,
            ``dev/score``, ``train/loss``).
        ranks: each rank's last word (pid, device, steps, samples, samples/s, memory, exit code, host, Dask worker).
        checkpoint, models: the model saved by a stop; every model file flair saved.
        checkpoints: every full checkpoint rank 0 wrote, ``{"epoch", "path", "sha256", "batch", "steps"}``, in order
            (a resume continues from the last; a resumed run's list starts with the one it began from, and its
            metrics with the earlier run's curve up to there); resumed_from: the id of the run this one resumed from
            (None: none).
        trial: for a sweep's trial (:func:`flair_nbddp.sweep`), ``{"study", "number", "params", "state", "value"}``,
            the state ``"running"``, ``"complete"``, ``"pruned"``, ``"failed"`` or ``"stopped"``, the value Optuna
            was told (None unless complete); else empty.
        run_dir, elapsed, samples_per_second, time_to_first_batch: as in :class:`~flair_nbddp.RunResult`.

    Example::

        best = max(history(name="train", status="finished"), key=lambda r: r.scores.get("dev/score", 0))
        best.history("dev/score")       # [(1, 0.71), (2, 0.86)]
    """

    id: int | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    updated_at: float | None = None
    status: str = "running"
    error: str | None = None
    name: str = ""
    origin: str = "launch"
    workers: str = ""
    source: str | None = None
    source_hash: str | None = None
    params: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    seed: int | None = None
    world_size: int = 0
    device_type: str = ""
    backend: str = ""
    devices: str = ""
    host: str = ""
    owner: str = ""
    versions: dict = field(default_factory=dict)
    final_metrics: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)
    checkpoint: str | None = None
    models: list = field(default_factory=list)
    checkpoints: list = field(default_factory=list)
    resumed_from: int | None = None
    trial: dict = field(default_factory=dict)
    run_dir: str | None = None
    elapsed: float | None = None
    samples_per_second: float | None = None
    time_to_first_batch: float | None = None
    ledger: Ledger | None = field(default=None, repr=False, compare=False)

    def history(self, metric: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs of one metric, e.g. ``"dev/score"``, read from the ledger.

        Raises:
            LedgerError: the ledger cannot be read any more.
        """
        return [(point.step, point.value) for point in self.metrics(metric)]

    def metrics(self, name: str | None = None) -> list[MetricPoint]:
        """Every recorded metric point, in order (only ``name``'s if given)."""
        if self.ledger is None or self.id is None:
            return []
        return self.ledger.metrics(self.id, name)

    @property
    def resumed_at(self) -> tuple[int, int] | None:
        """``(epoch, step)`` of the checkpoint the run continued from (as :attr:`~flair_nbddp.RunResult.resumed_at`);
        None for a run from the start."""
        if self.resumed_from is None or not self.checkpoints:
            return None
        return int(self.checkpoints[0]["epoch"]), int(self.checkpoints[0].get("steps", 0))

    @property
    def kwargs(self) -> dict:
        """The keyword arguments as recorded (empty for the magic, which records ``params["variables"]``)."""
        return self.params.get("kwargs", {})

    def __repr__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.started_at))
        parts = [f"#{self.id} {self.name}: {self.status}", self.devices, when]
        if self.elapsed is not None:
            parts.append(f"{self.elapsed:.1f} s")
        parts += [f"{name} {value:.4f}" for name, value in self.scores.items()]
        return "RunRecord(" + ", ".join(part for part in parts if part) + ")"


_COLUMNS = [item.name for item in dataclasses.fields(RunRecord) if item.name not in ("id", "ledger")]
_JSON = {"params", "options", "versions", "final_metrics", "scores", "ranks", "models", "checkpoints", "trial"}
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY AUTOINCREMENT, {", ".join(_COLUMNS)});
CREATE INDEX IF NOT EXISTS runs_name ON runs (name, id);
CREATE TABLE IF NOT EXISTS metrics (run_id INTEGER NOT NULL, name TEXT NOT NULL, step INTEGER, value REAL, time REAL);
CREATE INDEX IF NOT EXISTS metrics_run ON metrics (run_id, name);
"""
_PREPARED: set[Path] = set()  # ledgers this process has created or checked
_PREPARING = threading.Lock()


def _add_new_columns(connection: sqlite3.Connection) -> None:
    """Bring a ledger an earlier flair_nbddp wrote up to this schema: the columns it lacks (empty in its rows)."""
    present = {row[1] for row in connection.execute("PRAGMA table_info(runs)")}
    for name in _COLUMNS:
        if name not in present:
            try:
                connection.execute(f"ALTER TABLE runs ADD COLUMN {name}")
            except sqlite3.OperationalError as error:  # another process added it meanwhile
                if "duplicate column" not in str(error):
                    raise


def _insert_points(connection: sqlite3.Connection, run_id: int, points: list[MetricPoint]) -> None:
    connection.executemany(
        "INSERT INTO metrics VALUES (?, ?, ?, ?, ?)",
        [(run_id, point.name, point.step, point.value, point.time) for point in points],
    )


def _to_row(record: RunRecord) -> list[Any]:
    return [json.dumps(getattr(record, name)) if name in _JSON else getattr(record, name) for name in _COLUMNS]


class Ledger:
    """The SQLite file of runs. Every method opens it for one transaction, so any thread may call any method.

    Raises (every method):
        LedgerError: the file cannot be created, read or written (damaged, not a database, no permission,
            written by a newer flair_nbddp); the message names the file and the way out.

    Example:
        >>> import tempfile
        >>> ledger = Ledger(Path(tempfile.mkdtemp()) / "runs.sqlite")
        >>> run_id = ledger.insert(RunRecord(started_at=time.time(), name="train", owner=process_identity()))
        >>> ledger.append_metrics(run_id, [MetricPoint("dev/score", 0.5, 1, 0.0)])
        >>> ledger.end(run_id, status="finished")
        >>> [(r.name, r.status, r.history("dev/score")) for r in ledger.records()]
        [('train', 'finished', [(1, 0.5)])]
        >>> oct(ledger.path.stat().st_mode & 0o777)
        '0o600'
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).absolute()

    @classmethod
    def default(cls) -> Ledger | None:
        """The ledger of :func:`ledger_path`; None when recording is off."""
        path = ledger_path()
        return None if path is None else cls(path)

    # -- writing ----------------------------------------------------------------------------------
    def insert(self, record: RunRecord) -> int:
        """Add a run and return its id (runs of this host whose kernel died are marked lost first)."""
        placeholders = ", ".join("?" * len(_COLUMNS))

        def write(connection: sqlite3.Connection) -> int:
            self._mark_lost(connection, self._lost(connection))
            cursor = connection.execute(
                f"INSERT INTO runs ({', '.join(_COLUMNS)}) VALUES ({placeholders})", _to_row(record)
            )
            return int(cursor.lastrowid)

        return self._transaction(write)

    def append_metrics(
        self, run_id: int, points: list[MetricPoint], busy: float = BUSY_SECONDS, attempts: int = ATTEMPTS,
        checkpoints: list | None = None,
    ) -> None:  # fmt: skip
        """Append metric points to run ``run_id`` (and note the time, which dates a lost run's end); with
        ``checkpoints``, its full checkpoints so far."""

        def write(connection: sqlite3.Connection) -> None:
            _insert_points(connection, run_id, points)
            connection.execute("UPDATE runs SET updated_at = ? WHERE id = ?", (time.time(), run_id))
            if checkpoints is not None:
                connection.execute("UPDATE runs SET checkpoints = ? WHERE id = ?", (json.dumps(checkpoints), run_id))

        self._transaction(write, busy, attempts)

    def end(self, run_id: int, points: list[MetricPoint] = (), **fields: Any) -> None:
        """Write how run ``run_id`` ended (``fields``; ``ended_at`` defaults to now) and its last ``points``, once:
        a run that has its end already is left as it is, so writing an end again adds nothing."""
        unknown = set(fields) - set(_COLUMNS)
        if unknown:
            raise ConfigurationError(f"not fields of a RunRecord: {', '.join(sorted(unknown))}")
        fields = {"ended_at": time.time(), **fields}
        values = [json.dumps(value) if name in _JSON else value for name, value in fields.items()]

        def write(connection: sqlite3.Connection) -> None:
            assignments = ", ".join(f"{name} = ?" for name in fields)
            ended = connection.execute(
                f"UPDATE runs SET {assignments} WHERE id = ? AND ended_at IS NULL", [*values, run_id]
            )
            if ended.rowcount == 1:
                _insert_points(connection, run_id, points)

        self._transaction(write)

    def update(self, run_id: int, **fields: Any) -> None:
        """Set ``fields`` of run ``run_id``, ended or not (a sweep's verdict on its trial comes after the run)."""
        unknown = set(fields) - set(_COLUMNS)
        if unknown:
            raise ConfigurationError(f"not fields of a RunRecord: {', '.join(sorted(unknown))}")
        values = [json.dumps(value) if name in _JSON else value for name, value in fields.items()]

        def write(connection: sqlite3.Connection) -> None:
            assignments = ", ".join(f"{name} = ?" for name in fields)
            connection.execute(f"UPDATE runs SET {assignments} WHERE id = ?", [*values, run_id])

        self._transaction(write)

    # -- reading ----------------------------------------------------------------------------------
    def get(self, run_id: int) -> RunRecord | None:
        """Run ``run_id``'s record (None: the ledger has no such run)."""
        found = self.records(limit=1, run_id=run_id)
        return found[0] if found else None

    def records(
        self, limit: int | None = 20, status: str | None = None, name: str | None = None, origin: str | None = None,
        busy: float = BUSY_SECONDS, attempts: int = ATTEMPTS, run_id: int | None = None,
    ) -> list[RunRecord]:  # fmt: skip
        """Runs, newest first, filtered by status, name, origin and id (runs of dead kernels marked lost first);
        ``busy`` and ``attempts`` as for a write (a view passes short ones)."""
        given = (("status", status), ("name", name), ("origin", origin), ("id", run_id))
        conditions = [(column, value) for column, value in given]
        conditions = [(column, value) for column, value in conditions if value is not None]
        where = " AND ".join(f"{column} = ?" for column, _ in conditions) or "1"
        values = [value for _, value in conditions] + [-1 if limit is None else int(limit)]

        def read(connection: sqlite3.Connection) -> list[RunRecord]:
            cursor = connection.execute(f"SELECT * FROM runs WHERE {where} ORDER BY id DESC LIMIT ?", values)
            names = [column[0] for column in cursor.description]
            return [self._record(dict(zip(names, row))) for row in cursor.fetchall()]

        lost = self._transaction(self._lost, busy, attempts, write=False)
        if lost:  # the one write a read makes, and only when a run was lost
            self._transaction(lambda connection: self._mark_lost(connection, lost), busy, attempts)
        return self._transaction(read, busy, attempts, write=False)

    def metrics(self, run_id: int, name: str | None = None) -> list[MetricPoint]:
        """Run ``run_id``'s metric points in the order they were recorded (only ``name``'s if given)."""
        query = "SELECT name, value, step, time FROM metrics WHERE run_id = ?" + (" AND name = ?" if name else "")
        parameters = (run_id, name) if name else (run_id,)

        def read(connection: sqlite3.Connection) -> list[tuple]:
            return connection.execute(query + " ORDER BY rowid", parameters).fetchall()

        return [MetricPoint(*row) for row in self._transaction(read, write=False)]

    def _record(self, row: dict[str, Any]) -> RunRecord:
        values = {name: json.loads(value) if name in _JSON else value for name, value in row.items()
                  if not (name in _JSON and value is None)}  # an older ledger's row: the field's default  # fmt: skip
        return RunRecord(**{name: value for name, value in values.items() if name in _COLUMNS or name == "id"}, ledger=self)

    # -- the file ---------------------------------------------------------------------------------
    @staticmethod
    def _lost(connection: sqlite3.Connection) -> list[tuple[int, str]]:
        """The runs of this host still "running" whose kernel process is gone: ``(id, pid)`` each."""
        rows = connection.execute(
            "SELECT id, owner FROM runs WHERE status = 'running' AND host = ?", (socket.gethostname(),)
        ).fetchall()
        return [(run_id, (owner or "?").partition(":")[0]) for run_id, owner in rows if owner_alive(owner or "") is False]

    @staticmethod
    def _mark_lost(connection: sqlite3.Connection, lost: list[tuple[int, str]]) -> None:
        for run_id, pid in lost:
            connection.execute(
                "UPDATE runs SET status = 'lost', ended_at = COALESCE(updated_at, started_at), error = ? "
                "WHERE id = ? AND status = 'running'",
                (f"lost: the process that ran it (pid {pid}) ended before the run did", run_id),
            )

    def _transaction(
        self, work: Callable[[sqlite3.Connection], _T], busy: float = BUSY_SECONDS, attempts: int = ATTEMPTS,
        write: bool = True,
    ) -> _T:  # fmt: skip
        """``work`` in one transaction (a write one, or a read), waiting up to ``busy`` s for another writer,
        tried ``attempts`` times while the file stays busy."""
        self._prepare()
        attempt = 1
        while True:
            try:
                with self._connection(busy) as connection:
                    connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                    try:
                        value = work(connection)
                    except BaseException:
                        if connection.in_transaction:  # SQLite may have rolled back already (a full disk)
                            with contextlib.suppress(sqlite3.Error):
                                connection.execute("ROLLBACK")
                        raise
                    connection.execute("COMMIT")
                    return value
            except sqlite3.Error as error:
                explained = self._explain(error)
                if not explained.busy or attempt >= attempts:
                    raise explained from error
            attempt += 1

    @contextlib.contextmanager
    def _connection(self, busy: float) -> Iterator[sqlite3.Connection]:
        # mode=rw: never create the file here (only _prepare does, private and with its tables)
        connection = sqlite3.connect(f"{self.path.as_uri()}?mode=rw", uri=True, timeout=busy, isolation_level=None)
        try:
            connection.execute("PRAGMA synchronous = NORMAL")  # WAL: a commit is one append, synced at checkpoints
            yield connection
        finally:
            connection.close()

    def _prepare(self) -> None:
        """Create the directory (0700), the file (0600), WAL mode and the tables, once per process (again if the
        file was moved away meanwhile)."""
        with _PREPARING:
            if self.path in _PREPARED and self.path.exists():
                return
            try:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
                with self._connection(BUSY_SECONDS) as connection:
                    version = connection.execute("PRAGMA user_version").fetchone()[0]
                    if version > SCHEMA_VERSION:
                        raise LedgerError(
                            f"the run ledger {self.path} was written by a newer flair_nbddp (schema {version}, this "
                            f"one reads {SCHEMA_VERSION}): upgrade flair_nbddp, or point {HOME_ENV} at another directory"
                        )
                    connection.execute("PRAGMA journal_mode = WAL")
                    connection.executescript(_SCHEMA)
                    if version < SCHEMA_VERSION:
                        _add_new_columns(connection)
                        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except (sqlite3.Error, OSError) as error:
                raise self._explain(error) from error
            _PREPARED.add(self.path)

    def _explain(self, error: Exception) -> LedgerError:
        cause, busy = f"{type(error).__name__}: {error}", "locked" in str(error) or "busy" in str(error)
        if isinstance(error, sqlite3.DatabaseError) and not isinstance(error, sqlite3.OperationalError):
            aside = self.path.parent / "damaged"
            fix = (
                f"it is damaged or not an SQLite file. Move it aside with its -wal and -shm files (mkdir {aside} && "
                f"mv {self.path}* {aside}/) and the next run starts a new one"
            )
        elif busy:
            fix = "another process kept it busy for too long"
        else:
            fix = f"check that {self.path.parent} is a directory you can write to, with room on its disk"
        explained = LedgerError(
            f"the run ledger {self.path} cannot be used ({cause}): {fix}; or point {HOME_ENV} at another directory, "
            f"or set {SWITCH_ENV}=0 to record nothing"
        )
        explained.busy = busy
        return explained


def history(limit: int | None = 20, status: str | None = None, name: str | None = None) -> list[RunRecord]:
    """The runs recorded in the ledger, newest first, from every kernel that used it.

    Args:
        limit: at most this many (None: all).
        status: only runs that ended so (``"finished"``, ``"stopped"``, ``"failed"``, ``"lost"``) or ``"running"``.
        name: only runs of the function of this name (``"%%ddp_train"`` for the magic's cells).

    Raises:
        LedgerError: the ledger is off (``FLAIR_NBDDP_LEDGER=0``) or cannot be read; the message says why.

    Example::

        from flair_nbddp import history, compare
        recent = history(limit=5, name="train")
        recent[0].scores, recent[0].params["kwargs"]
        compare(recent)                                  # their dev/score curves in one figure
    """
    ledger = Ledger.default()
    if ledger is None:
        raise LedgerError(f"the run ledger is off ({SWITCH_ENV}=0): unset {SWITCH_ENV} to record runs again")
    return ledger.records(limit, status, name)
