"""Sensitivity: can the ladder see what its rules ask?

A rule that compares a read with a constant (`gain >= 0.02`) decides well only if the ladder can tell that bar from
no effect. Before any data, `assess` estimates for each such bar the read's standard error at the planned read
windows, its minimum detectable effect (two-sided 5%, power 80%) and the windows per rung the bar needs. After the
data, `robustness` gives each compared read's bootstrap probability of landing on the other side of its bar.

Bars (`find_bars`): in every rule's `when` and every conditional land entry's `if`, each comparison of a read with
a constant, on either side, in chained comparisons and inside `and`, `or`, `not` and boolean reads. A comparison of
something measured with anything that is not a constant, or an equality, is not a bar: it is listed with the reason.

The estimator. A rung's summary of a metric is the median of its n kept windows. The windows' noise comes from
earlier windows of the same workload, profile, window length and effective config (`ledger_noise`), or from the
A/A calibration of `[protocol.noise]` (`aa_noise`, preferred where both exist: it is this ladder's own baseline):
- rho, the windows' lag-1 autocorrelation: per run r1 over the deviations from the run's mean, corrected for its
  small-sample bias (E r1 ~ rho - (1 + 3 rho) / n, so rho = (n r1 + 1) / (n - 3)), averaged with weights n - 3,
  then clamped to [0, 0.9]: a negative value would shrink the error below that of independent windows, and near 1
  a run says almost nothing about its own level;
- sigma, one window's standard deviation, as a coefficient of variation pooled within runs,
  cv^2 = sum (n_i - 1) c_i (s_i / m_i)^2 / sum (n_i - 1): runs at different levels (an item that made the step
  faster) do not count their difference as noise. c_i = (n_i - 1) / (n_i - I_n), I_n = 1 + 2 sum_{k<n} (1 - k/n)
  rho^k: deviations from a run's own mean understate the spread of correlated windows;
- var(median of n windows) = (pi/2) sigma^2 / n * (1 + 2 sum_{k<n} (1 - k/n) (2/pi) asin(rho^k)).
  pi/2 is the median's variance over the mean's for normal windows (its efficiency is 2/pi). The sum is the
  inflation of a series whose lag-k correlation is rho^k, taken for the median: a median answers to the signs of
  the deviations, and the signs of a normal AR(1) series correlate as (2/pi) asin(rho^k), less than the values'
  rho^k, so the mean's (1 + rho) / (1 - rho) would overstate it. Both are asymptotic; for a few windows the
  median's variance is below (pi/2) sigma^2 / n, so the estimate errs towards asking for more windows.
- The read's error by the delta method on its own compiled expression: the slope in each summary by differences of
  a thousandth of that summary's window SD, at the null point (every rung the read compares set to the baseline
  rung's level), summaries of different rungs independent: se^2 = sum (df/dx_i)^2 var(x_i). At a kink (abs at its
  null) the steeper one-sided slope is taken: folding a difference does not shrink its noise.
- mde = (z_0.975 + z_0.8) se; the bar's distance is |bar - null|, null the read at the null point; powered when
  mde <= distance; windows needed, the fewest kept windows per rung at which it holds.

What the estimate does not see, and says so: a shift of level between processes (each sequential rung is a fresh
process) is not window-to-window noise. A paired metric (the loss) is listed, not estimated: rungs that saw the same
samples share their window noise, which cancels in their comparison, so an independent-rung error would be wrong.
So is a metric summarised otherwise than by a median (a peak by max, a last value), and a read of PASS, the rung
that passes an until-pass ladder, unknown before it runs.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any, Literal

from prereg.ledger import Ledger
from prereg.registry import get_workload
from prereg.rules import Expr, MapEnv, Scope, Undefined, compile_expr
from prereg.rules.nodes import (
    BoolOp,
    Comparison,
    ContextCall,
    HistoryCall,
    MetricRef,
    Node,
    Not,
    ReadRef,
    RungMetricRef,
    StepRef,
)
from prereg.rules.values import Value, is_number
from prereg.schema import ConditionalLand, Protocol, Registration, scope_names
from prereg.state import RegistrationState, load_state

MDE_Z = NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(0.80)  # two-sided 5%, power 80%
FRAGILE_ABOVE = 0.2  # a decision whose read crosses its bar in more than a fifth of the resamples is fragile
MIN_RUN_WINDOWS = 4  # the bias-corrected lag-1 autocorrelation divides by n - 3
RHO_CEILING = 0.9
GRADIENT_STEP = 1e-3  # of a summary's window SD: small against the noise, large against float rounding
WINDOWS_CAP = 100_000  # per rung; a bar that needs more is, for any ladder, out of reach

NoiseSource = Literal["ledger", "aa"]
Pair = tuple[str, str]  # (rung, metric)

# --- bars ----------------------------------------------------------------------------------------------------------

_HOLDS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
_MIRRORED = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}  # `0.02 <= gain` is `gain >= 0.02`
_NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}  # `not (gain < 0.02)` holds when `gain >= 0.02`
# Nodes whose value comes from outside the expression: a sub-expression with none of them is a constant.
_NAMING_NODES = (ReadRef, RungMetricRef, MetricRef, StepRef, ContextCall, HistoryCall)


@dataclass(frozen=True)
class Bar:
    """`read op bar` is what the condition needs of the read for the comparison to hold."""

    rule: str  # the rule's id
    clause: str  # "when", or "land.ITEM.if" for a conditional land entry
    read: str  # the read's name, or the text of the expression compared
    op: Literal["<", "<=", ">", ">="]
    bar: float
    expr: Expr = field(repr=False, compare=False)  # the read's side, compiled as a read

    @property
    def label(self) -> str:
        return _label(self.rule, self.clause)

    @property
    def direction(self) -> Literal["above", "below"]:
        return "above" if self.op in (">", ">=") else "below"

    def holds(self, value: float) -> bool:
        return _HOLDS[self.op](value, self.bar)


@dataclass(frozen=True)
class Unresolved:
    """A comparison of something measured whose bar cannot be found."""

    rule: str  # as Bar.label
    read: str
    reason: str


def read_expressions(reg: Registration) -> dict[str, Expr]:
    scope = Scope(kind="reads", reads=frozenset(reg.reads), **scope_names(reg, reg.declaration()))
    return {name: compile_expr(text, scope) for name, text in reg.reads.items()}


class _BarFinder:
    def __init__(self, reg: Registration):
        names = scope_names(reg, reg.declaration())
        self.rules_scope = Scope(kind="rules", reads=frozenset(reg.reads), **names)
        self.reads_scope = Scope(kind="reads", reads=frozenset(reg.reads), **names)
        self.reads = read_expressions(reg)
        self.bars: list[Bar] = []
        self.unresolved: list[Unresolved] = []

    def find(self, reg: Registration) -> tuple[tuple[Bar, ...], tuple[Unresolved, ...]]:
        for rule in reg.rules:
            self._visit(rule.id, "when", compile_expr(rule.when, self.rules_scope).root, negated=False)
            for entry in rule.land:
                if isinstance(entry, ConditionalLand):
                    clause = f"land.{entry.item}.if"
                    self._visit(rule.id, clause, compile_expr(entry.if_, self.rules_scope).root, negated=False)
        return tuple(self.bars), tuple(self.unresolved)

    def measured(self, node: Node) -> frozenset[Pair]:
        """The (rung, metric) summaries a node depends on, through the reads it names."""
        pairs: set[Pair] = set()
        for sub in node.walk():
            if isinstance(sub, RungMetricRef):
                pairs.add((sub.rung, sub.metric))
            elif isinstance(sub, ReadRef):
                pairs |= self.measured(self.reads[sub.name].root)
        return frozenset(pairs)

    def _visit(self, rule: str, clause: str, node: Node, *, negated: bool) -> None:
        if isinstance(node, Comparison):
            self._comparison(rule, clause, node, negated)
        elif isinstance(node, Not):
            self._visit(rule, clause, node.operand, negated=not negated)
        elif isinstance(node, ReadRef):
            self._visit(rule, clause, self.reads[node.name].root, negated=negated)  # a boolean read: its comparisons
        elif isinstance(node, BoolOp) or not isinstance(node, _NAMING_NODES):
            for child in node.children():  # all(...) and any(...) are and/or over their arguments
                self._visit(rule, clause, child, negated=negated)

    def _comparison(self, rule: str, clause: str, node: Comparison, negated: bool) -> None:
        label = _label(rule, clause)
        for left, op, right in zip(node.operands, node.ops, node.operands[1:]):
            left_measured, right_measured = bool(self.measured(left)), bool(self.measured(right))
            if not (left_measured or right_measured):
                continue
            read, other, op = (left, right, op) if left_measured else (right, left, _MIRRORED.get(op, op))
            name = _read_name(read)
            constant = _constant(other)
            if op in ("==", "!="):
                self.unresolved.append(Unresolved(label, name, f"`{node.source}` is an equality, not a bar"))
            elif (left_measured and right_measured) or constant is None:
                self.unresolved.append(
                    Unresolved(label, name, f"`{node.source}` compares it with {other.source}, which is not a constant")
                )
            elif not is_number(constant):
                self.unresolved.append(Unresolved(label, name, f"`{node.source}` compares it with a non-number"))
            else:
                expr = self.reads[name] if isinstance(read, ReadRef) else compile_expr(read.source, self.reads_scope)
                bar = Bar(rule, clause, name, _NEGATED[op] if negated else op, float(constant), expr)
                if bar not in self.bars:
                    self.bars.append(bar)


def _label(rule: str, clause: str) -> str:
    """How a row names where its bar is: the rule's id, or RULE.land.ITEM for a conditional land entry."""
    return rule if clause == "when" else f"{rule}.{clause.removesuffix('.if')}"


def _read_name(node: Node) -> str:
    return node.name if isinstance(node, ReadRef) else node.source


def _constant(node: Node) -> Value | None:
    """The value of a sub-expression that names nothing measured (`0.05`, `-0.02`, `1 / 20`), else None."""
    if any(isinstance(sub, _NAMING_NODES) for sub in node.walk()):
        return None
    value = node.evaluate(MapEnv())
    return None if isinstance(value, Undefined) else value


def find_bars(reg: Registration) -> tuple[tuple[Bar, ...], tuple[Unresolved, ...]]:
    """Every bar of every rule and conditional land entry, and the measured comparisons that have none."""
    return _BarFinder(reg).find(reg)


# --- noise -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowSeries:
    """One run's kept windows of one metric, in step order."""

    values: tuple[float, ...]
    origin: str  # "registration/run"
    external: bool  # windows a record entered (`prereg record`), not measured by the engine


@dataclass(frozen=True)
class NoNoise:
    reason: str
    measured_by: NoiseSource | None = None  # the source that will measure it (the A/A calibration at run)


@dataclass(frozen=True)
class MetricNoise:
    """A metric's window-to-window noise, and the level the windows sat at."""

    level: float  # the median of the windows: where a read is linearised
    cv: float  # one window's SD over the level
    rho: float  # lag-1 autocorrelation of consecutive windows, in [0, RHO_CEILING]
    windows: int
    runs: int
    source: NoiseSource
    external_runs: int = 0  # runs whose windows were recorded, not measured by the engine

    def __post_init__(self) -> None:
        if not (math.isfinite(self.level) and self.level != 0):
            raise ValueError(f"level = {self.level}: a noise level must be a finite number other than 0")
        if not (math.isfinite(self.cv) and self.cv >= 0):
            raise ValueError(f"cv = {self.cv}: a coefficient of variation is a finite number >= 0")
        if not 0 <= self.rho <= RHO_CEILING:
            raise ValueError(f"rho = {self.rho}: the autocorrelation is clamped to [0, {RHO_CEILING}]")

    @classmethod
    def from_sd(cls, level: float, sd: float, *, rho: float = 0.0, source: NoiseSource, windows: int, runs: int):
        """From an absolute window SD at `level`."""
        return cls(level, abs(sd / level), rho, windows, runs, source)

    @classmethod
    def from_series(cls, series: Sequence[WindowSeries], source: NoiseSource) -> MetricNoise | NoNoise:
        usable = [s for s in series if len(s.values) >= MIN_RUN_WINDOWS]
        if not usable:
            return NoNoise(
                f"no run has {MIN_RUN_WINDOWS} read windows of it"
                + (f" ({len(series)} shorter: {', '.join(s.origin for s in series)})" if series else "")
            )
        zero = [s.origin for s in usable if statistics.fmean(s.values) == 0]
        if zero:
            return NoNoise(f"its windows average 0 in {', '.join(zero)}: no coefficient of variation")
        corrected = [((len(s.values) * _lag1(s.values) + 1) / (len(s.values) - 3), len(s.values) - 3) for s in usable]
        rho = min(max(sum(r * w for r, w in corrected) / sum(w for _, w in corrected), 0.0), RHO_CEILING)
        squares = sum(
            (len(s.values) - 1) ** 2
            / (len(s.values) - mean_inflation(rho, len(s.values)))
            * (statistics.stdev(s.values) / statistics.fmean(s.values)) ** 2
            for s in usable
        )
        cv = math.sqrt(squares / sum(len(s.values) - 1 for s in usable))
        level = statistics.median([v for s in usable for v in s.values])
        return cls(
            level=level,
            cv=cv,
            rho=rho,
            windows=sum(len(s.values) for s in usable),
            runs=len(usable),
            source=source,
            external_runs=sum(s.external for s in usable),
        )

    def median_variance(self, level: float, n: int) -> float:
        """The variance of the median of n kept windows at `level`."""
        return math.pi / 2 * (self.cv * level) ** 2 / n * median_inflation(self.rho, n)


def _lag1(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    deviations = [v - mean for v in values]
    total = sum(d * d for d in deviations)
    return sum(a * b for a, b in zip(deviations, deviations[1:])) / total if total else 0.0


def mean_inflation(rho: float, n: int) -> float:
    """n var(mean of n AR(1) windows) / sigma^2; a run's deviations from its own mean miss (I_n - 1) / (n - 1)
    of sigma^2, so its sample variance is scaled by (n - 1) / (n - I_n)."""
    return 1 + 2 * sum((1 - k / n) * rho**k for k in range(1, n))


def median_inflation(rho: float, n: int) -> float:
    """Var(median of n AR(1) windows) over var(median of n independent ones): the signs' correlations summed."""
    total, k = 1.0, 1
    while k < n and rho**k > 1e-12:
        total += 2 * (1 - k / n) * (2 / math.pi) * math.asin(rho**k)
        k += 1
    return total


NoiseTable = Mapping[Pair, MetricNoise | NoNoise]


def _median_metrics(reg: Registration) -> list[str]:
    return sorted(name for name, m in reg.declaration().metrics.items() if m.summary == "median")


def _config_key(config: Mapping[str, Any]) -> str:
    return repr(sorted(config.items()))


def run_config(reg: Registration, rung: str) -> dict[str, Any]:
    """The rung's effective config as its run-start records it: every key, the defaults it resolved with included
    (two documents that leave a key unset but were frozen with different defaults ran different configs)."""
    return reg.effective_config(rung).model_dump(mode="json")


def rungs_like_baseline(reg: Registration) -> list[str]:
    """The rungs that run the baseline rung's effective config: an A/A calibration of the baseline stands for them."""
    baseline = run_config(reg, baseline_rung(reg))
    return [r.id for r in reg.protocol.rungs if run_config(reg, r.id) == baseline]


def prior_windows(
    states: Iterable[RegistrationState],
    *,
    workload: str,
    profile: str,
    log_every: int,
    config: Mapping[str, Any],
    table: Mapping[str, Any] | None = None,
) -> dict[str, list[WindowSeries]]:
    """metric -> the kept windows of every finished run of that workload (for a workload its document declares, the
    same table: the same script and metrics), profile and window length whose rung ran with exactly this effective
    config (`run_config`). Window length counts: a window's noise depends on the steps it averages."""
    metrics = get_workload(workload, table).metrics
    found: dict[str, list[WindowSeries]] = {}
    for state in states:
        versions: dict[int, Registration] = {}
        for run in state.runs:
            if run.status != "finished" or run.flagged or not run.windows:
                continue
            if run.version not in versions:
                versions[run.version] = state.registration_at(run.version)
            reg = versions[run.version]
            rung = run.rung.removesuffix("'")  # a primed re-run (C') runs C's config
            ran = (reg.workload, reg.command, reg.profile, reg.protocol.log_every)
            if ran != (workload, table, profile, log_every):
                continue
            if run_config(reg, rung) != config:
                continue
            for name, series in read_window_values(run.windows, metrics, reg.protocol.discard_first).items():
                found.setdefault(name, []).append(
                    WindowSeries(tuple(series), f"{state.reg_id}/{run.run_id}", run.external)
                )
    return found


def ledger_noise(reg: Registration, states: Iterable[RegistrationState]) -> dict[Pair, MetricNoise | NoNoise]:
    """(rung, metric) -> the noise of earlier windows matching each rung of `reg` (its own runs excluded: they are
    the data its rules judge, and an estimate made before them must not move with them)."""
    states = [s for s in states if s.reg_id != reg.id]
    table: dict[Pair, MetricNoise | NoNoise] = {}
    by_config: dict[str, dict[str, list[WindowSeries]]] = {}
    for rung in reg.protocol.rungs:
        config = run_config(reg, rung.id)
        key = _config_key(config)
        if key not in by_config:
            by_config[key] = prior_windows(
                states,
                workload=reg.workload,
                profile=reg.profile,
                log_every=reg.protocol.log_every,
                config=config,
                table=reg.command,
            )
        for metric in _median_metrics(reg):
            series = by_config[key].get(metric)
            table[(rung.id, metric)] = (
                MetricNoise.from_series(series, "ledger")
                if series
                else NoNoise(
                    f"no earlier finished run of {reg.workload}{' (this [command] table)' if reg.command else ''} on "
                    f"{reg.profile} with log_every = "
                    f"{reg.protocol.log_every} and rung {rung.id}'s config has {metric} windows"
                )
            )
    return table


def noise_from_ledger(ledger: Ledger, reg: Registration) -> dict[Pair, MetricNoise | NoNoise]:
    states = [load_state(ledger, reg_id) for reg_id in ledger.reg_ids() if reg_id != reg.id]
    return ledger_noise(reg, states)


def aa_noise(reg: Registration, series: Mapping[str, Sequence[WindowSeries]]) -> dict[Pair, MetricNoise | NoNoise]:
    """The A/A calibration: the baseline's windows, twice. They stand for every rung that runs the baseline's
    effective config (the items a rung adds are what the ladder measures, not its noise)."""
    rungs = rungs_like_baseline(reg)
    return {
        (rung, metric): MetricNoise.from_series(windows, "aa") for metric, windows in series.items() for rung in rungs
    }


def preferring(first: NoiseTable, then: NoiseTable) -> dict[Pair, MetricNoise | NoNoise]:
    """`first`'s known noise, else `then`'s: aa_noise before ledger_noise."""
    merged = dict(then)
    for pair, noise in first.items():
        if isinstance(noise, MetricNoise) or pair not in merged:
            merged[pair] = noise
    return merged


# --- the assessment --------------------------------------------------------------------------------------------


def baseline_rung(reg: Registration) -> str:
    """The first rung with no items (the first rung when every one has some): the level of no effect."""
    return next((r.id for r in reg.protocol.rungs if not r.items), reg.protocol.rungs[0].id)


def planned_windows(protocol: Protocol) -> int:
    """Kept windows per rung: windows end every log_every steps (the last at `steps`); those ending after
    discard_first are read."""
    return math.ceil(protocol.steps / protocol.log_every) - protocol.discard_first // protocol.log_every


@dataclass(frozen=True)
class Sensitivity:
    """One bar: can the planned windows tell it from no effect?"""

    read: str
    rule: str
    bar: float
    noise_cv: float | None  # the largest window CV among the summaries the read uses
    noise_source: Literal["ledger", "aa", "none"]  # that summary's source
    windows_per_rung: int
    se: float | None
    mde: float | None
    windows_needed: int | None
    powered: bool | None  # None when no noise is known
    notes: tuple[str, ...] = ()  # why a value is null; which noise came from recorded (external) runs

    def as_json(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "rule": self.rule,
            "bar": self.bar,
            "noise_cv": self.noise_cv,
            "noise_source": self.noise_source,
            "windows_per_rung": self.windows_per_rung,
            "se": self.se,
            "mde": self.mde,
            "windows_needed": self.windows_needed,
            "powered": self.powered,
        }


@dataclass(frozen=True)
class Assessment:
    rows: tuple[Sensitivity, ...]
    unresolved: tuple[Unresolved, ...]

    def rows_json(self) -> list[dict[str, Any]]:
        return [row.as_json() for row in self.rows]

    def notes_json(self) -> list[dict[str, str]]:
        """Why a row has nulls, and the compared reads with no bar: {rule, read, note}."""
        notes = [{"rule": row.rule, "read": row.read, "note": note} for row in self.rows for note in row.notes]
        return notes + [{"rule": u.rule, "read": u.read, "note": u.reason} for u in self.unresolved]


class _PointEnv:
    """The rule language's view of one point of summaries: reads evaluated over it, nothing else known."""

    def __init__(self, reads: Mapping[str, Expr], point: Mapping[Pair, float]):
        self.reads = reads
        self.point = point

    def read(self, name: str) -> Value:
        return self.reads[name].evaluate(self)

    def rung_metric(self, rung: str, metric: str) -> Value:
        return self.point.get((rung, metric), Undefined(f"{rung}.{metric} is not a summary of this read"))

    def rows(self, rung: str, metric: str) -> Undefined:
        return Undefined("no rows are recorded before the ladder")

    def metric(self, name: str) -> Value:
        return Undefined("a bare metric outside a pass rule")

    def step(self) -> Value:
        return Undefined("step outside a kill line")

    def history(self, metric: str) -> list[tuple[int, float]]:
        return []

    def oracle_passed(self, ident: str) -> Value:
        return Undefined("no oracle has a result before the ladder")

    def all_oracles_passed(self) -> Value:
        return Undefined("no oracle has a result before the ladder")

    def killed(self, ident: str) -> Value:
        return Undefined("nothing is killed before the ladder")

    def dropped(self, item_id: str) -> Value:
        return Undefined("nothing is dropped before the ladder")


def _value(expr: Expr, reads: Mapping[str, Expr], point: Mapping[Pair, float]) -> float | str:
    """The read at `point`, or why it has no finite value there."""
    value = expr.evaluate(_PointEnv(reads, point))
    if isinstance(value, Undefined):
        return value.reason
    if not is_number(value) or not math.isfinite(value):
        return f"it is {value!r} at the null point, not a finite number"
    return float(value)


def _windows_needed(variance: Callable[[int], float], distance: float) -> int | None:
    """The fewest windows n with MDE_Z * sqrt(variance(n)) <= distance; None beyond WINDOWS_CAP."""

    def enough(n: int) -> bool:
        return MDE_Z * math.sqrt(variance(n)) <= distance

    if not enough(WINDOWS_CAP):
        return None
    low, high = 0, 1  # enough(high) and not enough(low), low = 0 standing for "none"
    while not enough(high):
        low, high = high, min(2 * high, WINDOWS_CAP)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high


def _blocking(reg: Registration, pairs: frozenset[Pair], noise: NoiseTable) -> list[str]:
    """Why the read's error cannot be estimated from window noise; empty when it can."""
    metrics = reg.declaration().metrics
    baseline = baseline_rung(reg)
    blocking = []
    for rung, metric in sorted(pairs):
        where = f"{rung}.{metric}"
        if rung == "PASS":
            blocking.append(f"{where}: PASS is the rung that passes the ladder, not known before it runs")
        elif metrics[metric].paired:
            blocking.append(
                f"{where}: a paired metric; rungs that saw the same samples share its window noise, which cancels "
                "in their comparison, so the independent-rung error does not apply"
            )
        elif metrics[metric].summary != "median":
            blocking.append(f"{where}: summarised by {metrics[metric].summary}; window noise gives no error for it")
        elif not isinstance(noise.get((rung, metric)), MetricNoise):
            blocking.append(f"{where}: {noise.get((rung, metric), NoNoise('no noise was given for it')).reason}")
        elif not isinstance(noise.get((baseline, metric)), MetricNoise):
            blocking.append(f"{where}: the level of {metric} on the baseline rung {baseline} is not known")
    return blocking


def _assess_bar(
    reg: Registration, bar: Bar, pairs: frozenset[Pair], noise: NoiseTable, reads: Mapping[str, Expr]
) -> Sensitivity:
    known = {pair: found for pair in pairs if isinstance(found := noise.get(pair), MetricNoise)}
    noisiest = max(known.values(), key=lambda found: found.cv, default=None)
    # A summary whose noise is still to be measured leaves the row waiting on that source, whatever else is known.
    awaited = next(
        (n.measured_by for p in sorted(pairs) if isinstance(n := noise.get(p), NoNoise) and n.measured_by), None
    )
    marks = tuple(
        f"{rung}.{metric}: its noise includes {found.external_runs} recorded (external) run(s)"
        for (rung, metric), found in sorted(known.items())
        if found.external_runs
    )
    row = Sensitivity(
        read=bar.read,
        rule=bar.label,
        bar=bar.bar,
        noise_cv=noisiest.cv if noisiest and not awaited else None,
        noise_source=awaited or (noisiest.source if noisiest else "none"),
        windows_per_rung=planned_windows(reg.protocol),
        se=None,
        mde=None,
        windows_needed=None,
        powered=None,
        notes=marks,
    )
    blocking = _blocking(reg, pairs, noise) or ([] if pairs else ["the read uses no rung summary"])
    if blocking:
        return replace(row, notes=tuple(blocking) + marks)
    baseline = baseline_rung(reg)
    levels = {pair: noise[(baseline, pair[1])].level for pair in pairs}
    null = _value(bar.expr, reads, levels)
    if isinstance(null, str):
        return replace(row, notes=(f"the read has no value under no effect: {null}",) + marks)
    slopes: dict[Pair, float] = {}
    for pair in sorted(pairs):
        sd = known[pair].cv * abs(levels[pair])
        if sd == 0:
            slopes[pair] = 0.0
            continue
        h = GRADIENT_STEP * sd
        above = _value(bar.expr, reads, {**levels, pair: levels[pair] + h})
        below = _value(bar.expr, reads, {**levels, pair: levels[pair] - h})
        if isinstance(above, str) or isinstance(below, str):
            return replace(row, notes=(f"the read has no slope in {pair[0]}.{pair[1]} under no effect",) + marks)
        slopes[pair] = max(abs(above - null), abs(null - below)) / h

    def variance(windows: int) -> float:
        return sum(slopes[p] ** 2 * known[p].median_variance(levels[p], windows) for p in pairs)

    se = math.sqrt(variance(row.windows_per_rung))
    distance = abs(bar.bar - null)
    needed = _windows_needed(variance, distance) if distance > 0 else None
    if distance == 0:
        marks += (f"the bar is the read's value under no effect ({null:g}): no number of windows tells them apart",)
    elif needed is None:
        marks += (f"it needs more than {WINDOWS_CAP} windows per rung",)
    return replace(row, se=se, mde=MDE_Z * se, windows_needed=needed, powered=MDE_Z * se <= distance, notes=marks)


def assess(reg: Registration, noise: NoiseTable) -> Assessment:
    """Every bar of `reg` against the noise known for the summaries its read uses."""
    finder = _BarFinder(reg)
    bars, unresolved = finder.find(reg)
    rows = tuple(_assess_bar(reg, bar, finder.measured(bar.expr.root), noise, finder.reads) for bar in bars)
    return Assessment(rows, unresolved)


# --- after the data ----------------------------------------------------------------------------------------------


def decision_bars(reg: Registration, tried: Sequence[str], fired: str | None) -> tuple[Bar, ...]:
    """The bars the verdict's decision rests on: those of the rules tried (up to the one that fired) and of the
    fired rule's conditional land entries."""
    bars, _ = find_bars(reg)
    return tuple(b for b in bars if b.rule in tried and (b.clause == "when" or b.rule == fired))


def robustness(
    bars: Iterable[Bar], values: Mapping[str, Any], draws: Mapping[str, Sequence[float]], *, min_draws: int
) -> dict[str, dict[str, Any]]:
    """read -> its bar, the share of bootstrap draws on the other side of it from the read's value, and `fragile`
    when that share exceeds FRAGILE_ABOVE. A read with several bars shows the one it is likeliest to cross; one with
    no value or too few finite draws (fewer than `min_draws`) shows null."""
    shown: dict[str, dict[str, Any]] = {}
    for bar in bars:
        value, sample = values.get(bar.read), draws.get(bar.read, ())
        flip = None
        if is_number(value) and math.isfinite(value) and len(sample) >= min_draws:
            observed = bar.holds(value)
            flip = sum(bar.holds(d) != observed for d in sample) / len(sample)
        entry = {"bar": bar.bar, "flip_probability": flip, "fragile": None if flip is None else flip > FRAGILE_ABOVE}
        previous = shown.get(bar.read)
        if (
            previous is None
            or previous["flip_probability"] is None
            or (flip is not None and flip > previous["flip_probability"])
        ):
            shown[bar.read] = entry
    return shown


def read_window_values(windows, metrics, discard_first: int) -> dict[str, list[float]]:
    """metric -> its finite values over a run's read windows (those after the discarded warm-up), in order."""
    values: dict[str, list[float]] = {}
    for window in windows:
        if window.get("step", 0) <= discard_first:
            continue
        for name, value in window.items():
            if name in metrics and is_number(value) and math.isfinite(value):
                values.setdefault(name, []).append(float(value))
    return values
