"""The CLI never imports torch itself: checking, freezing, amending, deciding, auditing and reporting work on a
laptop without it (and start in a fraction of a second); `run` plans and records in this process and leaves torch
to its gate and rung processes. The workload's declaration is what validation imports, so it stays torch-free
too (prereg/workload.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import REPO

VERBS = [
    ["check", "registrations/molmo2-perf-pass1-tiny.toml", "--ledger", "{copy}"],
    ["freeze", "registrations/molmo2-perf-pass1-tiny.toml", "--ledger", "{fresh}"],
    ["amend", "molmo2-perf-pass1-tiny", "{amendment}", "--ledger", "{fresh}"],
    ["verdict", "molmo2-fast-h200", "--ledger", "{copy}"],
    ["audit", "verify", "--ledger", "{copy}"],
    ["audit", "list", "--ledger", "{copy}"],
    ["audit", "show", "molmo2-ar-f1-h200x2", "--ledger", "{copy}"],
    ["audit", "costs", "--ledger", "{copy}"],
    ["audit", "calibration", "--ledger", "{copy}"],
    ["report", "molmo2-fast-h200", "--out", "{out}", "--ledger", "{copy}"],
    ["run", "molmo2-perf-pass1-tiny", "--dry-run", "--ledger", "{fresh}"],
]

SCRIPT = textwrap.dedent("""
    import json, runpy, sys
    codes = []
    for args in json.loads(sys.argv[1]):
        sys.argv = ["cli.py", *args]
        try:
            runpy.run_path("cli.py", run_name="__main__")
            codes.append(0)
        except SystemExit as stop:
            codes.append(stop.code or 0)
    print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}), file=sys.stderr)
""")


def test_the_cli_never_imports_torch(tmp_path: Path) -> None:
    copy = tmp_path / "copy.db"
    shutil.copyfile(REPO / "ledger.db", copy)
    amendment = tmp_path / "amend.toml"
    amendment.write_text('reason = "a clearer title"\n[set]\ntitle = "renamed"\n')
    names = {
        "fresh": str(tmp_path / "fresh.db"),
        "copy": str(copy),
        "amendment": str(amendment),
        "out": str(tmp_path / "report"),
    }
    verbs = [[arg.format(**names) for arg in verb] for verb in VERBS]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(verbs)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    outcome = json.loads(result.stderr.strip().splitlines()[-1])
    assert outcome["codes"] == [0] * len(VERBS), (outcome, result.stderr[-2000:])
    assert outcome["torch"] is False


def test_importing_the_cli_imports_no_torch() -> None:
    """The bare import, apart from any verb: what `prereg --help` and shell completion pay for (tests/test_layering.py
    reads the same rule from cli.py's source)."""
    probe = 'import sys, cli; print("torch" in sys.modules, "engine.molmo2" in sys.modules)'
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
