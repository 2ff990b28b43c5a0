"""The F1 memory ladder (registrations/molmo2-ar-40k-f1.toml), replayed through the command line in the order it
was recorded, reaches the recorded conclusion.

freeze (the three-rung ladder) → record rungs 1-3 → amend rung 4 → record rung 4 → … → amend rung 8 → record rung 8
→ verdict. The record concludes: rungs 1-6 OOM (rejected), rung 7 trains but fails the nvidia-smi peak rule
(rejected), rung 8 passes the allocated-memory rule its amendment brought, and F2 keeps the full 40k (28.3 h ≤ 30 h).
Each rung is judged by the pass rule in force when it was measured, never by a later one.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import REGISTRATIONS, REPO, Cli

F1 = "molmo2-ar-40k-f1"
REGISTRATION = REGISTRATIONS / f"{F1}.toml"
HISTORY = REGISTRATIONS / F1
SMI_RULE = "rc == 0 and smi_peak_mib <= 75000"  # the frozen rule: "rc=0 AND peak ≤ ~75 GiB/GPU", nvidia-smi
ALLOCATED_RULE = "rc == 0 and vram_peak_gib <= 71"  # rung 8's amendment: "max vram_alloc_peak_gib … ≤ 71 GiB"

# The recorded order: the frozen ladder's three rungs are measured, then each amendment precedes its smoke.
RECORDED_ORDER: list[tuple[str, int]] = [("record", 1), ("record", 2), ("record", 3)] + [
    (verb, rung) for rung in range(4, 9) for verb in ("amend", "record")
]
# The document version each rung is measured under: amendment k (rung k + 3) makes version k.
VERSION_AT_MEASUREMENT = {"rung1": 0, "rung2": 0, "rung3": 0, "rung4": 1, "rung5": 2, "rung6": 3, "rung7": 4}


def step_file(verb: str, rung: int) -> Path:
    return HISTORY / f"{verb}-rung{rung}.toml"


def as_a_new_freeze_writes_it(directory: Path) -> Path:
    """The seed's recipe without `fps`, which a new freeze refuses (retired: nothing reads it, so nothing changes)."""
    text = REGISTRATION.read_text(encoding="utf-8")
    assert text.count(" fps = 30,") == 1
    path = directory / REGISTRATION.name
    path.write_text(text.replace(" fps = 30,", ""), encoding="utf-8")
    return path


def replay(
    cli: Cli, order: list[tuple[str, int]], replace: dict[tuple[str, int], Path] | None = None
) -> dict[str, Any]:
    """Freeze, then each step through the CLI (a step in `replace` uses that file instead); return the verdict."""
    cli.ok("freeze", as_a_new_freeze_writes_it(cli.ledger.parent))
    for verb, rung in order:
        cli.ok(verb, F1, (replace or {}).get((verb, rung), step_file(verb, rung)))
    return cli.ok_json("verdict", F1)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cli, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("f1-replay")
    cli = Cli(tmp / "ledger.db", tmp)
    return cli, replay(cli, RECORDED_ORDER)


def test_the_bundled_history_is_exactly_the_recorded_order():
    bundled = sorted(p.name for p in HISTORY.iterdir())
    assert bundled == sorted(step_file(verb, rung).name for verb, rung in RECORDED_ORDER)


def test_rung8_passes_the_rule_its_amendment_set(replayed):
    _, verdict = replayed
    assert verdict["until_pass"]["passed"] == "rung8"
    assert ALLOCATED_RULE in verdict["until_pass"]["reason"]
    assert (
        "'vram_peak_gib': 66.67" in verdict["until_pass"]["reason"]
    )  # "max vram_alloc_peak_gib 66.67 … PASSES the ≤71 rule"
    assert verdict["version"] == 5


def test_rungs_1_to_7_are_rejected_under_the_rule_in_force_when_measured(replayed):
    _, verdict = replayed
    rejected = verdict["until_pass"]["rejected"]
    assert [r["rung"] for r in rejected] == [f"rung{n}" for n in range(1, 8)]
    assert {r["result"] for r in rejected} == {"rejected"}
    assert {r["rung"]: r["version"] for r in rejected} == VERSION_AT_MEASUREMENT
    assert {r["pass_rule"] for r in rejected} == {SMI_RULE}  # rung 8's rule reaches none of them


def test_each_rejection_carries_the_seeds_reason(replayed):
    _, verdict = replayed
    reasons = {r["rung"]: r["reason"] for r in verdict["until_pass"]["rejected"]}
    for n in range(1, 7):  # "OOM … — REJECTED": the process died
        assert "is false" in reasons[f"rung{n}"] and "'rc': 1" in reasons[f"rung{n}"], reasons[f"rung{n}"]
    # "rc=0 — IT TRAINS. … Peak 78,057 MiB on the nvidia-smi sampler — FAILS the ≤~75,000 rule"
    assert "is false" in reasons["rung7"]
    assert "'rc': 0" in reasons["rung7"] and "'smi_peak_mib': 78057" in reasons["rung7"]


def test_f2_keeps_the_full_40k_at_the_passing_rungs_rate(replayed):
    _, verdict = replayed
    assert verdict["reads"]["projected_40k_h"] == pytest.approx(40000 * 2.55 / 3600)  # "40k × 2.55 = 28.3 h ≤ 30 h"
    assert (verdict["rule"], verdict["outcome"]) == ("F2-full-40k", "launch-full-40k")


def test_the_pre_declared_predictions_are_scored(replayed):
    _, verdict = replayed
    scored = {f"{e['n']}{e['part'] or ''}": e["result"] for e in verdict["expectations"]}
    # Rungs 5 and 6 OOM'd (no steady state); rung 8 measured 66.67 allocated and 67.78 reserved against 57.5 and
    # 64–66; rung 7's allocated peak was never reported, so its prediction cannot be scored.
    assert scored == {"5": "miss", "6": "miss", "7": "undefined", "8a": "miss", "8b": "miss"}


def test_no_amendment_is_post_hoc(replayed):
    _, verdict = replayed
    assert verdict["post_hoc"] == []


def test_the_ledger_verifies_after_the_replay(replayed):
    cli, _ = replayed
    report = cli.ok_json("audit", "verify")
    assert report["ok"] is True and report["first_bad"] is None
    assert report["entries"] == 1 + len(RECORDED_ORDER) + 1  # freeze, the recorded steps, the verdict


def rung7_with_allocated_peak(directory: Path) -> Path:
    """Rung 7's record plus an allocated peak that rung 8's rule would pass (its record reports none)."""
    path = directory / "record-rung7-allocated.toml"
    path.write_text(
        textwrap.dedent("""
        provenance = "test: rung 7 as recorded, plus a hypothetical allocated peak inside rung 8's ≤71 GiB rule"
        [rungs.rung7]
        items = []
        status = "finished"
        metrics = { rc = 0, steps = 150, smi_peak_mib = 78057, vram_peak_gib = 60.0, s_per_step = 3.88 }
    """),
        encoding="utf-8",
    )
    return path


def test_rung7_stays_rejected_even_when_rung8s_rule_would_pass_it(tmp_path: Path):
    cli = Cli(tmp_path / "ledger.db", tmp_path)
    verdict = replay(cli, RECORDED_ORDER, replace={("record", 7): rung7_with_allocated_peak(tmp_path)})
    rung7 = next(r for r in verdict["until_pass"]["rejected"] if r["rung"] == "rung7")
    assert (rung7["pass_rule"], rung7["version"]) == (SMI_RULE, 4)
    assert verdict["until_pass"]["passed"] == "rung8"


def test_the_same_rung7_measured_after_rung8s_amendment_passes_under_it(tmp_path: Path):
    # The contrast that makes the test above mean something: the rule follows the time of measurement.
    cli = Cli(tmp_path / "ledger.db", tmp_path)
    order = [step for step in RECORDED_ORDER if step != ("record", 7)]
    order.insert(order.index(("amend", 8)) + 1, ("record", 7))
    verdict = replay(cli, order, replace={("record", 7): rung7_with_allocated_peak(tmp_path)})
    assert verdict["until_pass"]["passed"] == "rung7"
    assert ALLOCATED_RULE in verdict["until_pass"]["reason"]
    assert [r["rung"] for r in verdict["until_pass"]["rejected"]] == [f"rung{n}" for n in range(1, 7)]


# The corrections against the lab's write-up (bench/results/encodings.sh): the encoder's values marked, the
# declaration times as the write-up gives them, and the GPU time the record omitted (rung 8, the forensics runs).
CORRECTIONS = REPO / "bench" / "results" / "encodings"
WHOLE_COST = [
    ("amend", CORRECTIONS / "f1-assumed.toml"),
    ("amend", CORRECTIONS / "f1-declared-when.toml"),
    ("amend", CORRECTIONS / "f1-forensics-rung.toml"),
    ("record", CORRECTIONS / "f1-record-costs.toml"),
]
# Rungs 4 and 6 (7 min × 4 GPUs each), 7 (41 min), 8 (at least 41 min) and the forensics runs (at most 15 min).
WHOLE_COST_GPU_S = 1680 + 1680 + 9840 + 9840 + 3600


def test_with_its_whole_cost_the_replay_reaches_the_same_conclusion(tmp_path: Path):
    cli = Cli(tmp_path / "ledger.db", tmp_path)
    replay(cli, RECORDED_ORDER)
    for verb, path in WHOLE_COST:
        cli.ok(verb, F1, path)
    verdict = cli.ok_json("verdict", F1)
    assert verdict["until_pass"]["passed"] == "rung8"
    assert [r["rung"] for r in verdict["until_pass"]["rejected"]] == [f"rung{n}" for n in range(1, 8)]
    assert (verdict["rule"], verdict["outcome"]) == ("F2-full-40k", "launch-full-40k")
    assert verdict["reads"]["projected_40k_h"] == pytest.approx(40000 * 2.55 / 3600)
    assert verdict["post_hoc"] == []
    costs = next(r for r in cli.ok_json("audit", "costs")["registrations"] if r["id"] == F1)
    assert costs["gpu_s"] == WHOLE_COST_GPU_S and not costs["overrun"]
    assumed = {a["path"] for a in cli.ok_json("audit", "show", F1)["assumed"]}
    assert "cost.ceiling_gpu_h" in assumed
