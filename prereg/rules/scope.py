"""Scope: which names an expression may use. Every name is checked against it at compile time."""

from __future__ import annotations

import keyword
from dataclasses import dataclass, fields
from typing import Literal, get_args

ScopeKind = Literal["reads", "rules", "expectations", "pass_rule", "kill"]
SCOPE_KINDS: tuple[str, ...] = get_args(ScopeKind)

# Kinds whose bare names are reads, whose measurements are named RUNG.metric, and which may ask about the
# oracle gate and kills (passed, killed, ...): they are judged after the ladder, over everything measured.
REFERENCE_KINDS = frozenset({"reads", "rules", "expectations"})
# Kinds whose value must be a condition; a read may be a number.
CONDITION_KINDS = frozenset({"rules", "expectations", "pass_rule", "kill"})

# How messages name an expression of each kind.
KIND_NOUNS = {
    "reads": "a read",
    "rules": "a rule",
    "expectations": "an expectation check",
    "pass_rule": "a pass rule",
    "kill": "a kill line",
}

# Names written into expressions as identifiers must be identifiers; oracle, item and kill ids only appear
# quoted, as arguments of passed()/dropped()/killed(), so they may be any string ("K-cudnn").
_IDENTIFIER_FIELDS = ("reads", "rungs", "metrics")


@dataclass(frozen=True)
class Scope:
    """What names an expression may use; checked at compile time."""

    kind: ScopeKind
    reads: frozenset[str] = frozenset()  # read names visible (reads/rules/expectations)
    rungs: frozenset[str] = frozenset()  # rung ids usable as RUNG.metric (plus "PASS" when until_pass)
    metrics: frozenset[str] = frozenset()  # metric names (RUNG.metric, bare metric in pass_rule/kill)
    items: frozenset[str] = frozenset()  # item ids (string args of passed()/dropped())
    oracles: frozenset[str] = frozenset()  # oracle ids (string args of passed())
    kills: frozenset[str] = frozenset()  # kill-line ids (string args of killed())
    row_metrics: frozenset[str] = frozenset()  # the metrics recorded row by row (arguments of row functions)

    def __post_init__(self) -> None:
        if self.kind not in SCOPE_KINDS:
            raise ValueError(f"scope kind {self.kind!r} is not one of {', '.join(SCOPE_KINDS)}")
        for field in fields(self)[1:]:
            value = getattr(self, field.name)
            if isinstance(value, str) or not all(isinstance(name, str) for name in value):
                raise TypeError(f"Scope.{field.name} must be a set of strings, got {value!r}")
            object.__setattr__(self, field.name, frozenset(value))
        for field_name in _IDENTIFIER_FIELDS:
            bad = sorted(
                n for n in getattr(self, field_name) if not (n.isidentifier() and n.isascii()) or keyword.iskeyword(n)
            )
            if bad:
                raise ValueError(
                    f"Scope.{field_name}: {bad} cannot be written in an expression; "
                    "names are ASCII identifiers, not Python keywords"
                )
        if self.reads and self.kind not in REFERENCE_KINDS:
            # A bare name in a pass rule or kill line is a metric; reads there would make it ambiguous.
            raise ValueError(f"a {self.kind} scope sees metrics, not reads; got reads {sorted(self.reads)}")
        if self.kind == "kill" and "step" in self.metrics:
            raise ValueError("in a kill scope 'step' is the window's last step; a metric cannot also be named step")
