"""The engine end to end on the tiny workload, through the CLI: the oracle gate drops what fails, the ladder
re-plans, kill lines fire with their contingencies, the ceiling stops a ladder, signals and SIGKILL leave a
verifiable ledger that a second `prereg run` resumes, and refusals refuse."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Cli, prereg_process

from prereg.ledger import Ledger
from prereg.state import load_state

ROOT = Path(__file__).resolve().parent.parent
MICRO = (ROOT / "tests" / "data" / "micro.toml").read_text()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def prereg(*args: str, ledger: Path, check: bool = False) -> subprocess.CompletedProcess:
    return prereg_process(*args, ledger=ledger, check=check)


def in_process(*args: str, ledger: Path) -> dict:
    """A verb that reads or decides (freeze, verdict, audit), run in this process: only `run` needs a process of
    its own (the engine starts rung processes and handles signals)."""
    return Cli(ledger, ledger.parent).ok_json(*args)


def registration(tmp_path: Path, text: str = MICRO, name: str = "micro.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def on_cuda(text: str, profile: str) -> str:
    """MICRO on a CUDA profile, its items kept out of the baseline (CUDA's default baseline runs them already)."""
    return text.replace('profile = "cpu-tiny"', f'profile = "{profile}"').replace(
        "max_crops = 1 }", "max_crops = 1, baseline_switches = [] }", 1
    )


def frozen(tmp_path: Path, text: str = MICRO) -> tuple[Path, Path]:
    path = registration(tmp_path, text)
    ledger = tmp_path / "ledger.db"
    in_process("freeze", str(path), ledger=ledger)
    return path, ledger


def run_json(reg_id: str, path: Path, ledger: Path) -> dict:
    result = prereg("run", reg_id, "--file", str(path), "--json", ledger=ledger, check=True)
    return json.loads(result.stdout)


def state_of(ledger: Path, reg_id: str = "micro"):
    store = Ledger.open(str(ledger), create=False)
    try:
        return load_state(store, reg_id), store.verify()
    finally:
        store.close()


def test_tiny_ladder_end_to_end(tmp_path):
    path, ledger = frozen(tmp_path)
    # --gate-only: every oracle answers, no rung starts, and the summary says what is left.
    gated = json.loads(
        prereg("run", "micro", "--file", str(path), "--gate-only", "--json", ledger=ledger, check=True).stdout
    )
    assert (gated["complete"], gated["stopped"], gated["runs"]) == (False, "gate-only", []), gated
    assert gated["remaining"] and not any(r.startswith("oracle ") for r in gated["remaining"]), gated["remaining"]
    oracles_after_gate = state_of(ledger)[0].oracles
    summary = run_json("micro", path, ledger)
    assert summary["complete"], summary
    assert "cuDNN" in summary["dropped"]["P1"]["reason"]  # cannot run on a CPU: a failure, never a skip
    state, report = state_of(ledger)
    assert report.ok
    assert state.oracles == oracles_after_gate  # the resumed run re-ran no oracle
    finished = {r.rung: r for r in state.runs if r.status == "finished"}
    assert set(finished) == {"A", "C"}  # B tested only P1: not run
    assert finished["C"].items == ("P2", "P4")
    assert [len(r.windows) for r in finished.values()] == [3, 3]
    assert all("vram_window_peak_gib" in w for w in finished["C"].windows)  # P2 rides rung C
    assert all("vram_window_peak_gib" not in w for w in finished["A"].windows)
    start = next(Ledger.open(str(ledger), create=False).entries(reg_id="micro", kinds=("run-start",))).data
    for key in ("git", "python", "torch", "cuda", "cudnn", "gpu", "driver", "host", "profile", "seed"):
        assert key in start["env"], key

    # A second run re-runs nothing: finished rungs are never re-run, oracles with results are not re-run.
    runs_before = len(state.runs)
    again = run_json("micro", path, ledger)
    assert again["complete"]
    assert len(state_of(ledger)[0].runs) == runs_before

    verdict = in_process("verdict", "micro", ledger=ledger)
    assert verdict["rule"] in ("faster", "not-faster")
    assert verdict["reads"]["primary"] is not None
    assert "primary" in verdict["intervals"]  # a bootstrap interval beside the value
    assert verdict["dropped"]["P1"]["oracle"] == "P1a"
    assert [e["result"] for e in verdict["expectations"]] == ["miss"]


def test_kill_line_fires_and_its_contingency_reruns_the_rung_primed(tmp_path):
    text = MICRO + '\n[[kill]]\nid = "K-test"\nwhen = "step >= 2"\nrungs = ["C"]\ndrops = ["P4"]\n'
    path, ledger = frozen(tmp_path, text)
    summary = run_json("micro", path, ledger)
    assert summary["complete"], summary
    state, report = state_of(ledger)
    assert report.ok
    killed = [r for r in state.runs if r.rung == "C"]
    assert len(killed) == 1 and killed[0].status == "killed" and killed[0].ended_by == {"kill": "K-test"}
    assert len(killed[0].windows) == 1  # killed on its first window
    primed = [r for r in state.runs if r.rung == "C'"]
    assert len(primed) == 1 and primed[0].status == "finished" and primed[0].items == ("P2",)
    assert state.dropped()["P4"]["cause"] == "kill"
    verdict = in_process("verdict", "micro", ledger=ledger)
    rung_c = next(r for r in verdict["rungs"] if r["rung"] == "C")
    assert rung_c["run"] == primed[0].run_id  # C is read from C'
    assert "P4" in verdict["park"] or "P4" not in verdict["land"]


def test_ceiling_stops_the_ladder(tmp_path):
    text = MICRO.replace("ceiling_gpu_h = 0.5", "ceiling_gpu_h = 0.0003")  # ~1 s: the gate alone exceeds it
    path, ledger = frozen(tmp_path, text)
    summary = run_json("micro", path, ledger)
    assert summary["stopped"] == "ceiling" and not summary["complete"]
    state, report = state_of(ledger)
    assert report.ok
    assert not state.runs
    assert state.ceilings and state.ceilings[0]["action"] == "stopped before the next rung"
    costs = in_process("audit", "costs", ledger=ledger)
    assert costs["registrations"][0]["overrun"] is True  # the gate's overrun is shown, never hidden


def test_on_ceiling_continue_runs_every_rung_and_records_each_overrun(tmp_path):
    text = MICRO.replace("ceiling_gpu_h = 0.5", "ceiling_gpu_h = 0.0003").replace(
        'on_ceiling = "stop"', 'on_ceiling = "continue"'
    )
    path, ledger = frozen(tmp_path, text)
    summary = run_json("micro", path, ledger)
    assert summary["complete"] and summary["stopped"] is None
    state, report = state_of(ledger)
    assert report.ok
    assert {r.status for r in state.runs} == {"finished"} and len(state.runs) == len(summary["runs"]) >= 2
    # one ceiling entry before each rung, none hidden: the overrun is recorded, and the ladder went on
    assert len(state.ceilings) == len(state.runs)
    assert all(
        c["action"] == "continuing; the overrun is recorded" and c["on_ceiling"] == "continue" for c in state.ceilings
    )
    costs = in_process("audit", "costs", ledger=ledger)
    assert costs["registrations"][0]["overrun"] is True


ONE_RUNG = """
id = "micro"
title = "a rung against the ceiling's deadline"
question = "Does a rung that outlasts what is left under the ceiling end over-ceiling?"
workload = "molmo2"
profile = "cpu-tiny"

[cost]
ceiling_gpu_h = 0.0002     # 0.72 device-seconds: the rung's own start and load outlast it
on_ceiling = "stop"

[protocol]
steps = 6
log_every = 2
discard_first = 2
config = { batch = 2, backward_chunks = 1, camera_counts = [1, 2], max_crops = 1 }
  [[protocol.rungs]]
  id = "A"

[reads]
speed = "A.s_per_step"

[[rules]]
id = "measured"
when = "speed > 0"
outcome = "measured"
"""


def test_a_rung_that_outlasts_the_ceiling_ends_over_ceiling_at_its_first_window(tmp_path):
    path, ledger = frozen(tmp_path, ONE_RUNG)
    summary = run_json("micro", path, ledger)
    state, report = state_of(ledger)
    assert report.ok
    [run] = state.runs
    assert run.status == "over-ceiling" and run.ended_by == {"ceiling": True}
    assert run.totals["steps"] == 2  # the deadline is checked after each window: the first one ends it
    assert summary["stopped"] == "ceiling" and not summary["complete"]  # even though it was the ladder's last rung
    costs = in_process("audit", "costs", ledger=ledger)
    assert costs["registrations"][0]["overrun"] is True


def test_edited_registration_is_refused(tmp_path):
    path, ledger = frozen(tmp_path)
    path.write_text(MICRO.replace("steps = 6", "steps = 8"))
    before = ledger.read_bytes()
    result = prereg("run", "micro", "--file", str(path), ledger=ledger)
    assert result.returncode == 3, result.stderr
    assert "changed since it was frozen" in result.stderr
    assert ledger.read_bytes() == before


def test_unfrozen_registration_is_refused(tmp_path):
    path, ledger = frozen(tmp_path)
    result = prereg("run", "not-frozen", ledger=ledger)
    assert result.returncode == 3
    assert "not frozen" in result.stderr


def _start_run(path: Path, ledger: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), "run", "micro", "--file", str(path), "--ledger", str(ledger), "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for(ledger: Path, kind: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ledger.exists():
            store = Ledger.open(str(ledger), create=False)
            try:
                if store.count(reg_id="micro", kinds=(kind,)):
                    return
            finally:
                store.close()
        time.sleep(0.2)
    raise AssertionError(f"no {kind} entry within {timeout} s")


LONG = MICRO.replace("steps = 6", "steps = 60").replace('items = ["P1", "P2", "P4"]', 'items = ["P1", "P4"]')
# The tests that stop a LONG ladder share one worker, so its gate (what they do not check) runs once for them.
ON_LONG_GATED = pytest.mark.xdist_group("engine-long")


@pytest.fixture(scope="module")
def long_gated(tmp_path_factory) -> Path:
    """A ledger with LONG frozen and its oracle gate run: every oracle has its result, no rung has started."""
    path, ledger = frozen(tmp_path_factory.mktemp("long"), LONG)
    prereg("run", "micro", "--file", str(path), "--gate-only", ledger=ledger, check=True)
    return ledger


def frozen_long(tmp_path: Path, gated: Path) -> tuple[Path, Path]:
    """LONG frozen and gated, in a copy of the shared ledger: a run of it starts at its first rung."""
    ledger = tmp_path / "ledger.db"
    for suffix in ("", "-wal"):
        if gated.with_name(gated.name + suffix).exists():
            shutil.copyfile(gated.with_name(gated.name + suffix), ledger.with_name(ledger.name + suffix))
    return registration(tmp_path, LONG), ledger


@ON_LONG_GATED
def test_sigterm_ends_the_rung_killed_and_the_next_run_redoes_it(tmp_path, long_gated):
    path, ledger = frozen_long(tmp_path, long_gated)
    process = _start_run(path, ledger)
    try:
        _wait_for(ledger, "window")
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    state, report = state_of(ledger)
    assert report.ok
    (run,) = [r for r in state.runs if r.rung == "A"]
    assert run.status == "killed" and run.ended_by == {"signal": "SIGTERM"}
    assert run.windows and run.windows[-1]["step"] < 60  # a final (partial) window, then the end

    summary = run_json("micro", path, ledger)  # resumes: the signalled rung runs again from scratch
    assert summary["complete"]
    state, report = state_of(ledger)
    assert report.ok
    finished = [r for r in state.runs if r.status == "finished"]
    assert sorted(r.rung for r in finished) == ["A", "C"]
    assert all(len(r.windows) == 30 for r in finished)  # exactly one full set of windows per rung


@ON_LONG_GATED
def test_a_rung_process_closes_its_ledger_before_it_ends(tmp_path, long_gated):
    """A rung process leaves with os._exit once its work is recorded (engine/worker_exit.py), past the interpreter's
    teardown, so it must close its ledger itself first. SQLite removes the write-ahead log when the last connection
    to the file closes: a rung alone on the ledger leaves none behind, and one that left its connection open would."""
    path, ledger = frozen_long(tmp_path, long_gated)
    Ledger.open(str(ledger), create=False).close()  # the copy's log folded in: the rung starts without one
    wal = ledger.with_name(ledger.name + "-wal")
    assert not wal.exists()
    command = [sys.executable, "-m", "engine.rung", "--ledger", str(ledger), "--reg", "micro",
               "--registration-dir", str(path.parent), "--steps", "2", "--run-spec", "0123456789ab=A:A:"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {"event": "end", "status": {"0123456789ab": "finished"}}
    assert not wal.exists()
    state, report = state_of(ledger)
    assert report.ok
    (run,) = state.runs
    assert (run.rung, run.status, [w["step"] for w in run.windows]) == ("A", "finished", [2])


# Long enough that a second `prereg run` starts and is refused while the first one's rung still trains.
LONGER = LONG.replace("steps = 60", "steps = 600")


def test_a_second_run_is_refused_while_the_first_runs(tmp_path):
    path, ledger = frozen(tmp_path, LONGER)
    process = _start_run(path, ledger)
    try:
        _wait_for(ledger, "window")
        second = prereg("run", "micro", "--file", str(path), ledger=ledger)
        assert second.returncode == 3 and "already in progress" in second.stderr
        assert process.poll() is None  # refused while the first was running, not after it ended
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    state, report = state_of(ledger)
    assert report.ok and [r.status for r in state.runs] == ["running"]  # the refused run wrote nothing


@ON_LONG_GATED
def test_sigkill_leaves_an_interrupted_run_that_the_next_run_redoes(tmp_path, long_gated):
    path, ledger = frozen_long(tmp_path, long_gated)
    process = _start_run(path, ledger)
    try:
        _wait_for(ledger, "window")
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the ladder and its rung process, mid-window
        process.wait(timeout=60)
    state, report = state_of(ledger)
    assert report.ok  # every append was all-or-nothing
    assert [r.status for r in state.runs] == ["running"]
    # Decided now, the killed run's windows count for nothing: no partial window reaches a read.
    early = in_process("verdict", "micro", ledger=ledger)
    assert next(r for r in early["rungs"] if r["rung"] == "A")["windows"] == 0
    assert early["reads"]["primary"] is None and early["outcome"] is None

    summary = run_json("micro", path, ledger)
    assert summary["complete"]
    state, report = state_of(ledger)
    assert report.ok
    assert [r.status for r in state.runs if r.rung == "A"] == ["interrupted", "finished"]
    verdict = in_process("verdict", "micro", ledger=ledger)
    rung_a = next(r for r in verdict["rungs"] if r["rung"] == "A")
    assert rung_a["windows"] == 29  # the finished run's 30 windows less the discarded first; nothing partial merged
    assert rung_a["run"] == [r for r in state.runs if r.rung == "A"][-1].run_id


def test_interleaved_schedule_runs_the_rungs_in_one_process_window_by_window(tmp_path):
    text = MICRO.replace("[protocol]\n", '[protocol]\nschedule = "interleaved"\n')
    path, ledger = frozen(tmp_path, text)
    summary = run_json("micro", path, ledger)
    assert summary["complete"], summary
    store = Ledger.open(str(ledger), create=False)
    try:
        starts = [e.data for e in store.entries(reg_id="micro", kinds=("run-start",))]
        windows = [(e.data["rung"], e.data["step"]) for e in store.entries(reg_id="micro", kinds=("window",))]
    finally:
        store.close()
    assert [s["rung"] for s in starts] == ["A", "C"] and all(s["schedule"] == "interleaved" for s in starts)
    assert starts[0]["env"]["host"] == starts[1]["env"]["host"] and len(starts[0]["interleaved_with"]) == 1
    assert windows == [("A", 2), ("C", 2), ("A", 4), ("C", 4), ("A", 6), ("C", 6)]  # alternating, one model load


UNTIL_PASS = (
    MICRO.replace("[protocol]\n", '[protocol]\nkind = "until_pass"\npass_rule = "rc == 0 and steps >= 6"\n')
    .replace(
        """  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "B"
  items = ["P1"]
  [[protocol.rungs]]
  id = "C"
  items = ["P1", "P2", "P4"]""",
        """  [[protocol.rungs]]
  id = "R1"
  [[protocol.rungs]]
  id = "R2"
  config = { batch = 1 }
  [[protocol.rungs]]
  id = "R3"
  config = { batch = 3 }""",
    )
    .split("[reads]")[0]
    + """
[[rules]]
id = "gate-passed"
when = "defined(PASS.steps)"
outcome = "launch"

[[kill]]
id = "K-short"
when = "step >= 2"
rungs = ["R1"]
"""
)


def test_until_pass_ladder_stops_at_the_first_rung_that_passes(tmp_path):
    # A window metric in the rule beside the totals: the ladder must judge with the windows, as the verdict does
    # (the H200 F1 ladder ran its rung8 after rung7 had passed `vram_peak_gib <= 125`: it judged without windows).
    pass_rule = "rc == 0 and steps >= 6 and loss < 1e9"
    path, ledger = frozen(
        tmp_path, UNTIL_PASS.replace('pass_rule = "rc == 0 and steps >= 6"', f'pass_rule = "{pass_rule}"')
    )
    summary = run_json("micro", path, ledger)
    assert summary["complete"], summary
    state, report = state_of(ledger)
    assert report.ok
    assert [(r.rung, r.status) for r in state.runs] == [("R1", "killed"), ("R2", "finished")]  # R3 never runs
    verdict = in_process("verdict", "micro", ledger=ledger)
    assert verdict["until_pass"]["passed"] == "R2"
    assert (
        verdict["until_pass"]["rejected"][0]["rung"] == "R1"
        and "steps" in verdict["until_pass"]["rejected"][0]["reason"]
    )
    assert verdict["outcome"] == "launch"


def test_a_ledger_that_fails_verification_is_refused_before_anything_runs(tmp_path):
    import sqlite3

    path, ledger = frozen(tmp_path)
    connection = sqlite3.connect(ledger)
    connection.execute("DROP TRIGGER entries_refuse_update")  # behind the tool's back, as an editor would
    connection.execute("UPDATE entries SET body = replace(body, '\"steps\":6', '\"steps\":7') WHERE seq = 1")
    connection.commit()
    connection.close()
    result = prereg("run", "micro", "--file", str(path), ledger=ledger)
    assert result.returncode == 4, (result.stdout, result.stderr)
    assert "entry 1" in result.stderr
    store = Ledger.open(str(ledger), create=False)
    try:
        assert store.count(reg_id="micro") == 1  # nothing was run or written
    finally:
        store.close()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine can honour a CUDA profile")
def test_a_profile_this_machine_cannot_honour_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, on a GPU machine too
    path, ledger = frozen(tmp_path, on_cuda(MICRO, "h200-4b"))
    before = ledger.read_bytes()
    result = prereg("run", "micro", "--file", str(path), ledger=ledger)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "needs CUDA" in result.stderr
    assert ledger.read_bytes() == before


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs CUDA")
def test_a_profile_needing_more_gpus_than_are_visible_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    path, ledger = frozen(tmp_path, on_cuda(MICRO, "h200x2-4b"))
    before = ledger.read_bytes()
    result = prereg("run", "micro", "--file", str(path), ledger=ledger)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "needs 2 GPUs; this machine has 1" in result.stderr
    assert ledger.read_bytes() == before


def test_an_interleaved_ladder_whose_rungs_set_their_own_config_is_refused_at_validation(tmp_path):
    text = MICRO.replace("[protocol]\n", '[protocol]\nschedule = "interleaved"\n').replace(
        '  id = "B"\n', '  id = "B"\n  config = { batch = 1 }\n'
    )
    path = registration(tmp_path, text)
    result = Cli(tmp_path / "ledger.db", tmp_path).on_ledger("check", str(path))
    assert result.exit_code == 2
    assert "interleaved" in result.stderr and "['B']" in result.stderr
    assert not (tmp_path / "ledger.db").exists()


def _rung_processes(ladder_pid: int) -> list[int]:
    """The `engine.rung` processes of a ladder started in its own session (process group = the ladder's pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == ladder_pid and b"engine.rung" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return found


@ON_LONG_GATED
def test_a_rung_process_that_dies_under_a_living_ladder_is_ended_failed_not_rerun(tmp_path, long_gated):
    """The kernel's OOM killer, or torchrun killing a rank after another rank's failure: the rung process dies
    without ending its run. The ladder records the run failed with the exit status it saw and stops (a compare
    ladder); a resume would otherwise re-run it for ever."""
    path, ledger = frozen_long(tmp_path, long_gated)
    process = _start_run(path, ledger)
    try:
        _wait_for(ledger, "window")
        pids = _rung_processes(process.pid)
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    summary = json.loads(out)
    assert summary["stopped"] == "failed" and not summary["complete"]
    state, report = state_of(ledger)
    assert report.ok
    [run] = state.runs
    assert run.status == "failed" and run.totals["rc"] == -signal.SIGKILL
    assert "ended by the ladder" in run.ended_by["error"] and run.totals["steps"] >= 1


def test_a_rung_process_that_dies_is_a_crash_its_kill_lines_judge(tmp_path):
    """A process that dies (a segfault in a kernel, the OOM killer) is a crash: the ladder ends its run on a crash
    window, and a line that says `rc != 0` kills it and drops what it suspects."""
    text = LONG + '\n[[kill]]\nid = "K-crash"\nwhen = "not finite(loss) or rc != 0"\nrungs = ["C"]\ndrops = ["P4"]\n'
    path, ledger = frozen(tmp_path, text)
    process = _start_run(path, ledger)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            state, _ = state_of(ledger)
            if any(r.rung == "C" and r.n_windows for r in state.runs):
                break
            time.sleep(0.2)
        pids = _rung_processes(process.pid)
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    summary = json.loads(out)
    assert summary["stopped"] != "failed", summary
    state, report = state_of(ledger)
    assert report.ok
    [run] = [r for r in state.runs if r.rung == "C"]
    assert (
        run.status == "killed" and run.ended_by["kill"] == "K-crash" and "ended by the ladder" in run.ended_by["error"]
    )
    assert run.crash_window["rc"] == -signal.SIGKILL and run.crash_window["step"] == run.windows[-1]["step"]
    assert state.dropped()["P4"]["cause"] == "kill"
