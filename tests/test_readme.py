"""The README and docs/ say what the code and the ledger say.

- The README's worked example runs as written: every `$ prereg …` line of it, in order, against a copy of the lab's
  ledger, exits 0 and prints what the README shows (the parts that do not depend on timing).
- The README's command reference names every verb of the CLI.
- docs/results.md's calibration table and its table of the ladders are what the committed ledger computes.
- Every relative link of the README and docs/*.md points to a file that exists (and to a heading that exists).
- The README and docs/*.md speak of what was measured, never of how the work was scheduled.
"""

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
from typer.main import get_command

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def section(text: str, heading: str) -> str:
    """The body of the `## heading…` section, up to the next `## ` heading."""
    return text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


def example_commands() -> list[list[str]]:
    return [
        shlex.split(line[2:])
        for line in section(README, "A worked example").splitlines()
        if line.startswith("$ prereg ")
    ]


def lab_ledger_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "ledger.db"
    shutil.copyfile(ROOT / "ledger.db", copy)  # a copy: tests never open the lab's ledger itself
    return copy


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


def cli_verbs() -> list[str]:
    """Every command of the typer app, as typed: `check`, …, `audit list`, …"""
    sys.path.insert(0, str(ROOT))
    try:
        import cli
    finally:
        sys.path.remove(str(ROOT))
    group = get_command(cli.app)
    verbs = []
    for name, command in sorted(group.commands.items()):
        sub = getattr(command, "commands", None)
        verbs += [f"{name} {subname}" for subname in sorted(sub)] if sub else [name]
    return verbs


def test_the_command_reference_names_every_verb():
    verbs = cli_verbs()
    assert "check" in verbs and "audit verify" in verbs  # the app was read, not an empty group
    reference = section(README, "Command reference")
    missing = [verb for verb in verbs if f"`prereg {verb}" not in reference]
    assert not missing, f"README's command reference does not name: {missing}"
    examples = {line[2:].split(" --")[0] for line in reference.splitlines() if line.startswith("$ prereg ")}
    unshown = [
        verb for verb in verbs if not any(f"prereg {verb}" == e or e.startswith(f"prereg {verb} ") for e in examples)
    ]
    assert not unshown, f"README's command reference has no example of: {unshown}"


def test_the_calibration_table_is_the_ledgers(tmp_path):
    """docs/results.md's calibration table and Brier score are what `prereg audit calibration` computes from the
    committed ledger: a new verdict that changes them must change the notebook too."""
    table = section(RESULTS, "Calibration of this lab's expectations")
    rows = re.findall(r"^\| ([a-z-]+) \| ([0-9.]+) \| ([0-9]+) \| ([0-9]+) \| ([0-9]+) \|$", table, re.M)
    command = [sys.executable, str(ROOT / "cli.py"), "audit", "calibration", "--json"]
    result = subprocess.run([*command, "--ledger", str(lab_ledger_copy(tmp_path))],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    computed = json.loads(result.stdout)
    assert rows == [
        (lv["confidence"], str(lv["p"]), str(lv["n"]), str(lv["hits"]), str(lv["undefined"]))
        for lv in computed["levels"]
    ]
    assert f"Brier score {computed['brier']:.3f} over {computed['scored']} scored expectations" in table


LADDER_ROW = re.compile(r"^\| `(?P<id>[a-z0-9.-]+)` \| [^|]+ \| (?P<outcome>[^|]+) \| (?P<entry>[0-9]+|—) \|$", re.M)


def test_the_ladders_table_is_the_ledgers(tmp_path):
    """docs/results.md lists every registration of the committed ledger once, each with its latest verdict's
    entry and outcome (or none)."""
    from prereg.audit import audit_list, audit_show
    from prereg.ledger import Ledger

    rows = {m["id"]: m for m in LADDER_ROW.finditer(section(RESULTS, "The ladders in the ledger"))}
    with Ledger.open(str(lab_ledger_copy(tmp_path)), create=False) as ledger:
        registrations = [row["id"] for row in audit_list(ledger)]
        verdicts = {reg_id: audit_show(ledger, reg_id)["verdict"] for reg_id in registrations}
    assert sorted(rows) == sorted(registrations)
    for reg_id, verdict in verdicts.items():
        row = rows[reg_id]
        if verdict is None:
            assert row["entry"] == "—", f"{reg_id} has no verdict in the ledger"
            continue
        assert row["entry"] == str(verdict["seq"]), f"{reg_id}: the latest verdict is entry {verdict['seq']}"
        if verdict["outcome"] is None:
            assert "no rule fired" in row["outcome"], reg_id
        else:
            assert f"`{verdict['outcome']}` ({verdict['rule']})" in row["outcome"], reg_id


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def relative_links(text: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_a_file_that_exists(document: Path):
    text = document.read_text(encoding="utf-8")
    links = relative_links(text)
    for link in links:
        path, _, anchor = link.partition("#")
        target = (document.parent / path).resolve()
        assert target.exists(), f"{document.name}: link {link!r} points to {target}, which does not exist"
        if anchor:
            assert anchor in heading_anchors(target.read_text(encoding="utf-8")), (
                f"{document.name}: link {link!r}: {path} has no heading with the anchor #{anchor}"
            )
    for anchor in re.findall(r"\]\(#([^)\s]+)\)", text):
        assert anchor in heading_anchors(text), f"{document.name}: no heading with the anchor #{anchor}"


def test_the_links_are_found():
    assert "docs/results.md" in relative_links(README)
    assert "../bench/results/README.md" in relative_links(RESULTS)


# How the work was scheduled is not what was measured: no sessions, numbered calls, lanes, issue numbers or device
# budgets in the project's own documents.
SCHEDULING_WORDS = re.compile(r"\bsessions?\b|\bcall \d|\blanes?\b|\bissue \d|device[ -]time", re.IGNORECASE)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_documents_speak_of_what_was_measured(document: Path):
    found = sorted({m.group(0) for m in SCHEDULING_WORDS.finditer(document.read_text(encoding="utf-8"))})
    assert not found, f"{document.name} says {found}"
