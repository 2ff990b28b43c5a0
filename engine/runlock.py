"""One `prereg run` of a registration at a time: a second is refused, never interleaved with the first."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

from prereg.errors import Refused


def lock_path(ledger_url: str, reg_id: str) -> Path:
    if "://" in ledger_url and not ledger_url.startswith("sqlite"):
        # A server ledger has no file beside it; the lock is per machine (the ledger's own append lock still
        # serializes writers across machines).
        digest = hashlib.sha256(f"{ledger_url}\0{reg_id}".encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"prereg-run-{digest}.lock"
    path = Path(ledger_url.removeprefix("sqlite:///"))
    return path.with_name(f"{path.name}.run-{reg_id}.lock")


class RunLock:
    def __init__(self, ledger_url: str, reg_id: str):
        self.path = lock_path(ledger_url, reg_id)
        self.reg_id = reg_id
        self.handle = None

    def __enter__(self) -> "RunLock":
        self.handle = open(self.path, "a+")
        try:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            holder = self.handle.read().strip() or "another process"
            self.handle.close()
            raise Refused(
                f"a run of {self.reg_id} is already in progress ({holder})",
                fix="wait for it to finish; runs of one registration never interleave",
            ) from None
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"pid {os.getpid()}")
        self.handle.flush()
        return self

    def __exit__(self, *exc) -> None:
        assert self.handle is not None
        fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
        self.handle.close()
