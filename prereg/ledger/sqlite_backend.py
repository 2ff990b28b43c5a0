"""The SQLite backend: one file, WAL, synchronous=FULL, every write and checkpoint under the flock of lock.py."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, create_engine, event

from prereg.errors import InvalidInput, PreregError
from prereg.ledger.lock import writer_lock

BUSY_TIMEOUT_S = 30.0  # a reader or a foreign tool (the sqlite3 shell) holding a lock; writers queue on the flock
APPEND_ONLY = "prereg ledger is append-only"
_WRITE = "prereg_write"  # execution option: this connection's transaction must begin IMMEDIATE

_GUARDS = [
    f"CREATE TRIGGER IF NOT EXISTS {table}_refuse_{op.lower()} BEFORE {op} ON {table} "
    f"BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY}: {op} on {table} refused'); END"
    for table in ("entries", "meta")
    for op in ("UPDATE", "DELETE")
] + [
    # INSERT OR REPLACE deletes the row it collides with without firing DELETE triggers (unless
    # recursive_triggers is on), so a replacing insert would be an UPDATE in disguise: refuse it first.
    "CREATE TRIGGER IF NOT EXISTS entries_refuse_replace BEFORE INSERT ON entries "
    "WHEN EXISTS (SELECT 1 FROM entries WHERE seq = NEW.seq) "
    "OR EXISTS (SELECT 1 FROM entries WHERE prev_head = NEW.prev_head) "
    f"BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY}: INSERT would replace an entry or fork the chain'); END",
    "CREATE TRIGGER IF NOT EXISTS meta_refuse_replace BEFORE INSERT ON meta "
    "WHEN EXISTS (SELECT 1 FROM meta) "
    f"BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY}: INSERT on meta refused'); END",
]


class SqliteBackend:
    def __init__(self, path: Path, *, create: bool, read_only: bool = False):
        if not path.exists():
            if not create:
                raise InvalidInput("no ledger file here", where=str(path), fix="check the path, or create it")
            if not path.parent.is_dir():
                raise InvalidInput("the ledger's directory does not exist", where=str(path.parent))
        self.path = path
        self.read_only = read_only
        self.engine = create_engine(f"sqlite:///{path}", creator=self._connect)
        # SQLAlchemy's documented recipe for pysqlite: the driver is in autocommit mode (isolation_level None)
        # and the transaction is begun here, so appends can say BEGIN IMMEDIATE: the write lock is taken
        # before the head is read, never upgraded from a read lock halfway (which could fail with BUSY).
        event.listen(self.engine, "begin", _begin)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        if self.read_only:
            # SQLite itself refuses every change on this connection; unlike a mode=ro open it still removes its
            # write-ahead log and shared-memory index on close, so a reader leaves the ledger's folder as it was.
            conn.execute("PRAGMA query_only=ON")
            return conn
        conn.execute("PRAGMA journal_mode=WAL")  # persistent; a no-op once the file is in WAL mode
        conn.execute("PRAGMA synchronous=FULL")  # per connection: a commit is on disk when append returns
        return conn

    @contextmanager
    def write(self) -> Iterator[Connection]:
        with writer_lock(self.path), self.engine.connect() as conn:
            conn.execution_options(**{_WRITE: True})
            with conn.begin():
                yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:  # autobegins a deferred BEGIN: one snapshot, no write lock
            yield conn

    def install_guards(self, conn: Connection) -> None:
        for statement in _GUARDS:
            conn.exec_driver_sql(statement)

    def checkpoint(self) -> None:
        """Fold the WAL into the database file and truncate it (before copying or committing the file)."""
        with writer_lock(self.path):
            raw = self.engine.raw_connection()
            try:
                # Outside any transaction: SQLite refuses to checkpoint from inside one.
                busy, _, _ = raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                raw.close()
        if busy:
            raise PreregError(
                "checkpoint incomplete: another connection is still reading an older snapshot",
                where=str(self.path),
                fix="retry once the other prereg process has finished",
            )

    def close(self) -> None:
        self.engine.dispose()


def _begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")
