"""Power before compute, through the CLI: `check` and `freeze` show each bar's sensitivity (docs/design.md's keys),
`run` refuses (exit 3) or extends before any rung as `on_underpowered` says, the A/A calibration is recorded and
counted, `verdict` shows each compared read's flip probability, `audit sensitivity` reads the whole ledger again.

Noise of known size comes from `prereg record` of an earlier registration's windows (the same workload, profile,
window length and config): the engine's own timing on a shared CPU is too uneven to pin a number on."""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

import pytest
from conftest import Cli, lab_ledger_copy, ledger_fingerprint, prereg_process, record_file, write
from sqlalchemy.exc import OperationalError

from prereg.calibration import calibration_runs, rung_cost_estimate
from prereg.ledger import Ledger
from prereg.state import load_state

SENSITIVITY_KEYS = {
    "read",
    "rule",
    "bar",
    "noise_cv",
    "noise_source",
    "windows_per_rung",
    "se",
    "mde",
    "windows_needed",
    "powered",
}
# A config as small as the tiny profile takes: one sample, one camera, one chunk.
CONFIG = "{ batch = 1, backward_chunks = 1, camera_counts = [1], max_crops = 1 }"
SEEDED_WINDOWS = 16


def ladder(
    reg_id: str,
    rules: list[tuple[str, str]],
    *,
    steps: int,
    discard_first: int = 0,
    protocol_extra: str = "",
    ceiling_gpu_h: float = 0.5,
) -> str:
    """Two rungs of the baseline (an A/A ladder: no items, so no oracle gate) and the read of their gain."""
    rule_tables = "".join(f'[[rules]]\nid = "{rid}"\nwhen = "{when}"\noutcome = "{rid}"\n' for rid, when in rules)
    return f"""
id = "{reg_id}"
title = "power before compute"
question = "can the ladder see its bars?"
workload = "molmo2"
profile = "cpu-tiny"

[cost]
ceiling_gpu_h = {ceiling_gpu_h}
on_ceiling = "stop"

[protocol]
steps = {steps}
log_every = 1
discard_first = {discard_first}
config = {CONFIG}
{protocol_extra}
  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "B"

[reads]
gain = "(A.s_per_step - B.s_per_step) / A.s_per_step"

{rule_tables}
"""


def seeded_windows(tmp_path: Path, *, cv: float = 0.02) -> Path:
    """A record of rungs A and B of the earlier registration: SEEDED_WINDOWS windows each, independent, `cv`."""
    rng = random.Random(7)
    parts = []
    for rung in "AB":
        parts.append(f'[rungs.{rung}]\nitems = []\nstatus = "finished"\n')
        parts += [
            f"[[rungs.{rung}.windows]]\nstep = {k + 1}\ns_per_step = {1.0 + cv * rng.gauss(0, 1)!r}\n"
            for k in range(SEEDED_WINDOWS)
        ]
    return record_file(tmp_path, "seeded.toml", *parts, provenance="windows of known noise, seeded")


def seed_earlier(cli: Cli, tmp_path: Path) -> None:
    earlier = write(tmp_path, "earlier.toml", ladder("earlier", [("any", "gain >= 0.5")], steps=SEEDED_WINDOWS))
    cli.ok("freeze", earlier)
    cli.ok("record", "earlier", seeded_windows(tmp_path))


# --- check and freeze --------------------------------------------------------------------------------------------


def test_check_on_an_empty_ledger_has_the_keys_and_null_power_with_the_reason(cli: Cli, tmp_path: Path) -> None:
    path = write(tmp_path, "power.toml", ladder("power", [("faster", "gain >= 0.05")], steps=8))
    empty = tmp_path / "empty.db"
    Ledger.open(str(empty)).close()
    before = ledger_fingerprint(empty)
    result = cli("check", path, "--json", "--ledger", empty)
    assert result.exit_code == 0, result.stdout
    payload = result.json()
    (row,) = payload["sensitivity"]
    assert set(row) == SENSITIVITY_KEYS
    assert (row["read"], row["rule"], row["bar"], row["windows_per_rung"]) == ("gain", "faster", 0.05, 8)
    assert (row["powered"], row["noise_source"], row["mde"], row["windows_needed"]) == (None, "none", None, None)
    reasons = [n["note"] for n in payload["sensitivity_notes"] if n["read"] == "gain"]
    assert reasons and all("no earlier finished run of molmo2 on cpu-tiny" in r for r in reasons), reasons
    assert ledger_fingerprint(empty) == before  # check opens the ledger read-only: nothing written

    missing = tmp_path / "nowhere.db"
    payload = cli("check", path, "--json", "--ledger", missing).json()
    assert payload["sensitivity"][0]["powered"] is None
    assert any("no ledger file here" in n["note"] for n in payload["sensitivity_notes"])
    assert not missing.exists()  # and never creates one


def test_a_ledger_opened_read_only_refuses_a_write(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    Ledger.open(str(path)).close()
    with pytest.raises(ValueError, match="read-only ledger cannot be created"):
        Ledger.open(str(tmp_path / "new.db"), read_only=True)
    store = Ledger.open(str(path), create=False, read_only=True)
    try:
        with pytest.raises(OperationalError, match="attempt to write a readonly database"):  # SQLite's own refusal
            store.append("freeze", "x", {})
        assert store.head()[0] == 0
    finally:
        store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.db", "ledger.db.lock"]  # no -wal or -shm left


def test_a_ledger_with_windows_of_known_noise_powers_one_bar_and_not_another(cli: Cli, tmp_path: Path) -> None:
    seed_earlier(cli, tmp_path)
    path = write(
        tmp_path,
        "power.toml",
        ladder("power", [("big", "gain >= 0.2"), ("small", "gain >= 0.01")], steps=4, protocol_extra=""),
    )
    before = ledger_fingerprint(cli.ledger)
    rows = {row["rule"]: row for row in cli.ok_json("check", path)["sensitivity"]}
    assert ledger_fingerprint(cli.ledger) == before
    big, small = rows["big"], rows["small"]
    for row in (big, small):
        assert row["noise_source"] == "ledger" and row["noise_cv"] == pytest.approx(0.02, rel=0.5)
        assert row["windows_per_rung"] == 4 and row["se"] > 0
    assert big["powered"] is True and big["mde"] <= 0.2 and big["windows_needed"] <= 4
    assert small["powered"] is False and small["mde"] > 0.01 and small["windows_needed"] > 4

    frozen = cli.ok("freeze", path).stdout
    said = " ".join(frozen.split())  # a warning folds at the terminal's width
    assert frozen.count("UNDERPOWERED") == 1 and "UNDERPOWERED: gain (rule small) bar 0.01: MDE" in said, frozen
    assert f"needs {small['windows_needed']} windows per rung · on_underpowered = warn" in said
    assert cli.ok_json("freeze", path)["sensitivity"] == list(rows.values())  # freeze --json: the same rows


def test_with_protocol_noise_the_bars_await_the_calibration(cli: Cli, tmp_path: Path) -> None:
    seed_earlier(cli, tmp_path)  # known noise in the ledger: the calibration, this ladder's own, is still preferred
    noise = 'on_underpowered = "refuse"\n  [protocol.noise]\n  windows = 4'
    path = write(tmp_path, "aa.toml", ladder("aa", [("r", "gain >= 0.05")], steps=4, protocol_extra=noise))
    payload = cli.ok_json("check", path)
    (row,) = payload["sensitivity"]
    assert (row["noise_source"], row["noise_cv"], row["powered"]) == ("aa", None, None)
    assert any("to be measured by the A/A calibration at run" in n["note"] for n in payload["sensitivity_notes"])
    text = cli.ok("check", path).stdout
    assert "A/A at run" in text and "sensitivity at 4 read windows per rung" in text


# --- run: refuse, the calibration, extend ------------------------------------------------------------------------


def entries(ledger: Path, reg_id: str, kind: str) -> list:
    store = Ledger.open(str(ledger), create=False)
    try:
        return list(store.entries(reg_id=reg_id, kinds=(kind,)))
    finally:
        store.close()


def test_refuse_stops_before_any_rung_after_a_recorded_and_counted_calibration(cli: Cli, tmp_path: Path) -> None:
    """The calibration runs the baseline twice for four read windows (after two warm-up steps); a 1% bar at one
    read window per rung needs a timing CV under 0.2% (the MDE at one window is about five CVs), which no CPU step
    time has: refused, exit 3, no rung. The calibration's time is in the gate's, and so in the ladder's cost."""
    noise = 'on_underpowered = "refuse"\n  [protocol.noise]\n  windows = 4'
    text = ladder("aa", [("faster", "gain >= 0.01")], steps=3, discard_first=2, protocol_extra=noise)
    path = write(tmp_path, "aa.toml", text)
    ledger = cli.ledger
    cli.ok("freeze", path)
    refused = prereg_process("run", "aa", "--file", str(path), "--json", ledger=ledger, check=False)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    error = json.loads(refused.stdout)
    assert error["exit_code"] == 3 and error["error"].startswith("on_underpowered = refuse: 1 bar(s)")
    assert "gain (rule faster) bar 0.01: MDE" in error["error"] and "at 1 read windows per rung" in error["error"]
    assert 'on_underpowered = "extend"' in error["fix"] and "before any rung runs" in error["fix"]
    assert not entries(ledger, "aa", "run-start")  # before any rung

    calibration = entries(ledger, "aa", "calibration")
    assert [e.data["run"] for e in calibration] == [1, 2]
    for entry in calibration:
        data = entry.data
        assert (data["rung"], data["items"], data["steps"]) == ("A", [], 6)  # 2 warm-up steps + 4 read windows
        assert [w["step"] for w in data["windows"]] == [1, 2, 3, 4, 5, 6]
        assert all("s_per_step" in w for w in data["windows"])
        assert data["gpu_s"] > 0 and data["gpu_s"] == pytest.approx(data["load_gpu_s"] + data["steps_gpu_s"], abs=1e-3)
    (gate,) = entries(ledger, "aa", "gate")
    assert gate.data["calibration"] == [e.ref for e in calibration]
    (cost,) = cli.ok_json("audit", "costs")["registrations"]
    calibrated_s = sum(e.data["gpu_s"] for e in calibration)
    assert cost["gpu_s"] == pytest.approx(gate.data["gpu_s"], abs=1e-3) and cost["split"]["oracle"] >= calibrated_s


def test_extend_runs_the_extended_steps_and_records_why(cli: Cli, tmp_path: Path) -> None:
    """Earlier windows of 2% noise: a 4% bar needs more than the planned two read windows per rung; the ladder
    extends before its first rung and both rungs run the extended steps, which the verdict reads."""
    ledger = cli.ledger
    seed_earlier(cli, tmp_path)
    text = ladder(
        "ext", [("faster", "gain >= 0.04")], steps=3, discard_first=1, protocol_extra='on_underpowered = "extend"'
    )
    path = write(tmp_path, "ext.toml", text)
    (planned,) = cli.ok_json("check", path)["sensitivity"]
    assert planned["powered"] is False and planned["windows_per_rung"] == 2 and planned["windows_needed"] > 2

    cli.ok("freeze", path)
    summary = json.loads(prereg_process("run", "ext", "--file", str(path), "--json", ledger=ledger, check=True).stdout)
    assert summary["complete"], summary
    windows = planned["windows_needed"]
    steps = 1 + windows  # the warm-up step, then the windows the bar needs
    assert summary["power"]["steps"] == steps and summary["power"]["decided"] == "now"
    (extension,) = entries(ledger, "ext", "extension")
    data = extension.data
    assert (data["from_steps"], data["steps"], data["from_windows"], data["windows"]) == (3, steps, 2, windows)
    (bar,) = data["bars"]
    assert bar["read"] == "gain" and bar["noise_source"] == "ledger" and bar["powered"] is False
    assert bar["mde"] == pytest.approx(planned["mde"]) and data["unreachable"] == []
    starts = entries(ledger, "ext", "run-start")
    assert sorted(e.data["rung"] for e in starts) == ["A", "B"] and all(e.data["steps"] == steps for e in starts)
    assert all(e.seq > extension.seq for e in starts)  # decided before the first rung
    store = Ledger.open(str(ledger), create=False)
    runs = load_state(store, "ext").runs
    store.close()
    assert [(r.status, len(r.windows)) for r in runs] == [("finished", steps)] * 2

    verdict = cli.ok_json("verdict", "ext")
    assert [r["windows"] for r in verdict["rungs"]] == [windows, windows]  # the verdict reads the extension
    resumed = json.loads(prereg_process("run", "ext", "--file", str(path), "--json", ledger=ledger, check=True).stdout)
    assert resumed["power"]["decided"] == "before" and resumed["power"]["steps"] == steps
    assert len(entries(ledger, "ext", "extension")) == 1


def test_a_profile_of_several_processes_refuses_the_calibration(cli: Cli, tmp_path: Path) -> None:
    noise = "  [protocol.noise]\n  windows = 4"
    text = ladder("aa2", [("r", "gain >= 0.05")], steps=3, protocol_extra=noise).replace("cpu-tiny", "cpu-tiny-x2")
    path = write(tmp_path, "aa2.toml", text)
    cli.ok("freeze", path)
    result = cli.on_ledger("run", "aa2", "--file", path, "--json")
    assert result.exit_code == 3 and "runs each rung as 2 processes" in result.json()["error"], result.stdout
    assert not entries(cli.ledger, "aa2", "gate")


# --- after the data ------------------------------------------------------------------------------------------------


def decided(cli: Cli, tmp_path: Path, reg_id: str, below_gain: float) -> float:
    """A registration whose rungs are recorded (16 windows each, 5% noise, B about 3% faster) and decided, its
    bar `below_gain` under the recorded gain; returns the gain."""
    rng = random.Random(11)
    series = {rung: [level * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(SEEDED_WINDOWS)] for rung, level in LEVELS}
    gain = (statistics.median(series["A"]) - statistics.median(series["B"])) / statistics.median(series["A"])
    text = ladder(reg_id, [("near", f"gain >= {gain - below_gain!r}")], steps=SEEDED_WINDOWS)
    cli.ok("freeze", write(tmp_path, f"{reg_id}.toml", text))
    parts = []
    for rung, values in series.items():
        parts.append(f'[rungs.{rung}]\nitems = []\nstatus = "finished"\n')
        parts += [f"[[rungs.{rung}.windows]]\nstep = {k + 1}\ns_per_step = {v!r}\n" for k, v in enumerate(values)]
    cli.ok("record", reg_id, record_file(tmp_path, f"{reg_id}-rec.toml", *parts))
    cli.ok("verdict", reg_id)
    return gain


LEVELS = (("A", 1.0), ("B", 0.97))


def test_the_verdict_shows_each_compared_reads_flip_beside_its_interval(cli: Cli, tmp_path: Path) -> None:
    decided(cli, tmp_path, "near", 1e-9)
    verdict = cli.ok_json("verdict", "near")
    flip = verdict["robustness"]["gain"]
    assert flip["fragile"] is True, flip  # the bar a hair under the gain: about half the resamples cross it
    text = cli.ok("verdict", "near").stdout
    header = next(line for line in text.splitlines() if "95% interval" in line)
    assert header.index("95% interval") < header.index("flip") < header.index("undefined because"), header
    (row,) = [line for line in text.splitlines() if line.startswith("│ gain ")]
    assert f"{flip['flip_probability']:.2f} fragile" in row, row


def test_audit_sensitivity_reads_each_decision_again_with_the_power_it_had_before_its_data(
    cli: Cli, tmp_path: Path
) -> None:
    gain = decided(cli, tmp_path, "first", 0.1)  # frozen before any other windows: no noise known before its data
    decided(cli, tmp_path, "second", 1e-9)  # frozen after first's windows were recorded: their noise is its power
    result = cli.ok_json("audit", "sensitivity")
    assert set(result) == {"reads", "without_bars", "counts"}
    rows = {row["id"]: row for row in result["reads"]}
    extra = {"id", "outcome", "post_hoc", "value", "flip_probability", "fragile", "notes"}
    for row in rows.values():
        assert set(row) == SENSITIVITY_KEYS | extra
        assert row["read"] == "gain" and row["windows_per_rung"] == SEEDED_WINDOWS
        assert row["value"] == pytest.approx(gain)
    first, second = rows["first"], rows["second"]
    assert (first["powered"], first["noise_source"], first["fragile"]) == (None, "none", False)
    assert any("no earlier finished run" in note for note in first["notes"])
    assert (second["noise_source"], second["fragile"]) == ("ledger", True)
    assert second["noise_cv"] == pytest.approx(0.05, rel=0.5)
    assert second["powered"] is False and second["mde"] > second["bar"]  # a 3% bar is too fine for 5% windows
    assert result["counts"] == {"decided": 2, "compared": 2, "fragile": 1, "underpowered": 1, "power_unknown": 1}
    text = cli.ok("audit", "sensitivity").stdout
    assert "compared reads: robustness after the data, power before it" in text
    assert "2 decided · 2 compared reads · 1 fragile · 1 underpowered before their data" in text

    out = tmp_path / "report"
    cli.ok("report", "second", "--out", out)
    report = (out / "report.md").read_text(encoding="utf-8")
    power = report.split("\n## Sensitivity\n", 1)[1]
    mde = f"{second['mde']:.4g}"
    assert "Before the data, at 16 read windows per rung" in power and "| gain | near | " in power and mde in power
    assert "| **no** |" in power and "| **fragile** |" in power  # underpowered before, fragile after
    assert (out / "robustness.png").stat().st_size > 0 and "robustness.png" in report


# --- the command workload: the calibration and the extension run the user's script -------------------------------

# Windows of 5% noise around 20 ms a step (10 ms with the switch `fast`), seeded by the rung the engine names
# (PREREG_RUNG): every run of the test sees the same windows, so the noise the calibration measures is fixed.
NOISY_SCRIPT = """
import json, os, random

steps, every = int(os.environ["PREREG_STEPS"]), int(os.environ["PREREG_LOG_EVERY"])
rng = random.Random(os.environ["PREREG_RUNG"])
level = 0.01 if "fast" in os.environ["PREREG_SWITCHES"].split(",") else 0.02
with open(os.environ["PREREG_WINDOWS"], "a") as out:
    for step in range(1, steps + 1):
        if step % every == 0 or step == steps:
            out.write(json.dumps({"steps": step, "s_per_step": level * (1 + 0.05 * rng.gauss(0, 1))}) + "\\n")
"""
PARITY_PROBE = 'import json\nprint(json.dumps({"loss_abs": 0.0}))\n'


def command_ladder(tmp_path: Path, on_underpowered: str, script: str = NOISY_SCRIPT) -> Path:
    """A script's A/B ladder with one read window per rung and a 10% bar: 5% windows need several."""
    lab = tmp_path / "lab"
    lab.mkdir(exist_ok=True)
    (lab / "train.py").write_text(script)
    (lab / "probe.py").write_text(PARITY_PROBE)
    python = Path(sys.executable)
    text = f"""
id = "cmd-power"
title = "a script's ladder, powered before compute"
question = "does the fast switch make a step at least 10% shorter?"
workload = "command"
profile = "local"

[command]
run = "{python} train.py"
probe = "{python} probe.py"
sources = ["train.py", "probe.py"]
switches = ["fast"]
metrics = ["s_per_step"]
probes = {{ parity = ["loss_abs"] }}

[cost]
ceiling_gpu_h = 0.5
on_ceiling = "stop"

[[items]]
id = "fast-item"
title = "the fast switch"
switch = "fast"
bitwise = false
  [[items.oracles]]
  id = "fast-parity"
  kind = "tolerance"
  probe = "parity"
  bounds = {{ loss_abs = 1e-4 }}

[protocol]
steps = 2
log_every = 1
discard_first = 1
on_underpowered = "{on_underpowered}"
  [protocol.noise]
  windows = 4
  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "B"
  items = ["fast-item"]

[reads]
gain = "(A.s_per_step - B.s_per_step) / A.s_per_step"

[[rules]]
id = "faster"
when = "gain >= 0.1"
outcome = "land-fast"
land = ["fast-item"]
"""
    return write(lab, "cmd-power.toml", text)


def test_check_of_the_bundled_command_example_assesses_its_bars_from_the_scripts_metrics(
    cli: Cli, tmp_path: Path
) -> None:
    """The command example's bars are rows from the script's own metrics (each summarised by a median), unknown on a
    ledger without earlier windows of the same [command] table, the reason given per rung and metric."""
    example = Path(__file__).resolve().parent.parent / "examples" / "command" / "mlp-matmul.toml"
    empty = tmp_path / "empty.db"
    Ledger.open(str(empty)).close()
    result = cli("check", example, "--json", "--ledger", empty)
    assert result.exit_code == 0, result.stdout
    payload = result.json()
    rows = {(row["read"], row["rule"]): row for row in payload["sensitivity"]}
    assert set(rows) == {("speedup", "R1"), ("loss_gap", "R1"), ("speedup", "R2"), ("loss_gap", "R2")}
    assert all(set(row) == SENSITIVITY_KEYS and row["powered"] is None for row in rows.values())
    assert rows[("speedup", "R1")]["windows_per_rung"] == 8  # (300 - 60) / 30
    notes = {(n["read"], n["note"]) for n in payload["sensitivity_notes"]}
    assert ("speedup", "A.s_per_step: no earlier finished run of command (this [command] table) on local with "
            "log_every = 30 and rung A's config has s_per_step windows") in notes  # fmt: skip
    assert any(
        read == "loss_gap" and note.startswith("A.loss: no earlier finished run of command") for read, note in notes
    )


def test_a_command_ladder_is_refused_from_its_scripts_calibration_then_extended(cli: Cli, tmp_path: Path) -> None:
    """The gate runs the user's script as the A/A calibration (the baseline rung A, twice, for 4 read windows after
    the warm-up step); one read window cannot see a 10% bar in 5% windows: refused (exit 3), no rung. Amended to
    `extend`, the same calibration decides the windows and the cost projected with them, which the ceiling judges;
    with room under it, both rungs run the script for the extended steps."""
    ledger = cli.ledger
    path = command_ladder(tmp_path, "refuse")
    (planned,) = cli.ok_json("check", path)["sensitivity"]
    assert (planned["noise_source"], planned["powered"], planned["windows_per_rung"]) == ("aa", None, 1)
    cli.ok("freeze", path)
    refused = prereg_process("run", "cmd-power", "--file", str(path), "--json", ledger=ledger, check=False)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    error = json.loads(refused.stdout)["error"]
    assert "gain (rule faster) bar 0.1" in error and "noise CV" in error and "aa)" in error, error
    assert not entries(ledger, "cmd-power", "run-start")
    calibration = entries(ledger, "cmd-power", "calibration")
    assert [(e.data["run"], e.data["rung"], e.data["steps"]) for e in calibration] == [(1, "A", 5), (2, "A", 5)]
    for entry in calibration:
        assert [w["step"] for w in entry.data["windows"]] == [1, 2, 3, 4, 5]
        assert all(0.015 < w["s_per_step"] < 0.025 for w in entry.data["windows"])  # the script's, not the engine's
    assert calibration[0].data["windows"] != calibration[1].data["windows"]  # two runs, two seeds
    (gate,) = entries(ledger, "cmd-power", "gate")
    assert gate.data["oracles"] == ["fast-parity"] and gate.data["calibration"] == [e.ref for e in calibration]

    # Extended under a ceiling the gate has already spent: the extension is decided and recorded with its projected
    # cost (the calibration's time per step at the extended steps), and the ceiling stops the ladder before a rung.
    extend = 'reason = "extend instead"\n[set.protocol]\non_underpowered = "extend"\n[set.cost]\nceiling_gpu_h = 1e-6\n'
    cli.ok("amend", "cmd-power", write(tmp_path, "extend.toml", extend))
    run = ["run", "cmd-power", "--file", str(path), "--json"]
    stopped = json.loads(prereg_process(*run, ledger=ledger, check=True).stdout)
    assert stopped["stopped"] == "ceiling" and stopped["runs"] == [] and stopped["power"]["decided"] == "now"
    (extension,) = entries(ledger, "cmd-power", "extension")
    windows, steps = extension.data["windows"], extension.data["steps"]
    assert windows > 1 and steps == 1 + windows and extension.data["from_windows"] == 1
    (bar,) = extension.data["bars"]
    assert (bar["rule"], bar["noise_source"], bar["windows_needed"]) == ("faster", "aa", windows)
    projection = extension.data["projection"]
    with Ledger.open(str(ledger), create=False) as store:
        reg = load_state(store, "cmd-power").registration()
        per_rung = rung_cost_estimate(calibration_runs(store, "cmd-power", reg, ()), steps)
    assert projection["per_rung_gpu_s"] == pytest.approx(per_rung) and projection["over_ceiling"] is True
    assert projection["projected_gpu_s"] == pytest.approx(projection["spent_gpu_s"] + 2 * per_rung)
    (ceiling,) = entries(ledger, "cmd-power", "ceiling")
    assert ceiling.data["action"] == "stopped before the next rung" and not entries(ledger, "cmd-power", "run-start")

    # With room under the ceiling the recorded extension stands (decided before, not again), and so does the
    # calibration: both rungs run the script for the extended steps.
    cli.ok("amend", "cmd-power", write(tmp_path, "room.toml", 'reason = "room"\n[set.cost]\nceiling_gpu_h = 0.5\n'))
    summary = json.loads(prereg_process(*run, ledger=ledger, check=True).stdout)
    assert summary["complete"] and summary["power"]["decided"] == "before", summary
    assert len(entries(ledger, "cmd-power", "extension")) == 1
    assert len(entries(ledger, "cmd-power", "calibration")) == 2
    starts = entries(ledger, "cmd-power", "run-start")
    assert sorted((e.data["rung"], e.data["steps"]) for e in starts) == [("A", steps), ("B", steps)]
    verdict = cli.ok_json("verdict", "cmd-power")
    assert [r["windows"] for r in verdict["rungs"]] == [windows, windows]
    assert verdict["rule"] == "faster" and verdict["robustness"]["gain"]["fragile"] is False


# --- docs/results.md -----------------------------------------------------------------------------------------------

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results.md"


def results_cell(value) -> str:
    """A value as docs/results.md's sensitivity table writes it: three significant digits, `—` for null."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def test_the_results_tables_power_and_fragility_are_the_ledgers(tmp_path: Path) -> None:
    """docs/results.md's table of `prereg audit sensitivity` is what the committed ledger computes: a new verdict
    (or a new record of earlier windows) that changes it must change the notebook too."""
    from prereg.audit import audit_sensitivity

    section = RESULTS.read_text(encoding="utf-8").split("\n## Power before compute, for the decisions already banked")
    table = section[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    with Ledger.open(str(lab_ledger_copy(tmp_path / "ledger.db")), create=False, read_only=True) as ledger:
        computed = audit_sensitivity(ledger)
    expected = []
    for r in computed["reads"]:
        flip = "—" if r["flip_probability"] is None else f"{r['flip_probability']:.2f}"
        flip += " **fragile**" if r["fragile"] else ""
        cells = [f"`{r['id']}`", f"{r['read']} ({r['rule']})", f"{results_cell(r['value'])} vs {r['bar']:g}", flip]
        cells += [results_cell(r["mde"]), results_cell(r["windows_needed"]), results_cell(r["powered"])]
        expected.append("| " + " | ".join(cells) + " |")
    assert rows == expected
    counts = computed["counts"]
    assert (
        f"{counts['decided']} decided verdicts, {counts['compared']} compared reads: {counts['fragile']} fragile, "
        f"{counts['underpowered']} underpowered before their data, {counts['power_unknown']} with no noise known"
    ) in table


def test_a_script_that_fails_its_calibration_stops_the_run_with_its_reason_and_no_rung(
    cli: Cli, tmp_path: Path
) -> None:
    path = command_ladder(tmp_path, "warn", script='import sys\nsys.exit("no GPU here, on purpose")\n')
    cli.ok("freeze", path)
    result = prereg_process("run", "cmd-power", "--file", str(path), "--json", ledger=cli.ledger, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    error = json.loads(result.stdout)
    assert error["error"].startswith("the A/A calibration failed (gate entry ") and "exited with 1" in error["error"]
    assert "no GPU here, on purpose" in error["error"] and "calibration runs again" in error["fix"]
    (gate,) = entries(cli.ledger, "cmd-power", "gate")
    assert gate.data["oracles"] == ["fast-parity"] and gate.data["calibration"] == [] and gate.data["gpu_s"] > 0
    assert not entries(cli.ledger, "cmd-power", "calibration") and not entries(cli.ledger, "cmd-power", "run-start")
