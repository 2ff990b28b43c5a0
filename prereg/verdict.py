"""The verdict: the frozen rules applied to what was measured, mechanically.

Rules are tried in order; the first whose `when` holds decides. A rule whose `when` is undefined does not fire,
and the verdict says which reads were undefined and why. Conditional land entries are evaluated the same way.
Expectations are scored hit / miss / undefined. Every read that depends on rung windows also gets a bootstrap
95% interval (windows resampled within each rung; a paired metric's by index, the same in every rung), and every read a
tried rule compares with a bar its robustness: the share of those resamples on the other side of the bar, `fragile`
above 20% (prereg.sensitivity). The rule still decides on the value it names.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from prereg.canonical import canonical_hash
from prereg.cost import cost_summary
from prereg.ledger import Ledger
from prereg.plan import PlannedRung, plan_ladder, primed
from prereg.rules import Expr, Scope, Undefined, compile_expr
from prereg.schema import ConditionalLand, Registration
from prereg.sensitivity import Bar, decision_bars, robustness
from prereg.state import RegistrationState, RungRun, load_state, summarize

BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0  # fixed: the interval is part of the recorded verdict and must be reproducible


@dataclass
class RungView:
    """What reads see of a rung."""

    id: str
    planned: PlannedRung
    run: RungRun | None
    summary: dict[str, Any]
    samples: dict[str, list[float]]
    why_undefined: str | None  # when the rung has no usable measurements


def _usable(run: RungRun) -> bool:
    return run.status != "interrupted" and run.flagged is None


def rung_views(reg: Registration, state: RegistrationState) -> dict[str, RungView]:
    dropped = set(state.dropped())
    views: dict[str, RungView] = {}
    until_pass = reg.protocol.kind == "until_pass"
    for planned in plan_ladder(reg, dropped):
        candidates = [r for r in state.runs if r.rung in (planned.id, primed(planned.id)) and _usable(r)]
        flagged = [r for r in state.runs if r.rung == planned.id and r.flagged]
        if planned.skip:
            views[planned.id] = RungView(
                planned.id, planned, None, {}, {}, f"rung {planned.id} was not run: {planned.skip}"
            )
            continue
        acceptable = ("finished", "killed", "failed", "over-ceiling") if until_pass else ("finished",)
        # A run measured with other items than the plan now has (a later drop) is stale: never read.
        reading = [r for r in candidates if r.status in acceptable and sorted(r.items) == sorted(planned.items)]
        if reading:
            run = reading[-1]
            summary, samples = summarize(run, reg.protocol.discard_first, reg.declaration())
            views[planned.id] = RungView(planned.id, planned, run, summary, samples, None)
            continue
        if candidates:
            last = candidates[-1]
            if last.kill:
                why = f"rung {planned.id} was killed at step {last.kill.get('step')} by {last.kill.get('kill')}"
            elif sorted(last.items) != sorted(planned.items):
                why = (
                    f"rung {planned.id} ran with items {list(last.items)}, but the plan now runs {list(planned.items)} "
                    "(an item was dropped after it ran): it needs a re-run"
                )
            else:
                why = f"rung {planned.id} has no finished run (last: {last.status})"
        elif flagged:
            why = (
                f"rung {planned.id} was recorded with items {list(flagged[-1].items)} against a plan of "
                f"{list(planned.items)}: {flagged[-1].flagged}"
            )
        else:
            why = f"rung {planned.id} has not run"
        views[planned.id] = RungView(planned.id, planned, None, {}, {}, why)
    return views


class VerdictEnv:
    """The rule language's view of a registration's measurements (prereg.rules.Env)."""

    def __init__(
        self,
        reg: Registration,
        state: RegistrationState,
        views: dict[str, RungView],
        passed_rung: str | None,
        pass_reason: str | None,
    ):
        self.reg = reg
        self.state = state
        self.views = views
        self.passed_rung = passed_rung
        self.pass_reason = pass_reason
        self.overrides: dict[tuple[str, str], Any] = {}
        self._reads: dict[str, Any] = {}
        self._compiled: dict[str, Expr] = {}
        self.dropped_items = state.dropped()

    def compiled_read(self, name: str) -> Expr:
        if name not in self._compiled:
            self._compiled[name] = compile_expr(self.reg.reads[name], read_scope(self.reg))
        return self._compiled[name]

    def read(self, name: str) -> Any:
        if name not in self._reads:
            self._reads[name] = self.compiled_read(name).evaluate(self)
        return self._reads[name]

    def rung_metric(self, rung: str, metric: str) -> Any:
        if rung == "PASS":
            if self.passed_rung is None:
                return Undefined(f"no rung passed the ladder ({self.pass_reason})")
            rung = self.passed_rung
        if (rung, metric) in self.overrides:
            return self.overrides[(rung, metric)]
        view = self.views.get(rung)
        if view is None or view.why_undefined:
            return Undefined(view.why_undefined if view else f"rung {rung} is not in the plan")
        if metric not in view.summary:
            return Undefined(f"{rung}.{metric} was not measured")
        return view.summary[metric]

    def rows(self, rung: str, metric: str) -> Any:
        if rung == "PASS":
            return Undefined("PASS names a rung's summary, not its rows")
        view = self.views.get(rung)
        if view is None or view.why_undefined:
            return Undefined(view.why_undefined if view else f"rung {rung} is not in the plan")
        assert view.run is not None
        if metric not in view.run.rows:
            return Undefined("no rows of it were recorded")
        return view.run.rows[metric]

    def metric(self, name: str) -> Any:
        return Undefined(f"bare metric {name} outside a pass rule")

    def step(self) -> Any:
        return Undefined("step outside a kill line")

    def history(self, metric: str) -> list[tuple[int, float]]:
        return []

    def oracle_passed(self, ident: str) -> Any:
        owner = self.reg.oracle_owner()
        oracle_ids = [ident] if ident in owner else [o.id for o in self.reg.item(ident).oracles]
        settled = self._all_passed(oracle_ids)
        return Undefined(f"oracle {self._missing(oracle_ids)[0]} has no result") if settled is None else settled

    def all_oracles_passed(self) -> Any:
        oracle_ids = [o.id for i in self.reg.items for o in i.oracles]
        settled = self._all_passed(oracle_ids)
        return Undefined(f"oracles {self._missing(oracle_ids)} have no result") if settled is None else settled

    def _missing(self, oracle_ids: list[str]) -> list[str]:
        return [o for o in oracle_ids if o not in self.state.oracles]

    def _all_passed(self, oracle_ids: list[str]) -> bool | None:
        """True or False when the results settle it, None while some have no result."""
        # Three-valued like `and`: one failure settles it even while other oracles have no result yet.
        if any(not self.state.oracles[o].passed for o in oracle_ids if o in self.state.oracles):
            return False
        return None if self._missing(oracle_ids) else True

    def killed(self, ident: str) -> Any:
        if any(k["kill"] == ident or k["rung"] == ident for k in self.state.kills):
            return True
        # "Not killed" is known only once every rung the line watches has run (or was planned out of the ladder).
        kill_line = next((k for k in self.reg.kill if k.id == ident), None)
        watched = [ident] if kill_line is None else kill_line.rungs or [r.id for r in self.reg.protocol.rungs]
        ended = {r.rung for r in self.state.runs if r.status not in ("running", "interrupted")}
        pending = [r for r in watched if r not in ended and primed(r) not in ended and not self.views[r].planned.skip]
        if pending:
            return Undefined(f"not known yet: rung(s) {pending} it watches have not run")
        return False

    def dropped(self, item_id: str) -> Any:
        return item_id in self.dropped_items


def read_scope(reg: Registration) -> Scope:
    rung_ids = [r.id for r in reg.protocol.rungs]
    return Scope(
        kind="reads",
        reads=frozenset(reg.reads),
        rungs=frozenset(rung_ids) | ({"PASS"} if reg.protocol.kind == "until_pass" else set()),
        metrics=frozenset(reg.declaration().metrics),
        items=frozenset(i.id for i in reg.items),
        oracles=frozenset(o.id for i in reg.items for o in i.oracles),
        kills=frozenset([k.id for k in reg.kill] + rung_ids),
        row_metrics=frozenset(m.name for m in reg.declaration().metrics.values() if m.rows),
    )


class PassRuleEnv(VerdictEnv):
    """A pass rule sees the judged rung's summary as bare metric names."""

    def __init__(self, base: VerdictEnv, view: RungView):
        self.__dict__.update(base.__dict__)
        self.view = view

    def metric(self, name: str) -> Any:
        if name not in self.view.summary:
            return Undefined(f"{self.view.id}.{name} was not measured")
        return self.view.summary[name]


def judge_until_pass(
    state: RegistrationState, views: dict[str, RungView], base: VerdictEnv
) -> tuple[str | None, list[dict[str, Any]], str]:
    """Rungs in order; the first whose pass rule (the one in force when it was measured) holds passes."""
    rejected: list[dict[str, Any]] = []
    for rung_id, view in views.items():
        if view.run is None:
            if view.planned.skip:
                rejected.append({"rung": rung_id, "result": "skipped", "reason": view.why_undefined})
                continue
            return None, rejected, f"rung {rung_id} has not been judged: {view.why_undefined}"
        reg_then = state.registration_at(view.run.version)
        rule_text = reg_then.protocol.pass_rule
        assert rule_text, "until_pass ladders always have a pass rule"
        scope = Scope(
            kind="pass_rule",
            rungs=frozenset(r.id for r in reg_then.protocol.rungs),
            metrics=read_scope(base.reg).metrics,
            items=frozenset(i.id for i in reg_then.items),
            oracles=frozenset(o.id for i in reg_then.items for o in i.oracles),
            kills=frozenset([k.id for k in reg_then.kill] + [r.id for r in reg_then.protocol.rungs]),
        )
        value = compile_expr(rule_text, scope).evaluate(PassRuleEnv(base, view))
        shown = {m: view.summary.get(m) for m in sorted(view.summary) if m in rule_text}
        if value is True:
            return rung_id, rejected, f"{rung_id} passed `{rule_text}` with {shown}"
        reason = (
            f"`{rule_text}` is {'undefined: ' + value.reason if isinstance(value, Undefined) else 'false'} with {shown}"
        )
        rejected.append(
            {
                "rung": rung_id,
                "result": "rejected",
                "pass_rule": rule_text,
                "version": view.run.version,
                "reason": reason,
            }
        )
    return None, rejected, "no rung passed"


def _bootstrap_draws(
    env: VerdictEnv, views: dict[str, RungView], targets: Mapping[str, Expr]
) -> dict[str, list[float]]:
    """Each target's finite values over BOOTSTRAP_RESAMPLES resamples, windows drawn with replacement within each rung.

    A paired metric (seed 002: the rungs' k-th windows saw the same samples, e.g. the training loss) is resampled
    by window index, the same indices in every rung, over the windows all rungs have: a draw compares like with
    like. Drawn independently, a read over a falling loss compared one rung's early windows with another's late
    ones (molmo2-fast-same-steps-h200's loss_gap of 0.8% got an interval reaching 33%)."""
    workload_metrics = env.reg.declaration().metrics
    resamplable = {
        (rung_id, metric): values
        for rung_id, view in views.items()
        if view.run is not None
        for metric, values in view.samples.items()
        if len(values) >= 2 and workload_metrics[metric].relative_ok
    }
    dependent = {name: expr for name, expr in targets.items() if _measures(env, expr) & resamplable.keys()}
    if not dependent:
        return {}
    rng = random.Random(BOOTSTRAP_SEED)
    draws: dict[str, list[float]] = {name: [] for name in dependent}
    aligned = {}  # paired metric -> the number of windows every rung that has it has
    for (_, metric), values in resamplable.items():
        if workload_metrics[metric].paired:
            aligned[metric] = min(aligned.get(metric, len(values)), len(values))
    for _ in range(BOOTSTRAP_RESAMPLES):
        overrides = {}
        shared = {metric: [rng.randrange(n) for _ in range(n)] for metric, n in sorted(aligned.items())}
        for (rung_id, metric), values in resamplable.items():
            if metric in shared:
                sample = [values[i] for i in shared[metric]]
            else:
                sample = [values[rng.randrange(len(values))] for _ in values]
            how = workload_metrics[metric].summary
            overrides[(rung_id, metric)] = (
                statistics.median(sample) if how == "median" else max(sample) if how == "max" else sample[-1]
            )
        trial = VerdictEnv(env.reg, env.state, env.views, env.passed_rung, env.pass_reason)
        trial._compiled = env._compiled
        trial.overrides = overrides
        if env.passed_rung:
            for (rung_id, metric), value in list(overrides.items()):
                if rung_id == env.passed_rung:
                    overrides[("PASS", metric)] = value
        for name, expr in dependent.items():
            value = expr.evaluate(trial)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                draws[name].append(float(value))
    return draws


def _measures(env: VerdictEnv, expr: Expr) -> frozenset[tuple[str, str]]:
    """The rung summaries an expression reads, through the reads it names."""
    pairs = set(expr.rung_metrics_used())
    for name in expr.reads_used():
        pairs |= _measures(env, env.compiled_read(name))
    return frozenset(pairs)


def _intervals(draws: Mapping[str, list[float]]) -> dict[str, list[float]]:
    """95% percentile intervals, for targets that kept at least half their draws finite."""
    intervals = {}
    for name, values in draws.items():
        if len(values) >= BOOTSTRAP_RESAMPLES // 2:
            values = sorted(values)
            intervals[name] = [values[int(0.025 * (len(values) - 1))], values[int(0.975 * (len(values) - 1))]]
    return intervals


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_value(value: Any) -> Any:
    if isinstance(value, Undefined):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


@dataclass(frozen=True)
class VerdictDetail:
    """The verdict, and what its intervals and robustness were taken over (for the report's plots; never
    recorded: the draws are a fixed-seed function of the same windows)."""

    verdict: dict[str, Any]
    bars: tuple[Bar, ...]  # the bars the decision rests on (decision_bars)
    compared: dict[str, Any]  # read -> the value its bar compares
    draws: dict[str, list[float]]  # read -> its finite bootstrap draws


def compute_verdict(ledger: Ledger, reg_id: str) -> dict[str, Any]:
    return verdict_detail(ledger, reg_id).verdict


def verdict_detail(ledger: Ledger, reg_id: str) -> VerdictDetail:
    state = load_state(ledger, reg_id)
    reg = state.registration()
    views = rung_views(reg, state)
    base = VerdictEnv(reg, state, views, None, None)
    pass_block = None
    if reg.protocol.kind == "until_pass":
        passed, rejected, reason = judge_until_pass(state, views, base)
        base = VerdictEnv(reg, state, views, passed, reason)
        pass_block = {"passed": passed, "reason": reason, "rejected": rejected}

    reads = {name: base.read(name) for name in reg.reads}
    undefined = {name: value.reason for name, value in reads.items() if isinstance(value, Undefined)}

    rules_scope = replace(read_scope(reg), kind="rules")
    fired = None
    rule_trace = []
    for rule in reg.rules:
        value = compile_expr(rule.when, rules_scope).evaluate(base)
        rule_trace.append(
            {
                "rule": rule.id,
                "when": rule.when,
                "value": _json_value(value) if not isinstance(value, Undefined) else None,
                "undefined": value.reason if isinstance(value, Undefined) else None,
            }
        )
        if value is True:
            fired = rule
            break

    # Intervals for the numeric reads; for each read a rule compared with a bar, how often a resample crosses it.
    numeric = {name: base.compiled_read(name) for name, value in reads.items() if _is_number(value)}
    bars = decision_bars(reg, [t["rule"] for t in rule_trace], fired.id if fired else None)
    compared = {bar.read: bar.expr.evaluate(base) for bar in bars}
    draws = _bootstrap_draws(base, views, {**{b.read: b.expr for b in bars if _is_number(compared[b.read])}, **numeric})
    intervals = _intervals({name: values for name, values in draws.items() if name in numeric})
    read_robustness = robustness(bars, compared, draws, min_draws=BOOTSTRAP_RESAMPLES // 2)

    dropped = state.dropped()
    land: list[str] = []
    park: list[str] = []
    conditional: list[dict[str, Any]] = []
    if fired is not None:
        for entry in fired.land:
            if isinstance(entry, ConditionalLand):
                value = compile_expr(entry.if_, rules_scope).evaluate(base)
                conditional.append(
                    {
                        "item": entry.item,
                        "if": entry.if_,
                        "value": _json_value(value),
                        "undefined": value.reason if isinstance(value, Undefined) else None,
                    }
                )
                (land if value is True else park).append(entry.item)
            else:
                land.append(entry)
        park.extend(fired.park)
    landed_but_dropped = [i for i in land if i in dropped]
    land = [i for i in land if i not in dropped]
    for item in landed_but_dropped:
        if item not in park:
            park.append(item)

    expectations = []
    exp_scope = replace(read_scope(reg), kind="expectations")
    for expectation in reg.expectations:
        value = compile_expr(expectation.check, exp_scope).evaluate(base)
        result = "undefined" if isinstance(value, Undefined) else "hit" if value is True else "miss"
        expectations.append(
            {
                "n": expectation.n,
                "part": expectation.part,
                "claim": expectation.claim,
                "confidence": expectation.confidence,
                "check": expectation.check,
                "result": result,
                "why": value.reason if isinstance(value, Undefined) else None,
            }
        )

    rungs = []
    for rung_id, view in views.items():
        # The spread of the finite samples: a NaN window shows in the summary, and NaN has no place in a min/max.
        finite_samples = {m: [x for x in v if math.isfinite(x)] for m, v in view.samples.items()}
        spread = {m: [min(v), max(v)] for m, v in finite_samples.items() if len(v) >= 2}
        rungs.append(
            {
                "rung": rung_id,
                "items": list(view.planned.items),
                "skip": view.planned.skip,
                "run": view.run.run_id if view.run else None,
                "status": view.run.status if view.run else None,
                "external": view.run.external if view.run else None,
                "version": view.run.version if view.run else None,
                "windows": len([w for w in view.run.windows if w.get("step", 0) > reg.protocol.discard_first])
                if view.run
                else 0,
                "summary": {k: _json_value(v) for k, v in view.summary.items()},
                "spread": spread,
                "why_undefined": view.why_undefined,
            }
        )
    flagged = [
        {"rung": r.rung, "run": r.run_id, "items": list(r.items), "why": r.flagged} for r in state.runs if r.flagged
    ]
    cost = cost_summary(ledger, state)
    verdict = {
        "registration": reg_id,
        "version": state.version,
        "doc_hash": state.versions[-1].doc_hash,
        "outcome": fired.outcome if fired else None,
        "rule": fired.id if fired else None,
        "rules": rule_trace,
        "land": land,
        "park": park,
        "conditional_land": conditional,
        "dropped": dropped,
        "reads": {name: _json_value(value) for name, value in reads.items()},
        "intervals": intervals,
        "robustness": read_robustness,
        "undefined": undefined,
        "expectations": expectations,
        "rungs": rungs,
        "flagged": flagged,
        "until_pass": pass_block,
        "post_hoc": state.post_hoc_paths(),
        "cost": cost,
    }
    return VerdictDetail(verdict, bars, compared, draws)


# Statistics the verdict derives from the same windows after its decision, recomputed on every read: a verdict
# recorded before one of them existed is still the same verdict, so they stay out of its digest.
DERIVED_KEYS = frozenset({"robustness"})


def verdict_digest(verdict: dict[str, Any]) -> str:
    return canonical_hash({key: value for key, value in verdict.items() if key not in DERIVED_KEYS})


def record_verdict(ledger: Ledger, reg_id: str) -> tuple[dict[str, Any], bool]:
    """Compute and append the verdict; idempotent: an unchanged verdict is not appended again."""
    verdict = compute_verdict(ledger, reg_id)
    digest = verdict_digest(verdict)
    previous = [e for e in ledger.entries(reg_id=reg_id, kinds=("verdict",))]
    if previous and previous[-1].data.get("digest") == digest:
        return verdict, False
    ledger.append("verdict", reg_id, {"digest": digest, "verdict": verdict})
    return verdict, True
