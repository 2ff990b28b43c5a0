"""Golden CLI output: what a person sees from `prereg check` of the S-bundle registration and from `prereg verdict`
on a fixed replay of its ladder; and at 80 columns, the narrowest terminal a person reads, `check`, `verdict`,
`audit list` and `audit show` on a copy of the lab's ledger. Hashes, heads and times are normalized;
`PREREG_UPDATE_GOLDEN=1` rewrites the files."""

from __future__ import annotations

import difflib
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import PERF_PASS1, REPO, Cli, freeze_as_the_lab_did, lab_ledger_copy

GOLDEN = Path(__file__).resolve().parent / "golden"
REPLAY = GOLDEN / "molmo2-perf-pass1.replay.toml"
UPDATE = os.environ.get("PREREG_UPDATE_GOLDEN") == "1"

HEX = re.compile(r"\b[0-9a-f]{12,64}\b")  # document hashes and ledger heads (shown whole or cut to 12/16)
TIME = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z?")


def normalized(text: str, tmp_path: Path) -> str:
    return TIME.sub("<time>", HEX.sub("<hash>", text.replace(str(tmp_path), "<tmp>")))


def assert_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"{path} is missing: run the tests with PREREG_UPDATE_GOLDEN=1 to write it"
    expected = path.read_text(encoding="utf-8")
    diff = "".join(
        difflib.unified_diff(expected.splitlines(keepends=True), text.splitlines(keepends=True), str(path), "now")
    )
    assert text == expected, (
        f"output differs from {path} (PREREG_UPDATE_GOLDEN=1 rewrites it if the change is intended):\n{diff}"
    )


def test_normalization_keeps_what_matters() -> None:
    text = "document 2dfd388079d6530b · entry 12 · head 90515bb8de4088e5 at 2026-08-08T14:31:02.123456Z, rung A 2.252"
    assert normalized(text, Path("/nowhere")) == "document <hash> · entry 12 · head <hash> at <time>, rung A 2.252"


def test_check_of_the_s_bundle_registration(cli: Cli, tmp_path: Path) -> None:
    # As the lab froze it (its items have since landed in the CUDA baseline): its effective configs are the
    # defaults it was frozen with.
    lab_ledger_copy(cli.ledger)
    result = cli.ok("check", PERF_PASS1)
    assert_golden("check-molmo2-perf-pass1.txt", normalized(result.stdout, tmp_path))


def test_verdict_on_a_fixed_replay_of_the_s_bundle_ladder(cli: Cli, tmp_path: Path) -> None:
    freeze_as_the_lab_did(cli.ledger, PERF_PASS1)
    cli.ok("record", "molmo2-perf-pass1", REPLAY)
    result = cli.ok("verdict", "molmo2-perf-pass1")
    assert_golden("verdict-molmo2-perf-pass1.txt", normalized(result.stdout, tmp_path))


# --- 80 columns ---------------------------------------------------------------------------------------------------

NARROW = 80


class NarrowCli(Cli):
    """The CLI in a terminal of 80 columns."""

    def __init__(self, ledger: Path, tmp: Path):
        super().__init__(ledger, tmp)
        self._env = {**self._env, "COLUMNS": str(NARROW)}


@pytest.fixture
def narrow(tmp_path: Path) -> NarrowCli:
    copy = tmp_path / "lab.db"
    shutil.copyfile(REPO / "ledger.db", copy)  # a copy: tests never open the lab's ledger itself
    return NarrowCli(copy, tmp_path)


def assert_narrow_golden(name: str, text: str) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > NARROW]
    assert not too_wide, f"lines wider than {NARROW} columns:\n" + "\n".join(too_wide)
    assert_golden(name, text)


@pytest.mark.parametrize(
    "name, args",
    [
        ("audit-list-80.txt", ["audit", "list"]),
        ("audit-show-80.txt", ["audit", "show", "molmo2-perf-pass1-h200"]),
        # an until-pass ladder of eight rungs whose rungs report the workload's displayed memory peaks
        ("verdict-80.txt", ["verdict", "molmo2-ar-f1-h200x2"]),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_the_labs_ledger_at_80_columns(narrow: NarrowCli, tmp_path: Path, name: str, args: list[str]) -> None:
    assert_narrow_golden(name, normalized(narrow.ok(*args).stdout, tmp_path))


def test_check_at_80_columns(tmp_path: Path) -> None:
    narrow = NarrowCli(tmp_path / "fresh.db", tmp_path)
    freeze_as_the_lab_did(narrow.ledger, PERF_PASS1)  # a new freeze refuses its items, now in the baseline
    result = narrow("check", PERF_PASS1, "--ledger", narrow.ledger)
    assert result.exit_code == 0, result.stderr
    assert_narrow_golden("check-80.txt", normalized(result.stdout, tmp_path))


def test_the_plan_a_dry_run_prints_at_80_columns(tmp_path: Path) -> None:
    narrow = NarrowCli(tmp_path / "fresh.db", tmp_path)
    narrow.ok("freeze", REPO / "registrations" / "molmo2-perf-pass1-tiny.toml")
    text = narrow.ok("run", "molmo2-perf-pass1-tiny", "--dry-run").stdout
    assert max(len(line) for line in text.splitlines()) <= NARROW, text
    assert "the plan that will run" in text and "P1, P2, P3a, P3b, P3c," in text, text
