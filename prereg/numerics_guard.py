"""Numerics changes land only behind a frozen numeric check.

A workload marks the run-config keys that compute the same step in other arithmetic (kernels, precision, packing,
the grouping of a reduction: `CHANGES_NUMERICS`; a command workload lists them as `numerics_keys`). A compare
ladder whose reads or rules compare two rungs that differ in such a key (their effective configs, defaults
included) must check that difference numerically, in one of two ways:

- a rule's condition requires a bound on a paired difference of the two rungs: one of its top-level `and` terms is
  `X <= c` (or `<`, or `c >= X`), where X compares a paired metric (the loss) of both rungs, directly or through
  reads. A rule that can decide the ladder without that bound still leaves the bound required by the rule that
  requires it: the bound is what landing on that rule means;
- or the difference is in switches (the baseline's, `baseline_switches`), and every switch in which the rungs
  differ is an item's, carrying a tolerance, bitwise or curve_overlay oracle: the gate then measures exactly that
  difference against the baseline. An oracle runs under protocol.config with its item's switch, so it never
  measures a difference of other run-config keys.

Otherwise a new freeze (and `check` of an unfrozen document) is refused. A document frozen before this rule keeps
its meaning: `check` shows it as frozen before the rule.
"""

from __future__ import annotations

from itertools import combinations

from prereg.errors import InvalidInput
from prereg.rules import Scope, compile_expr
from prereg.rules.nodes import BoolOp, Comparison, Node, ReadRef, RungMetricRef
from prereg.schema import Registration, scope_names

NUMERIC_KINDS = frozenset({"tolerance", "bitwise", "curve_overlay"})
UPPER = {"<", "<="}
LOWER = {">", ">="}


def fix(rungs: tuple[str, str], key: str) -> str:
    a, b = rungs
    return (
        f"bound the paired loss difference in the rule that lands it, e.g. [reads] loss_gap = "
        f'"abs({b}.loss - {a}.loss) / {a}.loss" and [[rules]] when = "... and loss_gap <= 0.01"; or keep {key} '
        f"equal across the compared rungs and test the change as an item whose switch carries a numeric oracle, e.g. "
        f'[[items]] id = "N1" switch = "SWITCH" bitwise = false [[items.oracles]] id = "N1a" kind = "tolerance" '
        f'probe = "PROBE" bounds = {{ loss_abs = 1e-3 }}, with items = ["N1"] on rung {b}'
    )


class _Uses:
    """(rung, metric) pairs an expression node reads, through the document's reads too."""

    def __init__(self, reg: Registration):
        self.reg = reg
        self.names = {**scope_names(reg, reg.declaration()), "reads": frozenset(reg.reads)}
        self.reads: dict[str, frozenset[tuple[str, str]]] = {}

    def compile(self, text: str, kind: str):
        return compile_expr(text, Scope(kind=kind, **self.names))  # validated already: it compiles

    def of(self, node: Node) -> frozenset[tuple[str, str]]:
        direct = {(n.rung, n.metric) for n in node.walk() if isinstance(n, RungMetricRef)}
        through = [self.read(n.name) for n in node.walk() if isinstance(n, ReadRef)]
        return frozenset(direct).union(*through)

    def read(self, name: str) -> frozenset[tuple[str, str]]:
        if name not in self.reads:
            self.reads[name] = self.of(self.compile(self.reg.reads[name], "reads").root)  # reads are acyclic
        return self.reads[name]


def _conjuncts(node: Node) -> list[Node]:
    if isinstance(node, BoolOp) and node.op == "and":
        return [term for operand in node.operands for term in _conjuncts(operand)]
    return [node]


def _bounded(term: Node) -> Node | None:
    """The side a comparison bounds from above (`X <= c`, `c >= X`), or None."""
    if not isinstance(term, Comparison) or len(term.ops) != 1:
        return None
    if term.ops[0] in UPPER:
        return term.operands[0]
    if term.ops[0] in LOWER:
        return term.operands[1]
    return None


def _loss_bounded(reg: Registration, uses: _Uses, paired: frozenset[str], rungs: tuple[str, str]) -> bool:
    for rule in reg.rules:
        for term in _conjuncts(uses.compile(rule.when, "rules").root):
            side = _bounded(term)
            if side is None:
                continue
            other = next(o for o in term.operands if o is not side)
            used = uses.of(side)
            if not uses.of(other) and any({(rungs[0], m), (rungs[1], m)} <= used for m in paired):
                return True
    return False


def _oracle_covered(reg: Registration, key: str, rungs: tuple[str, str]) -> bool:
    baseline_key = reg.declaration().run_config.model.BASELINE_KEY
    if key != baseline_key:
        return False
    a, b = (set(reg.effective_config(r).baseline()) for r in rungs)
    checked = {item.switch for item in reg.items if any(o.kind in NUMERIC_KINDS for o in item.oracles)}
    return (a ^ b) <= checked


def unguarded_numerics(reg: Registration) -> list[tuple[tuple[str, str], str, str]]:
    """(rungs, key, problem) for each pair of compared rungs differing in a numerics key without a numeric check."""
    if reg.protocol.kind != "compare":
        return []
    workload = reg.declaration()
    keys = workload.run_config.numerics_keys()
    if not keys:
        return []
    uses = _Uses(reg)
    # Compared: the rungs of one read, or of one comparison in a rule (`gain >= 0.05 and loss_gap <= 0.01` compares
    # the rungs of gain, and those of loss_gap, not each rung of one with each of the other).
    comparisons = [uses.compile(text, "reads").root for text in reg.reads.values()]
    for rule in reg.rules:
        root = uses.compile(rule.when, "rules").root
        comparisons += [node for node in root.walk() if isinstance(node, Comparison)] or [root]
    compared: set[tuple[str, str]] = set()
    for node in comparisons:
        rungs = sorted({rung for rung, _ in uses.of(node)} - {"PASS"})
        compared.update(combinations(rungs, 2))
    paired = frozenset(name for name, metric in workload.metrics.items() if metric.paired)
    order = {rung.id: n for n, rung in enumerate(reg.protocol.rungs)}
    problems = []
    for pair in sorted(compared, key=lambda p: (order[p[0]], order[p[1]])):
        pair = tuple(sorted(pair, key=order.get))
        configs = [reg.effective_config(rung) for rung in pair]
        for key in keys:
            values = [getattr(config, key) for config in configs]
            if values[0] == values[1]:
                continue
            if _loss_bounded(reg, uses, paired, pair) or _oracle_covered(reg, key, pair):
                continue
            problems.append(
                (
                    pair,
                    key,
                    f"rungs {pair[0]} and {pair[1]} are compared and differ in {key} ({pair[0]}={values[0]!r}, "
                    f"{pair[1]}={values[1]!r}), which changes numerics: no frozen numeric check covers it (no rule "
                    f"requires a bound on their paired loss difference, and no oracle measures it)",
                )
            )
    return problems


def refuse_unguarded(reg: Registration, where: str) -> None:
    problems = unguarded_numerics(reg)
    if problems:
        rungs, key, _ = problems[0]
        raise InvalidInput("; ".join(p for _, _, p in problems), where=where, fix=fix(rungs, key))


def frozen_before_the_rule(freeze_seq: int) -> str:
    return f"frozen at entry {freeze_seq} before the numerics-guard rule; a new freeze would be refused"
