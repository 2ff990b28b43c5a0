"""The rule language: the expressions of docs/design.md and the bundled registrations, three-valued semantics,
and a hypothesis round-trip of random well-formed expressions against an independent reference evaluator."""

from __future__ import annotations

import functools
import itertools
import math
import pickle
import statistics

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prereg.rules import Env, MapEnv, RuleError, Scope, Undefined, compile_expr

RUNGS = frozenset({"A", "B", "C"})
METRICS = frozenset({"s_per_step", "vram_peak_gib", "loss", "finite", "rc", "probe_chunk_mae"})
ITEMS = frozenset({"P1", "P2", "P3a", "P3b", "P3c", "P4"})
ORACLES = frozenset({"P1a", "P1b", "P1c", "P2a", "P4a"})
READS = Scope("reads", reads={"primary", "vram_clean"}, rungs=RUNGS, metrics=METRICS)
RULES = Scope(
    "rules",
    reads={"primary", "vram_clean", "a", "b", "c"},
    rungs=RUNGS,
    metrics=METRICS,
    items=ITEMS,
    oracles=ORACLES,
    kills={"K-cudnn"},
)
UNTIL_PASS_RULES = Scope("rules", rungs={"rung7", "rung8", "PASS"}, metrics=METRICS)
PASS_RULE = Scope("pass_rule", rungs={"rung7", "rung8"}, metrics=METRICS)
KILL = Scope("kill", rungs=RUNGS, metrics=METRICS)

PRIMARY = "(A.s_per_step - C.s_per_step) / A.s_per_step"
VRAM_CLEAN = "C.vram_peak_gib <= A.vram_peak_gib * 1.02"
K1 = (
    "not finite(loss) or (step >= 10000 and min_since(probe_chunk_mae, 2500) >= at_step(probe_chunk_mae, 2500))"
    " or (step >= 5000 and min(last(probe_chunk_mae, 3)) > 25)"
)
NOT_RUN = Undefined("rung C did not run")


def value(text: str, scope: Scope, **env) -> object:
    return compile_expr(text, scope).evaluate(MapEnv(**env))


# -- the docs/design.md example reads and rules ---------------------------------------------------


def test_primary_read_is_the_relative_step_time_gain():
    expr = compile_expr(PRIMARY, READS)
    env = MapEnv(rung_metrics={("A", "s_per_step"): 2.2518, ("C", "s_per_step"): 2.0})
    assert expr.evaluate(env) == (2.2518 - 2.0) / 2.2518
    assert expr.rung_metrics_used() == {("A", "s_per_step"), ("C", "s_per_step")}
    assert expr.rungs_used() == {"A", "C"}
    assert expr.reads_used() == frozenset()


def test_primary_read_is_undefined_when_rung_c_did_not_run_and_says_so():
    result = value(PRIMARY, READS, rung_metrics={("A", "s_per_step"): 2.2518, ("C", "s_per_step"): NOT_RUN})
    assert result == Undefined("C.s_per_step: rung C did not run")
    assert value(PRIMARY, READS, rung_metrics={("A", "s_per_step"): 2.2518}) == Undefined(
        "C.s_per_step: rung C has no measurements"
    )


@pytest.mark.parametrize(
    ("c_peak", "clean"), [(66.6, True), (66.6 * 1.02, True), (67.93, True), (67.94, False), (70.0, False)]
)
def test_vram_clean_guard_read(c_peak, clean):
    assert (
        value(VRAM_CLEAN, READS, rung_metrics={("A", "vram_peak_gib"): 66.6, ("C", "vram_peak_gib"): c_peak}) is clean
    )


@pytest.mark.parametrize(
    ("primary", "vram_clean", "r2", "r3"),
    [
        (0.09, True, True, False),
        (0.09, False, False, False),
        (0.03, True, False, True),
        (0.05, True, True, False),  # the bar is inclusive: C >= 5% faster lands the bundle
        (Undefined("C.s_per_step: rung C did not run"), False, False, Undefined),
        (Undefined("C.s_per_step: rung C did not run"), True, Undefined, Undefined),
    ],
)
def test_decision_rules_r2_and_r3(primary, vram_clean, r2, r3):
    env = MapEnv(reads={"primary": primary, "vram_clean": vram_clean})
    for text, expected in (("primary >= 0.05 and vram_clean", r2), ("primary < 0.05", r3)):
        result = compile_expr(text, RULES).evaluate(env)
        if expected is Undefined:
            assert result == Undefined("read primary is undefined: C.s_per_step: rung C did not run")
        else:
            assert result is expected


def test_rule_reads_used_lists_the_reads_it_depends_on():
    assert compile_expr("primary >= 0.05 and vram_clean", RULES).reads_used() == {"primary", "vram_clean"}


@pytest.mark.parametrize(("s_per_step", "fits"), [(2.55, True), (2.7, True), (2.7000001, False), (3.85, False)])
def test_seed_003_f2_wall_over_the_rung_that_passed(s_per_step, fits):
    expr = compile_expr("40000 * PASS.s_per_step / 3600 <= 30", UNTIL_PASS_RULES)
    assert expr.rungs_used() == {"PASS"}
    assert expr.evaluate(MapEnv(rung_metrics={("PASS", "s_per_step"): s_per_step})) is fits


def test_f2_wall_is_undefined_when_no_rung_passed():
    env = MapEnv(rung_metrics={("PASS", "s_per_step"): Undefined("no rung passed")})
    assert compile_expr("40000 * PASS.s_per_step / 3600 <= 30", UNTIL_PASS_RULES).evaluate(env) == Undefined(
        "PASS.s_per_step: no rung passed"
    )


@pytest.mark.parametrize(
    ("rc", "peak", "passes"), [(0, 66.67, True), (0, 71, True), (0, 71.01, False), (1, 66.67, False)]
)
def test_seed_003_rung_8_pass_rule_on_the_judged_rungs_summary(rc, peak, passes):
    assert value("rc == 0 and vram_peak_gib <= 71", PASS_RULE, metrics={"rc": rc, "vram_peak_gib": peak}) is passes


@pytest.mark.parametrize(
    ("loss", "kill"), [(2.0, False), (math.nan, True), (math.inf, True), (-math.inf, True), (7, False)]
)
def test_kill_on_non_finite_loss(loss, kill):
    assert value("not finite(loss)", KILL, metrics={"loss": loss}, step=20) is kill


def test_expectation_all_oracles_passed():
    expr = compile_expr("all_oracles_passed()", Scope("expectations", items=ITEMS, oracles=ORACLES))
    assert expr.evaluate(MapEnv(oracles={"P1a": True, "P2a": True})) is True
    assert expr.evaluate(MapEnv(oracles={"P1a": False, "P2a": Undefined("not run")})) is False
    assert expr.evaluate(MapEnv(oracles={"P1a": True, "P2a": Undefined("not run")})) == Undefined(
        "all_oracles_passed(): not run"
    )
    assert expr.evaluate(MapEnv()) == Undefined("all_oracles_passed(): no oracle has a result")
    assert expr.evaluate(MapEnv(all_oracles=True)) is True


def test_context_functions_ask_the_env_and_name_the_question_when_unknown():
    env = MapEnv(oracles={"P1a": True, "P1": False}, kills={"K-cudnn": True, "C": False}, dropped={"P1"})
    assert value('passed("P1a") and not passed("P1")', RULES, oracles={"P1a": True, "P1": False}) is True
    assert compile_expr('killed("K-cudnn") and not killed("C")', RULES).evaluate(env) is True
    assert compile_expr('dropped("P1") and not dropped("P2")', RULES).evaluate(env) is True
    assert compile_expr('passed("P2a")', RULES).evaluate(env) == Undefined('passed("P2a"): no result recorded')


# -- the K1 kill line of registrations/molmo2-ar-40k.toml over a synthetic run --------------------


def k1_fires(probe: dict[int, float], *, nan_loss_at: int | None = None, last_step: int = 12000) -> dict[int, object]:
    """Evaluate K1 after every 250-step log window; the probe exists only on its eval windows."""
    expr = compile_expr(K1, KILL)
    results, probe_history, loss_history = {}, [], []
    for step in range(250, last_step + 1, 250):
        loss = math.nan if step == nan_loss_at else 3.0 - step / 10000
        loss_history.append((step, loss))
        metrics = {"loss": loss}
        if step in probe:
            probe_history.append((step, probe[step]))
            metrics["probe_chunk_mae"] = probe[step]
        env = MapEnv(
            metrics=metrics, step=step, history={"probe_chunk_mae": list(probe_history), "loss": list(loss_history)}
        )
        results[step] = expr.evaluate(env)
    return results


def fired_at(results: dict[int, object]) -> list[int]:
    return [step for step, result in results.items() if result is True]


def test_k1_does_not_fire_on_a_descending_probe():
    results = k1_fires({s: 30 - s / 1000 for s in range(500, 12001, 500)})
    assert all(result is False for result in results.values()), results


def test_k1_fires_at_step_10000_when_the_probe_never_descends_below_its_step_2500_value():
    # 20.0 at 2500, then hovering above it (and under the 25 line, so the third clause stays quiet).
    probe = (
        {s: 22.0 for s in range(500, 2500, 500)}
        | {2500: 20.0}
        | {s: 20.0 + (s % 1000) / 1000 for s in range(3000, 12001, 500)}
    )
    assert fired_at(k1_fires(probe))[0] == 10000


def test_k1_does_not_fire_when_the_probe_dips_below_its_step_2500_value_once():
    probe = (
        {s: 22.0 for s in range(500, 2500, 500)}
        | {2500: 20.0}
        | {s: 20.5 for s in range(3000, 12001, 500)}
        | {7000: 19.9}
    )
    assert fired_at(k1_fires(probe)) == []


def test_k1_fires_after_step_5000_on_three_consecutive_probes_over_25():
    probe = {s: 10.0 for s in range(500, 12001, 500)} | {5500: 26.0, 6000: 27.0, 6500: 25.5}
    results = k1_fires(probe)
    assert fired_at(results)[0] == 6500
    # Two high evals are not three: nothing fires while the third is pending (the log windows of 6000-6250).
    assert results[6000] is False and results[6250] is False


def test_k1_three_high_probes_before_step_5000_wait_for_step_5000():
    probe = {s: 10.0 for s in range(500, 12001, 500)} | {4000: 30.0, 4500: 30.0, 5000: 30.0}
    assert fired_at(k1_fires(probe))[0] == 5000


def test_k1_fires_on_the_window_whose_loss_is_nan():
    probe = {s: 30 - s / 1000 for s in range(500, 12001, 500)}
    assert fired_at(k1_fires(probe, nan_loss_at=1250)) == [1250]


def test_k1_is_undefined_not_false_when_its_step_2500_anchor_was_never_measured():
    probe = {s: 20.0 for s in range(750, 12001, 750)}  # evals every 750 steps: none at 2500
    results = k1_fires(probe)
    assert results[9750] is False  # before step 10k the clause is decided by `step >= 10000`
    assert isinstance(results[10000], Undefined)
    assert "no probe_chunk_mae window ended at step 2500" in results[10000].reason


# -- three-valued logic ---------------------------------------------------------------------------

T, F, U = True, False, Undefined("rung C did not run")
AND = {(T, T): T, (T, F): F, (T, U): U, (F, T): F, (F, F): F, (F, U): F, (U, T): U, (U, F): F, (U, U): U}
OR = {(T, T): T, (T, F): T, (T, U): T, (F, T): T, (F, F): F, (F, U): U, (U, T): T, (U, F): U, (U, U): U}
NOT = {T: F, F: T, U: U}


def read_u(text: str, a, b=None) -> object:
    reads = {"a": a} if b is None else {"a": a, "b": b}
    return compile_expr(text, RULES).evaluate(MapEnv(reads=reads))


@pytest.mark.parametrize(("a", "b"), list(itertools.product([T, F, U], repeat=2)))
def test_and_or_truth_tables(a, b):
    for text, table in (("a and b", AND), ("a or b", OR), ("all(a, b)", AND), ("any(a, b)", OR)):
        result = read_u(text, a, b)
        expected = table[(a, b)]
        if isinstance(expected, Undefined):
            assert (
                result == Undefined("read a is undefined: rung C did not run")
                if isinstance(a, Undefined)
                else result == Undefined("read b is undefined: rung C did not run")
            ), (text, a, b, result)
        else:
            assert result is expected, (text, a, b, result)


@pytest.mark.parametrize("a", [T, F, U])
def test_not_truth_table(a):
    result = read_u("not a", a)
    assert result == (Undefined("read a is undefined: rung C did not run") if a is U else NOT[a])


def test_defined_is_never_undefined():
    assert read_u("defined(a)", U) is False
    assert read_u("defined(a)", 0.0) is True
    assert read_u("not defined(a) or a > 1", U) is True


class CountingEnv(MapEnv):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.asked: list[str] = []

    def read(self, name: str):
        self.asked.append(name)
        return super().read(name)


def test_and_or_do_not_compute_reads_after_a_deciding_operand():
    env = CountingEnv(reads={"a": False, "b": True, "c": True})
    assert compile_expr("a and b and c", RULES).evaluate(env) is False
    assert env.asked == ["a"]
    env = CountingEnv(reads={"a": U, "b": True, "c": True})
    assert compile_expr("a or b or c", RULES).evaluate(env) is True
    assert env.asked == ["a", "b"]


def test_undefined_keeps_its_first_cause_through_arithmetic_and_functions():
    env = MapEnv(reads={"a": Undefined("A.s_per_step: rung A did not run"), "b": Undefined("second")})
    assert compile_expr("max(a + 1, b) > 3", RULES).evaluate(env) == Undefined(
        "read a is undefined: A.s_per_step: rung A did not run"
    )


def test_undefined_has_no_truth_value():
    with pytest.raises(TypeError, match="no truth value"):
        bool(Undefined("why"))


@pytest.mark.parametrize(("a", "expected"), [(-1, False), (0, False), (0.5, True), (1, True), (2, False), (U, U)])
def test_chained_comparison(a, expected):
    result = read_u("0 < a <= 1", a)
    assert result == Undefined("read a is undefined: rung C did not run") if expected is U else result is expected


def test_chained_comparison_is_false_once_any_link_is_false_even_after_an_undefined_one():
    assert read_u("a < 1 < 0", U) is False
    assert read_u("5 < 3 < a", U) is False


def test_division_by_zero_is_undefined_naming_the_division():
    result = value(
        "A.s_per_step / (B.s_per_step - B.s_per_step) > 0",
        READS,
        rung_metrics={("A", "s_per_step"): 1.0, ("B", "s_per_step"): 2.0},
    )
    assert result == Undefined("division by zero in A.s_per_step / (B.s_per_step - B.s_per_step)")


@pytest.mark.parametrize(
    ("text", "reads", "reason"),
    [
        ("a > 1", {"a": "fast"}, "cannot compare the string 'fast' with the number 1"),
        ("a and True", {"a": 0.3}, "'and' needs True or False, got the number 0.3"),
        ("not a", {"a": 1}, "'not' needs True or False"),
        ("a + 1 > 0", {"a": True}, "'+' needs numbers, got the boolean True"),
        ("a", {"a": 0.3}, "a rule must be True or False"),
        ("abs(a) > 0", {"a": "x"}, "abs() takes numbers"),
        ("a == 1", {"a": True}, "cannot compare the boolean True with the number 1"),
    ],
)
def test_type_errors_at_evaluation_are_undefined_with_a_reason(text, reads, reason):
    result = compile_expr(text, RULES).evaluate(MapEnv(reads=reads))
    assert isinstance(result, Undefined) and reason in result.reason, result


def test_numbers_compare_across_int_and_float_and_numpy_values_are_admitted():
    assert value("rc == 0", PASS_RULE, metrics={"rc": 0.0}) is True
    assert (
        value(
            "rc == 0 and vram_peak_gib < 71", PASS_RULE, metrics={"rc": np.int64(0), "vram_peak_gib": np.float32(66.5)}
        )
        is True
    )


def test_an_env_returning_a_non_value_is_the_callers_bug():
    with pytest.raises(TypeError, match="Env.metric"):
        value("rc == 0", PASS_RULE, metrics={"rc": object()})


# -- functions ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("abs(-2.5)", 2.5),
        ("min(3, 1, 2)", 1),
        ("max(3, 1, 2)", 3),
        ("mean(1, 2, 3, 4)", 2.5),
        ("median(5, 1, 3)", 3),
        ("median(4, 1, 3, 2)", 2.5),
        ("sum(1, 2, 3.5)", 6.5),
        ("count(True, False, True)", 2),
        ("all(True, True)", True),
        ("any(False, False)", False),
        ("finite(1 / 3)", True),
        ("min(7)", 7),
        ("defined(1 / 0)", False),
    ],
)
def test_pure_functions(text, expected):
    result = compile_expr(text, READS).evaluate(MapEnv())
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize("text", ["max(a, 1)", "max(1, a)", "min(a, 1)", "min(1, a)", "median(1, a, 2)", "mean(a, 1)"])
def test_a_nan_anywhere_makes_a_summary_nan_whatever_its_position(text):
    assert math.isnan(compile_expr(text, Scope("reads", reads={"a"})).evaluate(MapEnv(reads={"a": math.nan})))


@pytest.mark.parametrize(
    ("x", "finite"), [(math.nan, False), (math.inf, False), (-math.inf, False), (1e308, True), (10**400, True)]
)
def test_finite(x, finite):
    assert read_u("finite(a)", x) is finite


def kill_env(step: int, **series: list[float]) -> MapEnv:
    """Windows every 100 steps ending at `step`, the last len(values) of them carrying the values."""
    return MapEnv(
        step=step, history={m: [(step - 100 * (len(v) - 1 - i), x) for i, x in enumerate(v)] for m, v in series.items()}
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("at_step(loss, 300) == 2.0", True),
        ("min_since(loss, 300) == 1.0", True),  # the windows ending at 300, 400 and 500
        ("max_since(loss, 400) == 3.0", True),
        ("max_since(loss, 300) == 3.0", True),
        ("min(last(loss, 2)) == 1.0", True),
        ("max(last(loss, 5)) == 4.0", True),
        ("mean(last(loss, 5)) == 2.4", True),
        ("sum(last(loss, 3)) == 6.0", True),
        ("median(last(loss, 3)) == 2.0", True),
        ("count(last(loss, step / 100)) == 5", Undefined),  # count() counts booleans, not numbers
        ("max(last(loss, step / 100)) == 4.0", True),  # a computed whole number of windows
        ("max(last(loss, 6)) > 0", Undefined),  # five windows so far
        ("at_step(loss, 250) > 0", Undefined),  # no window ended at step 250
        ("min_since(loss, 600) > 0", Undefined),
        ("max(last(loss, step / 1000)) > 0", Undefined),  # half a window
    ],
)
def test_history_functions(text, expected):
    result = compile_expr(text, KILL).evaluate(kill_env(500, loss=[4.0, 2.0, 2.0, 3.0, 1.0]))
    assert isinstance(result, Undefined) if expected is Undefined else result is expected, result


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("count(last(finite, 3)) == 2", True),
        ("all(last(finite, 2))", False),
        ("any(last(finite, 2))", True),
        ("all(last(finite, 1))", True),
        ("at_step(finite, 400) == False", True),
        ("min_since(finite, 100) > 0", Undefined),  # min/max of a boolean series is a type error
        ("all(last(loss, 2))", Undefined),  # all() of numbers likewise
    ],
)
def test_history_functions_over_a_boolean_series(text, expected):
    result = compile_expr(text, KILL).evaluate(kill_env(500, finite=[True, False, True], loss=[1.0, 2.0]))
    assert isinstance(result, Undefined) if expected is Undefined else result is expected, result


def test_history_function_reasons_say_what_is_missing():
    env = kill_env(500, loss=[4.0, 2.0])
    assert compile_expr("max(last(loss, 3)) > 0", KILL).evaluate(env).reason == (
        "last(loss, 3): only 2 loss window(s) so far, 3 needed"
    )
    assert (
        compile_expr("at_step(loss, 250) > 0", KILL)
        .evaluate(env)
        .reason.startswith("at_step(loss, 250): no loss window ended at step 250 (latest windows end at 400, 500)")
    )


def test_history_must_come_oldest_first():
    env = MapEnv(step=200, history={"loss": [(200, 1.0), (100, 2.0)]})
    with pytest.raises(ValueError, match="oldest first"):
        compile_expr("at_step(loss, 100) > 0", KILL).evaluate(env)


def test_all_and_any_over_undefined_follow_and_and_or():
    assert read_u("all(a, False)", U) is False
    assert read_u("any(a, True)", U) is True
    assert read_u("all(a, True)", U) == Undefined("read a is undefined: rung C did not run")
    assert read_u("count(a, True) >= 1", U) == Undefined("read a is undefined: rung C did not run")


# -- scope, errors, text handling -----------------------------------------------------------------


def test_scope_validation():
    with pytest.raises(ValueError, match="not one of"):
        Scope("rule")
    with pytest.raises(TypeError, match="set of strings"):
        Scope("reads", rungs="ABC")
    with pytest.raises(ValueError, match="sees metrics, not reads"):
        Scope("kill", reads={"primary"})
    with pytest.raises(ValueError, match="identifiers"):
        Scope("reads", rungs={"rung-8"})
    with pytest.raises(ValueError, match="identifiers"):
        Scope("reads", reads={"if"})
    with pytest.raises(ValueError, match="step"):
        Scope("kill", metrics={"step"})
    assert Scope("rules", kills={"K-cudnn"}).kills == {"K-cudnn"}  # ids are quoted, any string will do
    assert isinstance(Scope("reads", rungs=["A"]).rungs, frozenset)


def test_multi_line_expression_with_leading_indentation_compiles():
    text = "\n    (primary >= 0.05\n     and vram_clean)\n"
    assert compile_expr(text, RULES).evaluate(MapEnv(reads={"primary": 0.06, "vram_clean": True})) is True


def test_rule_error_is_a_value_error_that_survives_pickling():
    with pytest.raises(ValueError) as caught:
        compile_expr("2 ** 10", READS)
    error = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(error, RuleError) and str(error) == str(caught.value) and error.column == 3


def test_map_env_is_an_env():
    env: Env = MapEnv()
    assert env.step() == Undefined("no window has finished")
    assert env.history("loss") == []


# -- hypothesis: random well-formed expressions vs an independent reference evaluator --------------

NUMBER_NAMES = ("n1", "n2", "n3")
BOOLEAN_NAMES = ("b1", "b2")
ROUND_TRIP_SCOPE = Scope("reads", reads={*NUMBER_NAMES, *BOOLEAN_NAMES}, rungs={"A", "B"}, metrics={"x", "y"})
UNKNOWN = object()  # the reference evaluator's own undefined, unrelated to the evaluator under test

finite_floats = st.floats(allow_nan=False, allow_infinity=False)


@functools.cache
def number_trees(depth: int) -> st.SearchStrategy:
    leaves = st.one_of(
        st.integers(-1000, 1000).map(lambda v: ("const", v)),
        finite_floats.map(lambda v: ("const", v)),
        st.sampled_from(NUMBER_NAMES).map(lambda n: ("name", n)),
        st.sampled_from(["A.x", "A.y", "B.x", "B.y"]).map(lambda n: ("name", n)),
    )
    if depth == 0:
        return leaves
    numbers, booleans = number_trees(depth - 1), boolean_trees(depth - 1)
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(["-", "+"]), numbers).map(lambda t: ("sign", *t)),
        st.tuples(st.sampled_from(["+", "-", "*", "/"]), numbers, numbers).map(lambda t: ("arith", *t)),
        st.tuples(st.sampled_from(["abs"]), st.lists(numbers, min_size=1, max_size=1)).map(lambda t: ("call", *t)),
        st.tuples(
            st.sampled_from(["min", "max", "mean", "median", "sum"]), st.lists(numbers, min_size=1, max_size=4)
        ).map(lambda t: ("call", *t)),
        st.tuples(st.just("count"), st.lists(booleans, min_size=1, max_size=4)).map(lambda t: ("call", *t)),
    )


@functools.cache
def boolean_trees(depth: int) -> st.SearchStrategy:
    leaves = st.one_of(
        st.booleans().map(lambda v: ("const", v)), st.sampled_from(BOOLEAN_NAMES).map(lambda n: ("name", n))
    )
    if depth == 0:
        return leaves
    numbers, booleans = number_trees(depth - 1), boolean_trees(depth - 1)
    return st.one_of(
        leaves,
        booleans.map(lambda b: ("not", b)),
        st.tuples(st.sampled_from(["and", "or"]), st.lists(booleans, min_size=2, max_size=3)).map(
            lambda t: ("boolop", *t)
        ),
        st.lists(
            st.tuples(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), numbers), min_size=1, max_size=3
        ).flatmap(lambda links: numbers.map(lambda first: ("compare", first, links))),
        st.tuples(st.sampled_from(["==", "!="]), booleans, booleans).map(lambda t: ("compare", t[1], [(t[0], t[2])])),
        st.tuples(st.sampled_from(["all", "any"]), st.lists(booleans, min_size=1, max_size=3)).map(
            lambda t: ("call", *t)
        ),
        st.tuples(st.just("finite"), st.lists(numbers, min_size=1, max_size=1)).map(lambda t: ("call", *t)),
        st.tuples(st.just("defined"), st.lists(st.one_of(numbers, booleans), min_size=1, max_size=1)).map(
            lambda t: ("call", *t)
        ),
    )


def render(tree) -> str:
    kind = tree[0]
    if kind == "const":
        return repr(tree[1])
    if kind == "name":
        return tree[1]
    if kind == "sign":
        return f"{tree[1]}({render(tree[2])})"
    if kind == "arith":
        return f"({render(tree[2])} {tree[1]} {render(tree[3])})"
    if kind == "not":
        return f"(not {render(tree[1])})"
    if kind == "boolop":
        return "(" + f" {tree[1]} ".join(render(t) for t in tree[2]) + ")"
    if kind == "compare":
        return "(" + render(tree[1]) + "".join(f" {op} {render(t)}" for op, t in tree[2]) + ")"
    assert kind == "call"
    return f"{tree[1]}(" + ", ".join(render(t) for t in tree[2]) + ")"


def _kleene(values: list, deciding: bool):
    if deciding in values:
        return deciding
    return UNKNOWN if any(v is UNKNOWN for v in values) else not deciding


def _nan_or(values: list, pick):
    return math.nan if any(isinstance(v, float) and math.isnan(v) for v in values) else pick(values)


REFERENCE_CALLS = {
    "abs": lambda v: abs(v[0]),
    "min": lambda v: _nan_or(v, min),
    "max": lambda v: _nan_or(v, max),
    "mean": lambda v: sum(v) / len(v),
    "median": lambda v: _nan_or(v, statistics.median),
    "sum": sum,
    "count": lambda v: v.count(True),
    "finite": lambda v: math.isfinite(v[0]),
}


def reference(tree, names: dict):
    kind = tree[0]
    if kind == "const":
        return tree[1]
    if kind == "name":
        return names[tree[1]]
    if kind == "not":
        inner = reference(tree[1], names)
        return UNKNOWN if inner is UNKNOWN else not inner
    if kind == "boolop":
        return _kleene([reference(t, names) for t in tree[2]], deciding=tree[1] == "or")
    if kind == "compare":
        sides = [reference(tree[1], names), *(reference(t, names) for _, t in tree[2])]
        links = []
        for (op, _), left, right in zip(tree[2], sides, sides[1:]):
            if left is UNKNOWN or right is UNKNOWN:
                links.append(UNKNOWN)
            else:
                links.append(
                    {
                        "<": left < right,
                        "<=": left <= right,
                        ">": left > right,
                        ">=": left >= right,
                        "==": left == right,
                        "!=": left != right,
                    }[op]
                )
        return _kleene(links, deciding=False)
    if kind == "call" and tree[1] == "defined":
        return reference(tree[2][0], names) is not UNKNOWN
    if kind == "call" and tree[1] in ("all", "any"):
        return _kleene([reference(t, names) for t in tree[2]], deciding=tree[1] == "any")
    operands = [reference(t, names) for t in (tree[2] if kind == "call" else tree[2:])]
    if any(v is UNKNOWN for v in operands):
        return UNKNOWN
    if kind == "call":
        return REFERENCE_CALLS[tree[1]](operands)
    if kind == "sign":
        return -operands[0] if tree[1] == "-" else operands[0]
    left, right = operands
    if tree[1] == "/":
        return UNKNOWN if right == 0 else left / right
    return {"+": left + right, "-": left - right, "*": left * right}[tree[1]]


def name_values() -> st.SearchStrategy:
    # Undefined one time in six, so that most expressions stay defined and their values get compared.
    unknown = st.just(UNKNOWN)
    specials = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0])
    number = st.one_of(st.integers(-5, 5), st.integers(-5, 5), finite_floats, finite_floats, specials, unknown)
    boolean = st.one_of(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans(), unknown)
    names = [*NUMBER_NAMES, "A.x", "A.y", "B.x", "B.y"]
    return st.fixed_dictionaries({**{n: number for n in names}, **{b: boolean for b in BOOLEAN_NAMES}})


def env_for(names: dict) -> MapEnv:
    def as_value(n):
        v = names[n]
        return Undefined(f"{n} withheld") if v is UNKNOWN else v

    return MapEnv(
        reads={n: as_value(n) for n in (*NUMBER_NAMES, *BOOLEAN_NAMES)},
        rung_metrics={tuple(n.split(".")): as_value(n) for n in ("A.x", "A.y", "B.x", "B.y")},
    )


def same(result, expected) -> bool:
    if expected is UNKNOWN:
        return isinstance(result, Undefined)
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(result, float) and math.isnan(result)
    return type(result) is type(expected) and result == expected


ROUND_TRIP = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@ROUND_TRIP
@given(tree=st.one_of(number_trees(4), boolean_trees(4)), names=name_values())
def test_random_expressions_evaluate_like_the_reference(tree, names):
    text = render(tree)
    result = compile_expr(text, ROUND_TRIP_SCOPE).evaluate(env_for(names))
    expected = reference(tree, names)
    assert same(result, expected), (text, names, result, expected)


@ROUND_TRIP
@given(tree=boolean_trees(4), names=name_values())
def test_random_conditions_compile_as_rules_and_kill_lines(tree, names):
    text = render(tree)
    rule = compile_expr(text, Scope("rules", reads=ROUND_TRIP_SCOPE.reads, rungs={"A", "B"}, metrics={"x", "y"}))
    assert same(rule.evaluate(env_for(names)), reference(tree, names))
    # The same condition as a kill line: the names become the window's metrics.
    kill_text = text.replace("A.", "A_").replace("B.", "B_")
    metrics = {*NUMBER_NAMES, *BOOLEAN_NAMES, "A_x", "A_y", "B_x", "B_y"}
    kill = compile_expr(kill_text, Scope("kill", metrics=metrics))
    env = MapEnv(
        metrics={n.replace(".", "_"): Undefined("withheld") if v is UNKNOWN else v for n, v in names.items()}, step=0
    )
    assert same(kill.evaluate(env), reference(tree, names))
