"""The ledger: one append-only, hash-chained table of entries, in SQLite or PostgreSQL.

`Ledger.open(url)` is the entry point; `verify` recomputes everything and names the first bad entry.
"""

from __future__ import annotations

from prereg.ledger.chain import genesis_head
from prereg.ledger.lock import sqlite_wal_reset_affected
from prereg.ledger.store import Entry, Ledger
from prereg.ledger.verify import VerifyReport

__all__ = ["Entry", "Ledger", "VerifyReport", "genesis_head", "sqlite_wal_reset_affected"]
