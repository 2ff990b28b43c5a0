"""The README's worked example runs as written: every `$ prereg …` line of it, in order, against a copy of the
lab's ledger, exits 0 and prints what the README shows (the parts that do not depend on timing)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.xdist_group("engine")


def example_commands() -> list[list[str]]:
    section = README.split("## A worked example", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line[2:]) for line in section.splitlines() if line.startswith("$ prereg ")]


def test_the_readme_shows_both_commands():
    assert "make demo" in README and "make test" in README


def test_the_worked_example_runs_as_written(tmp_path):
    commands = example_commands()
    assert [c[1] for c in commands] == ["freeze", "run", "verdict", "audit"]
    demo = tmp_path / "reports" / "demo"
    demo.mkdir(parents=True)
    shutil.copyfile(ROOT / "ledger.db", demo / "ledger.db")
    shutil.copytree(ROOT / "registrations", tmp_path / "registrations")
    outputs = []
    for command in commands:
        result = subprocess.run(
            [sys.executable, str(ROOT / "cli.py"), *command[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "110"},
            timeout=600,
        )
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        outputs.append(result.stdout)
    text = "\n".join(outputs)
    for shown in [
        "molmo2-perf-pass1-tiny already frozen (no-op)",
        "oracle gate: 9 oracle(s) — every one runs before any rung",
        "oracle P1a (P1): FAIL → dropped · probe could not run: cuDNN attention is a CUDA backend",
        "oracle P4a (P4): pass · 23/23 bitwise equal",
        "every item it tests was dropped (P1)",
        "ladder complete",
        "verdict recorded",
    ]:
        assert shown in text, shown
    assert re.search(r"outcome: land-(hygiene|bundle) \(rule R[23]\)", text)


def test_the_calibration_table_is_the_ledgers(tmp_path):
    """The README's calibration table and Brier score are what `prereg audit calibration` computes from the
    committed ledger: a new verdict that changes them must change the README too."""
    section = README.split("**Calibration of this lab's expectations**", 1)[1].split("**Governance cost", 1)[0]
    rows = re.findall(r"^\| ([a-z-]+) \| ([0-9.]+) \| ([0-9]+) \| ([0-9]+) \| ([0-9]+) \|$", section, re.M)
    copy = tmp_path / "ledger.db"
    shutil.copyfile(ROOT / "ledger.db", copy)  # a copy: tests never open the lab's ledger itself
    result = subprocess.run([sys.executable, str(ROOT / "cli.py"), "audit", "calibration", "--json", "--ledger", str(copy)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    computed = json.loads(result.stdout)
    assert rows == [
        (lv["confidence"], str(lv["p"]), str(lv["n"]), str(lv["hits"]), str(lv["undefined"]))
        for lv in computed["levels"]
    ]
    assert f"Brier score {computed['brier']:.3f} over {computed['scored']} scored expectations" in section
