"""The clauses a frozen rule could not express until the tool had the means (bench/results/encodings_gates.sh),
applied to a copy of the lab's ledger: the script applies cleanly, the ledger verifies after it, nothing is
post-hoc, and each correction shows where a person looks — K-cudnn's crash clause in `check`, `audit show` and on a
crash window; the 40k run's E1 data gate as a kill line on the first window; its box pytest as the guard of every
decision rule in the verdict; read 1's paired per-frame Δ with its 95% interval, or the rows that did not pair."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import (
    REGISTRATIONS,
    REPO,
    Cli,
    apply_script,
    assert_the_lab_holds_what_the_script_appended,
    lab_ledger_before,
    write,
)

from engine.crash import crash_window
from engine.killwatch import KillEnv, KillWatch, kill_scope
from prereg.ledger import Ledger
from prereg.rules import compile_expr
from prereg.state import load_state

SCRIPT = REPO / "bench" / "results" / "encodings_gates.sh"
S_BUNDLE = (
    "molmo2-perf-pass1",
    "molmo2-perf-pass1-h200",
    "molmo2-perf-pass1-h200-interleaved",
    "molmo2-perf-pass1-tiny",
    "molmo2-perf-pass1-tiny-interleaved",
)
CRASH_CLAUSE = "not finite(loss) or rc != 0"
AR_40K = "molmo2-ar-40k"


# The lab's ledger holds these corrections from this entry on: the script appended them.
CORRECTIONS_FROM = 402
# One worker for the module: its fixture replays the script (10 s) once, not once on each worker.
pytestmark = pytest.mark.xdist_group("encodings-gates")


@pytest.fixture(scope="module")
def applied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lab's ledger as it was before the script, with the script applied, once for the module (tests copy it
    to write)."""
    return apply_script(SCRIPT, lab_ledger_before(CORRECTIONS_FROM, tmp_path_factory.mktemp("gates") / "ledger.db"))


@pytest.fixture
def copy_of_applied(applied: Path, tmp_path: Path) -> Cli:
    ledger = tmp_path / "ledger.db"
    shutil.copyfile(applied, ledger)
    return Cli(ledger, tmp_path)


def registration(ledger: Path, reg_id: str, version: int | None = None):
    with Ledger.open(str(ledger), create=False) as store:
        state = load_state(store, reg_id, with_windows=False)
        return state.registration() if version is None else state.registration_at(version)


def test_the_labs_ledger_holds_what_the_script_appends(applied: Path, tmp_path: Path):
    assert_the_lab_holds_what_the_script_appended(applied, CORRECTIONS_FROM, tmp_path)


def test_the_script_applies_and_the_ledger_verifies_with_nothing_post_hoc(applied: Path, tmp_path: Path):
    cli = Cli(applied, tmp_path)
    report = cli.ok_json("audit", "verify")
    assert report["ok"] is True and report["first_bad"] is None
    assert [row["id"] for row in cli.ok_json("audit", "list")["registrations"] if row["post_hoc"]] == []


# --- K-cudnn sees a crash ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reg_id", S_BUNDLE)
def test_k_cudnn_fires_on_a_crash_window_after_the_amendment_and_not_before(applied: Path, reg_id: str):
    measured = [{"step": 10, "loss": 5.0, "finite": True, "s_per_step": 2.2}]
    crashed = [*measured, crash_window(measured, 1, None, 1)]
    now = KillWatch(registration(applied, reg_id), "C", ("P1", "P2"))
    fired = now.check(crashed, final=True)
    assert fired is not None and fired["kill"] == "K-cudnn" and fired["drops"] == ["P1"]
    frozen = KillWatch(registration(applied, reg_id, 0), "C", ("P1", "P2"))
    assert frozen.check(crashed, final=True) is None  # the frozen line saw only the NaN
    assert now.check(measured) is None  # a measured window has no rc: the clause never fires on one


def test_check_and_audit_show_say_k_cudnn_holds_the_crash_clause(applied: Path, tmp_path: Path):
    cli = Cli(applied, tmp_path)
    payload = cli.ok_json("check", REGISTRATIONS / "molmo2-perf-pass1-h200.toml")
    assert {"path": "kill.K-cudnn.when", "value": CRASH_CLAUSE} in payload["amended"]
    assert (
        f'kill.K-cudnn.when: "{CRASH_CLAUSE}"' in cli.ok("check", REGISTRATIONS / "molmo2-perf-pass1-h200.toml").stdout
    )
    shown = cli.ok("audit", "show", "molmo2-perf-pass1-h200").stdout
    assert "Any cuDNN instability (crash, NaN" in shown and "rc != 0" in shown


def test_the_decided_s_bundle_keeps_its_verdict(copy_of_applied: Cli):
    """A kill line judges only windows measured after it: the runs that were measured stand, and so does the
    decision over them."""
    for reg_id in ("molmo2-perf-pass1-h200", "molmo2-perf-pass1-h200-interleaved"):
        with Ledger.open(str(copy_of_applied.ledger), create=False) as store:
            recorded = load_state(store, reg_id, with_windows=False).verdicts[-1].data["verdict"]
        now = copy_of_applied.ok_json("verdict", reg_id)
        assert (now["outcome"], now["rule"], now["land"]) == (recorded["outcome"], recorded["rule"], recorded["land"])


# --- the 40k run's E1 data gate --------------------------------------------------------------------------------------

SEED_BANNER = {
    "data_datasets": 878,
    "data_episodes": 38571,
    "data_frames": 18636749,
    "data_state_dim": 6,
    "data_action_dim": 6,
}


def e1_holds(ledger: Path, banner: dict) -> object:
    reg = registration(ledger, AR_40K)
    line = next(k for k in reg.kill if k.id == "K-E1")
    window = {"step": 100, "loss": 16.1, "finite": True, **banner}
    return compile_expr(line.when, kill_scope(reg)).evaluate(KillEnv([window]))


def test_the_e1_gate_aborts_on_the_first_window_at_any_deviation(applied: Path):
    assert e1_holds(applied, SEED_BANNER) is False
    for key in SEED_BANNER:
        assert e1_holds(applied, {**SEED_BANNER, key: SEED_BANNER[key] - 1}) is True, key
    watch = KillWatch(registration(applied, AR_40K), "run")
    fired = watch.check([{"step": 100, "loss": 16.1, "finite": True, **SEED_BANNER, "data_frames": 18636748}])
    assert fired is not None and fired["kill"] == "K-E1" and fired["step"] == 100


# --- the box pytest and read 1's paired Δ, as records bring them --------------------------------------------------


def box_record(tmp_path: Path, *, passed: int = 337, failed: int = 0, anchor_rows: str = "") -> Path:
    rows = '"ep0/f0" = 7.0\n"ep0/f1" = 7.2\n"ep1/f0" = 7.1\n'
    anchor_rows = anchor_rows or '"ep0/f0" = 7.8\n"ep0/f1" = 7.9\n"ep1/f0" = 7.7\n'
    text = (
        'provenance = "test: the box\'s launch record, its panel and the banked A-s0 npz"\n'
        '[rungs.run]\nitems = []\nstatus = "finished"\n'
        f"metrics = {{ s_per_step = 2.55, panel_chunk_mae = 7.1, panel_first_mae = 3.8, "
        f"box_pytest_passed = {passed}, box_pytest_failed = {failed} }}\n"
        f"[rungs.run.rows.panel_frame_chunk_mae]\n{rows}"
        '[rungs.a_s0]\nitems = []\nstatus = "finished"\n'
        f"[rungs.a_s0.rows.panel_frame_chunk_mae]\n{anchor_rows}"
    )
    return write(tmp_path, f"box-{passed}-{failed}-{len(anchor_rows)}.toml", text)


def test_a_green_launch_is_decided_and_read_1_has_its_paired_delta_and_interval(copy_of_applied: Cli, tmp_path):
    copy_of_applied.ok("record", AR_40K, box_record(tmp_path))
    verdict = copy_of_applied.ok_json("verdict", AR_40K)
    assert (verdict["rule"], verdict["outcome"]) == ("BEATS", "flow-trunk-candidate")
    reads = verdict["reads"]
    # differences -0.8, -0.7, -0.6: mean -0.7, sd 0.1, t(2) = 4.303 -> half-width 0.2484
    assert reads["chunk_delta_vs_a_s0"] == pytest.approx(-0.7)
    assert reads["chunk_delta_vs_a_s0_low"] == pytest.approx(-0.9484, abs=1e-4)
    assert reads["chunk_delta_vs_a_s0_high"] == pytest.approx(-0.4516, abs=1e-4)
    assert "first_delta_vs_a_s0" in verdict["undefined"]  # no first-action rows recorded: undefined, and why
    assert "no rows of it were recorded" in verdict["undefined"]["first_delta_vs_a_s0"]


@pytest.mark.parametrize(("passed", "failed"), [(336, 1), (340, 0)])
def test_a_launch_that_was_not_green_decides_nothing(copy_of_applied: Cli, tmp_path, passed, failed):
    copy_of_applied.ok("record", AR_40K, box_record(tmp_path, passed=passed, failed=failed))
    verdict = copy_of_applied.ok_json("verdict", AR_40K)
    assert verdict["outcome"] is None and verdict["rule"] is None
    assert verdict["reads"]["launch_green"] is False and verdict["reads"]["beats"] is True
    text = copy_of_applied.ok("verdict", AR_40K).stdout
    assert "rule BEATS: launch_green and beats → no" in text and "no rule fired" in text


def test_an_unrecorded_suite_decides_nothing_and_says_why(copy_of_applied: Cli):
    verdict = copy_of_applied.ok_json("verdict", AR_40K)
    assert verdict["outcome"] is None and "launch_green" in verdict["undefined"]


def test_rows_that_do_not_pair_are_reported_not_pooled(copy_of_applied: Cli, tmp_path):
    misaligned = '"ep0/f0" = 7.8\n"ep0/f1" = 7.9\n"ep2/f0" = 7.7\n'
    copy_of_applied.ok("record", AR_40K, box_record(tmp_path, anchor_rows=misaligned))
    verdict = copy_of_applied.ok_json("verdict", AR_40K)
    why = verdict["undefined"]["chunk_delta_vs_a_s0"]
    assert "the rows do not pair" in why and "'ep1/f0'" in why and "'ep2/f0'" in why
    assert verdict["reads"]["chunk_delta_vs_a_s0"] is None and verdict["reads"]["chunk_vs_a_s0"] is not None
    text = copy_of_applied.ok("verdict", AR_40K).stdout
    assert "the rows do not pair" in text
    report = copy_of_applied.ok("report", AR_40K, "--out", tmp_path / "report")
    assert report.exit_code == 0
    markdown = next((tmp_path / "report").rglob("*.md")).read_text(encoding="utf-8")
    assert "the rows do not pair" in markdown and "'ep2/f0'" in markdown
