"""The CLI surface is a contract (docs/design.md "The command line"): verbs, arguments and options are frozen in a
golden file; a change to them is a deliberate change of that file (PREREG_UPDATE_GOLDEN=1 regenerates it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from cli import app

GOLDEN = Path(__file__).parent / "golden" / "cli_surface.json"


def surface(command, path: str = "prereg") -> dict:
    # typer carries its own click: duck-typed, not isinstance against the click package.
    entry = {
        "params": [
            {
                "name": p.name,
                "opts": sorted(p.opts),
                "kind": p.param_type_name,
                "required": p.required,
                "flag": bool(getattr(p, "is_flag", False)),
            }
            for p in command.params
            if p.name != "help"
        ]
    }
    if hasattr(command, "commands"):
        entry["commands"] = {name: surface(sub, f"{path} {name}") for name, sub in sorted(command.commands.items())}
    return entry


def test_cli_surface_is_frozen():
    current = surface(typer.main.get_command(app))
    if os.environ.get("PREREG_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    assert current == json.loads(GOLDEN.read_text()), (
        "the CLI surface changed; update tests/golden/cli_surface.json deliberately"
    )


def test_every_verb_of_design_md_exists_and_takes_ledger_and_json():
    current = surface(typer.main.get_command(app))
    verbs = set(current["commands"])
    assert {"check", "freeze", "amend", "run", "record", "verdict", "audit", "report", "adopt"} <= verbs
    audits = {"list", "show", "verify", "costs", "calibration", "sensitivity", "adoption", "export"}
    assert audits <= set(current["commands"]["audit"]["commands"])
    for name, verb in [(n, v) for n, v in current["commands"].items() if n != "audit"] + list(
        current["commands"]["audit"]["commands"].items()
    ):
        options = {o for p in verb["params"] for o in p["opts"]}
        assert "--ledger" in options, name
        if name != "export":  # export writes JSONL, which is its machine-readable form
            assert "--json" in options, name
