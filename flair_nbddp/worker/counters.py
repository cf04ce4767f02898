"""Per-rank training throughput and position, counted by the streaming plugin and read by the heartbeat thread (and,
after an out-of-memory error, by the report of what the rank was doing)."""

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
        self.batch_sizes: dict[str, int | None] = {}  # flair's mini_batch_size and mini_batch_chunk_size
        self.epoch = self.batch = 0  # the batch being trained (from 1), 0 outside training

    def training_set_up(self, mini_batch_size: int | None, mini_batch_chunk_size: int | None) -> None:
        self.batch_sizes = {"mini_batch_size": mini_batch_size, "mini_batch_chunk_size": mini_batch_chunk_size}

    def batch_started(self, epoch: int = 0, batch: int = 0) -> None:
        self._batch_started = time.perf_counter()
        self.epoch, self.batch = epoch, batch

    def batch_done(self, samples: int) -> None:
        if self._batch_started is not None:
            self.training_seconds += time.perf_counter() - self._batch_started
        self.step += 1
        self.samples += samples

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.training_seconds if self.training_seconds else 0.0
