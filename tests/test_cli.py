"""The command line's contract: --json is one JSON object on stdout and nothing else (on errors too), exit codes,
read-only verbs leave the ledger's bytes alone, and text from documents is printed as written."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MINI, PASSING_ORACLES, Cli, ledger_fingerprint, record_file, rung_record, write


@pytest.fixture
def history(cli: Cli, frozen_mini: Path, tmp_path: Path) -> Path:
    """A ledger with a freeze, a record and a verdict; returns the directory of its files."""
    cli.ok("record", "mini", record_file(tmp_path, "r.toml", PASSING_ORACLES, rung_record("A", [], s_per_step=2.0)))
    cli.ok("verdict", "mini")
    cli.ok("audit", "export", "--out", tmp_path / "export.jsonl")
    write(tmp_path, "bad.toml", "id = \n")
    write(tmp_path, "amend.toml", 'reason = "add a read"\n[add.reads]\nbaseline = "A.s_per_step"\n')
    record_file(tmp_path, "record.toml", rung_record("B", ["P1"], s_per_step=1.9))
    return tmp_path


# (verb words with {dir} for the test's files, exit code). Each runs with --json against the test's ledger.
JSON_CALLS = [
    (["check", "{dir}/mini.toml"], 0),
    (["freeze", "{dir}/mini.toml"], 0),
    (["amend", "mini", "{dir}/amend.toml"], 0),
    (["record", "mini", "{dir}/record.toml"], 0),
    (["verdict", "mini"], 0),
    (["audit", "list"], 0),
    (["audit", "show", "mini"], 0),
    (["audit", "verify"], 0),
    (["audit", "costs"], 0),
    (["audit", "calibration"], 0),
    (["check", "{dir}/bad.toml"], 2),
    (["freeze", "{dir}/bad.toml"], 2),
    (["amend", "mini", "{dir}/bad.toml"], 2),
    (["record", "mini", "{dir}/missing.toml"], 2),
    (["record", "mini", "{dir}/amend.toml"], 2),
    (["verdict", "not-frozen"], 3),
    (["audit", "show", "not-frozen"], 3),
    (["audit", "import", "{dir}/export.jsonl"], 2),  # into a ledger that has entries
    (["verdict"], 2),  # a usage error: the missing argument
    (["audit", "verify", "--head", "not-a-head"], 2),
    (["audit", "frobnicate"], 2),
]


@pytest.mark.parametrize(("words", "code"), JSON_CALLS, ids=[" ".join(w) for w, _ in JSON_CALLS])
def test_json_output_is_one_object_and_nothing_else(cli: Cli, history: Path, words: list[str], code: int) -> None:
    result = cli.on_ledger(*[w.format(dir=history) for w in words], "--json")
    assert result.exit_code == code, result.stdout + result.stderr
    payload = result.json()  # the whole of stdout, parsed as one object
    assert result.stdout.count("\n") == 1
    if code:
        assert payload["exit_code"] == code and payload["error"]
        # prereg/ledger's own errors (import into a ledger with entries, a malformed --head) carry no fix yet.
        assert payload["fix"] or words[:2] in (["audit", "import"], ["audit", "verify"])
    else:
        assert "error" not in payload


def test_import_json_is_one_object(cli: Cli, history: Path) -> None:
    result = cli("audit", "import", history / "export.jsonl", "--ledger", history / "copy.db", "--json")
    assert result.exit_code == 0
    assert set(result.json()) == {"entries", "head"}


def test_verify_json_on_a_missing_ledger_is_one_object(cli: Cli, tmp_path: Path) -> None:
    result = cli("audit", "verify", "--ledger", tmp_path / "none.db", "--json")
    assert result.exit_code == 2
    assert result.json()["where"] == str(tmp_path / "none.db")


READ_ONLY = [
    ["verdict", "mini"],
    ["audit", "list"],
    ["audit", "show", "mini"],
    ["audit", "verify"],
    ["audit", "costs"],
    ["audit", "calibration"],
]
READ_ONLY_CALLS = [words + flag for words in READ_ONLY for flag in ([], ["--json"])] + [["audit", "export"]]


@pytest.mark.parametrize("words", READ_ONLY_CALLS, ids=[" ".join(w) for w in READ_ONLY_CALLS])
def test_read_only_verbs_leave_the_ledger_bytes_alone(cli: Cli, history: Path, words: list[str]) -> None:
    # `verdict` is read-only here because the history's verdict is already recorded (idempotence).
    before = ledger_fingerprint(cli.ledger)
    assert before["wal"] is None  # the previous verb closed the ledger: its write-ahead log was folded in
    cli.ok(*words)
    assert ledger_fingerprint(cli.ledger) == before


def test_check_writes_no_ledger(cli: Cli, mini: Path, tmp_path: Path) -> None:
    assert cli("check", mini).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mini.toml"]


def test_the_ledger_comes_from_prereg_ledger_when_not_given(cli: Cli, tmp_path: Path) -> None:
    result = cli("audit", "list")
    assert result.exit_code == 2
    assert str(tmp_path / "unintended-default-ledger.db") in result.stderr


def test_document_text_is_printed_as_written_not_as_markup(cli: Cli, tmp_path: Path) -> None:
    # Rich would read "[rungs.A]" as a style and "[/]" as a closing tag (a crash with nothing open).
    tricky = MINI.replace(
        'title = "mini: two items, three rungs"', 'title = "mini [rungs.A] [/] [bold]not bold"'
    ).replace('claim = "P1 alone buys 4%"', 'claim = "P1 alone [/] buys [red]4%"')
    document = write(tmp_path, "tricky.toml", tricky)
    checked = cli("check", document)
    assert checked.exit_code == 0, checked.stderr
    assert "mini [rungs.A] [/] [bold]not bold" in checked.stdout
    cli.ok("freeze", document)
    cli.ok(
        "record",
        "mini",
        record_file(tmp_path, "r.toml", rung_record("A", [], s_per_step=2.0), provenance="box [rungs.A] [/]"),
    )
    verdict = cli.ok("verdict", "mini").stdout
    assert "P1 alone [/] buys [red]4%" in verdict
    assert "s/step (median [min–max])" in verdict
    shown = cli.ok("audit", "show", "mini").stdout
    assert "mini [rungs.A] [/] [bold]not bold" in shown and "box [rungs.A] [/]" in shown


def test_error_text_is_printed_as_written(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    bad = record_file(tmp_path, "r.toml", '[rungs.A]\nitems = []\nstatus = "finished"\nmetric = { s_per_step = 1.0 }\n')
    result = cli.on_ledger("record", "mini", bad)
    assert "fix: correct the record file (provenance, [oracles.ID], [rungs.ID]); nothing was written" in result.stderr


def test_errors_are_not_wrapped_mid_path(cli: Cli, tmp_path: Path) -> None:
    deep = tmp_path / ("a-directory-name-long-enough-to-wrap-" * 3)
    deep.mkdir()
    bad = write(deep, "bad.toml", MINI.replace("loss_abs = 1e-3", "loss_abs = nan"))
    message = cli("check", bad).stderr
    assert (
        f"{bad}:" in message
        and "items.P1.oracles.P1a.bounds: bound loss_abs = nan must be a finite number >= 0" in message
    )


def test_json_errors_say_where_and_what_to_do(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    bad = record_file(tmp_path, "r.toml", rung_record("Z", [], s_per_step=1.0))
    payload = cli.on_ledger("record", "mini", bad, "--json").json()
    assert payload == {
        "error": "rungs.Z: not a rung of mini; rungs are ['A', 'B', 'C']",
        "where": str(bad),
        "fix": "record only planned rungs (amend to add a rung first)",
        "exit_code": 2,
    }
