"""Records and verdicts: parity first, the re-planned ladder, flagged rungs, undefined reads, conditional land,
idempotence and expectation scores — each through `prereg record` and `prereg verdict --json`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from conftest import (
    PASSING_ORACLES,
    PERF_PASS1,
    Cli,
    lab_ledger_copy,
    ledger_fingerprint,
    record_file,
    rung_record,
    write,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

P1_FAILS = "[oracles.P1a]\nloss_abs = 8.7e-3\ngrad_norm_rel = 4e-3\n[oracles.P2a]\nmissing = []\nviolations = []\n"
P2_FAILS = (
    "[oracles.P1a]\nloss_abs = 2e-4\ngrad_norm_rel = 3e-3\n"
    '[oracles.P2a]\nmissing = ["vram_window_peak_gib"]\nviolations = []\n'
)

# The keys `prereg verdict --json` promises other tools (docs/design.md, "The command line").
PROMISED = {"outcome", "rule", "land", "park", "dropped", "reads", "undefined", "expectations", "post_hoc"}


def rungs(**speeds: float) -> list[str]:
    items = {"A": [], "B": ["P1"], "C": ["P1", "P2"]}
    return [rung_record(rung, items[rung], s_per_step=s) for rung, s in speeds.items()]


def view(verdict: dict, rung: str) -> dict:
    return next(r for r in verdict["rungs"] if r["rung"] == rung)


def test_verdict_json_has_the_promised_keys_and_shapes(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", P1_FAILS, *rungs(A=2.0)))
    verdict = cli.ok_json("verdict", "mini")
    assert PROMISED <= set(verdict)
    assert (
        isinstance(verdict["land"], list)
        and isinstance(verdict["park"], list)
        and isinstance(verdict["post_hoc"], list)
    )
    assert set(verdict["reads"]) == {"primary", "secondary", "vram_clean"}
    assert all(value is None or isinstance(value, (int, float)) for value in verdict["reads"].values())
    assert set(verdict["undefined"]) <= set(verdict["reads"])
    assert [e["n"] for e in verdict["expectations"]] == [1, 2, 3]
    assert {e["result"] for e in verdict["expectations"]} <= {"hit", "miss", "undefined"}
    assert {"oracle", "observed", "bound"} <= set(verdict["dropped"]["P1"])


def test_a_failing_oracle_drops_its_item_with_observed_value_and_bound(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    recorded = cli.ok_json("record", "mini", record_file(tmp_path, "r.toml", P1_FAILS))
    assert recorded["oracles"] == {
        "P1a": {"passed": False, "reason": "loss_abs = 0.0087 > bound 0.001"},
        "P2a": {"passed": True, "reason": "schema holds"},
    }
    dropped = cli.ok_json("verdict", "mini")["dropped"]
    assert set(dropped) == {"P1"}
    assert dropped["P1"]["oracle"] == "P1a"
    assert dropped["P1"]["observed"] == {"loss_abs": 8.7e-3, "grad_norm_rel": 4e-3}
    assert dropped["P1"]["bound"] == {"loss_abs": 1e-3, "grad_norm_rel": 1e-2}
    assert "0.0087 > bound 0.001" in cli.ok("verdict", "mini").stdout


def test_a_probe_that_could_not_run_fails_its_oracle_with_the_reason(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    cli.ok(
        "record", "mini", record_file(tmp_path, "r.toml", '[oracles.P1a]\nerror = "cuDNN is not available on a CPU"\n')
    )
    assert (
        cli.ok_json("verdict", "mini")["dropped"]["P1"]["reason"]
        == "probe could not run: cuDNN is not available on a CPU"
    )


def test_a_non_finite_observation_fails_its_oracle_and_is_kept(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", "[oracles.P1a]\nloss_abs = nan\ngrad_norm_rel = 1e-3\n"))
    dropped = cli.ok_json("verdict", "mini")["dropped"]["P1"]
    assert dropped["observed"]["loss_abs"] == "nan" and "nan > bound" in dropped["reason"]


def test_the_ladder_replans_a_rung_whose_items_all_dropped(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok(
        "record",
        "mini",
        record_file(tmp_path, "r.toml", P1_FAILS, *rungs(A=2.0), rung_record("C", ["P2"], s_per_step=1.9)),
    )
    verdict = cli.ok_json("verdict", "mini")
    b, c = view(verdict, "B"), view(verdict, "C")
    assert b["skip"] == "every item it tests was dropped (P1)" and b["run"] is None
    assert c["skip"] is None and c["items"] == ["P2"] and c["summary"]["s_per_step"] == 1.9
    assert "secondary" in verdict["undefined"] and "rung B was not run" in verdict["undefined"]["secondary"]
    assert abs(verdict["reads"]["primary"] - 0.05) < 1e-12


def test_a_rung_equal_to_another_after_a_drop_is_not_run(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    recorded = cli.ok_json("record", "mini", record_file(tmp_path, "r.toml", P2_FAILS, *rungs(A=2.0, B=1.8, C=1.7)))
    assert recorded["rungs"]["C"]["flagged"] == "the plan does not run this rung: equal to rung B after dropping P2"
    verdict = cli.ok_json("verdict", "mini")
    assert view(verdict, "C")["skip"] == "equal to rung B after dropping P2"
    assert verdict["reads"]["primary"] is None
    assert verdict["undefined"]["primary"] == "C.s_per_step: rung C was not run: equal to rung B after dropping P2"
    assert abs(verdict["reads"]["secondary"] - 0.1) < 1e-12


def test_a_rung_recorded_with_other_items_is_flagged_kept_and_read_by_nothing(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    # B ran P1 and P2 although the plan's B is P1 alone.
    recorded = cli.ok_json(
        "record",
        "mini",
        record_file(
            tmp_path, "r.toml", PASSING_ORACLES, *rungs(A=2.0, C=1.7), rung_record("B", ["P1", "P2"], s_per_step=1.5)
        ),
    )
    assert recorded["rungs"]["B"]["flagged"] == "ran ['P2'] which the plan does not include"
    assert recorded["rungs"]["A"]["flagged"] is None

    verdict = cli.ok_json("verdict", "mini")
    assert verdict["reads"]["secondary"] is None
    assert "rung B was recorded with items ['P1', 'P2'] against a plan of ['P1']" in verdict["undefined"]["secondary"]
    assert [f["rung"] for f in verdict["flagged"]] == ["B"]
    assert verdict["reads"]["primary"] is not None  # the other rungs are read as usual

    runs = {r["rung"]: r for r in cli.ok_json("audit", "show", "mini")["runs"]}
    assert runs["B"]["flagged"] == "ran ['P2'] which the plan does not include" and runs["B"]["items"] == ["P1", "P2"]
    assert "flagged: ran ['P2'] which the plan does not include" in cli.ok("audit", "show", "mini").stdout


def test_a_rung_that_ran_an_item_the_gate_dropped_is_flagged(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    recorded = cli.ok_json("record", "mini", record_file(tmp_path, "r.toml", P1_FAILS, *rungs(A=2.0, C=1.7)))
    assert recorded["rungs"]["C"]["flagged"] == "ran ['P1'] which the oracle gate dropped"
    assert cli.ok_json("verdict", "mini")["reads"]["primary"] is None


def test_a_rung_measured_before_a_later_drop_is_stale(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r1.toml", *rungs(A=2.0, B=1.8, C=1.7)))
    assert cli.ok_json("verdict", "mini")["reads"]["primary"] is not None
    cli.ok("record", "mini", record_file(tmp_path, "r2.toml", P1_FAILS))  # the gate's result arrives after the ladder
    verdict = cli.ok_json("verdict", "mini")
    assert verdict["reads"]["primary"] is None
    assert verdict["undefined"]["primary"] == (
        "C.s_per_step: rung C ran with items ['P1', 'P2'], but the plan now runs ['P2'] "
        "(an item was dropped after it ran): it needs a re-run"
    )


def test_undefined_reads_fire_no_rule_and_say_why(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", PASSING_ORACLES, *rungs(A=2.0, B=1.8)))
    verdict = cli.ok_json("verdict", "mini")
    assert verdict["rule"] is None and verdict["outcome"] is None and verdict["land"] == verdict["park"] == []
    assert verdict["undefined"] == {
        "primary": "C.s_per_step: rung C has not run",
        "vram_clean": "C.vram_peak_gib: rung C has not run",
    }
    assert [t["undefined"] for t in verdict["rules"]] == [
        "read primary is undefined: C.s_per_step: rung C has not run"
    ] * 2
    assert "outcome: none — no rule fired" in cli.ok("verdict", "mini").stdout


def test_only_a_finished_rung_is_read_in_a_compare_ladder(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok(
        "record",
        "mini",
        record_file(
            tmp_path, "r.toml", *rungs(A=2.0, B=1.8), rung_record("C", ["P1", "P2"], s_per_step=1.0, status="failed")
        ),
    )
    assert (
        cli.ok_json("verdict", "mini")["undefined"]["primary"]
        == "C.s_per_step: rung C has no finished run (last: failed)"
    )


@pytest.mark.parametrize(
    ("c_vram", "landed", "parked"),
    [(10.1, ["P2"], ["P1"]), (10.5, [], ["P1", "P2"])],
    ids=["vram clean", "vram regressed"],
)
def test_a_conditional_land_lands_or_parks_on_its_condition(
    cli: Cli, frozen_mini: Path, tmp_path: Path, c_vram: float, landed: list, parked: list
) -> None:
    cli.ok(
        "record",
        "mini",
        record_file(
            tmp_path,
            "r.toml",
            PASSING_ORACLES,
            rung_record("A", [], s_per_step=2.0, vram=10.0),
            rung_record("B", ["P1"], s_per_step=1.99),
            rung_record("C", ["P1", "P2"], s_per_step=1.98, vram=c_vram),
        ),
    )
    verdict = cli.ok_json("verdict", "mini")
    assert verdict["rule"] == "R-hygiene" and verdict["outcome"] == "land-hygiene"
    assert verdict["land"] == landed and sorted(verdict["park"]) == parked
    [conditional] = verdict["conditional_land"]
    assert conditional["item"] == "P2" and conditional["value"] is (c_vram <= 10.2)


def test_the_first_rule_that_holds_decides(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", PASSING_ORACLES, *rungs(A=2.0, B=1.9, C=1.8)))
    verdict = cli.ok_json("verdict", "mini")
    assert (verdict["rule"], verdict["outcome"], verdict["land"], verdict["park"]) == (
        "R-land",
        "land-both",
        ["P1", "P2"],
        [],
    )
    assert [t["rule"] for t in verdict["rules"]] == ["R-land"]  # R-hygiene is never tried


def test_a_landed_item_that_was_dropped_is_parked(cli: Cli, tmp_path: Path, frozen_mini: Path) -> None:
    # Only P2's rung and the baseline survive; R-land would land P1 too, which its oracle dropped.
    cli.ok(
        "record",
        "mini",
        record_file(tmp_path, "r.toml", P1_FAILS, *rungs(A=2.0), rung_record("C", ["P2"], s_per_step=1.8)),
    )
    verdict = cli.ok_json("verdict", "mini")
    assert verdict["rule"] == "R-land"
    assert verdict["land"] == ["P2"] and verdict["park"] == ["P1"]


def test_expectations_are_scored_hit_miss_and_undefined(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", P2_FAILS, *rungs(A=2.0, B=1.9)))
    expectations = cli.ok_json("verdict", "mini")["expectations"]
    assert [(e["n"], e["result"]) for e in expectations] == [(1, "miss"), (2, "hit"), (3, "undefined")]
    assert (
        expectations[2]["why"]
        == "read primary is undefined: C.s_per_step: rung C was not run: equal to rung B after dropping P2"
    )
    assert expectations[0]["why"] is None and expectations[0]["confidence"] == "high"


def test_the_verdict_is_idempotent_and_moves_with_new_data(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r1.toml", PASSING_ORACLES, *rungs(A=2.0, B=1.8)))
    first = cli.ok_json("verdict", "mini")
    assert first["recorded"] is True and first["rule"] is None
    before = ledger_fingerprint(cli.ledger)
    again = cli.ok_json("verdict", "mini")
    assert again["recorded"] is False and again["head"] == first["head"]
    assert {k: again[k] for k in PROMISED} == {k: first[k] for k in PROMISED}
    assert ledger_fingerprint(cli.ledger) == before
    assert "unchanged (already recorded)" in cli.ok("verdict", "mini").stdout

    cli.ok("record", "mini", record_file(tmp_path, "r2.toml", *rungs(C=1.7)))
    moved = cli.ok_json("verdict", "mini")
    assert moved["recorded"] is True and moved["head"] != first["head"]
    assert moved["rule"] == "R-land"
    assert cli.ok_json("audit", "show", "mini")["entries"]["verdict"] == 2


def test_windows_are_summarized_after_the_warm_up_and_a_nan_window_is_not_hidden(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    # discard_first = 10: the step-10 window is warm-up; the median is over steps 20, 30, 40.
    windows = "".join(
        f"[[rungs.A.windows]]\nstep = {step}\ns_per_step = {s}\nloss = {loss}\nvram_peak_gib = {vram}\n"
        for step, s, loss, vram in [
            (10, 9.0, 5.0, 30.0),
            (20, 2.0, "nan", 10.0),
            (30, 2.2, 4.0, 10.5),
            (40, 2.1, 3.5, 10.2),
        ]
    )
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", '[rungs.A]\nitems = []\nstatus = "finished"\n' + windows))
    a = view(cli.ok_json("verdict", "mini"), "A")
    assert a["windows"] == 3
    assert a["summary"]["s_per_step"] == 2.1  # the median, not the warm-up's 9.0
    assert a["summary"]["vram_peak_gib"] == 10.5  # memory peaks reduce by max, over kept windows only
    assert a["summary"]["loss"] == "nan"  # a NaN window makes the summary NaN; it is never skipped
    assert a["spread"]["s_per_step"] == [2.0, 2.2] and a["spread"]["loss"] == [3.5, 4.0]  # the finite samples' range


speeds = st.floats(min_value=1.0, max_value=3.0, allow_nan=False)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=speeds, b=speeds, c=speeds, c_vram=st.floats(min_value=9.5, max_value=10.5))
def test_the_verdict_applies_the_frozen_rules_mechanically(
    cli: Cli, mini: Path, a: float, b: float, c: float, c_vram: float
) -> None:
    """MINI's rules, computed here by hand, against what `prereg verdict` decides for any measured speeds."""
    with tempfile.TemporaryDirectory() as scratch:
        ledger = Path(scratch) / "ledger.db"
        cli("freeze", mini, "--ledger", ledger)
        recorded = record_file(
            Path(scratch),
            "r.toml",
            PASSING_ORACLES,
            rung_record("A", [], s_per_step=a, vram=10.0),
            rung_record("B", ["P1"], s_per_step=b),
            rung_record("C", ["P1", "P2"], s_per_step=c, vram=c_vram),
        )
        assert cli("record", "mini", recorded, "--ledger", ledger).exit_code == 0
        verdict = cli("verdict", "mini", "--ledger", ledger, "--json").json()

    primary, vram_clean = (a - c) / a, c_vram <= 10.0 * 1.02
    if primary >= 0.05 and vram_clean:
        expected = ("R-land", ["P1", "P2"], [])
    else:
        expected = ("R-hygiene", ["P2"] if vram_clean else [], ["P1"] if vram_clean else ["P1", "P2"])
    assert (verdict["rule"], verdict["land"], sorted(verdict["park"])) == expected
    assert verdict["reads"]["primary"] == primary and verdict["reads"]["vram_clean"] is vram_clean
    assert [e["result"] for e in verdict["expectations"]] == [
        "hit",
        "hit" if (a - b) / a >= 0.04 else "miss",
        "hit" if primary >= 0.05 else "miss",
    ]


def test_not_killed_is_known_only_once_the_watched_rungs_have_run(cli: Cli, tmp_path: Path) -> None:
    # Expectation 4 of the S-bundle: passed("P1b") and not killed("K-cudnn"); K-cudnn watches rungs B and C.
    # Its items have since landed in the CUDA baseline, so it is frozen as the lab froze it: on a copy of its ledger.
    lab_ledger_copy(cli.ledger)
    assert cli.ok_json("freeze", PERF_PASS1)["already_frozen"]
    cli.ok(
        "record",
        "molmo2-perf-pass1",
        record_file(tmp_path, "gate.toml", "[oracles.P1b]\nmax_abs_diff = 0.01\nband = 0.03\nfinite = true\n"),
    )
    fourth = cli.ok_json("verdict", "molmo2-perf-pass1")["expectations"][4]
    assert (fourth["n"], fourth["result"]) == (4, "undefined")
    assert fourth["why"] == """killed("K-cudnn"): not known yet: rung(s) ['B', 'C'] it watches have not run"""
    bundle = ["P1", "P2", "P3a", "P3b", "P3c", "P4"]
    cli.ok(
        "record",
        "molmo2-perf-pass1",
        record_file(
            tmp_path, "ladder.toml", rung_record("B", ["P1"], s_per_step=2.1), rung_record("C", bundle, s_per_step=2.0)
        ),
    )
    assert cli.ok_json("verdict", "molmo2-perf-pass1")["expectations"][4]["result"] == "hit"


def test_a_later_passing_result_of_a_failed_oracle_does_not_undrop_its_item(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    # `prereg record` refuses a second observation; an entry appended by any other writer must not un-drop either.
    from prereg.ledger import Ledger

    cli.ok("record", "mini", record_file(tmp_path, "r.toml", P1_FAILS))
    with Ledger.open(str(cli.ledger), create=False) as ledger:
        first = next(ledger.entries(reg_id="mini", kinds=("oracle",)))
        ledger.append(
            "oracle",
            "mini",
            {**first.data, "observed": {"loss_abs": 1e-4, "grad_norm_rel": 1e-3}, "passed": True, "reason": "re-run"},
        )
    dropped = cli.ok_json("verdict", "mini")["dropped"]
    assert set(dropped) == {"P1"} and dropped["P1"]["observed"]["loss_abs"] == 8.7e-3


PAIRED = """
id = "paired"
title = "a paired loss read over rungs with unequal window counts"
question = "does a learning-rate change move the loss?"
workload = "molmo2"
profile = "cpu-tiny"

[cost]
ceiling_gpu_h = 0.5
on_ceiling = "stop"

[protocol]
kind = "compare"
steps = 50
log_every = 10
discard_first = 10
config = { batch = 4, backward_chunks = 2 }

  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "B"
  config = { lr = 2e-4 }

[reads]
loss_gap = "abs(B.loss - A.loss) / A.loss"

[[rules]]
id = "R"
when = "loss_gap <= 0.02"
outcome = "same"
"""


def test_a_paired_interval_pairs_the_windows_every_rung_has(cli: Cli, tmp_path: Path) -> None:
    """Rung A has a fourth read window that B lacks (a recorded rung). The loss is paired (the k-th windows saw
    the same samples), so the bootstrap draws window indices over the three both have: B's loss is 1.01 x A's in
    each, so every draw reads 0.01 and A's unpaired window (100.0) never enters the interval. The point value
    summarises each rung over its own windows (A's median includes it), so here it falls outside the interval:
    the interval says what the paired windows support, the point what each rung measured."""
    cli.ok("freeze", write(tmp_path, "paired.toml", PAIRED))

    def windows(rung: str, losses: list[float]) -> str:
        return "".join(
            f"[[rungs.{rung}.windows]]\nstep = {10 * (k + 1)}\ns_per_step = 1.0\nloss = {loss!r}\n"
            "vram_peak_gib = 10.0\n"
            for k, loss in enumerate(losses)
        )

    a = [9.0, 4.0, 3.0, 2.0, 100.0]  # step 10 is warm-up
    b = [9.09, 4.04, 3.03, 2.02]
    finished = '\nitems = []\nstatus = "finished"\n'
    rung_a, rung_b = "[rungs.A]" + finished + windows("A", a), "[rungs.B]" + finished + windows("B", b)
    cli.ok("record", "paired", record_file(tmp_path, "r.toml", rung_a, rung_b))
    verdict = cli.ok_json("verdict", "paired")
    assert verdict["reads"]["loss_gap"] == pytest.approx(abs(3.03 - 3.5) / 3.5)  # medians over each rung's own windows
    low, high = verdict["intervals"]["loss_gap"]
    assert low == pytest.approx(0.01) and high == pytest.approx(0.01)
