"""The fixed table of functions an expression may call.

Three families:
- pure functions of their arguments (abs, min, ..., defined), usable everywhere;
- context functions that ask the environment about the oracle gate and kills (passed, killed, ...), usable
  where a ladder is judged after the fact: reads, rules, expectations;
- history functions that reach back through the windows of the running rung (at_step, last, ...), usable in
  kill lines only. Their first argument is a bare metric name, not a value: `at_step(loss, 500)` names the
  series `loss`, it does not evaluate the current window's loss;
- row functions over the rows of a per-row metric (paired_delta, ...), usable where reads are judged: reads,
  rules, expectations. Both arguments name rows, RUNG.metric, not values: `paired_delta(run.m, anchor.m)` pairs
  the two rungs' rows by id (prereg/rules/rows.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prereg.rules.rows import paired_delta, paired_delta_high, paired_delta_low
from prereg.rules.values import StaticType, Undefined, Value, is_number


@dataclass(frozen=True)
class PureFunction:
    name: str
    usage: str  # how to call it, quoted in messages
    min_args: int
    max_args: int | None  # None: any number
    operand: StaticType  # what every argument (or element of a list argument) must be
    returns: StaticType
    takes_list: bool  # a single list argument stands for its elements: min(last(m, 3))
    strict: bool  # an undefined argument makes the result undefined (all but defined/all/any)
    apply: Callable[[list[Value]], Value] = field(repr=False, compare=False)


def _has_nan(values: Sequence[Value]) -> bool:
    return any(isinstance(v, float) and math.isnan(v) for v in values)


def _nan_propagating(pick: Callable[[list], Value]) -> Callable[[list[Value]], Value]:
    # Python's min/max answer depends on where a NaN sits (min([nan, 1]) is nan, min([1, nan]) is 1);
    # a NaN anywhere makes the summary NaN, so a broken window cannot hide behind a good one.
    def apply(values: list[Value]) -> Value:
        return math.nan if _has_nan(values) else pick(values)

    return apply


def _median(values: list) -> Value:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _mean(values: list) -> Value:
    return sum(values) / len(values)


def _finite(values: list) -> Value:
    (x,) = values
    return True if isinstance(x, int) else math.isfinite(x)  # an int is finite, however large


def _kleene(decisive: bool) -> Callable[[list[Value]], Value]:
    # all() is an n-ary `and`, any() an n-ary `or`: one defined deciding value settles it, as with and/or,
    # so `all(a, b)` and `a and b` always agree.
    def apply(values: list[Value]) -> Value:
        if any(v is decisive for v in values):
            return decisive
        undefined = [v for v in values if isinstance(v, Undefined)]
        return undefined[0] if undefined else not decisive

    return apply


def _aggregate(
    name: str, what: str, operand: StaticType, returns: StaticType, apply, *, strict: bool = True
) -> PureFunction:
    return PureFunction(
        name, f"{name}(x, y, ...) or {name}(last(m, n)): {what}", 1, None, operand, returns, True, strict, apply
    )


PURE_FUNCTIONS: dict[str, PureFunction] = {
    f.name: f
    for f in (
        PureFunction("abs", "abs(x): absolute value", 1, 1, "number", "number", False, True, lambda v: abs(v[0])),
        _aggregate("min", "the smallest (NaN if any is NaN)", "number", "number", _nan_propagating(min)),
        _aggregate("max", "the largest (NaN if any is NaN)", "number", "number", _nan_propagating(max)),
        _aggregate("mean", "the arithmetic mean", "number", "number", _mean),
        _aggregate("median", "the median (NaN if any is NaN)", "number", "number", _nan_propagating(_median)),
        _aggregate("sum", "the sum", "number", "number", sum),
        _aggregate("all", "True when every one is True", "boolean", "boolean", _kleene(False), strict=False),
        _aggregate("any", "True when one is True", "boolean", "boolean", _kleene(True), strict=False),
        _aggregate("count", "how many are True", "boolean", "number", lambda v: sum(1 for x in v if x is True)),
        PureFunction(
            "finite", "finite(x): False for NaN and infinities", 1, 1, "number", "boolean", False, True, _finite
        ),
        PureFunction(
            "defined",
            "defined(x): False when x is undefined; the only function that is never undefined",
            1,
            1,
            "any",
            "boolean",
            False,
            False,
            lambda v: not isinstance(v[0], Undefined),
        ),
    )
}


@dataclass(frozen=True)
class ContextFunction:
    name: str
    usage: str
    id_sources: tuple[str, ...]  # the Scope fields the quoted id may come from; () means no argument


CONTEXT_FUNCTIONS: dict[str, ContextFunction] = {
    f.name: f
    for f in (
        ContextFunction("all_oracles_passed", "all_oracles_passed(): every oracle of every item passed", ()),
        ContextFunction(
            "passed",
            'passed("P1a"): that oracle passed; passed("P1"): every oracle of item P1 passed',
            ("oracles", "items"),
        ),
        ContextFunction(
            "killed", 'killed("K1"): that kill line fired; killed("C"): rung C was killed', ("kills", "rungs")
        ),
        ContextFunction("dropped", 'dropped("P1"): item P1 was dropped', ("items",)),
    )
}


History = list[tuple[int, float | bool]]  # a boolean metric (finite) has a boolean series


def _step_text(step: int | float) -> str:
    return str(int(step)) if float(step).is_integer() else repr(step)


def _at_step(metric: str, history: History, step: int | float) -> Value:
    for window_step, value in history:
        if window_step == step:
            return value
    ends = ", ".join(str(s) for s, _ in history[-5:])
    return Undefined(
        f"no {metric} window ended at step {_step_text(step)}"
        + (f" (latest windows end at {ends})" if ends else " (no window yet)")
    )


def _last(metric: str, history: History, n: int | float) -> Value:
    if not float(n).is_integer() or n < 1:
        return Undefined(f"the count must be a whole number >= 1, got {n!r}")
    if len(history) < n:
        return Undefined(f"only {len(history)} {metric} window(s) so far, {int(n)} needed")
    return [value for _, value in history[-int(n) :]]


def _since(pick: Callable[[list], Value]) -> Callable[[str, History, int | float], Value]:
    summarise = _nan_propagating(pick)

    def apply(metric: str, history: History, step: int | float) -> Value:
        values = [value for window_step, value in history if window_step >= step]  # the window at `step` counts
        if not values:
            return Undefined(f"no {metric} window ended at or after step {_step_text(step)}")
        if not all(is_number(value) for value in values):
            return Undefined(f"{metric} is not a numeric series")
        return summarise(values)

    return apply


@dataclass(frozen=True)
class HistoryFunction:
    name: str
    usage: str
    returns: StaticType
    apply: Callable[[str, History, int | float], Value] = field(repr=False, compare=False)


HISTORY_FUNCTIONS: dict[str, HistoryFunction] = {
    f.name: f
    for f in (
        # at_step is "any": a series may be boolean (finite), and at_step(finite, 500) is a boolean.
        HistoryFunction(
            "at_step", "at_step(metric, s): the metric's value in the window that ended at step s", "any", _at_step
        ),
        HistoryFunction(
            "last",
            "last(metric, n) or last(metric, n, after=s): the metric's last n window values (with after=, of windows "
            "ending after step s only), for min/max/mean/median/sum/all/any/count",
            "list",
            _last,
        ),
        HistoryFunction(
            "min_since",
            "min_since(metric, s): the smallest value in windows ending at or after step s",
            "number",
            _since(min),
        ),
        HistoryFunction(
            "max_since",
            "max_since(metric, s): the largest value in windows ending at or after step s",
            "number",
            _since(max),
        ),
    )
}

# History functions that take `after=s`: only windows ending after step s count ("3 consecutive evals after step
# 5k": last(probe, 3, after=5000) waits for three windows past 5000, never reaching back before it).
HISTORY_QUALIFIED = frozenset({"last"})


@dataclass(frozen=True)
class RowFunction:
    name: str
    usage: str
    apply: Callable[[list[float]], Value] = field(repr=False, compare=False)  # over the paired differences


ROW_FUNCTIONS: dict[str, RowFunction] = {
    f.name: f
    for f in (
        RowFunction(
            "paired_delta",
            "paired_delta(R.m, ANCHOR.m): the mean of R's rows minus ANCHOR's, paired by row id",
            paired_delta,
        ),
        RowFunction(
            "paired_delta_low",
            "paired_delta_low(R.m, ANCHOR.m): the lower end of paired_delta's 95% interval (Student's t)",
            paired_delta_low,
        ),
        RowFunction(
            "paired_delta_high",
            "paired_delta_high(R.m, ANCHOR.m): the upper end of paired_delta's 95% interval (Student's t)",
            paired_delta_high,
        ),
    )
}

# A function's name is one namespace across the four families.
_FAMILIES = (PURE_FUNCTIONS, CONTEXT_FUNCTIONS, HISTORY_FUNCTIONS, ROW_FUNCTIONS)
assert not any(a.keys() & b.keys() for i, a in enumerate(_FAMILIES) for b in _FAMILIES[i + 1 :])
