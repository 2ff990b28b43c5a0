"""Retired options: each names the verdict that retired it; documents frozen with one still validate, check (exit
0, with a note) and audit; a new freeze, an amendment that introduces one, or a check of an unfrozen document that
uses one is refused with exit 2 naming the verdict, the ledger untouched; the runner does not run one."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MINI, REGISTRATIONS, Cli, lab_ledger_copy, ledger_fingerprint, prereg_process, write

from engine.molmo2.declaration import PROFILES
from engine.molmo2.run_config import RETIRED, X12_GATE, resolve
from prereg.ledger import Ledger
from prereg.state import load_state

# How each retirement shows in the lab's ledger: the registration and its verdict's outcome, or the item its oracle
# dropped; for an option no verdict retired, why none had to.
EVIDENCE = {
    "pack_attention = 'rows'": ("molmo2-pack-rows-h200", "park-rows", None),
    "pack_attention = 'varlen-fa4'": ("molmo2-pack-fa4-h200", "park-varlen-fa4", None),
    "switch vit_bf16_attention": ("molmo2-x1-h200", None, "X1"),
    "switch pool_fp32_math": ("molmo2-x34-h200", "park-x34", "X3"),
    "switch fp8_decoder_linears": ("molmo2-fp8-h200", None, "X5"),
    "switch fp8_rowwise_decoder_linears": ("molmo2-fp8-rowwise-h200", None, "X6"),
    "switch fp8_normed_input_linears": ("molmo2-fp8-normed-h200", None, "X8"),
    "switch staged_update": ("molmo2-staged-update-h200", "park-x9", None),
    "switch clip_in_adamw": ("molmo2-x4-landed-h200", "park-x4", None),
    "switch packed_query_heads": (None, X12_GATE, None),  # no verdict: its gate kept its ladder from running
    "suffix_attention = 'flex'": ("molmo2-sflex-h200", None, None),
    "config key pack_multiple": (None, "no ladder landing it", None),
    "config key compile_dynamic": (None, "no ladder landing it", None),
    "config key fps": (None, "nothing reading it", None),
    "config key truncate_layers": (None, "nothing reading it", None),
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Ledger:
    ledger = Ledger.open(str(lab_ledger_copy(tmp_path_factory.mktemp("lab") / "ledger.db")), create=False)
    yield ledger
    ledger.close()


def test_each_retired_option_names_the_verdict_that_retired_it(lab: Ledger):
    assert {option.label for option in RETIRED} == set(EVIDENCE)
    for option in RETIRED:
        reg_id, outcome, dropped = EVIDENCE[option.label]
        if reg_id is None:
            assert option.retired_by == outcome
            continue
        assert option.retired_by.startswith(f"{reg_id} ("), option
        verdict = [e.data["verdict"] for e in lab.entries(reg_id=reg_id, kinds=("verdict",))][-1]
        assert verdict["outcome"] == outcome, (option.label, verdict["outcome"])
        if dropped:
            assert dropped in verdict["dropped"], (option.label, verdict["dropped"])
            assert verdict["dropped"][dropped]["oracle"] in option.retired_by
        if outcome:
            assert outcome in option.retired_by
        else:
            assert "no outcome" in option.retired_by or "dropped" in option.retired_by


@pytest.mark.parametrize(
    ("reg_id", "uses"),
    [
        ("molmo2-pack-rows-h200", ["pack_attention = 'rows', retired by molmo2-pack-rows-h200 (park-rows)"]),
        ("molmo2-pack-fa4-h200", ["pack_attention = 'varlen-fa4', retired by molmo2-pack-fa4-h200 (park-varlen-fa4)"]),
        ("molmo2-x1-h200", ["switch vit_bf16_attention, retired by molmo2-x1-h200"]),
        ("molmo2-fp8-normed-h200", ["switch fp8_normed_input_linears, retired by molmo2-fp8-normed-h200"]),
        ("molmo2-staged-update-h200", ["switch staged_update, retired by molmo2-staged-update-h200 (park-x9)"]),
        ("molmo2-x4-landed-h200", ["switch clip_in_adamw, retired by molmo2-x4-landed-h200 (park-x4)"]),
        ("molmo2-x4-h200", ["switch clip_in_adamw, retired by molmo2-x4-landed-h200 (park-x4)"]),
        ("molmo2-x34-h200", ["switch pool_fp32_math, retired by molmo2-x34-h200", "suffix_attention = 'flex'"]),
        ("molmo2-ar-40k-f1", ["config key fps, retired by nothing reading it"]),
    ],
)
def test_a_document_frozen_with_a_retired_option_checks_with_a_note(tmp_path: Path, reg_id: str, uses: list[str]):
    ledger = lab_ledger_copy(tmp_path / "ledger.db")
    before = ledger_fingerprint(ledger)
    cli = Cli(ledger, tmp_path)
    shown = " ".join(cli.ok("check", REGISTRATIONS / f"{reg_id}.toml").stdout.split())  # whatever the wrapping
    for use in uses:
        assert f"uses retired option {use}" in shown
    assert "a new freeze would be refused" in shown
    assert ledger_fingerprint(ledger) == before
    cli.ok("audit", "show", reg_id)
    assert ledger_fingerprint(ledger) == before


def test_an_old_documents_rung_resolves_with_its_retired_option_and_validates(lab: Ledger):
    reg = load_state(lab, "molmo2-pack-rows-h200", with_windows=False).registration()
    assert reg.effective_config("B").pack_attention == "rows"
    assert reg.effective_config("A").suffix_attention == "flex"


RETIRED_DOCUMENTS = [
    ("rows", 'backward_chunks = 2, pack = true, pack_attention = "rows"', "protocol.config.pack_attention",
     "retired by molmo2-pack-rows-h200 (park-rows)"),
    ("fps", "backward_chunks = 2, fps = 30", "protocol.config.fps", "retired by nothing reading it"),
    ("pack_multiple", "backward_chunks = 2, pack = true, pack_multiple = 16", "protocol.config.pack_multiple",
     "retired by no ladder landing it"),
    ("compile_dynamic", "backward_chunks = 2, compile = true, compile_dynamic = true",
     "protocol.config.compile_dynamic", "retired by no ladder landing it"),
    ("baseline switch", 'backward_chunks = 2, baseline_switches = ["pool_fp32_math"]',
     "protocol.config.baseline_switches", "retired by molmo2-x34-h200"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "config", "path", "says"), RETIRED_DOCUMENTS, ids=[c[0] for c in RETIRED_DOCUMENTS])
def test_a_new_document_with_a_retired_option_is_refused_at_check_and_freeze(
    cli: Cli, frozen_mini: Path, tmp_path: Path, case: str, config: str, path: str, says: str
):
    text = MINI.replace('id = "mini"', 'id = "mini-retired"').replace("backward_chunks = 2", config)
    new = write(tmp_path, "retired.toml", text)
    before = ledger_fingerprint(cli.ledger)
    for verb in ("check", "freeze"):
        result = cli.on_ledger(verb, new)
        assert result.exit_code == 2, (verb, result.stdout, result.stderr)
        assert f"{new}: {path}: " in result.stderr and says in result.stderr, result.stderr
        assert "a new freeze cannot use a retired option" in result.stderr and "fix: remove it" in result.stderr
    assert ledger_fingerprint(cli.ledger) == before


def test_an_item_that_switches_a_retired_switch_is_refused(cli: Cli, tmp_path: Path):
    text = MINI.replace('switch = "suffix_cudnn"', 'switch = "vit_bf16_attention"')
    result = cli.on_ledger("freeze", write(tmp_path, "x1.toml", text))
    assert result.exit_code == 2
    assert "items.P1.switch: switch vit_bf16_attention is retired, retired by molmo2-x1-h200" in result.stderr
    assert not cli.ledger.exists()


def test_a_new_freeze_of_a_retired_document_is_refused_through_the_process(tmp_path: Path):
    ledger = tmp_path / "fresh.db"
    result = prereg_process("freeze", "registrations/molmo2-pack-rows-h200.toml", ledger=ledger, check=False)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "protocol.rungs.B.config.pack_attention: pack_attention = 'rows' is retired" in result.stderr
    assert "retired by molmo2-pack-rows-h200 (park-rows)" in result.stderr
    assert not ledger.exists()  # nothing written, not even an empty ledger
    # Where it is frozen already, the same freeze is the no-op it always was.
    lab = lab_ledger_copy(tmp_path / "lab.db")
    before = lab.read_bytes()
    again = prereg_process("freeze", "registrations/molmo2-pack-rows-h200.toml", ledger=lab, check=True)
    assert "already frozen" in again.stdout and lab.read_bytes() == before


def test_an_amendment_that_introduces_a_retired_option_is_refused(cli: Cli, frozen_mini: Path, tmp_path: Path):
    amendment = write(tmp_path, "amend.toml", 'reason = "r"\n[[add.protocol.rungs]]\nid = "D"\nconfig = { fps = 30 }\n')
    before = ledger_fingerprint(cli.ledger)
    result = cli.on_ledger("amend", "mini", amendment)
    assert result.exit_code == 2
    assert f"{amendment}: protocol.rungs.D.config.fps: config key fps is retired" in result.stderr
    assert ledger_fingerprint(cli.ledger) == before


def test_an_amendment_of_a_document_frozen_with_one_keeps_it(tmp_path: Path):
    """molmo2-ar-40k-f1 was frozen with fps: an amendment that adds a rung (it inherits protocol.config's fps) is
    not introducing it."""
    ledger = lab_ledger_copy(tmp_path / "ledger.db")
    rung9 = '[[add.protocol.rungs]]\nid = "rung9"\nconfig = { backward_chunks = 4 }\n'
    amendment = write(tmp_path, "amend.toml", f'reason = "a ninth rung"\n{rung9}')
    Cli(ledger, tmp_path).ok("amend", "molmo2-ar-40k-f1", amendment)
    with Ledger.open(str(ledger), create=False) as store:
        amended = [e.data for e in store.entries(reg_id="molmo2-ar-40k-f1", kinds=("amend",))][-1]
    assert amended["effective_config"]["rungs"]["rung9"]["fps"] == 30


def test_the_runner_does_not_run_a_retired_option():
    from engine.molmo2.runner import Molmo2Runner

    cpu = PROFILES["cpu-tiny"]
    with pytest.raises(ValueError, match="config key fps, retired by nothing reading it"):
        Molmo2Runner(cpu, resolve(cpu, {"fps": 30}), seed=0)
    with pytest.raises(ValueError, match="re-run such a rung from the commit its freeze records"):
        Molmo2Runner(cpu, resolve(cpu, {"pack": True, "pack_attention": "rows"}), seed=0)
