"""Paired arms must share the flag (prereg/pairing.py): a compare ladder may not compare a loss (or an
evaluation of the trained weights) across rungs whose steps group the samples differently. Freeze, check and amend
refuse it with exit 2, naming the file, the field and the key, and write nothing; speed comparisons stay allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MINI, REGISTRATIONS, UNPAIRED_BEFORE_THE_RULE, Cli, lab_ledger_copy, ledger_fingerprint, write

from prereg.actions import load_against
from prereg.ledger import Ledger
from prereg.pairing import unpaired_comparisons

INVALID = 2
BUCKETED_B = MINI.replace(
    'id = "B"\n  items = ["P1"]', 'id = "B"\n  items = ["P1"]\n  config = { bucket_by_length = true }'
)
LOSS_READ = '[reads]\nloss_drift = "abs(B.loss - A.loss) / A.loss"\n'


def variant(text: str, **replacements: str) -> str:
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def test_a_loss_compared_across_differently_bucketed_rungs_is_refused_and_writes_nothing(
    cli: Cli, frozen_mini: Path, tmp_path: Path
) -> None:
    path = write(
        tmp_path, "unpaired.toml", variant(BUCKETED_B, **{'id = "mini"': 'id = "unpaired"', "[reads]\n": LOSS_READ})
    )
    before = ledger_fingerprint(cli.ledger)
    for result in (cli.on_ledger("freeze", path), cli("check", path)):
        assert result.exit_code == INVALID, result
        assert str(path) in result.stderr and "reads.loss_drift" in result.stderr
        assert (
            "bucket_by_length: A=False, B=True" in result.stderr and "paired arms must share the flag" in result.stderr
        )
        assert "fix: set the key in [protocol].config" in result.stderr
    assert ledger_fingerprint(cli.ledger) == before


def test_the_comparison_is_found_through_reads_and_in_expectations() -> None:
    text = variant(
        BUCKETED_B, **{"[reads]\n": LOSS_READ, 'check = "secondary >= 0.04"': 'check = "loss_drift <= 0.05"'}
    )
    reg = _registration(text)
    problems = unpaired_comparisons(reg)
    assert [p.split(" = ")[0] for p in problems] == ["reads.loss_drift", "expectations.2.check"]


def test_rows_paired_by_id_are_no_paired_comparison_across_differently_bucketed_rungs() -> None:
    """Per-frame errors of the trained weights pair by frame id (paired_delta), but the weights of two rungs
    trained on other steps are other trajectories: the row functions count as comparisons of a paired metric."""
    delta = '[reads]\nd = "paired_delta(B.panel_frame_chunk_mae, A.panel_frame_chunk_mae)"\n'
    problems = unpaired_comparisons(_registration(variant(BUCKETED_B, **{"[reads]\n": delta})))
    assert len(problems) == 1 and problems[0].startswith("reads.d = ")
    assert "panel_frame_chunk_mae across rungs A, B" in problems[0]
    assert "bucket_by_length: A=False, B=True" in problems[0]
    assert unpaired_comparisons(_registration(variant(MINI, **{"[reads]\n": delta}))) == []  # the same steps


@pytest.mark.parametrize("case", ["speed only", "shared flag", "steps kept", "one rung", "until_pass"])
def test_what_stays_allowed(case: str) -> None:
    text = {
        "speed only": BUCKETED_B,  # MINI reads s_per_step and vram_peak_gib: the flag's own A/B
        "shared flag": variant(
            MINI,
            **{
                "config = { batch = 4, backward_chunks = 2 }": (
                    "config = { batch = 4, backward_chunks = 2, bucket_by_length = true }"
                ),
                "[reads]\n": LOSS_READ,
            },
        ),
        "steps kept": variant(
            MINI,
            **{
                'id = "B"\n  items = ["P1"]': 'id = "B"\n  items = ["P1"]\n  config = { chunk_by_cameras = true }',
                "[reads]\n": LOSS_READ,
            },
        ),
        "one rung": variant(BUCKETED_B, **{"[reads]\n": '[reads]\nloss_b = "B.loss"\n'}),
        "until_pass": variant(
            BUCKETED_B, **{"[reads]\n": LOSS_READ, 'kind = "compare"': 'kind = "until_pass"\npass_rule = "rc == 0"'}
        ),
    }[case]
    assert unpaired_comparisons(_registration(text)) == []


def test_an_amendment_that_introduces_the_comparison_is_refused(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    amendment = write(
        tmp_path,
        "a.toml",
        'reason = "compare losses too"\n[add.reads]\nloss_drift = "abs(B.loss - A.loss) / A.loss"\n'
        "[set.protocol.rungs.B]\nconfig = { bucket_by_length = true }\n",
    )
    before = ledger_fingerprint(cli.ledger)
    result = cli.on_ledger("amend", "mini", amendment)
    assert result.exit_code == INVALID and str(amendment) in result.stderr and "reads.loss_drift" in result.stderr
    assert ledger_fingerprint(cli.ledger) == before
    speed_only = write(
        tmp_path, "b.toml", 'reason = "bucket B"\n[set.protocol.rungs.B]\nconfig = { bucket_by_length = true }\n'
    )
    cli.ok("amend", "mini", speed_only)


def test_the_bundled_registrations_pair_their_comparisons_but_the_one_that_taught_the_rule(tmp_path: Path) -> None:
    ledger = Ledger.open(str(lab_ledger_copy(tmp_path / "ledger.db")), create=False)
    try:
        # Each as the lab froze it: its run configs under the defaults it was frozen with.
        registrations = [load_against(ledger, path)[0] for path in REGISTRATIONS.glob("*.toml")]
        unpaired = {reg.id for reg in registrations if unpaired_comparisons(reg)}
        assert unpaired == UNPAIRED_BEFORE_THE_RULE
        assert UNPAIRED_BEFORE_THE_RULE <= set(
            ledger.reg_ids()
        )  # frozen before the rule: a frozen registration never changes
    finally:
        ledger.close()


def _registration(text: str):
    import tomllib

    from prereg.schema import Registration

    return Registration.model_validate(tomllib.loads(text))
