"""Freeze and amend: what may change after freeze, when, and how a change after the data is marked forever."""

from __future__ import annotations

from pathlib import Path

from conftest import MINI, PASSING_ORACLES, Cli, ledger_fingerprint, record_file, rung_record, write

REFUSED = 3


def amendment(tmp_path: Path, name: str, body: str, reason: str = "test amendment") -> Path:
    return write(tmp_path, name, f'reason = "{reason}"\n{body}')


# --- freeze --------------------------------------------------------------------------------------------------


def test_freezing_twice_is_a_noop(cli: Cli, mini: Path) -> None:
    first = cli.ok_json("freeze", mini)
    before = ledger_fingerprint(cli.ledger)
    second = cli.ok_json("freeze", mini)
    assert first["already_frozen"] is False and second["already_frozen"] is True
    assert (second["seq"], second["head"], second["doc_hash"]) == (first["seq"], first["head"], first["doc_hash"])
    assert ledger_fingerprint(cli.ledger) == before
    assert "already frozen (no-op)" in cli.ok("freeze", mini).stdout


def test_a_formatting_only_change_is_the_same_document(cli: Cli, mini: Path, tmp_path: Path) -> None:
    first = cli.ok_json("freeze", mini)
    # Comments, blank lines, spacing, key order inside a table and another spelling of the same float.
    reformatted = MINI.replace(
        'title = "mini: two items, three rungs"\nquestion = "does P1 (and P2) make a step faster?"',
        '# reformatted by hand\nquestion   =   "does P1 (and P2) make a step faster?"\n\n\n'
        'title = "mini: two items, three rungs"',
    ).replace(
        "bounds = { loss_abs = 1e-3, grad_norm_rel = 1e-2 }",
        "bounds = {grad_norm_rel=0.01,loss_abs=0.001}  # the frozen bounds",
    )
    assert reformatted != MINI
    other = write(tmp_path, "mini-reformatted.toml", reformatted)
    before = ledger_fingerprint(cli.ledger)
    second = cli.ok_json("freeze", other)
    assert second["already_frozen"] is True
    assert second["doc_hash"] == first["doc_hash"]
    assert ledger_fingerprint(cli.ledger) == before


def test_a_changed_document_under_a_frozen_id_is_refused_with_the_way_forward(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    changed = write(tmp_path, "mini-changed.toml", MINI.replace("loss_abs = 1e-3", "loss_abs = 2e-3"))
    before = ledger_fingerprint(cli.ledger)
    result = cli.on_ledger("freeze", changed)
    assert result.exit_code == REFUSED
    assert str(changed) in result.stderr and "already frozen" in result.stderr
    assert "prereg amend mini FILE" in result.stderr
    as_json = cli.on_ledger("freeze", changed, "--json")
    assert as_json.exit_code == REFUSED
    assert "prereg amend mini" in as_json.json()["fix"]
    assert ledger_fingerprint(cli.ledger) == before


# --- amendments before the data -----------------------------------------------------------------------------


def test_rungs_reads_and_rules_may_be_added_before_the_data(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    rung = cli.ok_json(
        "amend",
        "mini",
        amendment(tmp_path, "1.toml", '[[add.protocol.rungs]]\nid = "D"\nitems = ["P2"]\n', "rung D: P2 alone"),
    )
    read = cli.ok_json(
        "amend",
        "mini",
        amendment(
            tmp_path,
            "2.toml",
            '[add.reads]\np2_alone = "(A.s_per_step - D.s_per_step) / A.s_per_step"\n',
            "read P2 alone",
        ),
    )
    rule = cli.ok_json(
        "amend",
        "mini",
        amendment(
            tmp_path,
            "3.toml",
            '[[add.rules]]\nid = "R-p2"\nwhen = "p2_alone >= 0.02"\noutcome = "land-p2"\nland = ["P2"]\n',
            "rule for P2",
        ),
    )
    assert [rung["version"], read["version"], rule["version"]] == [1, 2, 3]
    assert (
        rung["changed"] == ["protocol.rungs.D"]
        and read["changed"] == ["reads.p2_alone"]
        and rule["changed"] == ["rules.R-p2"]
    )
    assert rung["post_hoc"] == read["post_hoc"] == rule["post_hoc"] == []

    shown = cli.ok_json("audit", "show", "mini")
    assert [(v["version"], v["reason"], v["post_hoc"]) for v in shown["versions"]] == [
        (0, None, []),
        (1, "rung D: P2 alone", []),
        (2, "read P2 alone", []),
        (3, "rule for P2", []),
    ]
    assert len({v["doc_hash"] for v in shown["versions"]}) == 4
    text = cli.ok("audit", "show", "mini").stdout
    for reason in ("rung D: P2 alone", "read P2 alone", "rule for P2"):
        assert reason in text
    assert "POST-HOC" not in text

    cli.ok(
        "record",
        "mini",
        record_file(
            tmp_path,
            "r.toml",
            PASSING_ORACLES,
            rung_record("A", [], s_per_step=2.0),
            rung_record("D", ["P2"], s_per_step=1.9),
        ),
    )
    verdict = cli.ok_json("verdict", "mini")
    assert verdict["version"] == 3
    assert abs(verdict["reads"]["p2_alone"] - 0.05) < 1e-12
    assert [r["rung"] for r in verdict["rungs"]] == ["A", "B", "C", "D"]


# --- frozen bounds ------------------------------------------------------------------------------------------

WIDEN_P1A = "[set.items.P1.oracles.P1a.bounds]\nloss_abs = 1e-2\n"
BOUND_PATH = "items.P1.oracles.P1a.bounds.loss_abs"


def test_a_bound_may_move_before_its_oracle_has_a_result(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", "[oracles.P2a]\nmissing = []\nviolations = []\n"))
    moved = cli.ok_json("amend", "mini", amendment(tmp_path, "a.toml", WIDEN_P1A))
    assert moved["changed"] == [BOUND_PATH] and moved["post_hoc"] == []


def test_a_bound_change_after_the_oracle_has_a_result_is_post_hoc(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", PASSING_ORACLES))
    widen = amendment(tmp_path, "widen.toml", WIDEN_P1A, "widen P1a after seeing it")
    before = ledger_fingerprint(cli.ledger)
    refused = cli.on_ledger("amend", "mini", widen)
    assert refused.exit_code == REFUSED
    assert BOUND_PATH in refused.stderr and "--post-hoc" in refused.stderr
    assert ledger_fingerprint(cli.ledger) == before

    accepted = cli.ok_json("amend", "mini", widen, "--post-hoc")
    assert accepted["post_hoc"] == [BOUND_PATH]
    flag = f"amendment 1: {BOUND_PATH}"
    assert cli.ok_json("verdict", "mini")["post_hoc"] == [flag]
    assert f"POST-HOC: {flag}" in cli.ok("verdict", "mini").stdout
    [row] = cli.ok_json("audit", "list")["registrations"]
    assert row["post_hoc"] is True
    assert "POST-HOC" in cli.ok("audit", "list").stdout
    shown = cli.ok_json("audit", "show", "mini")
    assert shown["versions"][1]["post_hoc"] == [BOUND_PATH] and shown["post_hoc"] == [flag]
    assert f"POST-HOC: {flag}" in cli.ok("audit", "show", "mini").stdout
    cli.ok("report", "mini", "--out", tmp_path / "report")
    assert f"**POST-HOC**: {flag}" in (tmp_path / "report" / "report.md").read_text()
    assert "POST-HOC" in (tmp_path / "report" / "report.html").read_text()
    assert "POST-HOC" in cli.ok("audit", "costs").stdout
    assert "POST-HOC" in cli.ok("audit", "calibration").stdout


def test_a_post_hoc_bound_does_not_rejudge_the_result_it_saw(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    # "An item that fails its oracle is dropped, never re-toleranced": widening the bound afterwards keeps the drop.
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", "[oracles.P1a]\nloss_abs = 5e-3\ngrad_norm_rel = 1e-3\n"))
    cli.ok("amend", "mini", amendment(tmp_path, "widen.toml", WIDEN_P1A), "--post-hoc")
    dropped = cli.ok_json("verdict", "mini")["dropped"]
    assert dropped["P1"]["oracle"] == "P1a" and dropped["P1"]["bound"]["loss_abs"] == 1e-3


# --- rules after the data -----------------------------------------------------------------------------------

LOWER_THE_BAR = '[set.rules.R-land]\nwhen = "primary >= 0.01 and vram_clean"\n'


def test_a_rule_may_change_before_any_data(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    changed = cli.ok_json("amend", "mini", amendment(tmp_path, "a.toml", LOWER_THE_BAR))
    assert changed["changed"] == ["rules.R-land.when"] and changed["post_hoc"] == []


def test_a_rule_change_after_rung_data_is_post_hoc_and_then_decides(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    cli.ok(
        "record",
        "mini",
        record_file(
            tmp_path,
            "r.toml",
            PASSING_ORACLES,
            rung_record("A", [], s_per_step=2.0),
            rung_record("B", ["P1"], s_per_step=1.99),
            rung_record("C", ["P1", "P2"], s_per_step=1.96),
        ),
    )
    assert cli.ok_json("verdict", "mini")["rule"] == "R-hygiene"  # primary = 0.02 < 0.05
    lower = amendment(tmp_path, "lower.toml", LOWER_THE_BAR, "lower the bar after the read")
    before = ledger_fingerprint(cli.ledger)
    assert cli.on_ledger("amend", "mini", lower).exit_code == REFUSED
    assert ledger_fingerprint(cli.ledger) == before

    cli.ok("amend", "mini", lower, "--post-hoc")
    verdict = cli.ok_json("verdict", "mini")
    assert verdict["rule"] == "R-land" and verdict["outcome"] == "land-both"
    assert verdict["post_hoc"] == ["amendment 1: rules.R-land.when"]
    assert verdict["rules"][0]["when"] == "primary >= 0.01 and vram_clean"


def test_rules_and_expectations_after_oracle_results_are_post_hoc(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    # A failed oracle is a verdict input: it drops the item, and expectation 1 reads it.
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", "[oracles.P1a]\nloss_abs = 5e-3\ngrad_norm_rel = 1e-3\n"))
    soften = amendment(
        tmp_path, "soften.toml", '[set.expectations.1]\ncheck = "passed(\\"P2a\\") or not passed(\\"P2a\\")"\n'
    )
    assert cli.on_ledger("amend", "mini", soften).exit_code == REFUSED
    add_rule = amendment(
        tmp_path, "rule.toml", '[[add.rules]]\nid = "R-new"\nwhen = "dropped(\\"P1\\")"\noutcome = "give-up"\n'
    )
    assert cli.on_ledger("amend", "mini", add_rule).exit_code == REFUSED
    assert cli.ok_json("amend", "mini", add_rule, "--post-hoc")["post_hoc"] == ["rules.R-new"]


def test_adding_a_read_after_data_is_free_but_redefining_one_is_post_hoc(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", rung_record("A", [], s_per_step=2.0)))
    added = cli.ok_json("amend", "mini", amendment(tmp_path, "add.toml", '[add.reads]\nbaseline = "A.s_per_step"\n'))
    assert added["post_hoc"] == []
    redefine = amendment(
        tmp_path, "redefine.toml", '[set.reads]\nsecondary = "(A.s_per_step - B.s_per_step) / B.s_per_step"\n'
    )
    assert cli.on_ledger("amend", "mini", redefine).exit_code == REFUSED
    assert cli.ok_json("amend", "mini", redefine, "--post-hoc")["post_hoc"] == ["reads.secondary"]


# --- until-pass ladders: a pass rule is honoured only for rungs measured after it ---------------------------

LADDER = """
id = "memory-ladder"
title = "until-pass memory ladder over backward chunks"
question = "which chunking first fits the step in memory?"
workload = "molmo2"
profile = "cpu-tiny"

[cost]
ceiling_gpu_h = 1.0

[protocol]
kind = "until_pass"
steps = 40
log_every = 10
pass_rule = "rc == 0 and vram_peak_gib <= 71"
config = { batch = 12, backward_chunks = 2 }

  [[protocol.rungs]]
  id = "rung1"
  [[protocol.rungs]]
  id = "rung2"
  config = { backward_chunks = 4 }
  [[protocol.rungs]]
  id = "rung3"
  config = { backward_chunks = 6 }

[reads]
wall_h = "40000 * PASS.s_per_step / 3600"

[[rules]]
id = "F2"
when = "wall_h <= 30"
outcome = "launch"
"""


def ladder_rung(rung: str, *, vram: float, s_per_step: float) -> str:
    return (
        f'[rungs.{rung}]\nitems = []\nstatus = "finished"\n'
        f"metrics = {{ rc = 0, vram_peak_gib = {vram}, s_per_step = {s_per_step} }}\n"
    )


def test_a_pass_rule_change_is_honoured_only_for_rungs_measured_after_it(cli: Cli, tmp_path: Path) -> None:
    cli.ok("freeze", write(tmp_path, "ladder.toml", LADDER))
    cli.ok("record", "memory-ladder", record_file(tmp_path, "r1.toml", ladder_rung("rung1", vram=75.0, s_per_step=2.5)))
    moved = cli.ok_json(
        "amend",
        "memory-ladder",
        amendment(
            tmp_path,
            "a.toml",
            '[set.protocol]\npass_rule = "rc == 0 and vram_peak_gib <= 80"\n',
            "the true allocated-memory bar",
        ),
    )
    assert moved["post_hoc"] == []  # admissible: it judges only what is measured after it
    cli.ok("record", "memory-ladder", record_file(tmp_path, "r2.toml", ladder_rung("rung2", vram=76.0, s_per_step=2.6)))

    verdict = cli.ok_json("verdict", "memory-ladder")
    ladder = verdict["until_pass"]
    # rung1 (75 GiB) would pass the new bar; it was measured under the old one, which rejects it.
    assert ladder["passed"] == "rung2"
    [rejected] = ladder["rejected"]
    assert rejected["rung"] == "rung1" and rejected["version"] == 0
    assert rejected["pass_rule"] == "rc == 0 and vram_peak_gib <= 71"
    assert "false" in rejected["reason"] and "75" in rejected["reason"]
    assert abs(verdict["reads"]["wall_h"] - 40000 * 2.6 / 3600) < 1e-9
    assert verdict["rule"] == "F2" and verdict["outcome"] == "launch"
    assert "rung rung1 rejected" in cli.ok("verdict", "memory-ladder").stdout


def test_an_until_pass_ladder_with_no_passing_rung_leaves_pass_undefined(cli: Cli, tmp_path: Path) -> None:
    cli.ok("freeze", write(tmp_path, "ladder.toml", LADDER))
    cli.ok("record", "memory-ladder", record_file(tmp_path, "r.toml", ladder_rung("rung1", vram=75.0, s_per_step=2.5)))
    verdict = cli.ok_json("verdict", "memory-ladder")
    assert verdict["until_pass"]["passed"] is None
    assert "rung2 has not been judged" in verdict["until_pass"]["reason"]
    assert verdict["reads"]["wall_h"] is None and "no rung passed" in verdict["undefined"]["wall_h"]
    assert verdict["rule"] is None


# --- parity results stand ---------------------------------------------------------------------------------


def test_a_failed_oracle_cannot_be_observed_again_into_a_pass(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok(
        "record", "mini", record_file(tmp_path, "first.toml", "[oracles.P1a]\nloss_abs = 5e-3\ngrad_norm_rel = 1e-3\n")
    )
    again = record_file(
        tmp_path,
        "again.toml",
        "[oracles.P1a]\nloss_abs = 5e-4\ngrad_norm_rel = 1e-3\n",
        rung_record("A", [], s_per_step=2.0),
    )
    before = ledger_fingerprint(cli.ledger)
    refused = cli.on_ledger("record", "mini", again)
    assert refused.exit_code == REFUSED
    assert (
        str(again) in refused.stderr
        and "oracles ['P1a'] already have results" in refused.stderr
        and "fix:" in refused.stderr
    )
    assert ledger_fingerprint(cli.ledger) == before
    assert set(cli.ok_json("verdict", "mini")["dropped"]) == {"P1"}


def test_a_dry_run_plans_and_writes_nothing(cli: Cli, frozen_mini: Path) -> None:
    before = ledger_fingerprint(cli.ledger)
    result = cli.ok("run", "mini", "--dry-run", "--file", frozen_mini)
    assert "the plan that will run" in result.stdout
    assert ledger_fingerprint(cli.ledger) == before
