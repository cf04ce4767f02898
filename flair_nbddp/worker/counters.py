"""Per-rank training throughput, counted by the streaming plugin and read by the heartbeat thread."""

from __future__ import annotations

import time


class TrainingCounters:
    """Throughput of this rank, shared between the plugin (writer) and the heartbeat thread (reader)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step = 0
        self.samples = 0
        self.training_seconds = 0.0
        self._batch_started: float | None = None

    def batch_started(self) -> None:
        self._batch_started = time.perf_counter()

    def batch_done(self, samples: int) -> None:
        if self._batch_started is not None:
            self.training_seconds += time.perf_counter() - self._batch_started
        self.step += 1
        self.samples += samples

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.training_seconds if self.training_seconds else 0.0
