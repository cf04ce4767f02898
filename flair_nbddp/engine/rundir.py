"""A run's private directory and the files in it, and reading a rank's log as it grows.

Every run has a directory of mode 0700 under :func:`runs_root` (or the ``run_dir=`` the user named), on a
warm pool too: ``rank<r>.log`` (each rank's output during this run), ``rank<r>.stderr`` (its stderr lines and flair's
warnings, which the cell shows for every rank), ``payload.pkl`` (the call, packed once,
read by every rank) and ``result.pkl`` (rank 0's return value). A group of workers keeps its own
``stacks-rank<r>.txt`` (the hang watchdog's stack dumps) and start-up logs in the directory it started in.

Example:
    >>> import tempfile
    >>> run_dir = RunDir.create(tempfile.mkdtemp())
    >>> run_dir.log(1).name, run_dir.payload.name, oct(run_dir.path.stat().st_mode & 0o777)
    ('rank1.log', 'payload.pkl', '0o700')
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

RUNS_ENV = "FLAIR_NBDDP_RUNS"


def runs_root() -> Path:
    """Where run directories go: ``$FLAIR_NBDDP_RUNS``, else ``<tmp>/flair_nbddp-<uid>`` (mode 0700)."""
    root = Path(os.environ.get(RUNS_ENV) or Path(tempfile.gettempdir()) / f"flair_nbddp-{os.getuid()}").absolute()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    return root


@dataclass(frozen=True)
class RunDir:
    """The paths of one run's (or one worker group's) private directory."""

    path: Path

    @classmethod
    def create(cls, path: str | os.PathLike | None = None, prefix: str = "run-") -> RunDir:
        """A new private directory under :func:`runs_root`, or ``path`` (created 0700 if missing; an existing
        directory keeps its mode)."""
        if path is None:
            return cls(Path(tempfile.mkdtemp(prefix=prefix, dir=runs_root())))
        directory = Path(path).absolute()  # workers may run in another working directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(directory)

    def log(self, rank: int) -> Path:
        """Rank ``rank``'s output."""
        return self.path / f"rank{rank}.log"

    def stderr(self, rank: int) -> Path:
        """Rank ``rank``'s stderr lines and flair's warnings, also in its log: what the cell shows of every rank."""
        return self.path / f"rank{rank}.stderr"

    def logs(self, world_size: int) -> dict[int, Path]:
        """Every rank's output, by rank."""
        return {rank: self.log(rank) for rank in range(world_size)}

    def stacks(self, rank: int) -> Path:
        """Where rank ``rank`` dumps its Python stacks on ``SIGUSR1``."""
        return self.path / f"stacks-rank{rank}.txt"

    @property
    def payload(self) -> Path:
        """The packed call every rank reads."""
        return self.path / "payload.pkl"

    @property
    def result(self) -> Path:
        """Rank 0's packed return value."""
        return self.path / "result.pkl"

    def remove_job_files(self) -> None:
        """Delete the payload and the result (they can be large); the logs stay."""
        for path in (self.payload, self.result):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


class LogTail:
    """Incremental reader of a growing log file from its present end, yielding whole lines (a tqdm ``\\r``
    keeps its last state).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "rank0.log"
        >>> tail = LogTail(path)
        >>> _ = path.write_text("epoch 1\\n10%\\r50%\\rdone\\npart")
        >>> tail.read_lines(), tail.read_lines(final=True)
        (['epoch 1', 'done'], ['part'])
    """

    def __init__(self, path: Path) -> None:
        self._path, self._partial = path, b""
        self.start = self._offset = path.stat().st_size if path.exists() else 0  # what is there is an earlier run's

    def read_lines(self, final: bool = False) -> list[str]:
        """The lines completed since the last call (with ``final``, an unterminated last line too)."""
        try:
            with open(self._path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        if final and self._partial:
            complete, self._partial = [*complete, self._partial], b""
        return [line.decode("utf-8", "replace").rsplit("\r", 1)[-1] for line in complete]
