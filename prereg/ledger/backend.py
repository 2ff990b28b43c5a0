"""Where a ledger lives: a URL or path to the backend that stores it.

A backend owns the database-specific parts: how an exclusive append transaction is taken, how reads see
one snapshot, the triggers that refuse UPDATE and DELETE, and checkpoints. Everything else (the chain,
the queries, verification) is shared and lives in `store.py` over SQLAlchemy Core.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from sqlalchemy import Connection

from prereg.errors import InvalidInput

SQLITE_PREFIX = "sqlite:///"  # SQLAlchemy's form: sqlite:///relative.db, sqlite:////absolute.db
POSTGRES_PREFIXES = ("postgresql://", "postgresql+psycopg://")
URL_FORMS = "a file path (ledger.db), sqlite:///PATH, or postgresql://USER@HOST/DB"


class Backend(Protocol):
    def write(self) -> AbstractContextManager[Connection]:
        """One append transaction, exclusive against every other writer of this ledger; commits on exit."""

    def read(self) -> AbstractContextManager[Connection]:
        """One read transaction: every statement in it sees the same snapshot. Never blocks writers."""

    def install_guards(self, conn: Connection) -> None:
        """Create the triggers that refuse UPDATE and DELETE on the ledger's tables."""

    def checkpoint(self) -> None: ...

    def close(self) -> None: ...


def open_backend(url: str, *, create: bool, read_only: bool = False) -> Backend:
    # Imported here: each backend pulls in its own driver, and a SQLite user never needs psycopg.
    if url.startswith(POSTGRES_PREFIXES):
        from prereg.ledger.postgres_backend import PostgresBackend

        return PostgresBackend(url, read_only=read_only)
    if url.startswith(SQLITE_PREFIX):
        path = url[len(SQLITE_PREFIX) :]
    elif "://" in url:
        raise InvalidInput(f"unsupported ledger URL {url!r}", fix=f"give {URL_FORMS}")
    else:
        path = url
    if not path or path == ":memory:":
        raise InvalidInput(f"ledger URL {url!r} names no file", fix=f"give {URL_FORMS}")
    from prereg.ledger.sqlite_backend import SqliteBackend

    return SqliteBackend(Path(path), create=create, read_only=read_only)
