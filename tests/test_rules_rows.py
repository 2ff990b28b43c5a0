"""Row functions: a per-row metric's rows paired by id against an anchor's, the mean difference and its 95%
interval, undefined with the rows that did not pair; where they may be called and what they may be given; and
`prereg record`'s rows, which only a metric recorded row by row may have."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
from conftest import Cli, lab_ledger_copy, ledger_fingerprint, write

from prereg.rules import MapEnv, RuleError, Scope, Undefined, compile_expr
from prereg.rules.rows import t_quantile_975

SCOPE = Scope(
    kind="reads",
    rungs=frozenset({"run", "anchor"}),
    metrics=frozenset({"frame_mae", "loss"}),
    row_metrics=frozenset({"frame_mae"}),
)
RUN = {"f0": 7.0, "f1": 7.2, "f2": 7.1}
ANCHOR = {"f0": 7.8, "f1": 7.9, "f2": 7.7}


def value(text: str, run: dict, anchor: dict, scope: Scope = SCOPE):
    env = MapEnv(rows={("run", "frame_mae"): run, ("anchor", "frame_mae"): anchor})
    return compile_expr(text, scope).evaluate(env)


def test_the_t_quantile_matches_the_table():
    table = {1: 12.7062, 2: 4.3027, 3: 3.1824, 5: 2.5706, 10: 2.2281, 30: 2.0423, 1000: 1.9623}
    for df, t in table.items():
        assert t_quantile_975(df) == pytest.approx(t, abs=4e-3), df


def test_paired_delta_and_its_interval():
    deltas = [RUN[k] - ANCHOR[k] for k in RUN]
    half = 4.3027 * statistics.stdev(deltas) / math.sqrt(3)
    assert value("paired_delta(run.frame_mae, anchor.frame_mae)", RUN, ANCHOR) == pytest.approx(-0.7)
    assert value("paired_delta_low(run.frame_mae, anchor.frame_mae)", RUN, ANCHOR) == pytest.approx(-0.7 - half, 1e-4)
    assert value("paired_delta_high(run.frame_mae, anchor.frame_mae)", RUN, ANCHOR) == pytest.approx(-0.7 + half, 1e-4)
    # pairs by id, not by position: the anchor's rows in another order give the same difference
    reordered = dict(reversed(list(ANCHOR.items())))
    assert value("paired_delta(run.frame_mae, anchor.frame_mae)", RUN, reordered) == pytest.approx(-0.7)
    assert value("paired_delta(run.frame_mae, anchor.frame_mae) < -0.5", RUN, ANCHOR) is True


def test_rows_that_do_not_pair_are_undefined_naming_them():
    missing = {"f0": 7.8, "f1": 7.9, "f9": 7.7}
    result = value("paired_delta(run.frame_mae, anchor.frame_mae)", RUN, missing)
    assert isinstance(result, Undefined)
    assert "the rows do not pair" in result.reason
    assert "1 row(s) of run.frame_mae have no row in anchor.frame_mae ('f2')" in result.reason
    assert "1 row(s) of anchor.frame_mae have no row in run.frame_mae ('f9')" in result.reason
    many = {f"g{i}": 1.0 for i in range(10)}
    assert "and 7 more" in value("paired_delta(run.frame_mae, anchor.frame_mae)", RUN, {**ANCHOR, **many}).reason


def test_too_few_or_broken_rows_are_undefined_with_the_reason():
    one = value("paired_delta(run.frame_mae, anchor.frame_mae)", {"f0": 1.0}, {"f0": 2.0})
    assert isinstance(one, Undefined) and "at least 2" in one.reason
    broken = value("paired_delta(run.frame_mae, anchor.frame_mae)", {**RUN, "f1": math.nan}, ANCHOR)
    assert isinstance(broken, Undefined) and "not finite ('f1')" in broken.reason
    absent = compile_expr("paired_delta(run.frame_mae, anchor.frame_mae)", SCOPE).evaluate(MapEnv())
    assert isinstance(absent, Undefined) and "run.frame_mae" in absent.reason


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("paired_delta(run.loss, anchor.loss)", "not recorded row by row"),
        ("paired_delta(run.frame_mae)", r"takes 2 argument\(s\)"),
        ("paired_delta(run.frame_mae, 1)", "is not RUNG.metric"),
        ("paired_delta(frame_mae, anchor.frame_mae)", "is not RUNG.metric"),
        ("paired_delta(nowhere.frame_mae, anchor.frame_mae)", "rung 'nowhere' does not exist"),
        ("paired_delta(run.frame_mae.x, anchor.frame_mae)", "is not RUNG.metric"),
    ],
)
def test_row_functions_take_two_recorded_row_sets(text: str, says: str):
    with pytest.raises(RuleError, match=says):
        compile_expr(text, SCOPE)


@pytest.mark.parametrize("kind", ["kill", "pass_rule"])
def test_row_functions_judge_finished_rungs_only(kind: str):
    scope = Scope(kind=kind, rungs=SCOPE.rungs, metrics=SCOPE.metrics, row_metrics=SCOPE.row_metrics)
    with pytest.raises(RuleError, match="pairs the rows of finished rungs"):
        compile_expr("paired_delta(run.frame_mae, anchor.frame_mae) < 0", scope)


def test_a_rows_read_names_the_rung_metrics_it_pairs():
    expr = compile_expr("paired_delta(run.frame_mae, anchor.frame_mae)", SCOPE)
    assert expr.rung_metrics_used() == {("run", "frame_mae"), ("anchor", "frame_mae")}


# --- prereg record's rows --------------------------------------------------------------------------------------


def frozen_ar_40k(tmp_path: Path) -> Cli:
    """A copy of the lab's ledger, where molmo2-ar-40k is frozen."""
    return Cli(lab_ledger_copy(tmp_path / "ledger.db"), tmp_path)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('[rungs.run.rows.panel_chunk_mae]\n"f0" = 7.0\n', "recorded in the wrong place"),
        ("[rungs.run]\nmetrics = { panel_frame_chunk_mae = 7.0 }\n", "recorded in the wrong place"),
        ('[rungs.run.rows.frame_accuracy]\n"f0" = 0.5\n', "unknown metric(s) ['frame_accuracy']"),
    ],
)
def test_only_a_per_row_metric_has_rows_and_a_refused_record_writes_nothing(tmp_path: Path, body: str, says: str):
    cli = frozen_ar_40k(tmp_path)
    head = '[rungs.run]\nitems = []\nstatus = "finished"\n' if not body.startswith("[rungs.run]\n") else ""
    text = (
        'provenance = "test"\n' + head + body.replace("[rungs.run]\n", '[rungs.run]\nitems = []\nstatus = "finished"\n')
    )
    path = write(tmp_path, "rows.toml", text)
    before = ledger_fingerprint(cli.ledger)
    result = cli.on_ledger("record", "molmo2-ar-40k", path)
    assert result.exit_code == 2 and says in result.stderr, result.stderr
    assert ledger_fingerprint(cli.ledger) == before
