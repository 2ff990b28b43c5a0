"""Expr: a compiled expression, ready to evaluate against an Env."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prereg.rules.nodes import Node, ReadRef, RungMetricRef
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
        return frozenset((node.rung, node.metric) for node in self.root.walk() if isinstance(node, RungMetricRef))

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
