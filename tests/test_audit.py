"""`prereg audit`: list, show, costs, calibration (its Brier score computed here by hand), verify, and the
export -> import round trip."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from conftest import MINI, PASSING_ORACLES, Cli, ledger_fingerprint, record_file, rung_record, write

P1_FAILS = "[oracles.P1a]\nloss_abs = 8.7e-3\ngrad_norm_rel = 4e-3\n"


def test_list_shows_each_registration_with_its_status(cli: Cli, tmp_path: Path) -> None:
    for name in ("frozen", "measured", "decided"):
        cli.ok("freeze", write(tmp_path, f"{name}.toml", MINI.replace('id = "mini"', f'id = "mini-{name}"')))
    cli.ok("record", "mini-measured", record_file(tmp_path, "m.toml", PASSING_ORACLES))
    cli.ok("amend", "mini-measured", write(tmp_path, "a.toml", 'reason = "title"\n[set]\ntitle = "renamed"\n'))
    cli.ok(
        "record",
        "mini-decided",
        record_file(
            tmp_path,
            "d.toml",
            PASSING_ORACLES,
            rung_record("A", [], s_per_step=2.0),
            rung_record("B", ["P1"], s_per_step=1.9),
            rung_record("C", ["P1", "P2"], s_per_step=1.8),
        ),
    )
    cli.ok("verdict", "mini-decided")

    rows = {row["id"]: row for row in cli.ok_json("audit", "list")["registrations"]}
    assert [rows[i]["status"] for i in ("mini-decided", "mini-frozen", "mini-measured")] == [
        "decided",
        "frozen",
        "measured",
    ]
    assert rows["mini-measured"]["versions"] == 2 and rows["mini-measured"]["title"] == "renamed"
    assert rows["mini-decided"]["outcome"] == "land-both" and rows["mini-frozen"]["outcome"] is None
    assert all(row["profile"] == "cpu-tiny" and not row["post_hoc"] for row in rows.values())
    text = cli.ok("audit", "list").stdout
    assert re.search(r"mini-decided\s+│ decided\s+│ 1\s+│ land-both", text), text


def test_show_tells_one_registrations_whole_history(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    cli.ok(
        "record",
        "mini",
        record_file(
            tmp_path, "r.toml", P1_FAILS, rung_record("A", [], s_per_step=2.0), provenance="4xH100 box, 02:26Z"
        ),
    )
    cli.ok("verdict", "mini")
    shown = cli.ok_json("audit", "show", "mini")
    assert shown["id"] == "mini" and shown["status"] == "decided" and shown["workload"] == "molmo2"
    [oracle] = shown["oracles"]
    assert (oracle["oracle"], oracle["passed"], oracle["external"], oracle["version"]) == ("P1a", False, True, 0)
    assert shown["dropped"]["P1"]["oracle"] == "P1a"
    [run] = shown["runs"]
    assert (run["rung"], run["status"], run["external"], run["provenance"]) == (
        "A",
        "finished",
        True,
        "4xH100 box, 02:26Z",
    )
    assert shown["entries"] == {"freeze": 1, "oracle": 1, "record": 1, "verdict": 1, "window": 0}
    assert shown["verdict"]["outcome"] is None and [e["result"] for e in shown["verdict"]["expectations"]] == [
        "miss",
        "undefined",
        "undefined",
    ]
    text = cli.ok("audit", "show", "mini").stdout
    assert "loss_abs = 0.0087 > bound 0.001" in text and "4xH100 box, 02:26Z" in text


def test_costs_count_every_recorded_rung_and_show_the_overrun(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    # MINI's ceiling is 0.5 device-hours = 1800 s; the two rungs report 1000 + 1200 s.
    rungs = "".join(
        f'[rungs.{rung}]\nitems = {items}\nstatus = "finished"\nmetrics = {{ s_per_step = 2.0, gpu_s = {gpu_s} }}\n'
        for rung, items, gpu_s in (("A", "[]", 1000.0), ("B", '["P1"]', 1200.0))
    )
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", rungs))
    [row] = cli.ok_json("audit", "costs")["registrations"]
    assert row["id"] == "mini" and row["ceiling_gpu_s"] == 1800.0
    assert (
        row["gpu_s"] == 2200.0 and row["split"]["external"] == 2200.0 and row["per_rung"] == {"A": 1000.0, "B": 1200.0}
    )
    assert row["overrun"] is True
    assert "OVERRUN" in cli.ok("audit", "costs").stdout


def test_calibration_maps_confidence_levels_and_scores_brier(cli: Cli, tmp_path: Path) -> None:
    # mini: expectations 1 high, 2 medium, 3 low. mini-2: the same checks at medium-high, medium-low, medium.
    cli.ok("freeze", write(tmp_path, "mini.toml", MINI))
    cli.ok(
        "freeze",
        write(
            tmp_path,
            "mini-2.toml",
            MINI.replace('id = "mini"', 'id = "mini-2"')
            .replace('confidence = "high"', 'confidence = "medium-high"')
            .replace('confidence = "medium"', 'confidence = "medium-low"')
            .replace('confidence = "low"', 'confidence = "medium"'),
        ),
    )
    cli.ok("freeze", write(tmp_path, "never-decided.toml", MINI.replace('id = "mini"', 'id = "never-decided"')))
    a, b, c = (
        rung_record("A", [], s_per_step=2.0),
        rung_record("B", ["P1"], s_per_step=1.9),
        rung_record("C", ["P1", "P2"], s_per_step=1.8),
    )
    cli.ok("record", "mini", record_file(tmp_path, "m1.toml", PASSING_ORACLES, a, b))
    cli.ok("verdict", "mini")  # superseded below: only each registration's latest verdict counts
    cli.ok("record", "mini", record_file(tmp_path, "m2.toml", c))
    cli.ok("verdict", "mini")  # 1 hit (all oracles pass), 2 hit (secondary 0.05), 3 hit (primary 0.1)
    cli.ok(
        "record",
        "mini-2",
        record_file(
            tmp_path,
            "n.toml",
            P1_FAILS,
            "[oracles.P2a]\nmissing = []\nviolations = []\n",
            a,
            rung_record("C", ["P2"], s_per_step=1.9),
        ),
    )
    cli.ok("verdict", "mini-2")  # 1 miss (P1a failed), 2 undefined (B not run), 3 hit (primary 0.05)

    calibration = cli.ok_json("audit", "calibration")
    levels = {row["confidence"]: row for row in calibration["levels"]}
    assert {name: row["p"] for name, row in levels.items()} == {
        "low": 0.2,
        "medium-low": 0.35,
        "medium": 0.5,
        "medium-high": 0.65,
        "high": 0.8,
    }
    assert {name: (row["n"], row["hits"], row["undefined"]) for name, row in levels.items()} == {
        "low": (1, 1, 0),
        "medium-low": (0, 0, 1),
        "medium": (2, 2, 0),
        "medium-high": (1, 0, 0),
        "high": (1, 1, 0),
    }
    scored = [(0.8, 1), (0.5, 1), (0.2, 1), (0.65, 0), (0.5, 1)]  # (stated probability, hit)
    brier = sum((p - hit) ** 2 for p, hit in scored) / len(scored)
    assert abs(brier - 0.3205) < 1e-12
    assert calibration["scored"] == 5 and abs(calibration["brier"] - brier) < 1e-12
    assert levels["medium"]["hit_rate"] == 1.0 and levels["medium-low"]["hit_rate"] is None
    assert "Brier score 0.3205 over 5 scored expectations" in cli.ok("audit", "calibration").stdout


def test_calibration_of_a_ledger_without_verdicts_has_no_score(cli: Cli, frozen_mini: Path) -> None:
    calibration = cli.ok_json("audit", "calibration")
    assert calibration["scored"] == 0 and calibration["brier"] is None


def build_history(cli: Cli, tmp_path: Path) -> None:
    cli.ok("freeze", write(tmp_path, "mini.toml", MINI))
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", P1_FAILS, rung_record("A", [], s_per_step=2.0)))
    cli.ok(
        "amend",
        "mini",
        write(tmp_path, "a.toml", 'reason = "late bound"\n[set.items.P1.oracles.P1a.bounds]\nloss_abs = 1e-2\n'),
        "--post-hoc",
    )
    cli.ok("verdict", "mini")


def test_export_then_import_is_the_same_ledger(cli: Cli, tmp_path: Path) -> None:
    build_history(cli, tmp_path)
    exported = tmp_path / "ledger.jsonl"
    cli.ok("audit", "export", "--out", exported)
    assert cli.ok("audit", "export").stdout == exported.read_text(encoding="utf-8")
    original = cli.ok_json("audit", "verify")

    copy = tmp_path / "copy.db"
    imported = cli("audit", "import", exported, "--ledger", copy, "--json")
    assert imported.exit_code == 0, imported.stderr
    assert imported.json() == {"entries": original["entries"], "head": original["head"]}
    copied = cli("audit", "verify", "--ledger", copy, "--json").json()
    assert (copied["ok"], copied["entries"], copied["head"]) == (True, original["entries"], original["head"])
    assert cli("audit", "show", "mini", "--ledger", copy, "--json").json() == cli.ok_json("audit", "show", "mini")
    assert cli("audit", "export", "--ledger", copy).stdout == exported.read_text(encoding="utf-8")


def test_import_into_a_ledger_with_entries_is_refused_and_writes_nothing(cli: Cli, tmp_path: Path) -> None:
    build_history(cli, tmp_path)
    exported = tmp_path / "ledger.jsonl"
    cli.ok("audit", "export", "--out", exported)
    before = ledger_fingerprint(cli.ledger)
    refused = cli.on_ledger("audit", "import", exported)
    assert refused.exit_code == 2 and "import only into a new, empty ledger" in refused.stderr
    assert ledger_fingerprint(cli.ledger) == before


def test_verify_names_the_first_edited_entry(cli: Cli, tmp_path: Path) -> None:
    build_history(cli, tmp_path)
    good = cli.ok_json("audit", "verify")
    assert set(good) >= {"ok", "entries", "head", "first_bad"}
    assert (good["ok"], good["entries"], good["first_bad"]) == (True, 5, None)

    # Edit an entry's bytes behind the ledger's back (the triggers stop accidents, not intent).
    with sqlite3.connect(cli.ledger) as db:
        db.execute("DROP TRIGGER entries_refuse_update")
        db.execute("UPDATE entries SET body = replace(body, '0.0087', '0.0001') WHERE seq = 2")
    db.close()
    failed = cli.on_ledger("audit", "verify", "--json")
    assert failed.exit_code == 4
    report = failed.json()
    assert (report["ok"], report["first_bad"]) == (False, 2)
    human = cli.on_ledger("audit", "verify")
    assert human.exit_code == 4 and "ledger failed verification at entry 2" in human.stderr
