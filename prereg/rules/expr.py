"""Expr: a compiled expression, ready to evaluate against an Env."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prereg.rules.nodes import Node, ReadRef, RowsCall, RungMetricRef
from prereg.rules.scope import CONDITION_KINDS, KIND_NOUNS
from prereg.rules.values import Undefined, Value, describe

if TYPE_CHECKING:
    from prereg.rules.env import Env


@dataclass(frozen=True)
class Expr:
    """Made by compile_expr, never by hand: `root` has passed the allow-list and the scope's name checks."""

    text: str
    scope_kind: str
    root: Node = field(repr=False)

    def reads_used(self) -> frozenset[str]:
        return frozenset(node.name for node in self.root.walk() if isinstance(node, ReadRef))

    def rung_metrics_used(self) -> frozenset[tuple[str, str]]:
        """Every (rung, metric) the expression measures with: values, and the rows a row function pairs."""
        used = {(node.rung, node.metric) for node in self.root.walk() if isinstance(node, RungMetricRef)}
        used |= {ref for node in self.root.walk() if isinstance(node, RowsCall) for ref in (node.rows, node.anchor)}
        return frozenset(used)

    def rungs_used(self) -> frozenset[str]:
        return frozenset(rung for rung, _ in self.rung_metrics_used())

    def evaluate(self, env: Env) -> Value:
        value = self.root.evaluate(env)
        if self.scope_kind in CONDITION_KINDS and not isinstance(value, (bool, Undefined)):
            # A read the compiler could not type (a number where a condition was due) surfaces here.
            return Undefined(
                f"{KIND_NOUNS[self.scope_kind]} must be True or False; {self.text!r} gave {describe(value)}"
            )
        return value
