"""flair's transformer word embeddings gathered from the model's output in one operation, not sentence by sentence.

For each batch, flair's transformer word embeddings put the windows of long sentences back together
(``combine_strided_tensors``: for the hidden states, for the word positions, and for the input ids) and pick each
word's sub-token (``fill_masked_elements``) in Python loops over the batch's sentences. Each turn of those loops
selects with a boolean mask, and on a GPU each such selection waits for the device: about a hundred waits in every
batch of 32 sentences, which leave the GPU idle while the next operations are queued.

In a worker with ``direct_embeddings`` on (the default), both are done with the positions worked out on the host
from a copy of the small integer tensors that say where each sentence's rows and words are (the window of each
row, each sub-token's word, the sentences' lengths), and one indexed copy on the device: the same tensors, value
for value, in the same types, with the same gradients (each position is copied from exactly one place). What is
not the plain case (word positions that repeat or go back within a row, a word past the sentence's length) and a
traced model (ONNX export) go flair's way.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_JOB = {"enabled": True}


def install() -> None:
    """Replace flair's two loops in its transformer embeddings' module (once per worker)."""
    import flair.embeddings.transformer as transformer

    if getattr(transformer.fill_masked_elements, "_flair_nbddp_gathers", False):
        return
    for name, ours in (("combine_strided_tensors", combine_strided_tensors),
                       ("fill_masked_elements", fill_masked_elements)):
        flairs = getattr(transformer, name)
        replacement = functools.wraps(flairs)(functools.partial(ours, flairs))
        replacement._flair_nbddp_gathers = True
        setattr(transformer, name, replacement)


def start_job(enabled: bool) -> None:
    """A job begins: the gathers are one operation each if ``enabled``."""
    _JOB["enabled"] = enabled


def _flairs_way() -> bool:
    import torch

    return not _JOB["enabled"] or torch.jit.is_tracing() or torch.jit.is_scripting()


def combine_strided_tensors(
    flairs: Any, hidden_states: Any, overflow_to_sample_mapping: Any, half_stride: int, max_length: int,
    default_value: int,
) -> Any:  # fmt: skip
    """flair's ``combine_strided_tensors``: each sentence's rows (its strided windows) joined into one row of a
    ``default_value``-filled tensor, the first window whole up to its middle, every window's middle, the last window
    from its middle on."""
    if _flairs_way():
        return flairs(hidden_states, overflow_to_sample_mapping, half_stride, max_length, default_value)
    import flair
    import torch

    mapping = overflow_to_sample_mapping.cpu().numpy()
    counts = np.bincount(mapping)
    token_count = max_length + (max_length - 2) * int(counts.max() - 1)
    combined = torch.zeros((len(counts), token_count, *hidden_states.shape[2:]), device=flair.device,
                           dtype=hidden_states.dtype)  # fmt: skip
    combined += default_value
    width = hidden_states.shape[1]
    source_rows, source_columns, target_rows, target_columns = [], [], [], []
    for sentence, count in enumerate(counts.tolist()):
        rows = np.flatnonzero(mapping == sentence)
        if count == 1:
            pieces = [(rows[0], 0, width)]
        else:
            middle = max(0, max_length - 1 - half_stride - (half_stride + 1))
            pieces = [(rows[0], 0, min(width, half_stride + 1))]
            pieces += [(row, half_stride + 1, min(width, half_stride + 1 + middle)) for row in rows]
            pieces.append((rows[-1], min(width, max_length - half_stride - 1), width))
        at = 0
        for row, start, end in pieces:
            span = max(0, end - start)
            source_rows.append(np.full(span, row))
            source_columns.append(np.arange(start, start + span))
            target_rows.append(np.full(span, sentence))
            target_columns.append(np.arange(at, at + span))
            at += span
    rows, columns = np.concatenate(source_rows), np.concatenate(source_columns)
    source = hidden_states.device  # the CPU for an embedding that runs there (ONNX), while the result is flair's
    values = hidden_states[_index(rows, source), _index(columns, source)].to(combined.device)
    rows, columns = np.concatenate(target_rows), np.concatenate(target_columns)
    combined[_index(rows, combined.device), _index(columns, combined.device)] = values
    return combined


def fill_masked_elements(
    flairs: Any, all_token_embeddings: Any, sentence_hidden_states: Any, mask: Any, word_ids: Any, lengths: Any
) -> Any:
    """flair's ``fill_masked_elements``: each word's row of ``all_token_embeddings`` (up to its sentence's length)
    the hidden state of its sub-token that ``mask`` picks, zeros for a word without one."""
    if _flairs_way():
        return flairs(all_token_embeddings, sentence_hidden_states, mask, word_ids, lengths)
    import torch

    picked = torch.where(mask & (word_ids >= 0), word_ids, -1).cpu().numpy()
    rows, columns = np.nonzero(picked >= 0)
    words = picked[rows, columns]
    lengths_ = lengths.cpu().numpy() if hasattr(lengths, "cpu") else np.asarray(lengths)
    same_row = rows[1:] == rows[:-1]
    if (words >= lengths_[rows]).any() or (same_row & (words[1:] <= words[:-1])).any():
        return flairs(all_token_embeddings, sentence_hidden_states, mask, word_ids, lengths)

    source, target = sentence_hidden_states.device, all_token_embeddings.device
    values = sentence_hidden_states[_index(rows, source), _index(columns, source)].to(target)
    all_token_embeddings[_index(rows, target), _index(words, target)] = values
    return all_token_embeddings


def _index(positions: np.ndarray, device: Any) -> Any:
    """Positions as an index tensor on ``device``."""
    import torch

    return torch.from_numpy(positions.astype(np.int64)).to(device, non_blocking=True)
