"""What the ranks print, as the parent reads it: the lines the cell shows, and the tail of each rank's output.

With ``output="rank0"`` (the default) the cell shows rank 0's output as it is, and every other rank's stderr lines and
flair warnings (its ``rank<r>.stderr``), each prefixed ``[rank r]``; with ``output="all"``, every line of every rank,
prefixed. Other ranks' progress bars stay out of the cell. Each rank may show ``BURST_LINES`` lines at once (a whole
traceback) and ``LINES_PER_SECOND`` a second on average; past that, a line a second says how many more its file holds: a
rank that prints 1,000 lines a second leaves the cell readable and the parent's work small. Each rank's own output is
also kept, its last lines only, for the dashboard's per-rank view.

Example:
    >>> import tempfile
    >>> from flair_nbddp.engine.state import RunState
    >>> run_dir = RunDir.create(tempfile.mkdtemp())
    >>> output, state = RankOutput(run_dir, 2, "rank0"), RunState(world_size=2, device_type="cpu")
    >>> _ = run_dir.log(0).write_text("epoch 1\\n")
    >>> _ = run_dir.log(1).write_text("epoch 1\\nUserWarning: loss is nan\\n")
    >>> _ = run_dir.stderr(1).write_text("UserWarning: loss is nan\\n")
    >>> output.read(state)
    >>> snapshot = state.snapshot()
    >>> snapshot.log_lines, snapshot.rank_logs[1]
    (('epoch 1', '[rank 1] UserWarning: loss is nan'), ('epoch 1', 'UserWarning: loss is nan'))
"""

from __future__ import annotations

import re
import time

from .rundir import LogTail, RunDir
from .state import RunState

LINES_PER_SECOND = 20
BURST_LINES = 200
_PROGRESS_BAR = re.compile(r"\d+%\|.*\||\d+it \[\d")


class RankOutput:
    """Reads every rank's files of ``run_dir`` from their present end on, into a :class:`RunState`."""

    def __init__(self, run_dir: RunDir, world_size: int, mode: str) -> None:
        self.run_dir, self.mode = run_dir, mode
        self._logs = [LogTail(run_dir.log(rank)) for rank in range(world_size)]
        self._stderr = [LogTail(run_dir.stderr(rank)) for rank in range(world_size)]
        self._budget = [_Budget() for _ in range(world_size)]

    @property
    def log_starts(self) -> dict[int, int]:
        """Where this run's output begins in each rank's log (a ``run_dir`` used before holds earlier runs')."""
        return {rank: tail.start for rank, tail in enumerate(self._logs)}

    def read(self, state: RunState, final: bool = False) -> None:
        """Move what the ranks printed since the last read into ``state`` (``final``: unterminated lines too)."""
        cell: list[str] = []
        for rank, tail in enumerate(self._logs):
            lines = tail.read_lines(final)
            state.add_rank_lines(rank, lines)
            if self.mode == "all":
                cell += self._prefixed(rank, lines, final)
            elif rank == 0:
                cell += lines
        if self.mode == "rank0":
            for rank, tail in enumerate(self._stderr[1:], 1):
                lines = [line for line in tail.read_lines(final) if not _PROGRESS_BAR.search(line)]
                cell += self._prefixed(rank, lines, final)
        state.add_log_lines(cell)

    def _prefixed(self, rank: int, lines: list[str], final: bool) -> list[str]:
        budget = self._budget[rank]
        shown = [f"[rank {rank}] {line}" for line in budget.take(lines)]
        if budget.skipped and (final or budget.note_due()):
            shown.append(f"[rank {rank}] ... {budget.skipped} more lines in {self.run_dir.log(rank)}")
            budget.skipped = 0
        return shown


class _Budget:
    """A token bucket of lines: ``BURST_LINES`` at once, refilled at ``LINES_PER_SECOND``; counts what it refused."""

    def __init__(self) -> None:
        self.tokens, self.skipped = float(BURST_LINES), 0
        self._filled_at = self._noted_at = time.monotonic()

    def take(self, lines: list[str]) -> list[str]:
        now = time.monotonic()
        self.tokens = min(BURST_LINES, self.tokens + (now - self._filled_at) * LINES_PER_SECOND)
        self._filled_at = now
        allowed = lines[: int(self.tokens)]
        self.tokens -= len(allowed)
        self.skipped += len(lines) - len(allowed)
        return allowed

    def note_due(self) -> bool:
        """A second passed since the last note of refused lines."""
        now = time.monotonic()
        if now - self._noted_at < 1.0:
            return False
        self._noted_at = now
        return True
