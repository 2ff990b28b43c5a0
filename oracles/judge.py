"""Comparators: observed values of an oracle + its frozen bounds -> pass or fail, with the reason.

One function per kind, the pass conditions of docs/design.md's oracle table. The observed values come from a probe
(or from `prereg record`, for measurements made elsewhere); the verdict never comes from the observer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Judgement:
    passed: bool
    reason: str  # for a failure: the observed value against the bound; for a pass: the margin


def _number(observed: dict[str, Any], name: str) -> float | None:
    value = observed.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def tolerance(observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    failures, margins = [], []
    for name, bound in sorted(bounds.items()):
        value = _number(observed, name)
        if value is None:
            failures.append(f"{name} not observed")
        elif not math.isfinite(value) or value > bound:
            failures.append(f"{name} = {value:.4g} > bound {bound:.4g}")
        else:
            margins.append(f"{name} = {value:.4g} <= {bound:.4g}")
    return Judgement(not failures, "; ".join(failures or margins))


def bitwise(observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    equal, total = observed.get("equal"), observed.get("total")
    if not isinstance(equal, int) or not isinstance(total, int) or total <= 0:
        return Judgement(False, f"equal/total not observed (got equal={equal!r}, total={total!r})")
    if equal == total:
        return Judgement(True, f"{equal}/{total} bitwise equal")
    return Judgement(False, f"{equal}/{total} bitwise equal; first mismatch {observed.get('first_mismatch')!r}")


def byte_match(observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    if observed.get("equal") is True:
        return Judgement(True, "byte-identical")
    return Judgement(False, f"bytes differ; first difference {observed.get('first_difference')!r}")


def curve_overlay(observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    """max |A-B| within a limit: the bound max_abs_diff; or k x the baseline's steady band (bound steady_band = k:
    its largest step-to-step move after its warm-up, engine probes' `steady_band`); or, with no bound, the
    baseline's whole band (its largest move, the first steps' drop on a fresh init)."""
    diff = _number(observed, "max_abs_diff")
    if observed.get("finite") is not True:
        return Judgement(False, "a curve is not finite (NaN/inf)")
    if "max_abs_diff" in bounds:
        limit, name = bounds["max_abs_diff"], "bound"
    elif "steady_band" in bounds:
        steady = _number(observed, "steady_band")
        limit = None if steady is None else bounds["steady_band"] * steady
        name = f"{bounds['steady_band']:g} x the baseline's steady band"
    else:
        limit, name = _number(observed, "band"), "the baseline's own step-to-step band"
    if diff is None or limit is None:
        needed = "steady_band" if "steady_band" in bounds else "band (or a bound)"
        return Judgement(False, f"max_abs_diff and {needed} must be observed")
    if diff <= limit:
        return Judgement(True, f"max |A-B| = {diff:.4g} <= {name} {limit:.4g}")
    return Judgement(False, f"max |A-B| = {diff:.4g} > {name} {limit:.4g}")


def finite(observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    if observed.get("finite") is True:
        return Judgement(True, "finite")
    return Judgement(False, f"not finite; first bad step {observed.get('first_bad_step')!r}")


def schema(observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    missing, violations = observed.get("missing"), observed.get("violations")
    if not isinstance(missing, list) or not isinstance(violations, list):
        return Judgement(False, "missing/violations not observed")
    if not missing and not violations:
        return Judgement(True, "schema holds")
    return Judgement(False, f"missing {missing}, violations {violations}")


def raises(observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    if observed.get("raised") is True:
        return Judgement(True, f"aborted: {observed.get('message', '')}".strip())
    return Judgement(False, "the planted fault did not abort")


def memory(observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    peak, bound = _number(observed, "peak_gib"), bounds["peak_gib"]
    if peak is None:
        return Judgement(False, "peak_gib not observed")
    if peak <= bound:
        return Judgement(True, f"peak {peak:.2f} GiB <= {bound:.2f}")
    return Judgement(False, f"peak {peak:.2f} GiB > bound {bound:.2f}")


JUDGES: dict[str, Callable[[dict[str, Any], dict[str, float]], Judgement]] = {
    "tolerance": tolerance,
    "bitwise": bitwise,
    "byte_match": byte_match,
    "curve_overlay": curve_overlay,
    "finite": finite,
    "schema": schema,
    "raises": raises,
    "memory": memory,
}


# The names each kind reads from an observation (the table above): (required, optional). A tolerance oracle
# requires one value per bound and may carry anything else its probe observes.
OBSERVED: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "bitwise": (frozenset({"equal", "total"}), frozenset({"first_mismatch"})),
    "byte_match": (frozenset({"equal"}), frozenset({"first_difference"})),
    "curve_overlay": (frozenset({"max_abs_diff", "finite"}), frozenset({"band", "steady_band"})),
    "finite": (frozenset({"finite"}), frozenset({"first_bad_step"})),
    "schema": (frozenset({"missing", "violations"}), frozenset()),
    "raises": (frozenset({"raised"}), frozenset({"message"})),
    "memory": (frozenset({"peak_gib"}), frozenset()),
}
PROBE_FAILED = "error"  # an observation that says the probe could not run: judged a failure, with its reason


def observation_problem(
    kind: str, observed: dict[str, Any], bounds: dict[str, float], probe_observes: frozenset[str]
) -> str | None:
    """Why an observation entered by hand cannot be judged as written (a name the oracle does not read, or one it
    needs and lacks), or None. A typo must be refused as bad input: judged, it would drop the item for good."""
    if observed.get(PROBE_FAILED):
        return None
    if kind == "tolerance":
        required, optional = frozenset(bounds), probe_observes
    else:
        required, optional = OBSERVED[kind]
        if kind == "curve_overlay" and "steady_band" in bounds:
            required = required | {"steady_band"}  # k x the baseline's steady band is the limit
        elif kind == "curve_overlay" and "max_abs_diff" not in bounds:
            required = required | {"band"}  # without a bound, the baseline's own band is the limit
    unknown = sorted(set(observed) - required - optional)
    missing = sorted(required - set(observed))
    if not unknown and not missing:
        return None
    problems = ([f"unknown {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else [])
    expected = sorted(required) + [f"{name} (optional)" for name in sorted(optional - required)]
    return (
        f'{" and ".join(problems)}; a {kind} oracle reads {expected}, or {PROBE_FAILED} = "why the probe could not run"'
    )


def judge(kind: str, observed: dict[str, Any], bounds: dict[str, float]) -> Judgement:
    if kind not in JUDGES:
        raise ValueError(f"unknown oracle kind {kind!r}; kinds are {sorted(JUDGES)}")
    if observed.get(PROBE_FAILED):
        # The probe could not run (e.g. cuDNN on a CPU): a failure with that reason, never a skip.
        return Judgement(False, f"probe could not run: {observed[PROBE_FAILED]}")
    return JUDGES[kind](observed, bounds)
