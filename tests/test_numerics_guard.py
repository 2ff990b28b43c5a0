"""Numerics changes need a frozen guard (prereg/numerics_guard.py): a compare ladder whose compared rungs differ in a
run-config key that changes numerics is refused at check and freeze (exit 2, the ledger untouched) unless a rule
requires a bound on their paired loss difference or an oracle measures the difference; documents frozen before
the rule check with a note."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    MINI,
    REGISTRATIONS,
    UNGUARDED_BEFORE_THE_NUMERICS_RULE,
    Cli,
    lab_ledger_copy,
    ledger_fingerprint,
    write,
)

from prereg.actions import load_against
from prereg.ledger import Ledger
from prereg.numerics_guard import unguarded_numerics

PACKED_B = MINI.replace('id = "mini"', 'id = "mini-pack"').replace(
    'items = ["P1"]\n', 'items = ["P1"]\n  config = { pack = true }\n', 1
)


def test_a_compared_rung_that_changes_numerics_unguarded_is_refused_at_check_and_freeze(cli: Cli, tmp_path: Path):
    path = write(tmp_path, "pack.toml", PACKED_B)
    for verb in ("check", "freeze"):
        result = cli.on_ledger(verb, path)
        assert result.exit_code == 2, (verb, result.stdout, result.stderr)
        said = " ".join(result.stderr.split())
        assert f"{path}: rungs A and B are compared and differ in pack (A=False, B=True)" in said, said
        assert "fix: bound the paired loss difference in the rule that lands it" in said
        assert 'loss_gap = "abs(B.loss - A.loss) / A.loss"' in said and "[[items.oracles]]" in said
    assert not cli.ledger.exists()  # not even an empty ledger


def test_a_rung_that_only_tunes_the_compiled_kernels_is_a_numerics_change_too(cli: Cli, tmp_path: Path):
    """compile_tuning can move a reduction's order: rungs that differ only in it need the same guard."""
    tuned = (
        MINI.replace('id = "mini"', 'id = "mini-tuned"')
        .replace(
            "config = { batch = 4, backward_chunks = 2 }", "config = { batch = 4, backward_chunks = 2, compile = true }"
        )
        .replace('items = ["P1"]\n', 'items = ["P1"]\n  config = { compile_tuning = "coordinate-descent" }\n', 1)
    )
    result = cli.on_ledger("check", write(tmp_path, "tuned.toml", tuned))
    assert result.exit_code == 2, (result.stdout, result.stderr)
    said = " ".join(result.stderr.split())
    assert "rungs A and B are compared and differ in compile_tuning (A='default', B='coordinate-descent')" in said, said
    assert not cli.ledger.exists()


def test_a_paired_loss_bound_the_landing_rule_requires_guards_it(cli: Cli, tmp_path: Path):
    bounded = PACKED_B.replace('vram_clean = "', 'loss_gap = "abs(B.loss - A.loss) / A.loss"\nvram_clean = "').replace(
        'when = "primary >= 0.05 and vram_clean"', 'when = "primary >= 0.05 and vram_clean and loss_gap <= 0.01"'
    )
    cli.ok("freeze", write(tmp_path, "bounded.toml", bounded))
    # A bound in an expectation, or a lower bound, lands nothing: still refused.
    claimed = (
        PACKED_B.replace('"mini-pack"', '"mini-claimed"')
        .replace('vram_clean = "', 'loss_gap = "abs(B.loss - A.loss) / A.loss"\nvram_clean = "')
        .replace('check = "secondary >= 0.04"', 'check = "secondary >= 0.04 and loss_gap <= 0.01"')
    )
    assert cli.on_ledger("check", write(tmp_path, "claimed.toml", claimed)).exit_code == 2


def test_an_oracle_on_the_switch_the_rungs_differ_in_guards_it(cli: Cli, tmp_path: Path):
    switched = MINI.replace('id = "mini"', 'id = "mini-baseline"').replace(
        'items = ["P1"]\n', 'items = []\n  config = { baseline_switches = ["suffix_cudnn"] }\n', 1
    )
    switched = switched.replace('id = "R-hygiene"', 'id = "R-hygiene"\n# ').replace('land = [{ item = "P2", ', "# ")
    reg = _registration(tmp_path, switched)
    assert unguarded_numerics(reg) == []  # P1 switches suffix_cudnn and carries a tolerance oracle
    schema_only = switched.replace('kind = "tolerance"', 'kind = "finite"').replace(
        "bounds = { loss_abs = 1e-3, grad_norm_rel = 1e-2 }", ""
    )
    [(rungs, key, _)] = unguarded_numerics(_registration(tmp_path, schema_only))
    assert (rungs, key) == (("A", "B"), "baseline_switches")


def _registration(tmp_path: Path, text: str):
    reg, _ = load_against(None, write(tmp_path, "doc.toml", text))
    return reg


def test_the_bundled_documents_the_rule_refuses_were_frozen_before_it_and_check_with_a_note(tmp_path: Path):
    ledger = lab_ledger_copy(tmp_path / "ledger.db")
    with Ledger.open(str(ledger), create=False) as lab:
        refused = {p.stem for p in REGISTRATIONS.glob("*.toml") if unguarded_numerics(load_against(lab, p)[0])}
        assert refused == UNGUARDED_BEFORE_THE_NUMERICS_RULE and refused <= set(lab.reg_ids())
        seq = next(iter(lab.entries(reg_id="throughput-compile-2b", kinds=("freeze",)))).seq
    before = ledger_fingerprint(ledger)
    document = REGISTRATIONS / "throughput-compile-2b.toml"
    shown = " ".join(Cli(ledger, tmp_path).ok("check", document).stdout.split())
    assert f"frozen at entry {seq} before the numerics-guard rule; a new freeze would be refused" in shown
    assert ledger_fingerprint(ledger) == before
    fresh = tmp_path / "fresh.db"
    refusal = Cli(fresh, tmp_path).on_ledger("freeze", document)
    assert refusal.exit_code == 2 and "differ in compile" in refusal.stderr and not fresh.exists()


COMMAND = """
id = "cmd"
title = "a kernel of my own"
question = "is the fused kernel faster?"
workload = "command"
profile = "local"

[command]
run = "python train.py"
config = ["kernel", "lr"]
{numerics}
metrics = ["s_per_step", "loss"]
paired_metrics = ["loss"]

[cost]
ceiling_gpu_h = 0.1

[protocol]
steps = 4
log_every = 2
  [[protocol.rungs]]
  id = "A"
  config = {{ kernel = "eager" }}
  [[protocol.rungs]]
  id = "B"
  config = {{ kernel = "fused" }}

[reads]
gain = "(A.s_per_step - B.s_per_step) / A.s_per_step"
{reads}
[[rules]]
id = "land"
when = "gain >= 0.05{bound}"
outcome = "fused"
"""


@pytest.mark.parametrize(
    ("numerics", "bounded", "refused"),
    [("", False, False), ('numerics_keys = ["kernel"]', False, True), ('numerics_keys = ["kernel"]', True, False)],
)
def test_a_command_workload_declares_its_numerics_keys(tmp_path: Path, numerics: str, bounded: bool, refused: bool):
    reads = 'loss_gap = "abs(B.loss - A.loss)"' if bounded else ""
    text = COMMAND.format(numerics=numerics, reads=reads, bound=" and loss_gap <= 0.01" if bounded else "")
    problems = unguarded_numerics(_registration(tmp_path, text))
    assert [(r, k) for r, k, _ in problems] == ([(("A", "B"), "kernel")] if refused else [])
