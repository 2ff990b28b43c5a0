"""What a ladder costs (prereg/cost.py, written out by engine/report/costs.py): device-seconds split into model
load, oracle gate, steps and the rest, read from the ledger, summing to what was recorded, against the ceiling; and
two registrations of one question that differ only in their schedule, side by side — refused, with nothing
written, when they ask different questions."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import MINI, Cli, ledger_fingerprint, prereg_process, write

from engine.report.costs import compare_schedules, same_question
from prereg import actions
from prereg.cost import PARTS, cost_summary, ladder_cost
from prereg.ledger import Ledger
from prereg.ledger.envelope import TS_FORMAT
from prereg.state import load_state

ROOT = Path(__file__).resolve().parent.parent
MICRO = (ROOT / "tests" / "data" / "micro.toml").read_text()
TINY = ROOT / "registrations" / "molmo2-perf-pass1-tiny.toml"
TWIN = ROOT / "registrations" / "molmo2-perf-pass1-tiny-interleaved.toml"


def parts_sum(row: dict) -> float:
    return sum(row.get(name, 0.0) for name in PARTS)


def interleaved(text: str, reg_id: str) -> str:
    """The interleaved twin of a registration: its id and schedule changed, nothing else."""
    first_id = text.split('id = "', 1)[1].split('"', 1)[0]
    return text.replace(f'id = "{first_id}"', f'id = "{reg_id}"', 1).replace(
        "[protocol]\n", '[protocol]\nschedule = "interleaved"\n', 1
    )


# --- the banked H200 ladder: the split of what was recorded -----------------------------------------------------


@pytest.fixture(scope="module")
def h200_cost(tmp_path_factory):
    copy = tmp_path_factory.mktemp("banked") / "ledger.db"
    shutil.copyfile(ROOT / "ledger.db", copy)  # a copy: tests never open the lab's ledger itself
    with Ledger.open(str(copy), create=False) as ledger:
        state = load_state(ledger, "molmo2-perf-pass1-h200", with_windows=False)
        return ladder_cost(ledger, "molmo2-perf-pass1-h200", state), cost_summary(ledger, state), state


def test_the_banked_h200_split_sums_to_each_rungs_recorded_total_and_to_the_verdicts_cost(h200_cost):
    cost, recorded, state = h200_cost
    runs = {r.run_id: r for r in state.runs}
    assert set(cost["per_run"]) == set(runs)
    for run_id, row in cost["per_run"].items():
        assert parts_sum(row) == pytest.approx(runs[run_id].totals["gpu_s"], abs=1e-6)
        assert row["load"] == pytest.approx(runs[run_id].totals["load_gpu_s"], abs=1e-9)
        assert (
            row["steps_read"] > row["steps_warmup"] > 0
        )  # 40 read steps against 20 warm-up ones (the slowest: the first)
        assert 0 < row["other"] < 10 and row["unsplit"] == 0
    assert cost["gpu_s"] == pytest.approx(recorded["gpu_s"], abs=1e-3)
    assert cost["gpu_s"] == pytest.approx(sum(cost["split"].values()), abs=1e-6)
    assert cost["split"]["oracle_gate"] == pytest.approx(recorded["split"]["oracle"], abs=1e-3)
    assert cost["split"]["load"] == pytest.approx(recorded["split"]["load"], abs=1e-3)
    # The verdict's "steps" was everything after the load; here it is cut into steps and the process start/teardown.
    steps_and_rest = cost["split"]["steps_warmup"] + cost["split"]["steps_read"] + cost["split"]["other"]
    assert steps_and_rest == pytest.approx(recorded["split"]["steps"], abs=1e-3)
    assert cost["start_from"] == ["timestamps"]  # this ledger's run-ends do not record where the load started


def test_the_banked_h200_share_of_the_ceiling(h200_cost):
    cost, _, _ = h200_cost
    assert cost["ceiling_gpu_s"] == 1800.0  # ceiling_gpu_h = 0.5
    assert cost["share_of_ceiling"] == pytest.approx(cost["gpu_s"] / 1800.0)
    assert 0.55 < cost["share_of_ceiling"] < 0.56 and not cost["overrun"]
    gates = [p for p in cost["processes"] if p["kind"] == "gate"]
    assert [g["status"] for g in gates] == [
        "stopped by SIGUSR1",
        "finished",
    ]  # the session's time budget split the gate
    for gate in gates:
        assert 0 < gate["load"] < gate["probes"] < gate["total"]


def test_every_cost_the_lab_ledger_recorded_is_what_the_one_cost_model_computes(tmp_path):
    """Each decided registration's verdict recorded its cost (the number the ceiling judged); the cost model the
    verdict, the ceiling, `audit costs` and the report share computes exactly that again, and the report's split
    sums to it."""
    copy = tmp_path / "ledger.db"
    shutil.copyfile(ROOT / "ledger.db", copy)  # a copy: tests never open the lab's ledger itself
    checked = 0
    with Ledger.open(str(copy), create=False) as ledger:
        for reg_id in ledger.reg_ids():
            verdicts = list(ledger.entries(reg_id=reg_id, kinds=("verdict",)))
            if not verdicts:
                continue
            state = load_state(ledger, reg_id, with_windows=False)
            assert cost_summary(ledger, state) == verdicts[-1].data["verdict"]["cost"], reg_id
            split = ladder_cost(ledger, reg_id, state)
            assert split["recorded_gpu_s"] == verdicts[-1].data["verdict"]["cost"]["gpu_s"], reg_id
            assert sum(split["split"].values()) == pytest.approx(split["gpu_s"], abs=1e-6), reg_id
            checked += 1
    assert checked >= 10


# --- the derivation, on a ledger whose every timestamp is known ----------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


class Clock:
    """Stands in for the ledger's clock: each entry is stamped at the time the test says."""

    def __init__(self):
        self.now = T0

    def at(self, seconds: float) -> None:
        self.now = T0 + timedelta(seconds=seconds)

    def __call__(self) -> str:
        return self.now.strftime(TS_FORMAT)


def hand_made(tmp_path: Path, monkeypatch, text: str = MINI, *, load_start_s: float | None = None) -> Ledger:
    """MINI with a gate and two rung processes whose times are chosen: sequential A (2 devices) and A-less B+C
    interleaved in one process (1 device)."""
    clock = Clock()
    monkeypatch.setattr("prereg.ledger.store.utc_timestamp", clock)
    ledger = Ledger.open(str(tmp_path / "ledger.db"), create=True)
    actions.freeze(ledger, write(tmp_path, "mini.toml", text))
    # The gate: 10 s of wall on one device, 2 s of load, two probes of 3 and 4 s.
    clock.at(100)
    ledger.append(
        "oracle",
        "mini",
        {
            "oracle": "P1a",
            "item": "P1",
            "kind": "tolerance",
            "observed": {"loss_abs": 0.0, "grad_norm_rel": 0.0},
            "bounds": {"loss_abs": 1e-3, "grad_norm_rel": 1e-2},
            "passed": True,
            "reason": "ok",
            "version": 0,
            "gpu_s": 3.0,
        },
    )
    ledger.append(
        "oracle",
        "mini",
        {
            "oracle": "P2a",
            "item": "P2",
            "kind": "schema",
            "observed": {"missing": [], "violations": []},
            "bounds": {},
            "passed": True,
            "reason": "ok",
            "version": 0,
            "gpu_s": 4.0,
        },
    )
    ledger.append(
        "gate",
        "mini",
        {"gpu_s": 10.0, "wall_s": 10.0, "load_s": 2.0, "oracles": ["P1a", "P2a"], "stopped": None, "version": 0},
    )
    # Rung A, alone in a process on 2 devices, started at t=200: run-start 2 s in, 1 s of load, four 10-step windows.
    clock.at(202)
    ledger.append("run-start", "mini", {"rung": "A", "items": [], "version": 0, "interleaved_with": []}, ref="runA")
    for step, elapsed in [(10, 5.0), (20, 8.0), (30, 11.0), (40, 14.0)]:
        clock.at(200 + elapsed + 0.0002)
        ledger.append(
            "window",
            "mini",
            {"rung": "A", "step": step, "steps": 10, "s_per_step": 0.3, "elapsed_s": elapsed, "ledger_s": 0.01},
            ref="runA",
        )
    totals = {"gpu_s": 29.0, "load_gpu_s": 2.0, "load_s": 1.0, "wall_s": 14.5, "rc": 0, "steps": 40}
    if load_start_s is not None:
        totals["load_start_s"] = load_start_s
    ledger.append("run-end", "mini", {"rung": "A", "status": "finished", "totals": totals}, ref="runA")
    # Rungs B and C interleaved in one process on 1 device, started at t=300: run-starts 3 s in, 2 s of load.
    clock.at(303)
    ledger.append(
        "run-start", "mini", {"rung": "B", "items": ["P1"], "version": 0, "interleaved_with": ["runC"]}, ref="runB"
    )
    ledger.append(
        "run-start",
        "mini",
        {"rung": "C", "items": ["P1", "P2"], "version": 0, "interleaved_with": ["runB"]},
        ref="runC",
    )
    for step, run, elapsed in [
        (10, "runB", 7.0),
        (10, "runC", 9.0),
        (20, "runB", 10.0),
        (20, "runC", 12.0),
        (30, "runB", 13.0),
        (30, "runC", 15.0),
        (40, "runB", 16.0),
        (40, "runC", 18.0),
    ]:
        clock.at(300 + elapsed)
        ledger.append(
            "window",
            "mini",
            {"rung": run[-1], "step": step, "steps": 10, "s_per_step": 0.1, "elapsed_s": elapsed},
            ref=run,
        )
    for run, rung in (("runB", "B"), ("runC", "C")):
        ledger.append(
            "run-end",
            "mini",
            {
                "rung": rung,
                "status": "finished",
                "totals": {"gpu_s": 9.5, "load_gpu_s": 1.0, "load_s": 2.0, "wall_s": 19.0, "rc": 0, "steps": 40},
            },
            ref=run,
        )
    return ledger


def test_the_split_is_derived_from_the_window_clock_and_the_timestamps(tmp_path, monkeypatch):
    with hand_made(tmp_path, monkeypatch) as ledger:
        cost = ladder_cost(ledger, "mini")
    gate, a, bc = cost["processes"]
    assert (gate["kind"], gate["load"], gate["probes"], gate["total"]) == ("gate", 2.0, 7.0, 10.0)
    # A on 2 devices: start 2 s, load 1 s, first window 5 - 3 = 2 s (warm-up: step 10 <= discard_first),
    # three read windows of 3 s, teardown 0.5 s — each times 2.
    assert a["start_from"] == "timestamps" and a["devices"] == pytest.approx(2.0)
    assert (a["start"], a["load"], a["steps_warmup"], a["steps_read"], a["teardown"]) == pytest.approx(
        (4.0, 2.0, 4.0, 18.0, 1.0), abs=1e-3
    )
    assert a["ledger_writes"] == pytest.approx(0.08)
    # B+C: one process, one device, one load of 2 s after a start of 3 s; windows cut in the order they ended.
    assert bc["label"] == "rungs B+C (interleaved)" and bc["devices"] == pytest.approx(1.0)
    assert (bc["start"], bc["load"], bc["steps_warmup"], bc["steps_read"], bc["teardown"]) == pytest.approx(
        (3.0, 2.0, 4.0, 9.0, 1.0), abs=1e-3
    )
    assert cost["split"] == pytest.approx(
        {"load": 4.0, "oracle_gate": 10.0, "steps_warmup": 8.0, "steps_read": 27.0, "other": 9.0}, abs=1e-3
    )
    assert cost["gpu_s"] == pytest.approx(58.0) and cost["recorded_gpu_s"] == pytest.approx(58.0)
    assert cost["rung_processes"] == 2
    # Per rung: each row sums to that run's recorded gpu_s; interleaved rungs take the engine's even split.
    assert {k: round(parts_sum(v), 6) for k, v in cost["per_run"].items()} == {"runA": 29.0, "runB": 9.5, "runC": 9.5}
    assert cost["per_run"]["runB"]["load"] == pytest.approx(1.0)
    assert cost["share_of_ceiling"] == pytest.approx(58.0 / 1800.0) and not cost["overrun"]


def test_a_recorded_load_start_is_used_instead_of_the_timestamps(tmp_path, monkeypatch):
    with hand_made(tmp_path, monkeypatch, load_start_s=2.5) as ledger:
        cost = ladder_cost(ledger, "mini")
    a = cost["processes"][1]
    assert a["start_from"] == "recorded"
    assert (a["start"], a["steps_warmup"]) == pytest.approx(
        (5.0, 3.0), abs=1e-6
    )  # the first window now starts at 3.5 s
    assert parts_sum(cost["per_run"]["runA"]) == pytest.approx(29.0)


def test_over_the_ceiling_the_share_exceeds_one_and_the_report_says_overrun(tmp_path, monkeypatch):
    from engine.report.costs import cost_markdown

    with hand_made(tmp_path, monkeypatch, MINI.replace("ceiling_gpu_h = 0.5", "ceiling_gpu_h = 0.01")) as ledger:
        cost = ladder_cost(ledger, "mini")
    assert cost["ceiling_gpu_s"] == pytest.approx(36.0) and cost["overrun"]
    assert cost["share_of_ceiling"] == pytest.approx(58.0 / 36.0)
    text = "\n".join(cost_markdown(cost))
    assert "**58.0 device-seconds of the 36 ceiling (161.1%)**" in text and "**OVERRUN**" in text


def test_a_number_the_split_needs_and_the_ledger_lacks_is_reported_missing(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr("prereg.ledger.store.utc_timestamp", clock)
    with Ledger.open(str(tmp_path / "ledger.db"), create=True) as ledger:
        actions.freeze(ledger, write(tmp_path, "mini.toml", MINI))
        ledger.append("run-start", "mini", {"rung": "A", "items": [], "version": 0}, ref="runA")
        ledger.append(
            "window", "mini", {"rung": "A", "step": 20, "steps": 10, "s_per_step": 0.3}, ref="runA"
        )  # no elapsed_s
        ledger.append(
            "run-end",
            "mini",
            {"rung": "A", "status": "finished", "totals": {"gpu_s": 12.0, "load_gpu_s": 2.0, "wall_s": 12.0}},
            ref="runA",
        )
        cost = ladder_cost(ledger, "mini")
    assert cost["split"]["unsplit"] == pytest.approx(10.0) and cost["split"]["load"] == pytest.approx(2.0)
    assert cost["split"]["steps_read"] == 0 and cost["gpu_s"] == pytest.approx(12.0)
    assert any("elapsed_s" in note and "not separable" in note for note in cost["notes"])


# --- two schedules of one question ------------------------------------------------------------------------------


def test_sequential_and_interleaved_ladders_of_one_question_side_by_side(tmp_path):
    ledger = tmp_path / "ledger.db"
    cli = Cli(ledger, tmp_path)  # the verbs that read; only `run` needs a process of its own
    paths = [
        write(tmp_path, "micro.toml", MICRO),
        write(tmp_path, "micro-interleaved.toml", interleaved(MICRO, "micro-interleaved")),
    ]
    for path, reg_id in zip(paths, ("micro", "micro-interleaved")):
        cli.ok("freeze", path)
        if reg_id == "micro-interleaved":  # the twin has not run yet: not comparable, and no saving is claimed
            cli.ok("report", "micro", "--compare", reg_id, "--out", tmp_path / "early")
            early = (tmp_path / "early" / "report.md").read_text()
            assert "**Not comparable yet**" in early and "device-seconds less" not in early
        prereg_process("run", reg_id, "--file", str(path), ledger=ledger, check=True)
    before = ledger_fingerprint(ledger)
    out = tmp_path / "report"
    result = cli.ok_json("report", "micro", "--compare", "micro-interleaved", "--out", out)
    assert ledger_fingerprint(ledger) == before  # a report reads; the verdicts it shows are computed, not recorded
    sequential, interleaved_side = result["compare"]["sides"]
    assert (sequential["schedule"], interleaved_side["schedule"]) == ("sequential", "interleaved")
    comparison = json.loads((out / "compare.json").read_text())
    costs = [side["cost"] for side in comparison["sides"]]
    assert [c["rung_processes"] for c in costs] == [2, 1]  # A and C a process (and a load) each; then one for both
    for cost in costs:
        assert sum(cost["split"].values()) == pytest.approx(cost["gpu_s"], abs=1e-6)
        assert cost["gpu_s"] == pytest.approx(cost["recorded_gpu_s"], abs=1e-3)
        assert cost["start_from"] == ["recorded"] and cost["split"]["steps_read"] > 0  # run-ends carry load_start_s
        for row in cost["per_run"].values():
            assert row["unsplit"] == 0
        assert cost["share_of_ceiling"] == pytest.approx(cost["gpu_s"] / 1800.0)
    outcomes = [(s["outcome"], s["rule"], sorted(s["land"]), sorted(s["park"])) for s in comparison["sides"]]
    assert all(o[0] in ("land", "land-hygiene") for o in outcomes)
    assert result["compare"]["same_verdict"] is (outcomes[0] == outcomes[1])
    assert [s["primary"]["read"] for s in result["compare"]["sides"]] == ["primary", "primary"]
    text = (out / "report.md").read_text()
    assert "## Cost: what the ladder cost" in text and "## Same question, two schedules" in text
    assert (
        "**Both reach the same verdict**" if result["compare"]["same_verdict"] else "**The verdicts differ**"
    ) in text
    assert (out / "cost_compare.png").stat().st_size > 0 and (out / "cost.png").stat().st_size > 0
    html = (out / "report.html").read_text()
    assert "Same question, two schedules" in html and "cost_compare.png" in html


def test_the_bundled_tiny_pair_asks_one_question(tmp_path, cli):
    with Ledger.open(str(tmp_path / "ledger.db"), create=True) as ledger:
        actions.freeze(ledger, TINY)
        actions.freeze(ledger, TWIN)
        tiny, twin = (
            load_state(ledger, "molmo2-perf-pass1-tiny"),
            load_state(ledger, "molmo2-perf-pass1-tiny-interleaved"),
        )
        assert same_question(tiny, twin) == []
        assert (tiny.registration().protocol.schedule, twin.registration().protocol.schedule) == (
            "sequential",
            "interleaved",
        )
        comparison = compare_schedules(ledger, "molmo2-perf-pass1-tiny", "molmo2-perf-pass1-tiny-interleaved")
    assert comparison["same_verdict"] is None and "not reached" in comparison["why"]  # nothing has run yet
    result = cli.ok(
        "report", "molmo2-perf-pass1-tiny", "--compare", "molmo2-perf-pass1-tiny-interleaved", "--out", tmp_path / "r"
    )
    assert "not comparable yet" in result.stdout


DIFFERENT = [
    (
        "a bound",
        lambda t: t.replace("bounds = { loss_abs = 1e-3 }", "bounds = { loss_abs = 1e-2 }"),
        "items.P1.oracles.P1a.bounds.loss_abs",
    ),
    ("the steps", lambda t: t.replace("steps = 6\n", "steps = 8\n"), "protocol.steps"),
    ("a rule", lambda t: t.replace('when = "primary >= 0.05"', 'when = "primary >= 0.02"'), "rules.faster.when"),
    ("the profile's config", lambda t: t.replace("batch = 2,", "batch = 3,"), "protocol.config.batch"),
    (
        "a rung's own config",
        lambda t: t.replace('  id = "B"\n', '  id = "B"\n  config = { batch = 1 }\n'),
        "protocol.rungs.B.config",
    ),
]


@pytest.mark.parametrize("what, change, path", DIFFERENT, ids=[d[0] for d in DIFFERENT])
def test_a_pair_that_asks_different_questions_is_refused_with_exit_2_and_nothing_written(
    tmp_path, cli, ledger_path, what, change, path
):
    # The sequential registration carries the change (an interleaved ladder cannot even set a rung's own config).
    cli.ok("freeze", write(tmp_path, "micro.toml", change(MICRO)))
    cli.ok("freeze", write(tmp_path, "micro-interleaved.toml", interleaved(MICRO, "micro-interleaved")))
    before = ledger_fingerprint(ledger_path)
    out = tmp_path / "report"
    result = cli.on_ledger("report", "micro", "--compare", "micro-interleaved", "--out", out, "--json")
    assert result.exit_code == 2, result.stdout
    error = result.json()
    assert "do not ask the same question" in error["error"] and path in error["error"], error
    assert "protocol.schedule" in error["fix"]
    assert ledger_fingerprint(ledger_path) == before and not out.exists()


def test_comparing_a_registration_with_itself_is_refused(tmp_path, cli):
    cli.ok("freeze", write(tmp_path, "micro.toml", MICRO))
    result = cli.on_ledger("report", "micro", "--compare", "micro", "--out", tmp_path / "r")
    assert result.exit_code == 2 and "itself" in result.stderr and not (tmp_path / "r").exists()
