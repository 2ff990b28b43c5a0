"""The rule language refuses what it does not allow, says what and where, and never fails any other way."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import prereg.rules
from prereg.rules import MAX_DEPTH, MAX_LENGTH, MapEnv, RuleError, Scope, Undefined, compile_expr

RUNGS = frozenset({"A", "B", "C"})
METRICS = frozenset({"s_per_step", "vram_peak_gib", "loss", "finite", "rc", "probe_chunk_mae"})
READS = Scope(
    "reads",
    reads={"primary", "vram_clean", "x", "y"},
    rungs=RUNGS,
    metrics=METRICS,
    items={"P1", "P2"},
    oracles={"P1a", "P2a"},
    kills={"K1"},
)
RULES = Scope(
    "rules",
    reads={"primary", "vram_clean"},
    rungs=RUNGS,
    metrics=METRICS,
    items={"P1", "P2"},
    oracles={"P1a", "P2a"},
    kills={"K1"},
)
UNTIL_PASS = Scope("rules", rungs={"rung7", "rung8", "PASS"}, metrics=METRICS)
PASS_RULE = Scope("pass_rule", rungs={"rung7", "rung8", "PASS"}, metrics=METRICS)
KILL = Scope("kill", rungs=RUNGS, metrics=METRICS)
EXPECTATIONS = Scope(
    "expectations", reads={"primary"}, rungs=RUNGS, metrics=METRICS, items={"P1", "P2"}, oracles={"P1a", "P2a"}
)
SCOPES = [READS, RULES, UNTIL_PASS, PASS_RULE, KILL, EXPECTATIONS]


def refusal(text: str, scope: Scope = READS) -> RuleError:
    with pytest.raises(RuleError) as caught:
        compile_expr(text, scope)
    error = caught.value
    assert error.expression == text
    message = str(error)
    assert message.startswith("rule expression "), message
    if error.column is not None:
        assert f"column {error.column}" in message and 1 <= error.column <= len(text)
    return error


# (expression, fragments its message must contain, column or None for "whole expression")
GOLDEN = [
    ("__import__('os')", ["unknown function '__import__'", "functions are abs, min"], 1),
    ("().__class__.__bases__[0].__subclasses__()", ["only a function's name can be called"], 1),
    ("abs.__class__", ["attribute access '.__class__' on 'abs' is not allowed", "RUNG.metric"], 1),
    ("x[0]", ["a subscript x[...] is not allowed", "allowed: numbers"], 1),
    ("lambda: 1", ["a lambda is not allowed"], 1),
    ("[x for x in y]", ["a comprehension is not allowed"], 1),
    ("(x for x in y)", ["a comprehension is not allowed"], 1),
    ("2 ** 10", ["'**' (power) is not allowed", "the operators are + - * /"], 3),
    ("7 % 2", ["'%' (remainder) is not allowed"], 3),
    ("7 // 2", ["'//' (floor division) is not allowed"], 3),
    ("x | y", ["'|' (bitwise or) is not allowed"], 3),
    ("x << 2", ["'<<' (bit shift) is not allowed"], 3),
    ("~x", ["'~' (bitwise not) is not allowed"], 1),
    ("x @ y", ["'@' (matrix multiplication) is not allowed"], 3),
    ("x in y", ["'in' is not allowed"], 3),
    ("x not in y", ["'not in' is not allowed"], 3),
    ("x is None", ["'is' is not allowed"], 3),
    ("f'{x}'", ["an f-string is not allowed"], 1),
    ("abs(x=1)", ["keyword argument 'x=' is not allowed in abs()", "positional"], 5),
    ("max(1, **y)", ["keyword argument '**' unpacking is not allowed"], 8),
    ("open('x')", ["unknown function 'open'"], 1),
    ("eval('1')", ["unknown function 'eval'"], 1),
    ("getattr(A, 's_per_step')", ["unknown function 'getattr'"], 1),
    ("A.s_per_step.real", ["attribute access '.real' on 'A.s_per_step' is not allowed", "one dot"], 1),
    ("A.s_per_step()", ["only a function's name can be called", "'A.s_per_step'"], 1),
    ("abs(1).real", ["attribute access '.real' on 'abs(1)' is not allowed"], 1),
    ("A.__class__", ["rung A has no metric '__class__'", "metrics are"], 1),
    ("(y := 1)", ["an assignment expression (:=) is not allowed"], 2),
    ("1 if x else 2", ["a conditional expression (a if c else b) is not allowed"], 1),
    ("max(*x)", ["a starred argument '*x' is not allowed"], 5),
    ("[1, 2]", ["a list display [...] is not allowed"], 1),
    ("(1, 2)", ["a tuple is not allowed"], 1),
    ("{1: 2}", ["a dict display {...} is not allowed"], 1),
    ("{1}", ["a set display {...} is not allowed"], 1),
    ("None", ["None is not a value here", "defined(x)"], 1),
    ("1j", ["a complex number is not allowed"], 1),
    ("b'x'", ["a bytes literal is not allowed"], 1),
    ("...", ["Ellipsis is not allowed"], 1),
    ("x.y", ["attribute access '.y' on 'x' is not allowed"], 1),
    ("primry > 1", ["unknown name 'primry'", "did you mean 'primary'?", "reads (primary, vram_clean, x, y)"], 1),
    ("D.s_per_step > 1", ["rung 'D' does not exist", "rungs are A, B, C"], 1),
    ("A.s_pr_step > 1", ["rung A has no metric 's_pr_step'", "did you mean 's_per_step'?"], 1),
    ("PASS.s_per_step > 1", ["rung 'PASS' does not exist", "rungs are A, B, C"], 1),
    ("s_per_step > 1", ["'s_per_step' is a metric", "e.g. A.s_per_step"], 1),
    ("step > 100", ["'step' exists only in kill lines"], 1),
    ("at_step(loss, 100) > 1", ["at_step() reaches back", "only in kill lines"], 1),
    ("A > 1", ["'A' is a rung", "A.metric"], 1),
    ("abs > 1", ["'abs' is a function; call it"], 1),
    ("true", ["unknown name 'true'", "write True or False"], 1),
    ("abs(1, 2)", ["abs() takes 1 argument(s), got 2"], 1),
    ("min()", ["min() takes at least 1 argument(s), got 0"], 1),
    ("all_oracles_passed(1)", ["all_oracles_passed() takes 0 argument(s), got 1"], 1),
    ("passed(x)", ["passed() takes a quoted oracle or item id"], 8),
    ("passed('P9')", ["'P9' is not a known oracle or item id", "oracle or item ids are P1, P1a, P2, P2a"], 8),
    ("killed('K11')", ["'K11' is not a known kill or rung id", "did you mean 'K1'?"], 8),
    ("dropped('P1a')", ["'P1a' is not a known item id", "item ids are P1, P2"], 9),
    ("x and 3", ["'and' needs a boolean, and '3' is a number"], 7),
    ("not 2", ["'not' needs a boolean, and '2' is a number"], 5),
    ("-True", ["unary minus needs a number, and 'True' is a boolean"], 2),
    ("'a' + 1", ["'+' needs a number, and \"'a'\" is a string"], 1),
    ("'a' < 'b'", ["'<' needs a number"], 1),
    ("1 == 'a'", ["'==' compares a number with a string"], 3),
    ("x == (1 < 2) == 3", ["'==' compares a boolean with a number"], 14),
    ("finite(x > 1)", ["finite() needs a number"], 8),
    ("count(1, 2)", ["count() needs a boolean"], 7),
    ("A . s_per_step", ["must be written exactly as 'A.s_per_step'"], 1),
    ("\uff21.s_per_step", ["must be written exactly as 'A.s_per_step'"], 1),
    ("\ufb01nite(x)", ["must be written exactly as 'finite'"], 1),
    ("", ["the expression is empty"], None),
    ("   \n ", ["the expression is empty"], None),
    ("x >", ["not a valid expression"], None),
    ("x = 1", ["not a valid expression"], 3),
    ("\x00", ["not a valid expression"], None),
    ("import os", ["not a valid expression"], 1),
    ("x; y", ["not a valid expression"], 2),
]


@pytest.mark.parametrize(("text", "fragments", "column"), GOLDEN, ids=[g[0][:30] for g in GOLDEN])
def test_golden_refusals(text, fragments, column):
    error = refusal(text)
    for fragment in fragments:
        assert fragment in str(error), str(error)
    assert error.column == column, str(error)


def test_length_cap_names_both_numbers():
    text = "sum(" + ", ".join(["x"] * 300) + ")"
    text += " " * (MAX_LENGTH - len(text))  # exactly at the cap: compiles
    assert len(text) == MAX_LENGTH
    compile_expr(text, READS)
    error = refusal(text + " ")
    assert error.column is None
    assert f"{MAX_LENGTH + 1} characters long; the cap is {MAX_LENGTH}" in str(error)
    assert str(error).count("x + ") < 30  # the message quotes an excerpt, not the whole expression


def test_length_is_counted_before_parsing():
    assert "1001 characters" in str(refusal("(" * 1001))


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("not " * 40 + "vram_clean", 41),
        ("abs(" * 40 + "x" + ")" * 40, 41),
        ("(" * 40 + "x" + ")" * 40 + " > 1", 40),
        ("-" * 40 + "x", 41),
        (" + ".join(["x"] * 33), 33),  # a + b + ... nests one level per operator
    ],
)
def test_depth_cap_names_the_depth_and_the_cap(text, depth):
    error = refusal(text, READS)
    assert f"nests {depth} deep; the cap is {MAX_DEPTH}" in str(error)


def test_depth_cap_allows_exactly_the_cap():
    compile_expr("-" * (MAX_DEPTH - 1) + "x", READS)
    compile_expr("(" * MAX_DEPTH + "x" + ")" * MAX_DEPTH, READS)
    compile_expr("sum(" + ", ".join(["x"] * 100) + ") > 0", READS)  # wide is fine, only deep is capped


def test_a_thousand_deep_unary_chain_is_refused_not_a_recursion_error():
    assert "the cap is 32" in str(refusal("-" * 999 + "x"))


def test_refused_constructs_are_found_inside_allowed_ones():
    assert "subscript" in str(refusal("abs(x[0]) > 1"))
    assert "lambda" in str(refusal("vram_clean and (lambda: True)()", RULES))
    assert "'**'" in str(refusal("max(1, (x + 2) ** 2)"))
    assert "attribute access" in str(refusal("x > 0 and A.s_per_step.__class__ == 1"))


def test_columns_count_characters_after_leading_whitespace_and_non_ascii_text():
    assert refusal("   2 ** 10").column == 6
    text = "'\u00e9t\u00e9' == 'x' and 2 ** 2 > 1"
    assert refusal(text).column == text.index("**") + 1


@pytest.mark.parametrize(
    ("text", "scope", "fragment"),
    [
        ("PASS.s_per_step < 3", PASS_RULE, "PASS is not available in a pass rule"),
        ("s_per_step", RULES, "'s_per_step' is a metric"),
        ("1 + 2", RULES, "a rule must be a condition (True or False), and this is a number"),
        ("'yes'", EXPECTATIONS, "an expectation check must be a condition"),
        ("s_per_step * 2", PASS_RULE, "a pass rule must be a condition"),
        ("loss", READS, "'loss' is a metric"),
        ("passed('P1a')", KILL, "passed() is not available in a kill line"),
        ("all_oracles_passed()", PASS_RULE, "all_oracles_passed() is not available in a pass rule"),
        ("step > 1", PASS_RULE, "'step' exists only in kill lines"),
        ("min_since(loss, 10) > 1", PASS_RULE, "only in kill lines"),
        ("los > 1", KILL, "did you mean 'loss'?"),
        (
            "at_step(loss + 1, 5) > 1",
            KILL,
            "the first argument of at_step() names a metric's series: 'loss + 1' is not a metric",
        ),
        ("at_step(los, 5) > 1", KILL, "'los' is not a metric; did you mean 'loss'?"),
        ("at_step(loss) > 1", KILL, "at_step() takes 2 argument(s), got 1"),
        ("at_step(loss, True) > 1", KILL, "at_step() needs a number"),
        ("max(last(loss, 0)) > 1", KILL, "last() counts windows: a whole number >= 1, got 0"),
        ("max(last(loss, 2.5)) > 1", KILL, "got 2.5"),
        (
            "last(loss, 3) > 1",
            KILL,
            "'<' needs a number" if False else "'>' needs a number, and 'last(loss, 3)' is a list",
        ),
        ("last(loss, 3) == 1", KILL, "'last(loss, 3)' is a list, which cannot be compared"),
        ("last(loss, 3)", KILL, "last(...) gives a list, which is not a value on its own"),
        ("max(last(loss, 3), 2) > 1", KILL, "which max() takes only as its sole argument"),
        ("abs(last(loss, 3)) > 1", KILL, "abs() does not take a list"),
        ("killed('PASS')", UNTIL_PASS, "'PASS' is not a known kill or rung id"),
        ("PASS > 1", UNTIL_PASS, "'PASS' is a rung"),
    ],
)
def test_scope_specific_refusals(text, scope, fragment):
    assert fragment in str(refusal(text, scope))


def test_pass_metric_is_allowed_only_where_the_caller_declared_an_until_pass_ladder():
    compile_expr("40000 * PASS.s_per_step / 3600 <= 30", UNTIL_PASS)
    assert "rung 'PASS' does not exist" in str(refusal("40000 * PASS.s_per_step / 3600 <= 30", RULES))


def test_bare_metrics_mean_the_judged_rung_in_a_pass_rule_and_the_window_in_a_kill_line():
    for scope in (PASS_RULE, KILL):
        assert compile_expr("not finite", scope).evaluate(MapEnv(metrics={"finite": False})) is True


def test_the_package_never_calls_eval_exec_compile_or_import():
    forbidden = {"eval", "exec", "compile", "__import__", "execfile"}
    package = Path(prereg.rules.__file__).parent
    found = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if name in forbidden:
                    found.append(f"{path.name}:{node.lineno} {name}()")
    assert len(list(package.glob("*.py"))) >= 5
    assert found == []


# -- fuzzing: junk either compiles or is refused with RuleError, and what compiles evaluates ---------

TOKENS = [
    "A",
    "B",
    "PASS",
    ".",
    "s_per_step",
    "loss",
    "finite",
    "primary",
    "x",
    "step",
    "(",
    ")",
    ",",
    "and",
    "or",
    "not",
    "+",
    "-",
    "*",
    "/",
    "**",
    "%",
    "//",
    "<",
    "<=",
    "==",
    "!=",
    ">",
    "0",
    "1",
    "2.5",
    "1e400",
    "-1",
    "'P1a'",
    "'P1'",
    "True",
    "False",
    "None",
    "[",
    "]",
    "{",
    "}",
    "lambda",
    ":",
    ":=",
    "if",
    "else",
    "for",
    "in",
    "is",
    "__class__",
    "__import__",
    "abs",
    "min",
    "max",
    "mean",
    "median",
    "sum",
    "count",
    "all",
    "any",
    "defined",
    "last",
    "at_step",
    "min_since",
    "passed",
    "killed",
    "dropped",
    "all_oracles_passed",
    "=",
    "f'",
    "'",
    '"',
    "\\",
    "\n",
    "#",
    "@",
    "~",
    "|",
    "&",
    "^",
    "...",
    "yield",
    "await",
    "*x",
    "**x",
    "\t",
    " ",
    "\u00e9",
    "\uff21",
    "\x00",
    "0x1F",
    "1_000",
    "1j",
    "b''",
]
JUNK_ENVS = [
    MapEnv(),
    MapEnv(
        reads={"primary": 0.07, "vram_clean": True, "x": math.nan, "y": "text"},
        rung_metrics={
            ("A", "s_per_step"): 2.2,
            ("B", "s_per_step"): 0,
            ("C", "loss"): math.inf,
            ("PASS", "rc"): 0,
            ("A", "finite"): True,
        },
        metrics={"loss": 0.0, "finite": False, "rc": 0, "s_per_step": -1e308, "probe_chunk_mae": 26.0},
        step=5000,
        history={"loss": [(100, 1.0), (200, math.nan)], "probe_chunk_mae": [(2500, 20.0), (5000, 26.0)]},
        oracles={"P1a": True, "P1": Undefined("no result")},
        kills={"K1": False},
        dropped={"P2"},
    ),
]


def compile_or_refuse(text: str, scope: Scope) -> None:
    try:
        expr = compile_expr(text, scope)
    except RuleError as error:
        assert str(error).startswith("rule expression ")
        return
    for env in JUNK_ENVS:
        result = expr.evaluate(env)
        assert isinstance(result, (bool, int, float, str, Undefined)), (text, result)
        if scope.kind != "reads":
            assert isinstance(result, (bool, Undefined)), (text, result)


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(tokens=st.lists(st.sampled_from(TOKENS), max_size=30), scope=st.sampled_from(SCOPES))
def test_token_soup_compiles_or_is_refused(tokens, scope):
    compile_or_refuse(" ".join(tokens), scope)


@FUZZ
@given(tokens=st.lists(st.sampled_from(TOKENS), max_size=30), scope=st.sampled_from(SCOPES))
def test_token_soup_without_spaces_compiles_or_is_refused(tokens, scope):
    compile_or_refuse("".join(tokens), scope)


@FUZZ
@given(text=st.text(max_size=60), scope=st.sampled_from(SCOPES))
def test_arbitrary_text_compiles_or_is_refused(text, scope):
    compile_or_refuse(text, scope)


@settings(max_examples=30, deadline=None)
@given(text=st.text(alphabet="(-x+not )", min_size=990, max_size=1010), scope=st.sampled_from(SCOPES))
def test_long_and_deep_text_compiles_or_is_refused(text, scope):
    compile_or_refuse(text, scope)


# Syntactically valid Python over the whole expression grammar, allowed and refused constructs mixed, so
# that the allow-list and the evaluator (not the parser) see most of the inputs.
LEAF_NAMES = [
    "primary",
    "vram_clean",
    "x",
    "y",
    "loss",
    "finite",
    "rc",
    "step",
    "A",
    "PASS",
    "abs",
    "min",
    "last",
    "passed",
    "__import__",
    "open",
    "__class__",
    "os",
    "True",
    "False",
    "None",
]
LEAVES = st.one_of(
    st.sampled_from(LEAF_NAMES),
    st.sampled_from(["A.s_per_step", "B.loss", "PASS.rc", "C.finite", "D.loss", "A.nope"]),
    st.integers(-3, 3).map(str),
    st.sampled_from(["0.0", "1e400", "2.5", "'P1a'", "'P1'", "'K1'", "'A'", "''"]),
)
BINARY = ["+", "-", "*", "/", "**", "%", "//", "@", "<<", ">>", "|", "^", "&"]
COMPARE = ["<", "<=", ">", ">=", "==", "!=", "in", "not in", "is", "is not"]
FUNCTION_NAMES = [
    "abs",
    "min",
    "max",
    "mean",
    "median",
    "sum",
    "count",
    "all",
    "any",
    "finite",
    "defined",
    "passed",
    "killed",
    "dropped",
    "all_oracles_passed",
    "at_step",
    "last",
    "min_since",
    "max_since",
    "getattr",
    "x",
]


def _allowed_syntax(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "/"]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["-", "+", "not "]), inner).map(lambda t: f"({t[0]}{t[1]})"),
        st.tuples(st.sampled_from([" and ", " or "]), st.lists(inner, min_size=2, max_size=3)).map(
            lambda t: "(" + t[0].join(t[1]) + ")"
        ),
        st.tuples(inner, st.lists(st.tuples(st.sampled_from(COMPARE[:6]), inner), min_size=1, max_size=2)).map(
            lambda t: "(" + t[0] + "".join(f" {op} {v}" for op, v in t[1]) + ")"
        ),
        st.tuples(st.sampled_from(FUNCTION_NAMES), st.lists(inner, max_size=3)).map(
            lambda t: f"{t[0]}({', '.join(t[1])})"
        ),
    )


def _refused_syntax(inner: st.SearchStrategy) -> st.SearchStrategy:
    args = st.lists(inner, max_size=3)
    return st.one_of(
        st.tuples(inner, st.sampled_from(BINARY[4:]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        inner.map(lambda v: f"(~{v})"),
        st.tuples(inner, st.sampled_from(COMPARE[6:]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(FUNCTION_NAMES), args, st.sampled_from(["x=1", "*x", "**x"])).map(
            lambda t: f"{t[0]}({', '.join([*t[1], t[2]])})"
        ),
        st.tuples(inner, st.sampled_from(["real", "s_per_step", "__class__"])).map(lambda t: f"({t[0]}).{t[1]}"),
        inner.map(lambda v: f"({v})[0]"),
        inner.map(lambda v: f"(lambda: {v})"),
        st.tuples(inner, inner, inner).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
        args.map(lambda v: f"[{', '.join(v)}]"),
        inner.map(lambda v: f"[q for q in {v}]"),
        inner.map(lambda v: f"f'{{{v}}}'"),
        inner.map(lambda v: f"(z := {v})"),
    )


# Only allowed syntax: most inputs get past the allow-list to name and type checks, and many to evaluation.
ALLOWED_SYNTAX = st.recursive(LEAVES, _allowed_syntax, max_leaves=10)
# Allowed and refused syntax mixed: the allow-list must find a refused construct wherever it nests.
ANY_SYNTAX = st.recursive(
    LEAVES, lambda inner: st.one_of(_allowed_syntax(inner), _refused_syntax(inner)), max_leaves=10
)
FUZZ_PYTHON = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ_PYTHON
@given(text=ALLOWED_SYNTAX, scope=st.sampled_from(SCOPES))
def test_allowed_syntax_compiles_or_is_refused_and_evaluates(text, scope):
    compile_or_refuse(text, scope)


@FUZZ_PYTHON
@given(text=ANY_SYNTAX, scope=st.sampled_from(SCOPES))
def test_any_python_expression_compiles_or_is_refused(text, scope):
    compile_or_refuse(text, scope)
