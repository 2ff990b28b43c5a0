"""prereg: experiment governance. The documents and the ledger; no torch here."""

__version__ = "0.1.0"
