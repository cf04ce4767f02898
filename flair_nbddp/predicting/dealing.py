"""How a predict call's inputs are cut into chunks for the ranks: alike lengths together, input order kept coarsely.

The inputs are taken in windows of consecutive inputs (16 chunks, at most 4,096 inputs); within a window they are
sorted by length (longest first) and cut into chunks of a few batches. A batch of alike lengths pads little, and
flair's ``predict`` sorts each chunk again. Chunks are dealt window by window, so the finished inputs form a growing
prefix of the input: what a JSON Lines file can be written in order from, and what a stop leaves done (the chunks
finished past the prefix are dropped, less than a window's worth when the ranks keep an even pace). The predictions
waiting for their turn in the notebook are about a window's worth.

Example:
    >>> import numpy as np
    >>> [chunk.tolist() for chunk in deal(np.array([3, 9, 1, 7, 5, 2]), chunk=2, window=4)]
    [[1, 3], [0, 2], [4, 5]]
"""

from __future__ import annotations

import numpy as np

CHUNK_BATCHES = 4  # batches of mini_batch_size a chunk holds: the unit a rank takes, sends back, and stops after
WINDOW_CHUNKS = 16  # chunks sorted together: what a stop can leave finished but after the prefix
WINDOW_AT_MOST = 4096  # inputs sorted together
WINDOW_SHARE = 16  # a small call's window: about this share of its inputs, so its prefix grows as it goes


def chunk_size(mini_batch_size: int) -> int:
    """Inputs a chunk holds for flair's ``mini_batch_size``.

    Example:
        >>> chunk_size(32)
        128
    """
    return mini_batch_size * CHUNK_BATCHES


def window_size(total: int, chunk: int) -> int:
    """Inputs sorted together: a whole number of chunks, at least one, at most :data:`WINDOW_CHUNKS` and
    :data:`WINDOW_AT_MOST` inputs.

    Example:
        >>> window_size(100_000, 128), window_size(100_000, 512), window_size(1_000, 128), window_size(50, 128)
        (2048, 4096, 128, 128)
    """
    chunks = max(1, min(WINDOW_CHUNKS, WINDOW_AT_MOST // chunk, total // WINDOW_SHARE // chunk))
    return chunks * chunk


def deal(lengths: np.ndarray, chunk: int, window: int) -> list[np.ndarray]:
    """The chunks, in the order the ranks take them: each an array of input indices, longest first."""
    chunks = []
    for start in range(0, len(lengths), window):
        order = start + np.argsort(-lengths[start:start + window], kind="stable")
        chunks.extend(order[at:at + chunk].astype(np.int64) for at in range(0, len(order), chunk))
    return chunks
