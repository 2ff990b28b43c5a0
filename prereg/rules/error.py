"""RuleError: an expression the rule language refuses, with where and what is allowed instead."""

from __future__ import annotations

_EXCERPT = 80  # characters of the expression quoted in a message; longer ones are cut with "..."


class RuleError(ValueError):
    """Refused expression. str() names the expression, the offending construct (with column), and what is allowed.

    A ValueError, so that a pydantic validator that compiles an expression reports it as a field error.
    `column` is the 1-based character position of the offending construct in `expression` (None when
    the problem is the expression as a whole, like its length).
    """

    expression: str
    column: int | None

    def __init__(self, expression: str, problem: str, *, column: int | None = None, allowed: str | None = None):
        self.expression = expression
        self.problem = problem
        self.column = column
        self.allowed = allowed
        super().__init__(self._message())

    def _message(self) -> str:
        quoted = self.expression if len(self.expression) <= _EXCERPT else self.expression[: _EXCERPT - 3] + "..."
        where = f"rule expression {quoted!r}" + (f", column {self.column}" if self.column is not None else "")
        return f"{where}: {self.problem}" + (f"; {self.allowed}" if self.allowed else "")

    def __reduce__(self):  # the keyword-only signature would otherwise break pickling across processes
        return (_rebuild, (self.expression, self.problem, self.column, self.allowed))


def _rebuild(expression: str, problem: str, column: int | None, allowed: str | None) -> RuleError:
    return RuleError(expression, problem, column=column, allowed=allowed)
