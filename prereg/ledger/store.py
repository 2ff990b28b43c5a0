"""The Ledger: append-only, hash-chained entries in SQLite or PostgreSQL. The one source of truth."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from sqlalchemy import Connection, Select, func, inspect, select
from sqlalchemy.exc import DatabaseError, OperationalError

from prereg.errors import InvalidInput
from prereg.ledger.backend import Backend, open_backend
from prereg.ledger.chain import genesis_head, is_head, link
from prereg.ledger.envelope import check_item, envelope_bytes, utc_timestamp
from prereg.ledger.tables import ENTRIES, FORMAT_VERSION, LEDGER_TABLES, META
from prereg.ledger.verify import VerifyReport, verify_rows

_ROW_COLUMNS = (
    ENTRIES.c.seq,
    ENTRIES.c.kind,
    ENTRIES.c.reg_id,
    ENTRIES.c.ref,
    ENTRIES.c.ts,
    ENTRIES.c.body,
    ENTRIES.c.prev_head,
    ENTRIES.c.head,
)
_STREAM_ROWS = 2000  # rows fetched per round trip when streaming (a server-side cursor on PostgreSQL)


@dataclass(frozen=True)
class Entry:
    seq: int
    kind: str
    reg_id: str | None
    ref: str | None
    ts: str
    data: dict
    prev_head: str
    head: str
    body: bytes  # the canonical envelope bytes the chain hashes


class Ledger:
    """Open with `Ledger.open(url)`; close with `close()` (or use it as a context manager)."""

    def __init__(self, backend: Backend, url: str, name: str):
        self._backend = backend
        self.url = url
        self.name = name

    @classmethod
    def open(cls, url: str, *, create: bool = True, name: str = "prereg", read_only: bool = False) -> Ledger:
        """Open the ledger at `url` (a path, sqlite:///PATH or postgresql://...).

        `name` is used only when the ledger is created here (it seeds the genesis head); an existing
        ledger keeps the name it was created with. `read_only`: the database refuses every write on this
        ledger's connections (a verb that promises to write nothing); it cannot create one.
        """
        if read_only and create:
            raise ValueError("read_only = True with create = True: a read-only ledger cannot be created")
        backend = open_backend(url, create=create, read_only=read_only)
        try:
            stored_name = _initialize(backend, url, create=create, name=name)
        except DatabaseError as error:
            backend.close()
            if isinstance(error, OperationalError):  # locked, unreachable, refused: not about what the file holds
                raise
            # A file the database cannot read at all (SQLite: "file is not a database"): bad input, like a ledger
            # whose meta row is missing, named with the file and a way forward, not an unexpected error.
            raise InvalidInput(
                f"not a readable database ({error.orig}): not a prereg ledger, or a damaged one",
                where=url,
                fix="name the ledger's file; restore a damaged one from a copy or an export (`prereg audit import`)",
            ) from None
        except BaseException:
            backend.close()
            raise
        return cls(backend, url, stored_name)

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writing -------------------------------------------------------------------------------------

    def append(self, kind: str, reg_id: str | None, data: dict, *, ref: str | None = None) -> Entry:
        return self.append_many([(kind, reg_id, data, ref)])[0]

    def append_many(self, items: list[tuple[str, str | None, dict, str | None]]) -> list[Entry]:
        """Append (kind, reg_id, data, ref) items in one transaction: all of them are written, or none."""
        for kind, reg_id, data, ref in items:
            check_item(kind, reg_id, data, ref)
        if not items:
            return []
        with self._backend.write() as conn:
            seq, head = _head(conn, self.name)
            entries = []
            for kind, reg_id, data, ref in items:
                seq += 1
                ts = utc_timestamp()
                body = envelope_bytes(seq, kind, reg_id, ref, ts, data)
                new_head = link(head, body)
                entries.append(Entry(seq, kind, reg_id, ref, ts, data, head, new_head, body))
                head = new_head
            conn.execute(ENTRIES.insert(), [_row(entry) for entry in entries])
        return entries

    def checkpoint(self) -> None:
        """SQLite: fold the write-ahead log into the database file. PostgreSQL: nothing to do."""
        self._backend.checkpoint()

    # --- reading -------------------------------------------------------------------------------------

    def head(self) -> tuple[int, str]:
        """(the last seq, or 0 when empty; its head, or the genesis head when empty)."""
        with self._backend.read() as conn:
            return _head(conn, self.name)

    def entries(
        self,
        *,
        reg_id: str | None = None,
        kinds: Iterable[str] | None = None,
        ref: str | None = None,
        after_seq: int = 0,
    ) -> Iterator[Entry]:
        """Entries matching every filter given, in seq order, streamed from one snapshot."""
        query = _filtered(select(*_ROW_COLUMNS), reg_id, kinds, ref)
        query = query.where(ENTRIES.c.seq > after_seq).order_by(ENTRIES.c.seq)
        with self._backend.read() as conn:
            for seq, kind, row_reg, row_ref, ts, body, prev_head, head in _stream(conn, query):
                data = json.loads(body)["data"]
                yield Entry(seq, kind, row_reg, row_ref, ts, data, prev_head, head, body.encode("utf-8"))

    def count(self, *, reg_id: str | None = None, kinds: Iterable[str] | None = None, ref: str | None = None) -> int:
        query = _filtered(select(func.count()).select_from(ENTRIES), reg_id, kinds, ref)
        with self._backend.read() as conn:
            return conn.execute(query).scalar_one()

    def count_by(self, reg_id: str, kind: str) -> dict[str | None, int]:
        """ref -> how many entries of this kind the registration has under it (e.g. windows per run)."""
        query = (
            select(ENTRIES.c.ref, func.count())
            .where(ENTRIES.c.reg_id == reg_id, ENTRIES.c.kind == kind)
            .group_by(ENTRIES.c.ref)
        )
        with self._backend.read() as conn:
            return {ref: count for ref, count in conn.execute(query)}

    def reg_ids(self) -> list[str]:
        """Every registration id that has an entry, in code point order.

        Sorted here, not by ORDER BY: PostgreSQL would sort by the database's collation (en_US puts "a" before
        "B"), SQLite by code point; the same ledger must list the same way on both.
        """
        query = select(ENTRIES.c.reg_id).where(ENTRIES.c.reg_id.is_not(None)).distinct()
        with self._backend.read() as conn:
            return sorted(conn.execute(query).scalars())

    def verify(self, *, published_head: str | None = None) -> VerifyReport:
        """Recompute the whole chain and every envelope; name the first bad entry.

        `published_head`, a head once shown outside the ledger (a report, a commit message), must still be
        some entry's head; if it is not, the ledger lost entries since, and first_bad is the seq after
        the last entry.
        """
        if published_head is not None and not is_head(published_head):
            raise InvalidInput(f"published head {published_head!r} is not 64 lowercase hex digits")
        query = select(*_ROW_COLUMNS).order_by(ENTRIES.c.seq)
        with self._backend.read() as conn:
            return verify_rows(self.name, _stream(conn, query), published_head)

    # --- moving a ledger -----------------------------------------------------------------------------

    def export_jsonl(self, out: IO[str]) -> int:
        """Write the header line, then one line per entry (its envelope plus prev_head and head); return the count."""
        from prereg.ledger.jsonl import export_entries

        query = select(*_ROW_COLUMNS).order_by(ENTRIES.c.seq)
        with self._backend.read() as conn:
            return export_entries(self.name, _stream(conn, query), out)

    @classmethod
    def import_jsonl(cls, src: IO[str], url: str) -> Ledger:
        """Create the ledger at `url` from an export, re-verifying every line before anything is committed.

        The target must be new or empty. A line that breaks the chain raises LedgerCorrupt naming its seq,
        and the target is left empty.
        """
        from prereg.ledger.jsonl import read_header, read_rows

        name = read_header(src)
        ledger = cls.open(url, create=True, name=name)
        try:
            if ledger.name != name:
                raise InvalidInput(f"the ledger at {url} is named {ledger.name!r}, the export {name!r}", where=url)
            with ledger._backend.write() as conn:
                last_seq, _ = _head(conn, name)
                if last_seq:
                    raise InvalidInput(
                        f"the ledger already has {last_seq} entries; import only into a new, empty ledger", where=url
                    )
                for batch in read_rows(name, src):
                    conn.execute(ENTRIES.insert(), batch)
        except BaseException:
            ledger.close()
            raise
        return ledger


def _initialize(backend: Backend, url: str, *, create: bool, name: str) -> str:
    """Create the tables, triggers and meta row of a new ledger; return the ledger's stored name."""
    with backend.read() as conn:
        meta = _read_meta(conn, url)
    if meta is None:
        if not create:
            raise InvalidInput("no prereg ledger here", where=url, fix="check the URL, or create the ledger")
        if not name or not isinstance(name, str) or "\x00" in name:
            raise ValueError(f"ledger name {name!r} must be a non-empty string without NUL characters")
        with backend.write() as conn:
            meta = _read_meta(conn, url)  # another process may have created it while we waited
            if meta is None:
                tables = inspect(conn).get_table_names()
                if ENTRIES.name in tables:
                    raise InvalidInput("an `entries` table without a `meta` table: not a prereg ledger", where=url)
                META.metadata.create_all(conn, tables=LEDGER_TABLES)
                backend.install_guards(conn)
                conn.execute(META.insert().values(id=1, name=name, format=FORMAT_VERSION))
                meta = (name, FORMAT_VERSION)
    stored_name, fmt = meta
    if fmt != FORMAT_VERSION:
        raise InvalidInput(
            f"ledger format {fmt} is not the format this prereg reads ({FORMAT_VERSION})",
            where=url,
            fix="use the prereg version that wrote it",
        )
    return stored_name


def _read_meta(conn: Connection, url: str) -> tuple[str, int] | None:
    if not inspect(conn).has_table(META.name):
        return None
    row = conn.execute(select(META.c.name, META.c.format).where(META.c.id == 1)).one_or_none()
    if row is None:
        raise InvalidInput("the ledger's meta table has no row: not a prereg ledger, or a damaged one", where=url)
    return row.name, row.format


def _head(conn: Connection, name: str) -> tuple[int, str]:
    row = conn.execute(select(ENTRIES.c.seq, ENTRIES.c.head).order_by(ENTRIES.c.seq.desc()).limit(1)).one_or_none()
    return (0, genesis_head(name)) if row is None else (row.seq, row.head)


def _filtered(query: Select, reg_id: str | None, kinds: Iterable[str] | None, ref: str | None) -> Select:
    if reg_id is not None:
        query = query.where(ENTRIES.c.reg_id == reg_id)
    if kinds is not None:
        query = query.where(ENTRIES.c.kind.in_(list(kinds)))
    if ref is not None:
        query = query.where(ENTRIES.c.ref == ref)
    return query


def _stream(conn: Connection, query: Select) -> Iterator[Any]:
    # Plain tuples, never ORM objects: verify walks a million rows.
    return iter(conn.execute(query.execution_options(yield_per=_STREAM_ROWS)))


def _row(entry: Entry) -> dict[str, Any]:
    return {
        "seq": entry.seq,
        "kind": entry.kind,
        "reg_id": entry.reg_id,
        "ref": entry.ref,
        "ts": entry.ts,
        "body": entry.body.decode("utf-8"),
        "prev_head": entry.prev_head,
        "head": entry.head,
    }
