"""Seed 002: "paired arms must share the flag".

A run-config flag that regroups the samples into steps (molmo2's `bucket_by_length`, marked `REGROUPS_SAMPLES`)
trains a rung on other steps than a rung without it: another optimisation trajectory, so their losses and the
evaluations of their weights (the workload's `paired` metrics) are not a paired comparison, however alike the
samples per pass. molmo2-fast-h200 compared them anyway and its loss expectation read 4.14 against 2.93 after 24
steps on the H200, a difference of batching, not of the execution under test.

Freezing refuses a compare ladder whose reads, rules or expectations compare a paired metric across rungs that
differ in such a key. Comparing speed or memory across them stays allowed: that is the key's own A/B.
"""

from __future__ import annotations

from prereg.errors import InvalidInput
from prereg.rules import Scope, compile_expr
from prereg.schema import Registration, scope_names

FIX = ("set the key in [protocol].config so every compared rung shares it, or compare across these rungs only metrics "
       "that do not depend on which samples share a step (speed, memory)")  # fmt: skip


def unpaired_comparisons(reg: Registration) -> list[str]:
    """One line per expression that compares a paired metric across rungs trained on differently grouped steps;
    each names the field, the metric, the rungs and the key with each rung's value."""
    if reg.protocol.kind != "compare":
        return []
    workload = reg.declaration()
    regrouping = workload.run_config.regrouping_keys()
    paired = {metric.name for metric in workload.metrics.values() if metric.paired}
    if not regrouping or not paired:
        return []
    # Each rung's effective value: a default that regroups counts as much as a value the document set.
    values = {
        rung.id: {key: getattr(reg.effective_config(rung.id), key) for key in regrouping} for rung in reg.protocol.rungs
    }

    names = {**scope_names(reg, workload), "reads": frozenset(reg.reads)}
    uses: dict[str, frozenset[tuple[str, str]]] = {}  # read -> (rung, metric) it uses, through other reads too

    def used(text: str, kind: str) -> frozenset[tuple[str, str]]:
        expr = compile_expr(text, Scope(kind=kind, **names))  # already validated: it compiles
        direct = expr.rung_metrics_used()
        return direct.union(*(read_uses(name) for name in expr.reads_used()))

    def read_uses(name: str) -> frozenset[tuple[str, str]]:
        if name not in uses:
            uses[name] = used(reg.reads[name], "reads")  # reads are acyclic (schema.py)
        return uses[name]

    expressions = [(f"reads.{name}", text, "reads") for name, text in reg.reads.items()]
    expressions += [(f"rules.{rule.id}.when", rule.when, "rules") for rule in reg.rules]
    expressions += [(f"expectations.{e.n}{e.part or ''}.check", e.check, "expectations") for e in reg.expectations]
    problems = []
    for where, text, kind in expressions:
        references = [(rung, metric) for rung, metric in used(text, kind) if metric in paired]
        compared = sorted({rung for rung, _ in references})
        metrics = sorted({metric for _, metric in references})
        differing = [key for key in regrouping if len({values[rung][key] for rung in compared}) > 1]
        if len(compared) > 1 and differing:
            settings = "; ".join(
                f"{key}: " + ", ".join(f"{rung}={values[rung][key]}" for rung in compared) for key in differing
            )
            problems.append(
                f"{where} = {text!r} compares {', '.join(metrics)} across rungs {', '.join(compared)}, whose steps "
                f"group the samples differently ({settings}): not a paired comparison (paired arms must share the flag)"
            )
    return problems


def refuse_unpaired(reg: Registration, where: str) -> None:
    problems = unpaired_comparisons(reg)
    if problems:
        raise InvalidInput("; ".join(problems), where=where, fix=FIX)
