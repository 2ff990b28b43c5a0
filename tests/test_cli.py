"""The command line's contract: --json is one JSON object on stdout and nothing else (on errors too), exit codes,
read-only verbs leave the ledger's bytes alone, text from documents is printed as written, and a table stays
readable at any terminal width (engine/report/terminal.py)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from conftest import MINI, PASSING_ORACLES, Cli, ledger_fingerprint, record_file, rung_record, write
from rich.console import Console

from engine.report.terminal import Column, column_widths, print_table


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


# --- tables at any width ----------------------------------------------------------------------------------------

# Rows shaped like `prereg audit list`'s: ids of up to 35 characters, where rich's own squeezing left columns of
# zero width at 80 columns (headers and values gone).
LIST_COLUMNS = [
    Column("id", key=True, min_width=20),
    Column("status", short=True),
    Column("versions", short=True),
    Column("outcome", min_width=12),
    Column("profile"),
    Column("frozen", short=True),
]
LIST_ROWS = [
    ["molmo2-perf-pass1-h200-interleaved", "decided", "1", "land-bundle", "h200-4b", "2026-11-30"],
    ["molmo2-fast-same-steps-h200", "decided", "1", "default-fast-path-same-steps", "h200-4b", "2026-11-30"],
    ["molmo2-ar-40k", "frozen", "12", "—", "h100x4-4b", "2026-11-30"],
]


def rendered(width: int, columns: list[Column], rows: list[list[str]]) -> str:
    console = Console(width=width, file=io.StringIO(), highlight=False, soft_wrap=False, color_system=None)
    print_table(console, "registrations", columns, rows)
    return console.file.getvalue()


def header_cells(text: str) -> list[str]:
    """A table's headers as printed, each column's header lines joined."""
    lines = [line.strip().strip("┃").split("┃") for line in text.splitlines() if line.startswith("┃")]
    return [" ".join(" ".join(parts).split()) for parts in zip(*lines)]


@pytest.mark.parametrize("width", [40, 60, 80, 90, 100, 120, 160])
def test_a_table_at_any_width_keeps_every_header_and_value(width: int) -> None:
    text = rendered(width, LIST_COLUMNS, LIST_ROWS)
    assert max(len(line) for line in text.splitlines()) <= width, text
    if "┃" in text:  # a table: every header whole, every short value on one line
        assert header_cells(text) == [c.header for c in LIST_COLUMNS], text
        assert all(value in text for row in LIST_ROWS for value in row[1:3] + row[5:])
    else:  # the list form: every value whole, under its header
        for row in LIST_ROWS:
            assert f"id: {row[0]}" in text
            assert all(f"  {c.header}: {v}" in text for c, v in zip(LIST_COLUMNS[1:], row[1:]))


def test_a_table_folds_other_columns_before_its_key_and_drops_to_a_list_only_when_it_must() -> None:
    natural = column_widths(LIST_COLUMNS, LIST_ROWS, 200)
    assert natural == [34, 7, 8, 28, 9, 10]
    folded = column_widths(LIST_COLUMNS, LIST_ROWS, 110)
    assert folded[0] == 34 and folded[3] < 28  # the outcome folds; the id, the row's name, stays whole
    narrower = column_widths(LIST_COLUMNS, LIST_ROWS, 90)
    assert 20 <= narrower[0] < 34  # the key folds last, never under its min_width
    assert column_widths(LIST_COLUMNS, LIST_ROWS, 80) is None  # below every column's minimum: a list
    assert "id: molmo2-perf-pass1-h200-interleaved\n  status: decided\n" in rendered(80, LIST_COLUMNS, LIST_ROWS)


def test_the_list_form_repeats_the_row_a_continuation_line_belongs_to() -> None:
    columns = [Column("item"), Column("switch"), Column("oracle", min_width=30), Column("bounds", min_width=30)]
    rows = [["P1", "suffix_cudnn", "P1a", "loss_abs ≤ 0.001"], ["", "", "P1b", "—"]]
    text = rendered(40, columns, rows)
    assert text.split("\n\n")[1].splitlines() == ["item: P1", "  oracle: P1b", "  bounds: —"]
