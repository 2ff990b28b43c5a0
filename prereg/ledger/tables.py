"""The ledger's two tables, as SQLModel tables shared by the SQLite and PostgreSQL backends.

Rows are written with SQLAlchemy Core inserts built from already-validated values (a `table=True` model
skips validation, so it is never the thing that validates), and read back through plain cursors.
"""

from __future__ import annotations

from sqlalchemy import CheckConstraint, Column, Index, Integer, String, Table, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

FORMAT_VERSION = 1  # of the tables and the envelope; a ledger of another format is refused at open


class EntryRow(SQLModel, table=True):
    __tablename__ = "entries"
    __table_args__ = (
        # A second entry claiming the same predecessor is a fork: refused by the database, not by us.
        UniqueConstraint("prev_head", name="uq_entries_prev_head"),
        # One registration's entries of some kinds, in order (audit show, the verdict's inputs).
        Index("ix_entries_reg_kind_seq", "reg_id", "kind", "seq"),
        # Windows per run: count_by(reg, "window") is answered from this index alone.
        Index("ix_entries_reg_kind_ref", "reg_id", "kind", "ref"),
        # One run's entries, in order.
        Index("ix_entries_ref_seq", "ref", "seq"),
    )

    # 1-based and contiguous; assigned under the writer lock, never by the database.
    seq: int = Field(sa_column=Column(Integer, primary_key=True, autoincrement=False))
    kind: str = Field(sa_column=Column(String(64), nullable=False))
    reg_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    ref: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    ts: str = Field(sa_column=Column(String(32), nullable=False))
    body: str = Field(sa_column=Column(Text, nullable=False))  # canonical JSON of the envelope, UTF-8
    prev_head: str = Field(sa_column=Column(String(64), nullable=False))
    head: str = Field(sa_column=Column(String(64), nullable=False))


class MetaRow(SQLModel, table=True):
    __tablename__ = "meta"
    __table_args__ = (CheckConstraint("id = 1", name="ck_meta_single_row"),)

    id: int = Field(sa_column=Column(Integer, primary_key=True, autoincrement=False))
    name: str = Field(sa_column=Column(Text, nullable=False))  # the genesis head is derived from it
    format: int = Field(sa_column=Column(Integer, nullable=False))


ENTRIES: Table = EntryRow.__table__  # type: ignore[attr-defined]
META: Table = MetaRow.__table__  # type: ignore[attr-defined]
LEDGER_TABLES = [ENTRIES, META]
