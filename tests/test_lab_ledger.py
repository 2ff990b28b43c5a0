"""The lab's committed ledger.db (a copy: tests never open it in place) against the repository: it verifies, it
holds every bundled registration frozen at the document its file holds now, and wherever the engine ran a ladder,
every oracle result came before the first rung started (parity first, as recorded, not only as designed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REGISTRATIONS, REPO

from prereg.actions import load_against
from prereg.documents import document_hash
from prereg.ledger import Ledger
from prereg.state import load_state

REGISTRATION_FILES = sorted(REGISTRATIONS.glob("*.toml"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Ledger:
    copy = tmp_path_factory.mktemp("lab") / "ledger.db"
    shutil.copyfile(REPO / "ledger.db", copy)
    ledger = Ledger.open(str(copy), create=False)
    yield ledger
    ledger.close()


def test_the_lab_ledger_verifies(lab: Ledger) -> None:
    report = lab.verify()
    assert report.ok, (report.first_bad, report.reason)


@pytest.mark.parametrize("path", REGISTRATION_FILES, ids=lambda p: p.stem)
def test_every_bundled_registration_is_frozen_at_its_files_document(lab: Ledger, path: Path) -> None:
    reg, _ = load_against(lab, path)  # as frozen: its run configs resolve with the defaults it was frozen with
    assert reg.id in set(lab.reg_ids()), f"{path.name} is not frozen in ledger.db: run `prereg freeze {path}`"
    frozen = load_state(lab, reg.id, with_windows=False).versions[0]
    assert frozen.doc_hash == document_hash(reg), f"{path.name} no longer holds the document frozen as {reg.id}"


def test_where_the_engine_ran_a_ladder_the_gate_came_first(lab: Ledger) -> None:
    checked = 0
    for reg_id in lab.reg_ids():
        oracles = [e.seq for e in lab.entries(reg_id=reg_id, kinds=("oracle",)) if not e.data.get("external")]
        starts = [e.seq for e in lab.entries(reg_id=reg_id, kinds=("run-start",))]
        if oracles and starts:
            assert max(oracles) < min(starts), f"{reg_id}: an oracle result after the first rung started"
            checked += 1
    assert checked >= 2  # the H200 S-bundle and X1 ran their gates through the engine (the demo runs on a copy)


def test_a_paired_read_is_bootstrapped_by_window_index(lab: Ledger) -> None:
    """molmo2-fast-same-steps-h200 compares the training loss of two rungs that saw the same samples window by
    window, while the loss fell 35% across the read windows (4.51 to 2.93). Resampling each rung's windows on its
    own would compare early windows of one with late ones of the other and give the 0.8% loss gap an interval
    reaching 33%; resampled by window index, the interval is the gap's own spread. The speed reads keep
    independent draws."""
    from prereg.verdict import compute_verdict

    verdict = compute_verdict(lab, "molmo2-fast-same-steps-h200")
    low, high = verdict["intervals"]["loss_gap"]
    assert low <= verdict["reads"]["loss_gap"] <= high < 0.02, (low, high)
    low, high = verdict["intervals"]["speedup"]
    assert low < verdict["reads"]["speedup"] < high


# What a verdict decided. Its intervals and robustness are statistics beside the decision: a recorded verdict keeps the
# intervals of the resampling it was computed with and may have no robustness, so only the decision must recompute.
DECISION_FIELDS = ("outcome", "rule", "rules", "land", "park", "conditional_land", "dropped", "reads", "undefined")


def test_every_recorded_verdict_recomputes_to_the_same_decision(lab: Ledger) -> None:
    from prereg.verdict import compute_verdict

    checked = 0
    for reg_id in lab.reg_ids():
        recorded = load_state(lab, reg_id, with_windows=False).verdicts
        if not recorded:
            continue
        was, now = recorded[-1].data["verdict"], compute_verdict(lab, reg_id)
        assert {k: was[k] for k in DECISION_FIELDS} == {k: now[k] for k in DECISION_FIELDS}, reg_id
        assert [e["result"] for e in was["expectations"]] == [e["result"] for e in now["expectations"]], reg_id
        checked += 1
    assert checked >= 10


# Verdicts whose intervals were recorded before the bootstrap resampled paired metrics by window index: their
# decision recomputes exactly, their intervals do not (checked below), so verdict records them again.
INTERVALS_FROM_AN_EARLIER_BOOTSTRAP = {"molmo2-x2-h200"}


def test_a_recorded_verdict_is_not_recorded_again_for_its_new_statistics(lab: Ledger) -> None:
    """Every recorded verdict predates `robustness`: verdict again recomputes it and appends nothing."""
    from prereg.verdict import DERIVED_KEYS, compute_verdict, record_verdict

    for reg_id in lab.reg_ids():
        recorded = load_state(lab, reg_id, with_windows=False).verdicts
        if not recorded:
            continue
        was, now = recorded[-1].data["verdict"], compute_verdict(lab, reg_id)
        differ = sorted(k for k in set(was) | set(now) if k not in DERIVED_KEYS and was.get(k) != now.get(k))
        if reg_id in INTERVALS_FROM_AN_EARLIER_BOOTSTRAP:
            assert differ == ["intervals"], reg_id
            continue
        assert differ == [], reg_id
        before = lab.head()
        verdict, appended = record_verdict(lab, reg_id)
        assert not appended and lab.head() == before, reg_id
        assert "robustness" in verdict, reg_id
