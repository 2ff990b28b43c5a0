"""The cross-process writer lock of a SQLite ledger, and why every writer and checkpoint takes it.

SQLite 3.7.0 through 3.51.2 has a documented WAL-reset race (https://sqlite.org/wal.html#walresetbug; fixed
in 3.51.3, backported to 3.50.7 and 3.44.6) that can corrupt the database or lose committed transactions: a
checkpoint that starts while another connection commits the transaction that resets the WAL misses the
reset, and a later checkpoint skips frames. It needs a checkpoint running concurrently with another
connection's WAL-resetting commit. The SQLite we link (3.40.1 here; PyPI's pysqlite3-binary 3.51.1 and
sqlean.py 3.50.4 too) is affected, so we remove the concurrency instead of trusting the version:

- every write transaction (`BEGIN IMMEDIATE ... COMMIT`) runs while holding an exclusive `fcntl.flock` on
  the sidecar file `<db>.lock`. SQLite's auto-checkpoint runs inside COMMIT, so it is covered too;
- every explicit checkpoint (`Ledger.checkpoint`) holds the same lock;
- readers never write, so never auto-checkpoint. The one checkpoint outside the lock is SQLite's
  close-time checkpoint, which runs only when the closing connection obtains the exclusive lock on the
  database file, i.e. when no other connection has it open: nothing can commit concurrently.

So at most one of {a commit, a checkpoint} runs at any moment, on this machine. The kernel drops a flock
when its holder dies, so a writer killed mid-append never leaves the ledger locked. (flock does not work
across machines on network filesystems; a ledger shared between machines belongs in PostgreSQL.)
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The documented race: introduced with WAL in 3.7.0, fixed in 3.51.3 (so 3.52.0 and later are fine),
# and fixed on two older branches by point releases.
_FIRST_AFFECTED = (3, 7, 0)
_FIRST_FIXED = (3, 51, 3)
_BACKPORT_FIXES = {(3, 44): 6, (3, 50): 7}


def sqlite_wal_reset_affected(version: tuple[int, ...]) -> bool:
    """Whether a SQLite of this version (e.g. `sqlite3.sqlite_version_info`) has the WAL-reset race."""
    if len(version) < 3 or not all(isinstance(part, int) and part >= 0 for part in version):
        raise ValueError(f"SQLite version {version!r} is not a (major, minor, patch) tuple of ints")
    triple = tuple(version[:3])
    if not _FIRST_AFFECTED <= triple < _FIRST_FIXED:
        return False
    fixed_patch = _BACKPORT_FIXES.get(triple[:2])
    return fixed_patch is None or triple[2] < fixed_patch


def lock_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".lock")


@contextmanager
def writer_lock(db_path: Path) -> Iterator[None]:
    """Hold the exclusive writer lock of the ledger at `db_path`, waiting for it as long as it takes.

    The file is opened afresh on every acquisition: flock is per open file description, so two threads or
    two Ledger objects in one process exclude each other exactly like two processes do.
    """
    fd = os.open(lock_path(db_path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks; a dead holder's lock is released by the kernel
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
