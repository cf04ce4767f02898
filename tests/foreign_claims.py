"""Claims of other processes of the machine, made in the test's own process: a claim file written and locked as
another kernel's would be (its pid, user and notebook), which the kit reads as it reads any other process's.

Example::

    claim = ForeignClaim(ClaimDir(), cpu=2, capacity=2)      # live until claim.end()
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import time

from flair_nbddp.engine.claim_files import FORMAT, ClaimDir


class ForeignClaim:
    """A live claim (or place in the queue, ``kind="wait"``) of process ``pid`` of ``user``, until :meth:`end`."""

    def __init__(self, files: ClaimDir, kind: str = "claim", user: str = "alice", pid: int = 424242,
                 label: str = "run #7 'tagger' (started 09:00:00)", **fields) -> None:  # fmt: skip
        self.path = files.ensure() / f"{kind}-{user}-{pid}-{secrets.token_hex(4)}.json"
        record = {"format": FORMAT, "kind": kind, "label": label, "user": user, "pid": pid, "host": "here",
                  "where": "ner/tagger.ipynb", "since": time.time(), **fields}  # fmt: skip
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.write(self.fd, json.dumps(record).encode())

    def end(self) -> None:
        """Its holder ends: the lock goes, and the file with it."""
        os.unlink(self.path)
        os.close(self.fd)
