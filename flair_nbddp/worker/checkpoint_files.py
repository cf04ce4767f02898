"""A job's full checkpoints as files: what a checkpoint holds of a process (its random number generators), how it
is written (whole or not at all) and read (only if it is the file the run wrote), and where this job writes and
resumes from (with, for a run restarted after running out of memory, the smaller chunk size it resumes with). No flair here: the worker calls :func:`start_job` for every job, flair or not, and
:mod:`.checkpoints` (the flair plugin) asks it for the rest.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ResumeError

FORMAT = 2  # 2: plugins named by class and place among their class's (1: by place among all)
NAME = "checkpoint.pt"


def generators() -> dict[str, Any]:
    """This process's random number generators: python's, numpy's, torch's and (where there is one) CUDA's."""
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_generators(state: dict[str, Any]) -> None:
    """Put this process's generators back as :func:`generators` found them."""
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write(path: Path, checkpoint: dict[str, Any]) -> str:
    """Write ``checkpoint`` to ``path`` whole or not at all; its sha256. ``torch.save`` writes into the file as it
    pickles (no copy of the whole in memory), and the bytes are hashed on their way: both let go of the GIL, so a
    training thread beside this one keeps its pace."""
    import torch

    return _write_whole(path, lambda file: torch.save(checkpoint, file))


def write_bytes(path: Path, data: bytes) -> str:
    """Write a checkpoint's ``data`` to ``path`` whole or not at all; its sha256."""
    return _write_whole(path, lambda file: file.write(data))


def _write_whole(path: Path, fill: Callable[[io.RawIOBase], Any]) -> str:
    """Have ``fill`` write a file beside ``path``, flush it to disk and rename it over ``path`` (the previous file
    stays until the new one is complete); the sha256 of what ``fill`` wrote."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as raw:
        file = _HashingFile(raw)
        fill(file)
        raw.flush()
        os.fsync(raw.fileno())
    sha256 = file.sha256.hexdigest()  # before the rename: the file and its record follow each other at once
    os.replace(partial, path)
    return sha256


class _HashingFile(io.RawIOBase):
    """A file written through, hashing what is written."""

    def __init__(self, file: io.BufferedWriter) -> None:
        super().__init__()
        self._file, self.sha256 = file, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        return self._file.write(data)


def read(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """The checkpoint at ``path``; with ``sha256``, only if the file is the one written (else ``ResumeError``)."""
    import torch

    data = Path(path).read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ResumeError(f"{path} is not the checkpoint the run wrote (its sha256 differs): it was changed or cut")
    checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    if checkpoint.get("format") != FORMAT:
        raise ResumeError(f"{path} is not a flair_nbddp checkpoint of format {FORMAT}: start the run afresh")
    return checkpoint




@dataclass
class _Job:
    directory: Path | None = None
    resume: str = ""
    resume_sha256: str = ""
    chunk_size: int | None = None
    every: int | None = None


_JOB = _Job()


def start_job(
    directory: str | Path | None, resume: str = "", resume_sha256: str = "", chunk_size: int | None = None,
    every: int | None = None,
) -> None:  # fmt: skip
    """A job begins: its trainings write their checkpoints in ``directory`` (None: none), at every epoch's end and,
    with ``every``, every so many optimizer steps; the first resumes from the checkpoint at ``resume`` (if given)
    when its sha256 is ``resume_sha256``, and, in a run restarted after running out of memory, every training
    computes its batches in pieces of ``chunk_size``."""
    global _JOB
    _JOB = _Job(Path(directory) if directory else None, resume, resume_sha256, chunk_size, every)


def job_checkpoint_every() -> int | None:
    """Every how many optimizer steps this job's trainings also write a checkpoint (None: at epochs' ends)."""
    return _JOB.every


def job_chunk_size() -> int | None:
    """The ``mini_batch_chunk_size`` this job imposes on flair's trainings (None: theirs)."""
    return _JOB.chunk_size


def job_directory() -> Path | None:
    """Where this job's trainings write their checkpoints (None: they write none)."""
    return _JOB.directory


def take_resume() -> dict[str, Any] | None:
    """The checkpoint this job resumes from, read and checked, for its first training only (None: start afresh)."""
    if not _JOB.resume:
        return None
    path, sha256 = _JOB.resume, _JOB.resume_sha256
    _JOB.resume = ""
    return read(Path(path), sha256 or None)
