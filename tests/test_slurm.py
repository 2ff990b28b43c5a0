"""Ladders on a cluster, through the CLI, against a real Slurm (tests/slurm_cluster.sh: one node, this machine).

Each rung and each oracle gate is a job; the ledger is the test's SQLite file, which the partition's one node
(this host) reaches. The command workload with a tiny script is the quickest rung; Molmo2's cpu-tiny runs as a
job too, and as one job of two gloo tasks. Faults are made the way a cluster makes them: scancel, a rung process
killed, a script that fails, a `prereg run` killed while its job runs. Without a cluster these tests skip (fail
under REQUIRE_SLURM=1); the checks of prereg.toml and of job outcomes at the end need none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import Cli, ledger_fingerprint

from engine.launch.slurm import JobState, exit_status, outcome
from prereg.ledger import Ledger
from prereg.state import load_state

REPO = Path(__file__).resolve().parent.parent


def on_slurm(test):
    """A test that submits jobs: marked `slurm`, and run on one worker, so one job at a time has the two cores."""
    return pytest.mark.xdist_group("slurm")(pytest.mark.slurm(test))


TRAIN = """
import json, os, sys, time

steps, every = int(os.environ["PREREG_STEPS"]), int(os.environ["PREREG_LOG_EVERY"])
config = json.loads(os.environ["PREREG_CONFIG"])
fast = "fast" in os.environ["PREREG_SWITCHES"].split(",")
with open(os.environ["PREREG_WINDOWS"], "a") as out:
    for step in range(1, steps + 1):
        time.sleep(config.get("pause", 0.0))
        if step % every:
            continue
        out.write(json.dumps({"steps": step, "s_per_step": 0.01 if fast else 0.02, "loss": 1.0 / step}) + "\\n")
        out.flush()
        if config.get("crash"):
            sys.exit("boom: the script failed on purpose")
"""

PROBE = """
import json
print(json.dumps({"loss_abs": 1e-7}))
"""

HEAD = """
id = "{reg_id}"
title = "a script on a cluster"
question = "Does the fast switch halve a step, run as jobs?"
workload = "command"
profile = "local"
{launcher}
[command]
run = "python train.py"
probe = "python probe.py"
cwd = "scripts"
sources = ["train.py", "probe.py"]
switches = ["fast"]
config = ["pause", "crash"]
metrics = ["s_per_step", "loss"]
probes = {{ parity = ["loss_abs"] }}

[cost]
ceiling_gpu_h = 0.5
"""

ITEM = """
[[items]]
id = "fast-item"
title = "switch fast"
switch = "fast"
bitwise = false
  [[items.oracles]]
  id = "fast-parity"
  kind = "tolerance"
  probe = "parity"
  bounds = { loss_abs = 1e-4 }
"""

PROTOCOL = """
[protocol]
steps = {steps}
log_every = 2
discard_first = 2
config = {{ pause = {pause}, crash = {crash} }}
  [[protocol.rungs]]
  id = "A"
  items = []
"""

RUNG_B = """
  [[protocol.rungs]]
  id = "B"
  items = ["fast-item"]

[reads]
speedup = "(A.s_per_step - B.s_per_step) / A.s_per_step"

[[rules]]
id = "land"
when = "speedup >= 0.4"
outcome = "land-fast"
land = ["fast-item"]

[[rules]]
id = "park"
when = "speedup < 0.4"
outcome = "park-fast"
park = ["fast-item"]
"""


def launchers(partition: str) -> str:
    return f"""
[launchers.cluster]
kind = "slurm"
partition = "{partition}"
time = "00:10:00"

[launchers.faraway]
kind = "slurm"
partition = "{partition}-remote"

[launchers.here]
kind = "local"
"""


def lab(
    tmp_path: Path,
    reg_id: str,
    *,
    launcher: str | None = "cluster",
    partition: str = "prereg",
    steps: int = 4,
    pause: float = 0.0,
    crash: bool = False,
    with_b: bool = False,
) -> Path:
    """prereg.toml, the scripts and a registration in tmp_path; the registration's path."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    (tmp_path / "scripts" / "train.py").write_text(textwrap.dedent(TRAIN))
    (tmp_path / "scripts" / "probe.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "prereg.toml").write_text(launchers(partition))
    text = HEAD.format(reg_id=reg_id, launcher=f'launcher = "{launcher}"\n' if launcher else "")
    text += (ITEM if with_b else "") + PROTOCOL.format(steps=steps, pause=pause, crash=str(crash).lower())
    text += RUNG_B if with_b else ""
    path = tmp_path / f"{reg_id}.toml"
    path.write_text(text)
    return path


ENV = {
    **os.environ,
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    "PYTHONPATH": str(REPO),
    "COLUMNS": "120",
    "NO_COLOR": "1",
}


def command(*args: str | Path, ledger: Path) -> list[str]:
    return [sys.executable, str(REPO / "cli.py"), *map(str, args), "--ledger", str(ledger)]


def prereg(*args: str | Path, ledger: Path, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """`prereg ARGS` as a process of its own, in `cwd` (where prereg.toml is found)."""
    return subprocess.run(command(*args, ledger=ledger), cwd=cwd, capture_output=True, text=True, env=ENV,
                          timeout=timeout)  # fmt: skip


def ok_json(*args: str | Path, ledger: Path, cwd: Path, timeout: float = 180) -> dict:
    result = prereg(*args, "--json", ledger=ledger, cwd=cwd, timeout=timeout)
    assert result.returncode == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def frozen(tmp_path: Path, reg_id: str, **options) -> tuple[Path, Path]:
    """The lab written and its registration frozen (in-process: only `run` needs a process of its own)."""
    path = lab(tmp_path, reg_id, **options)
    ledger = tmp_path / "ledger.db"
    Cli(ledger, tmp_path).ok("freeze", path)
    return path, ledger


def entries(ledger: Path, reg_id: str, *kinds: str) -> list:
    store = Ledger.open(str(ledger), create=False)
    try:
        return list(store.entries(reg_id=reg_id, kinds=kinds))
    finally:
        store.close()


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_state(job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True)
    return shown.stdout.split("JobState=", 1)[1].split()[0]


# --- a ladder as jobs -------------------------------------------------------------------------------------------


@on_slurm
def test_a_command_ladder_run_as_jobs_reaches_the_local_verdict(slurm_partition, tmp_path):
    """The same ladder (gate, A, B), once on this machine and once as Slurm jobs: the same verdict; every job is
    in the ledger with its id and host, and every run-start names its job and the resolved launcher."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    local_path, local_ledger = frozen(here, "slurm-local", launcher=None, partition=slurm_partition, with_b=True)
    path, ledger = frozen(there, "slurm-jobs", partition=slurm_partition, with_b=True)
    assert ok_json("run", "slurm-local", "--file", local_path, ledger=local_ledger, cwd=here)["complete"]
    summary = ok_json("run", "slurm-jobs", "--file", path, ledger=ledger, cwd=there)
    assert summary["complete"] and summary["jobs"] == []
    local = Cli(local_ledger, here).ok_json("verdict", "slurm-local")
    remote = Cli(ledger, there).ok_json("verdict", "slurm-jobs")
    assert (remote["outcome"], remote["land"], remote["reads"]) == (local["outcome"], local["land"], local["reads"])
    assert remote["outcome"] == "land-fast"

    jobs = {e.ref: e for e in entries(ledger, "slurm-jobs", "job")}
    ends = {e.ref: e.data for e in entries(ledger, "slurm-jobs", "job-end")}
    assert sorted(j.data["purpose"] for j in jobs.values()) == ["gate", "rung", "rung"]
    assert set(ends) == set(jobs) and {e["state"] for e in ends.values()} == {"COMPLETED"}
    for start in entries(ledger, "slurm-jobs", "run-start"):
        assert start.data["job"]["id"] in jobs and start.data["job"]["hosts"] == ends[start.data["job"]["id"]]["hosts"]
        assert start.data["launcher"] == {
            "name": "cluster",
            "kind": "slurm",
            "partition": slurm_partition,
            "nodes": 1,
            "gpus_per_node": 0,
            "time": "00:10:00",
            "account": None,
            "qos": None,
            "sbatch": {},
        }
    shown = Cli(ledger, there).ok_json("audit", "show", "slurm-jobs")
    assert sorted(j["job"] for j in shown["jobs"]) == sorted(jobs) and {j["state"] for j in shown["jobs"]} == {
        "completed"
    }
    text = Cli(ledger, there).ok("audit", "show", "slurm-jobs").stdout
    assert "cluster jobs" in text and all(job_id in text for job_id in jobs)
    # The local ladder records no launcher: its runs are as they always were.
    assert all("launcher" not in e.data for e in entries(local_ledger, "slurm-local", "run-start"))


MOLMO2_TINY = """
id = "{reg_id}"
title = "molmo2 tiny as a job"
question = "Does a Molmo2 rung run as a Slurm job{ranks}?"
workload = "molmo2"
profile = "{profile}"
launcher = "cluster"

[cost]
ceiling_gpu_h = 0.5

[protocol]
steps = 2
log_every = 1
config = {{ batch = 2, backward_chunks = 2, camera_counts = [1], max_crops = 1{ddp} }}
  [[protocol.rungs]]
  id = "A"
"""


@on_slurm
@pytest.mark.parametrize("profile, tasks", [("cpu-tiny", 1), ("cpu-tiny-x2", 2)])
def test_a_molmo2_tiny_rung_runs_as_one_job_of_one_task_per_rank(slurm_partition, tmp_path, profile, tasks):
    """cpu-tiny as a job; cpu-tiny-x2 as one job of two tasks (two gloo ranks started by srun): one set of windows,
    each the rung's (world_size 2), written by rank 0 alone."""
    reg_id = f"slurm-molmo2-{tasks}"
    (tmp_path / "prereg.toml").write_text(launchers(slurm_partition))
    path = tmp_path / f"{reg_id}.toml"
    path.write_text(
        MOLMO2_TINY.format(
            reg_id=reg_id,
            profile=profile,
            ranks=" of two tasks" if tasks == 2 else "",
            ddp=", ddp = true" if tasks == 2 else "",
        )
    )
    ledger = tmp_path / "ledger.db"
    Cli(ledger, tmp_path).ok("freeze", path)
    summary = ok_json("run", reg_id, "--file", path, ledger=ledger, cwd=tmp_path, timeout=300)
    assert summary["complete"], summary
    (job,) = entries(ledger, reg_id, "job")
    assert (job.data["nodes"], job.data["tasks_per_node"]) == (1, tasks)
    windows = entries(ledger, reg_id, "window")
    assert [w.data["step"] for w in windows] == [1, 2] and {w.data["world_size"] for w in windows} == {tasks}
    (end,) = entries(ledger, reg_id, "run-end")
    assert end.data["status"] == "finished" and end.data["totals"]["world_size"] == tasks


# --- faults -----------------------------------------------------------------------------------------------------


def started_job(ledger: Path, reg_id: str) -> tuple[str, dict]:
    """(job id, the run-start's process) once the rung's first window is in the ledger."""
    wait_for(lambda: entries(ledger, reg_id, "window"), "the rung's first window")
    (start,) = entries(ledger, reg_id, "run-start")
    return start.data["job"]["id"], start.data["process"]


@on_slurm
def test_scancel_of_a_running_rung_ends_it_killed_and_stops_the_ladder(slurm_partition, tmp_path):
    path, ledger = frozen(tmp_path, "slurm-cancel", partition=slurm_partition, steps=200, pause=0.2)
    ladder = subprocess.Popen(command("run", "slurm-cancel", "--file", path, "--json", ledger=ledger), cwd=tmp_path,
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    job_id, _ = started_job(ledger, "slurm-cancel")
    subprocess.run(["scancel", job_id], check=True)
    out, err = ladder.communicate(timeout=60)
    assert ladder.returncode == 0, err
    summary = json.loads(out)
    assert summary["stopped"] == "killed" and summary["remaining"] == ["A"]
    (end,) = entries(ledger, "slurm-cancel", "run-end")
    assert end.data["status"] == "killed" and end.data["ended_by"] == {"signal": "SIGTERM"}
    (settled,) = entries(ledger, "slurm-cancel", "job-end")
    assert settled.data["state"] == "CANCELLED" and settled.data["runs"] == {end.ref: "killed"}
    # As after a local kill by a signal: the rung is pending again, to re-run from scratch.
    assert ok_json("run", "slurm-cancel", "--file", path, "--dry-run", ledger=ledger, cwd=tmp_path)["pending"] == ["A"]


@on_slurm
def test_a_script_that_fails_fails_its_rung_and_its_job(slurm_partition, tmp_path):
    path, ledger = frozen(tmp_path, "slurm-crash", partition=slurm_partition, crash=True)
    summary = ok_json("run", "slurm-crash", "--file", path, ledger=ledger, cwd=tmp_path)
    assert summary["stopped"] == "failed"
    (end,) = entries(ledger, "slurm-crash", "run-end")
    assert end.data["status"] == "failed" and "boom: the script failed on purpose" in end.data["ended_by"]["error"]
    (settled,) = entries(ledger, "slurm-crash", "job-end")
    assert settled.data["state"] == "FAILED" and settled.data["runs"] == {end.ref: "failed"}


@on_slurm
def test_a_job_whose_rung_dies_without_its_end_is_failed_from_the_jobs_state(slurm_partition, tmp_path):
    """The rung process SIGKILLed (as the OOM killer does): no end in the ledger; the job ends FAILED, and the
    ladder ends the run `failed` naming the job's state."""
    path, ledger = frozen(tmp_path, "slurm-oom", partition=slurm_partition, steps=200, pause=0.2)
    ladder = subprocess.Popen(command("run", "slurm-oom", "--file", path, "--json", ledger=ledger), cwd=tmp_path,
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    job_id, process = started_job(ledger, "slurm-oom")
    os.kill(process["pid"], signal.SIGKILL)
    out, err = ladder.communicate(timeout=60)
    assert ladder.returncode == 0, err
    assert json.loads(out)["stopped"] == "failed"
    (end,) = entries(ledger, "slurm-oom", "run-end")
    assert end.data["status"] == "failed" and end.data["ended_by"]["job_state"] == "FAILED"
    assert end.data["ended_by"]["job"] == job_id and end.data["totals"]["rc"] != 0


@on_slurm
def test_a_ladder_killed_while_its_job_runs_leaves_it_running_and_the_next_run_reads_it(slurm_partition, tmp_path):
    """SIGKILL of `prereg run` mid-rung: the job runs on; the next run waits for it, takes its result and runs
    the rest — every rung once, one set of windows each, nothing interrupted."""
    path, ledger = frozen(tmp_path, "slurm-resume", partition=slurm_partition, with_b=True, steps=6, pause=0.5)
    ladder = subprocess.Popen(command("run", "slurm-resume", "--file", path, ledger=ledger), cwd=tmp_path, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    job_id, _ = started_job(ledger, "slurm-resume")
    ladder.kill()
    ladder.wait()
    assert job_state(job_id) in ("RUNNING", "COMPLETING", "COMPLETED")  # the job outlived its ladder
    summary = ok_json("run", "slurm-resume", "--file", path, ledger=ledger, cwd=tmp_path)
    assert summary["complete"], summary
    state = load_state(Ledger.open(str(ledger), create=False), "slurm-resume")
    assert sorted(r.rung for r in state.runs) == ["A", "B"]
    assert {r.status for r in state.runs} == {"finished"} and {r.n_windows for r in state.runs} == {3}
    assert not entries(ledger, "slurm-resume", "interrupted")
    rung_a = next(e for e in entries(ledger, "slurm-resume", "run-start") if e.data["rung"] == "A")
    assert rung_a.data["job"]["id"] == job_id


@on_slurm
def test_detach_submits_and_returns_and_a_later_run_waits_for_the_result(slurm_partition, tmp_path):
    path, ledger = frozen(tmp_path, "slurm-detach", partition=slurm_partition, steps=4, pause=0.3)
    detached = ok_json("run", "slurm-detach", "--file", path, "--detach", ledger=ledger, cwd=tmp_path)
    assert detached["stopped"] == "detached" and not detached["complete"]
    ((job_id, purpose),) = [(j["job"], j["purpose"]) for j in detached["jobs"]]
    assert purpose == "rung"
    shown = Cli(ledger, tmp_path).ok_json("audit", "show", "slurm-detach")
    assert [(j["job"], j["state"]) for j in shown["jobs"]] in ([(job_id, "queued")], [(job_id, "running")])
    # A second detached run while the job runs submits nothing more.
    again = ok_json("run", "slurm-detach", "--file", path, "--detach", ledger=ledger, cwd=tmp_path)
    if again["jobs"]:
        assert [j["job"] for j in again["jobs"]] == [job_id]
    summary = ok_json("run", "slurm-detach", "--file", path, ledger=ledger, cwd=tmp_path)
    assert summary["complete"] and [r["status"] for r in summary["runs"]] == ["finished"]
    assert [e.ref for e in entries(ledger, "slurm-detach", "job")] == [job_id]


@on_slurm
def test_a_sqlite_ledger_is_refused_for_a_partition_with_another_host(slurm_partition, tmp_path):
    path, ledger = frozen(tmp_path, "slurm-faraway", launcher="faraway", partition=slurm_partition)
    before = ledger_fingerprint(ledger)
    result = prereg("run", "slurm-faraway", "--file", path, ledger=ledger, cwd=tmp_path)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "prereg-faraway" in result.stderr and "PostgreSQL" in result.stderr
    assert ledger_fingerprint(ledger) == before


# --- without a cluster: prereg.toml and the outcomes of jobs ----------------------------------------------------


@pytest.mark.parametrize(
    "toml, says",
    [
        ('[launchers.cluster]\nkind = "slurm"\n', "partition"),
        ('[launchers.cluster]\nkind = "pbs"\n', "kind"),
        ('[launchers.cluster]\nkind = "slurm"\npartition = "gpu"\ntime = "soon"\n', "time = 'soon'"),
        ('[launchers.cluster]\nkind = "slurm"\npartition = "gpu"\nsbatch = { partition = "x" }\n', "launcher's own"),
        ('[launchers.other]\nkind = "local"\n', "launcher 'cluster' is not in"),
    ],
)
def test_a_bad_prereg_toml_is_refused_at_run_naming_file_and_field(tmp_path, monkeypatch, toml, says):
    path, ledger = frozen(tmp_path, "slurm-bad")
    (tmp_path / "prereg.toml").write_text(toml)
    before = ledger_fingerprint(ledger)
    monkeypatch.chdir(tmp_path)  # prereg.toml is found from the current folder up
    result = Cli(ledger, tmp_path).on_ledger("run", "slurm-bad", "--file", path)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert "prereg.toml" in result.stderr and says in result.stderr
    assert ledger_fingerprint(ledger) == before


def test_a_launcher_without_a_prereg_toml_above_is_refused(tmp_path, monkeypatch):
    path, ledger = frozen(tmp_path, "slurm-none")
    (tmp_path / "prereg.toml").unlink()  # and none above: pytest's temporary folders hold none
    monkeypatch.chdir(path.parent)
    result = Cli(ledger, tmp_path).on_ledger("run", "slurm-none", "--file", path)
    assert result.exit_code == 2 and "needs a prereg.toml" in result.stderr


def test_detach_on_this_machine_is_refused(tmp_path, monkeypatch):
    path, ledger = frozen(tmp_path, "slurm-here", launcher="here")
    monkeypatch.chdir(tmp_path)
    result = Cli(ledger, tmp_path).on_ledger("run", "slurm-here", "--file", path, "--detach")
    assert result.exit_code == 2 and "--detach" in result.stderr


@pytest.mark.parametrize(
    "state, status, becomes",
    [
        ("COMPLETED", "finished", "finished"),
        ("CANCELLED", "killed", "killed"),
        ("CANCELLED", None, "killed"),
        ("FAILED", "failed", "failed"),
        ("FAILED", None, "failed"),
        ("OUT_OF_MEMORY", None, "failed"),
        ("TIMEOUT", None, "failed"),
        ("PREEMPTED", "killed", "interrupted"),
        ("PREEMPTED", None, "interrupted"),
        ("PREEMPTED", "finished", "finished"),
        ("NODE_FAIL", None, "interrupted"),
        ("UNKNOWN", None, "interrupted"),
    ],
)
def test_a_jobs_runs_end_as_the_jobs_state_and_the_rungs_end_say(state, status, becomes):
    assert outcome(state, status) == becomes


def test_a_jobs_exit_status_reads_as_a_processs():
    assert exit_status(JobState("COMPLETED", "0:0")) == 0
    assert exit_status(JobState("FAILED", "1:0")) == 1
    assert exit_status(JobState("FAILED", "0:9")) == -9
    assert exit_status(JobState("NODE_FAIL")) == 1


def _controller(tmp_path: Path, failures: int, stderr: str) -> Path:
    """An `scontrol` on PATH whose first `failures` calls fail as a busy or a forgetting controller would, then
    answer as a running job's does."""
    counter = tmp_path / "calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(
        textwrap.dedent(f"""\
            #!/usr/bin/env bash
            n=$(($(cat {counter} 2>/dev/null || echo 0) + 1)); echo $n > {counter}
            if [ $n -le {failures} ]; then echo "{stderr}" >&2; exit 1; fi
            echo "JobId=$4 JobState=RUNNING ExitCode=0:0 NodeList=here Reason=None"
        """)
    )
    script.chmod(0o755)
    return script.parent


def test_a_busy_controller_is_asked_again_and_never_read_as_a_forgotten_job(tmp_path, monkeypatch):
    import engine.launch.slurm as slurm

    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    monkeypatch.setenv(
        "PATH", f"{_controller(tmp_path, 2, 'slurm_load_jobs error: Socket timed out')}:{os.environ['PATH']}"
    )
    assert slurm.job_state("41").state == "RUNNING"  # a timed-out query is not a job Slurm no longer knows


def test_a_controller_that_never_answers_stops_the_ladder_rather_than_re_run_a_rung(tmp_path, monkeypatch):
    import engine.launch.slurm as slurm

    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    monkeypatch.setenv(
        "PATH", f"{_controller(tmp_path, 99, 'slurm_load_jobs error: Socket timed out')}:{os.environ['PATH']}"
    )
    with pytest.raises(RuntimeError, match="failed 5 times: slurm_load_jobs error: Socket timed out"):
        slurm.job_state("41")
