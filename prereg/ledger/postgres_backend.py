"""The PostgreSQL backend: the same tables; appends serialized by a transaction-scoped advisory lock.

The advisory lock is taken inside the append transaction, before the head is read, so writers on any
number of machines form one chain; it is released by COMMIT or ROLLBACK, and by the server when a
client dies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, create_engine, text

from prereg.ledger.sqlite_backend import APPEND_ONLY

# One constant for every prereg ledger: the ASCII of "prereg" as a bigint. Two ledgers in one database
# (different schemas) share it, which only serializes their appends.
ADVISORY_LOCK_KEY = int.from_bytes(b"prereg", "big")

_GUARD_FUNCTION = f"""
CREATE OR REPLACE FUNCTION prereg_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION '{APPEND_ONLY}: % on % refused', TG_OP, TG_TABLE_NAME;
END
$$
"""
_GUARDS = [_GUARD_FUNCTION] + [
    statement
    for table in ("entries", "meta")
    for statement in (
        f"CREATE TRIGGER {table}_refuse_change BEFORE UPDATE OR DELETE ON {table} "
        "FOR EACH ROW EXECUTE FUNCTION prereg_refuse_change()",
        f"CREATE TRIGGER {table}_refuse_truncate BEFORE TRUNCATE ON {table} "
        "FOR EACH STATEMENT EXECUTE FUNCTION prereg_refuse_change()",
    )
]


class PostgresBackend:
    def __init__(self, url: str, *, read_only: bool = False):
        driver_url = "postgresql+psycopg://" + url.split("://", 1)[1]
        # A reader's session refuses every write at the server (default_transaction_read_only).
        connect_args = {"options": "-c default_transaction_read_only=on"} if read_only else {}
        # READ COMMITTED, explicitly, whatever the server's (or role's, or database's) default_transaction_isolation:
        # an append reads the head in a statement after the lock statement, so it sees the last writer's commit.
        # Under REPEATABLE READ or SERIALIZABLE the transaction's snapshot is taken by the lock statement itself,
        # before it waits, and concurrent appends would fail on a stale head. Reads ask for REPEATABLE READ below.
        self.engine = create_engine(
            driver_url, pool_pre_ping=True, isolation_level="READ COMMITTED", connect_args=connect_args
        )

    @contextmanager
    def write(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
            yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            # Several statements (a count, then the rows) must agree: one snapshot for the transaction.
            conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn

    def install_guards(self, conn: Connection) -> None:
        for statement in _GUARDS:
            conn.execute(text(statement))

    def checkpoint(self) -> None:
        """Nothing to do: PostgreSQL checkpoints its own WAL, and the WAL-reset race is SQLite's."""

    def close(self) -> None:
        self.engine.dispose()
