"""A crash is something a kill line can see: a rung that raises ends with a crash window (`step`, `rc`), the kill
lines judge it, and a line that says `rc != 0` fires its contingency on a crash — the Molmo2 rung crashed by its
planted fault, the command rung by a script that exits non-zero mid-run. Without the `rc` clause the crash stays a
failure that stops the ladder, and no read sees the crash window."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import Cli, prereg_process

from engine.crash import crash_window
from engine.killwatch import KillWatch
from engine.molmo2.planted import CRASH_VARIABLE, planted_crash
from prereg.ledger import Ledger
from prereg.schema import Registration
from prereg.state import load_state, summarize

ROOT = Path(__file__).resolve().parent.parent
MICRO = (ROOT / "tests" / "data" / "micro.toml").read_text()
CRASH_CLAUSE = "not finite(loss) or rc != 0"


def with_kill(text: str, when: str, rung: str, drops: str, at: str = "") -> str:
    return text + f'\n[[kill]]\nid = "K-crash"\nwhen = "{when}"\nrungs = ["{rung}"]\ndrops = ["{drops}"]\n{at}'


def state_of(ledger: Path, reg_id: str):
    store = Ledger.open(str(ledger), create=False)
    try:
        return load_state(store, reg_id), store.verify()
    finally:
        store.close()


# --- the crash window and the kill watch -------------------------------------------------------------------------


def micro_reg(when: str, at: str = "") -> Registration:
    import tomllib

    text = MICRO.replace("discard_first = 2\n", "discard_first = 2\nsave_every = 4\n") if at else MICRO
    return Registration.model_validate(tomllib.loads(with_kill(text, when, "C", "P4", at)))


MEASURED = [{"step": 2, "loss": 5.0, "finite": True, "s_per_step": 0.05}]


def test_a_crash_window_holds_step_and_rc_and_no_measured_metric():
    window = crash_window(MEASURED, 1, None, 1)
    assert window == {"step": 2, "rc": 1, "world_size": 1}
    assert crash_window(MEASURED, 1, 7, 1)["rc"] == 7  # the script's own exit status
    assert crash_window(MEASURED, 1, 0, 1)["rc"] == 1  # a script that exited 0 on a broken contract: the rung's
    assert crash_window([], 1, None, 2)["step"] == 0


def test_the_rc_clause_fires_on_a_crash_window_and_the_finite_clause_alone_does_not():
    crashed = [*MEASURED, crash_window(MEASURED, 1, None, 1)]
    fired = KillWatch(micro_reg(CRASH_CLAUSE), "C", ("P4",)).check(crashed, final=True)
    assert fired is not None and fired["kill"] == "K-crash" and fired["drops"] == ["P4"] and fired["step"] == 2
    assert "the run crashed" in fired["reason"]
    # loss is absent from a crash window, not zero: `not finite(loss)` is undefined there and does not fire
    assert KillWatch(micro_reg("not finite(loss)"), "C", ("P4",)).check(crashed, final=True) is None
    # on a measured window `rc` is absent: the clause never fires on one
    assert KillWatch(micro_reg(CRASH_CLAUSE), "C", ("P4",)).check(MEASURED) is None


def test_a_save_line_fires_on_the_crash_window_with_no_boundary_to_wait_for():
    reg = micro_reg(CRASH_CLAUSE, 'at = "save"\n')
    crashed = [*MEASURED, crash_window(MEASURED, 1, None, 1)]
    fired = KillWatch(reg, "C", ("P4",)).check(crashed, final=True)
    assert fired is not None and "the run crashed at step 2" in fired["reason"]


def test_the_planted_crash_variable_names_a_switch_and_a_step():
    assert planted_crash({}) is None
    assert planted_crash({CRASH_VARIABLE: "no_embed_clone@3"}) == ("no_embed_clone", 3)
    for bad in ("no_embed_clone", "no_embed_clone@0", "@3", "no_embed_clone@x"):
        with pytest.raises(ValueError, match="SWITCH@STEP"):
            planted_crash({CRASH_VARIABLE: bad})


# --- the Molmo2 rung, crashed at its planted fault -------------------------------------------------------------


def run_micro(tmp_path: Path, monkeypatch, when: str) -> tuple[dict, Path]:
    path = tmp_path / "micro.toml"
    path.write_text(with_kill(MICRO, when, "C", "P4"))
    ledger = tmp_path / "ledger.db"
    Cli(ledger, tmp_path).ok("freeze", path)
    # C carries P4 (no_embed_clone): its third step's batch is planted with the <im_patch> mismatch
    monkeypatch.setenv(CRASH_VARIABLE, "no_embed_clone@3")
    result = prereg_process("run", "micro", "--file", str(path), "--json", ledger=ledger, check=False)
    return json.loads(result.stdout), ledger


def test_a_molmo2_crash_fires_the_rc_clause_and_the_ladder_re_plans(tmp_path, monkeypatch):
    summary, ledger = run_micro(tmp_path, monkeypatch, CRASH_CLAUSE)
    assert summary["complete"], summary
    state, report = state_of(ledger, "micro")
    assert report.ok
    [crashed] = [r for r in state.runs if r.rung == "C"]
    assert crashed.status == "killed" and crashed.ended_by["kill"] == "K-crash"
    assert "<im_patch>" in crashed.ended_by["error"]
    assert crashed.crash_window == {"step": 2, "rc": 1, "world_size": 1}
    assert state.kills[-1]["step"] == 2 and "the run crashed" in state.kills[-1]["reason"]
    assert state.dropped()["P4"]["cause"] == "kill"
    [primed] = [r for r in state.runs if r.rung == "C'"]
    assert primed.status == "finished" and primed.items == ("P2",)
    # The crash window is no measured window: the crashed run's one window is all a read could see of it.
    assert [w["step"] for w in crashed.windows] == [2] and crashed.n_windows == 1
    summary_c, samples = summarize(crashed, 0, state.registration().declaration())
    assert "rc" not in samples and samples["s_per_step"] == [crashed.windows[0]["s_per_step"]]
    shown = Cli(ledger, tmp_path).ok("audit", "show", "micro").stdout
    assert "killed by K-crash at step 2 (crashed at step 2, rc 1)" in shown
    verdict = Cli(ledger, tmp_path).ok_json("verdict", "micro")
    assert verdict["dropped"]["P4"]["kill"] == "K-crash"
    assert next(r for r in verdict["rungs"] if r["rung"] == "C")["run"] == primed.run_id


def test_without_the_rc_clause_a_molmo2_crash_fails_the_rung_and_stops_the_ladder(tmp_path, monkeypatch):
    summary, ledger = run_micro(tmp_path, monkeypatch, "not finite(loss)")
    assert summary["stopped"] == "failed" and not summary["complete"]
    state, report = state_of(ledger, "micro")
    assert report.ok and state.kills == []
    [crashed] = [r for r in state.runs if r.rung == "C"]
    assert crashed.status == "failed" and set(crashed.ended_by) == {"error"}
    assert crashed.crash_window == {"step": 2, "rc": 1, "world_size": 1}  # recorded all the same
    assert "P4" not in state.dropped()


# --- the command rung, whose script exits non-zero mid-run -------------------------------------------------------

# Exits 3 after its first window when the switch `risky` is on; trains to the end otherwise.
TRAIN = """
import json, os, sys

steps, every = int(os.environ["PREREG_STEPS"]), int(os.environ["PREREG_LOG_EVERY"])
risky = "risky" in os.environ["PREREG_SWITCHES"].split(",")
with open(os.environ["PREREG_WINDOWS"], "a") as out:
    for step in range(every, steps + 1, every):
        out.write(json.dumps({"steps": step, "s_per_step": 0.02, "loss": 1.0 / step}) + "\\n")
        out.flush()
        if risky:
            sys.exit(3)
"""
PROBE = 'import json\nprint(json.dumps({"loss_abs": 0.0}))\n'
COMMAND = """
id = "cmd-crash"
title = "a script that crashes"
question = "Does a crash drop what it suspects?"
workload = "command"
profile = "local"

[command]
run = "python train.py"
probe = "python probe.py"
sources = ["train.py", "probe.py"]
switches = ["risky", "safe"]
metrics = ["s_per_step", "loss"]
probes = {{ parity = ["loss_abs"] }}

[cost]
ceiling_gpu_h = 0.5
on_ceiling = "stop"
{items}
[protocol]
steps = 4
log_every = 2
discard_first = 0
  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "B"
  items = ["risky-item", "safe-item"]
"""
ITEM = """
[[items]]
id = "{switch}-item"
title = "switch {switch}"
switch = "{switch}"
bitwise = false
  [[items.oracles]]
  id = "{switch}-parity"
  kind = "tolerance"
  probe = "parity"
  bounds = {{ loss_abs = 1e-4 }}
"""


def run_command(tmp_path: Path, when: str) -> tuple[dict, Path]:
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    (tmp_path / "probe.py").write_text(PROBE)
    items = "".join(ITEM.format(switch=s) for s in ("risky", "safe"))
    path = tmp_path / "cmd-crash.toml"
    path.write_text(with_kill(COMMAND.format(items=items), when, "B", "risky-item"))
    ledger = tmp_path / "ledger.db"
    Cli(ledger, tmp_path).ok("freeze", path)
    result = prereg_process("run", "cmd-crash", "--file", str(path), "--json", ledger=ledger, check=False)
    return json.loads(result.stdout), ledger


def test_a_script_that_exits_nonzero_fires_the_rc_clause_and_the_ladder_re_plans(tmp_path):
    summary, ledger = run_command(tmp_path, CRASH_CLAUSE)
    assert summary["complete"], summary
    state, report = state_of(ledger, "cmd-crash")
    assert report.ok
    [crashed] = [r for r in state.runs if r.rung == "B"]
    assert crashed.status == "killed" and crashed.ended_by["kill"] == "K-crash"
    assert "exited with 3 after reporting 2 of 4 steps" in crashed.ended_by["error"]
    assert crashed.crash_window == {"step": 2, "rc": 3, "world_size": 1} and crashed.totals["rc"] == 3
    [primed] = [r for r in state.runs if r.rung == "B'"]
    assert primed.status == "finished" and primed.items == ("safe-item",)


def test_without_the_rc_clause_a_script_that_exits_nonzero_fails_the_rung(tmp_path):
    summary, ledger = run_command(tmp_path, "not finite(loss)")
    assert summary["stopped"] == "failed"
    state, report = state_of(ledger, "cmd-crash")
    assert report.ok and state.kills == []
    [crashed] = [r for r in state.runs if r.rung == "B"]
    assert crashed.status == "failed" and crashed.crash_window["rc"] == 3
    assert "crashed at step 2, rc 3" in Cli(ledger, tmp_path).ok("audit", "show", "cmd-crash").stdout


# --- a cluster job that died without ending its run ----------------------------------------------------------------


def lost_job(tmp_path: Path, when: str):
    """A frozen micro registration with a kill line on rung C, the run-start and first window of its rung C on a
    two-node job, and that job's entry: what the ledger holds when the job dies without ending its run."""
    from prereg.canonical import encode_nonfinite

    document = tmp_path / "micro.toml"
    document.write_text(with_kill(MICRO, when, "C", "P4"))
    ledger_path = tmp_path / "ledger.db"
    Cli(ledger_path, tmp_path).ok("freeze", document)
    ledger = Ledger.open(str(ledger_path), create=False)
    run_id = "micro-C-1"
    start = {"rung": "C", "declared_rung": "C", "items": ["P1", "P2", "P4"], "version": 1, "steps": 8}
    ledger.append("run-start", "micro", start, ref=run_id)
    ledger.append("window", "micro", encode_nonfinite({**MEASURED[0], "rung": "C", "elapsed_s": 0.1}), ref=run_id)
    job = ledger.append("job", "micro", {"purpose": "rung", "runs": {run_id: "C"}, "nodes": 2, "tasks_per_node": 1},
                        ref="4242")  # fmt: skip
    return ledger, job, run_id


@pytest.mark.parametrize(("when", "status"), [(CRASH_CLAUSE, "killed"), ("not finite(loss)", "failed")])
def test_a_slurm_job_that_died_ends_its_run_with_a_crash_window_its_kill_lines_judge(tmp_path: Path, when, status):
    """Slurm says the job ran out of memory and the rung never wrote its run's end: the settle records the crash
    window (the last recorded step, the job's exit status, its ranks) and the run's kill lines judge it as the rung
    would have — `rc != 0` fires its contingency, a line without it leaves the run failed."""
    from engine.launch.slurm import JobState, settle

    ledger, job, run_id = lost_job(tmp_path, when)
    try:
        assert settle(ledger, job, JobState("OUT_OF_MEMORY", "0:125")) == -125
        end = [e.data for e in ledger.entries(reg_id="micro", kinds=("run-end",), ref=run_id)]
        kills = [e.data for e in ledger.entries(reg_id="micro", kinds=("kill",), ref=run_id)]
        job_end = [e.data for e in ledger.entries(reg_id="micro", kinds=("job-end",), ref="4242")]
        assert ledger.verify().ok
    finally:
        ledger.close()
    assert len(end) == 1 and end[0]["status"] == status
    assert end[0]["crash_window"] == {"step": 2, "rc": -125, "world_size": 2}
    assert end[0]["ended_by"]["job_state"] == "OUT_OF_MEMORY" and "without ending its run" in str(end[0]["ended_by"])
    assert job_end[0]["runs"] == {run_id: status}
    if status == "killed":
        assert len(kills) == 1 and kills[0]["kill"] == "K-crash" and kills[0]["drops"] == ["P4"]
        assert end[0]["ended_by"]["kill"] == "K-crash"
    else:
        assert kills == []
