"""Errors a user can act on, each with the exit code docs/design.md assigns to it."""

from __future__ import annotations


class PreregError(Exception):
    """Base of every error the CLI turns into a message and an exit code."""

    exit_code = 1

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None):
        self.message = message
        self.where = where  # a file, file:line, or a field path
        self.fix = fix  # what the user should do
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


class InvalidInput(PreregError):
    """Malformed or inconsistent input; nothing was written."""

    exit_code = 2


class Refused(PreregError):
    """A governance rule refused the action (not frozen, changed since freeze, post-hoc, profile)."""

    exit_code = 3


class LedgerCorrupt(PreregError):
    """The ledger failed verification."""

    exit_code = 4

    def __init__(self, message: str, *, first_bad: int | None = None, **kw):
        self.first_bad = first_bad
        super().__init__(message, **kw)
