"""The oracle judges (oracles/judge.py): every kind at its boundary and just past it, the observations that must
never pass (not observed, NaN, a bool where a number belongs, a probe that could not run), and the check that
refuses a hand-entered observation with a typo instead of judging it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oracles.judge import JUDGES, judge, observation_problem

# (kind, observed, bounds, passes, the reason must say)
CASES = [
    ("tolerance", {"loss_abs": 1e-3}, {"loss_abs": 1e-3}, True, "loss_abs = 0.001 <= 0.001"),
    (
        "tolerance",
        {"loss_abs": 1.038e-3},
        {"loss_abs": 1e-3},
        False,
        "loss_abs = 0.001038 > bound 0.001",
    ),  # X1a on the H200
    (
        "tolerance",
        {"loss_abs": 1e-4, "grad_norm_rel": 0.02},
        {"loss_abs": 1e-3, "grad_norm_rel": 1e-2},
        False,
        "grad_norm_rel = 0.02 > bound 0.01",
    ),
    ("tolerance", {"loss_abs": math.nan}, {"loss_abs": 1e-3}, False, "loss_abs = nan > bound"),
    ("tolerance", {"loss_abs": -math.inf}, {"loss_abs": 1e-3}, False, "loss_abs = -inf > bound"),
    ("tolerance", {"loss_abs": True}, {"loss_abs": 1e-3}, False, "loss_abs not observed"),
    ("tolerance", {}, {"loss_abs": 1e-3}, False, "loss_abs not observed"),
    ("bitwise", {"equal": 23, "total": 23}, {}, True, "23/23 bitwise equal"),
    ("bitwise", {"equal": 22, "total": 23, "first_mismatch": "wte.weight"}, {}, False, "first mismatch 'wte.weight'"),
    ("bitwise", {"equal": 0, "total": 0}, {}, False, "equal/total not observed"),
    ("bitwise", {"equal": 23.0, "total": 23}, {}, False, "equal/total not observed"),
    ("byte_match", {"equal": True}, {}, True, "byte-identical"),
    ("byte_match", {"equal": False, "first_difference": 17}, {}, False, "first difference 17"),
    ("byte_match", {"equal": 1}, {}, False, "bytes differ"),  # 1 is not True: only the boolean passes
    ("curve_overlay", {"max_abs_diff": 0.04, "finite": True}, {"max_abs_diff": 0.04}, True, "<= bound 0.04"),
    ("curve_overlay", {"max_abs_diff": 0.0401, "finite": True}, {"max_abs_diff": 0.04}, False, "> bound 0.04"),
    ("curve_overlay", {"max_abs_diff": 0.01, "finite": False}, {"max_abs_diff": 0.04}, False, "not finite"),
    (
        "curve_overlay",
        {"max_abs_diff": 4.75, "band": 4.75, "finite": True},
        {},
        True,
        "the baseline's own step-to-step band 4.75",
    ),
    (
        "curve_overlay",
        {"max_abs_diff": 4.76, "band": 4.75, "finite": True},
        {},
        False,
        "> the baseline's own step-to-step band",
    ),
    ("curve_overlay", {"max_abs_diff": 0.01, "finite": True}, {}, False, "band (or a bound) must be observed"),
    ("finite", {"finite": True}, {}, True, "finite"),
    ("finite", {"finite": False, "first_bad_step": 7}, {}, False, "first bad step 7"),
    ("schema", {"missing": [], "violations": []}, {}, True, "schema holds"),
    ("schema", {"missing": ["vram_window_peak_gib"], "violations": []}, {}, False, "missing ['vram_window_peak_gib']"),
    ("schema", {"missing": None, "violations": []}, {}, False, "not observed"),
    ("raises", {"raised": True, "message": "patch count"}, {}, True, "aborted: patch count"),
    ("raises", {"raised": False}, {}, False, "did not abort"),
    ("memory", {"peak_gib": 125.0}, {"peak_gib": 125.0}, True, "<= 125.00"),
    ("memory", {"peak_gib": 125.0307}, {"peak_gib": 125.0}, False, "> bound 125.00"),  # F1's rung 5, as a bound
    ("memory", {}, {"peak_gib": 125.0}, False, "peak_gib not observed"),
]


@pytest.mark.parametrize(
    ("kind", "observed", "bounds", "passes", "says"), CASES, ids=[f"{c[0]}-{n}" for n, c in enumerate(CASES)]
)
def test_each_kind_at_its_boundary_and_past_it(kind, observed, bounds, passes, says):
    judgement = judge(kind, observed, bounds)
    assert judgement.passed is passes
    assert says in judgement.reason, judgement.reason


def test_every_kind_has_a_passing_and_a_failing_case():
    assert {(c[0], c[3]) for c in CASES} == {(kind, outcome) for kind in JUDGES for outcome in (True, False)}


@pytest.mark.parametrize("kind", sorted(JUDGES))
def test_a_probe_that_could_not_run_fails_whatever_else_it_says(kind):
    passing = next(c for c in CASES if c[0] == kind and c[3])
    judgement = judge(kind, {**passing[1], "error": "cuDNN attention is a CUDA backend"}, passing[2])
    assert not judgement.passed and judgement.reason == "probe could not run: cuDNN attention is a CUDA backend"


def test_an_unknown_kind_is_an_error_naming_the_kinds():
    with pytest.raises(ValueError, match="unknown oracle kind 'approx'; kinds are"):
        judge("approx", {}, {})


@given(value=st.floats(allow_nan=True, allow_infinity=True), bound=st.floats(min_value=0, max_value=1e6))
def test_tolerance_passes_exactly_when_the_value_is_finite_and_within_the_bound(value, bound):
    assert judge("tolerance", {"x": value}, {"x": bound}).passed is (math.isfinite(value) and value <= bound)


@pytest.mark.parametrize(("kind", "observed", "bounds", "says"), [
    ("tolerance", {"loss_ab": 1e-4}, {"loss_abs": 1e-3}, "unknown ['loss_ab'] and missing ['loss_abs']"),
    ("bitwise", {"equal": 3}, {}, "missing ['total']"),
    ("curve_overlay", {"max_abs_diff": 0.1, "finite": True}, {}, "missing ['band']"),  # no bound: the band is the limit
    ("memory", {"peak": 3.0}, {"peak_gib": 4.0}, "unknown ['peak'] and missing ['peak_gib']"),
])  # fmt: skip
def test_a_hand_entered_observation_with_a_typo_is_a_problem_not_a_judgement(kind, observed, bounds, says):
    problem = observation_problem(kind, observed, bounds, frozenset({"loss_abs", "grad_norm_rel"}))
    assert problem is not None and says in problem, problem


def test_a_complete_observation_and_a_probe_failure_are_no_problem():
    assert (
        observation_problem("curve_overlay", {"max_abs_diff": 0.1, "finite": True}, {"max_abs_diff": 0.2}, frozenset())
        is None
    )
    assert observation_problem("memory", {"error": "no CUDA"}, {"peak_gib": 4.0}, frozenset()) is None
