"""The Slurm launcher: one cluster job per gate or rung, submitted through submitit, followed through the ledger.

A job's tasks are the rung's ranks (engine/launch/slurm_task.py): `nodes` x (the profile's processes per node),
started by srun; rank 0 alone writes the ledger, as locally. Submitting appends a `job` entry (ref = the Slurm job
id: its launcher, settings, purpose and runs) before anything runs, so a job is known to the ledger while it is
queued; the rung's run-start records the job's id and hosts. The ladder follows a job by reading its entries
from the ledger (the same progress display as a local run) and its state from Slurm, and settles it once it ends
with a `job-end` entry: the job's state, its hosts, and what became of each of its runs, decided from the
evidence (the job's state, and whether the rung wrote its end):

- the rung wrote its end: that status stands — finished, killed (scancel's SIGTERM reached it), failed —, unless
  the job was preempted, requeued or lost with its node, whose unfinished run is `interrupted`, re-run;
- no end: preempted, requeued, node failure or a job Slurm no longer knows: `interrupted`; cancelled: `killed`;
  anything else (failed, out of memory, the time limit): a crash, with the job's state as the reason: its crash
  window (engine/crash.py) is judged by the run's kill lines, so the run is `killed` where one holds on it, else
  `failed`.

Jobs never requeue (--no-requeue): a requeued job would run its runs' ids again; the ladder re-runs an
interrupted rung from scratch as a new job. A job outlives its ladder: a ladder stopped by a signal leaves it
running, and the next `prereg run` waits for it and reads its result.

Job state comes from `scontrol show job` while the controller holds the job (MinJobAge), else from `sacct`.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from engine.crash import RUNG_FAILED, end_crashed_run
from engine.launch import LAUNCHER_VARIABLE, Purpose
from engine.launch.local import REPO_ROOT
from engine.launch.slurm_task import Task
from prereg.errors import Refused
from prereg.launchers import SlurmLauncher
from prereg.ledger import Entry, Ledger
from prereg.workload import Profile

# How often a following ladder reads the ledger and asks Slurm for the job's state: one scontrol call per half
# second is a small load on the controller, and a rung's end is seen within half a second of its job's.
POLL_S = 0.5
# States a job is still in (queued, running, finishing): https://slurm.schedmd.com/squeue.html#SECTION_JOB-STATE-CODES
ACTIVE = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
        "SPECIAL_EXIT",
    }
)
# Ended by the cluster, not by the rung: its runs are interrupted and re-run from scratch.
INTERRUPTING = frozenset({"PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "REVOKED", "UNKNOWN"})
SCONTROL_FIELD = re.compile(r"(\w+)=(\S*)")
# The time limit's warning: SIGTERM this long before it, so the rung ends its run (killed) before the SIGKILL.
TIME_LIMIT_WARNING_S = 60


@dataclass(frozen=True)
class JobState:
    state: str  # Slurm's job state (RUNNING, COMPLETED, CANCELLED, …), UNKNOWN when Slurm no longer knows the job
    exit_code: str | None = None
    nodes: str | None = None
    reason: str | None = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


def _run(words: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(words, capture_output=True, text=True, timeout=60)


# scontrol's words for a job the controller no longer holds; any other failure is the controller not answering.
FORGOTTEN_JOB = "Invalid job id"
CONTROLLER_RETRIES = 5  # a busy controller times out a query; asking again is cheap, deciding wrongly re-runs a rung


def show_job(job_id: str) -> subprocess.CompletedProcess:
    """`scontrol show job`, asked again while the controller does not answer: only a job the controller says it no
    longer holds may be looked up elsewhere (or be unknown, and so be re-run)."""
    for attempt in range(CONTROLLER_RETRIES):
        shown = _run(["scontrol", "show", "job", "-o", job_id])
        if shown.returncode == 0 or FORGOTTEN_JOB in shown.stderr:
            return shown
        time.sleep(1.0 + attempt)
    raise RuntimeError(
        f"scontrol show job {job_id} failed {CONTROLLER_RETRIES} times: {shown.stderr.strip() or shown.stdout.strip()}"
    )


def job_state(job_id: str) -> JobState:
    shown = show_job(job_id)
    if shown.returncode == 0 and shown.stdout.strip():
        fields = dict(SCONTROL_FIELD.findall(shown.stdout))
        return JobState(
            fields.get("JobState", "UNKNOWN"), fields.get("ExitCode"), fields.get("NodeList"), fields.get("Reason")
        )
    accounted = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,NodeList"])
    lines = [line for line in accounted.stdout.splitlines() if line.strip()] if accounted.returncode == 0 else []
    if lines:
        state, exit_code, nodes = (lines[0].split("|") + ["", ""])[:3]
        return JobState(state.split()[0], exit_code or None, nodes or None)  # "CANCELLED by 0" -> CANCELLED
    return JobState("UNKNOWN", reason="neither scontrol nor sacct knows the job")


def hostnames(node_list: str) -> list[str]:
    expanded = _run(["scontrol", "show", "hostnames", node_list])
    if expanded.returncode != 0:
        raise RuntimeError(f"scontrol show hostnames {node_list} failed: {expanded.stderr.strip()}")
    return expanded.stdout.split()


def partition_hosts(partition: str) -> list[str]:
    """Every node of the partition, whatever its state."""
    listed = _run(["sinfo", "-h", "-p", partition, "-o", "%N"])
    if listed.returncode != 0:
        raise Refused(
            f"sinfo cannot list partition {partition!r}: {listed.stderr.strip() or 'no output'}",
            fix="run `prereg run` where Slurm's commands reach the cluster, or correct the launcher's partition",
        )
    nodes = [line.strip() for line in listed.stdout.splitlines() if line.strip()]
    if not nodes:
        raise Refused(
            f"Slurm has no partition {partition!r}", fix="correct the launcher's partition (`sinfo -s` lists them)"
        )
    return sorted({host for node_list in nodes for host in hostnames(node_list)})


def this_host(host: str) -> bool:
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    return host in names or host.split(".")[0] in names


def check_ledger_reachable(ledger_url: str, name: str, settings: SlurmLauncher) -> None:
    """Every node a job may run on must reach the ledger: PostgreSQL, or SQLite when every node is this host."""
    if ledger_url.startswith(("postgresql://", "postgresql+psycopg://")):
        return
    others = [host for host in partition_hosts(settings.partition) if not this_host(host)]
    if others:
        raise Refused(
            f"launcher {name!r} runs jobs on partition {settings.partition!r}, whose nodes include"
            f" {', '.join(others)}: a SQLite ledger ({ledger_url}) is a file on this host, which they cannot write",
            fix="run with a PostgreSQL ledger every node reaches (--ledger postgresql://HOST/DB), or a partition of"
            " this host alone",
        )


def tasks_per_node(name: str, settings: SlurmLauncher, profile: Profile) -> int:
    """The rung's ranks on each node: its processes spread evenly over the launcher's nodes, one per GPU."""
    ranks = profile.world_size
    if ranks % settings.nodes:
        raise Refused(
            f"profile {profile.name} runs {ranks} process(es), which launcher {name!r}'s {settings.nodes} nodes"
            " cannot share evenly",
            fix=f"set nodes to a divisor of {ranks} in the launcher, or pick a profile to match",
        )
    if profile.device == "cuda" and settings.gpus_per_node * settings.nodes < profile.gpus:
        raise Refused(
            f"profile {profile.name} needs {profile.gpus} GPUs; launcher {name!r} asks for {settings.nodes} x"
            f" {settings.gpus_per_node}",
            fix="raise the launcher's nodes or gpus_per_node",
        )
    return ranks // settings.nodes


def job_folder(reg_id: str) -> Path:
    """submitit's folder (the job's script, pickles and logs), under the repository root, where the rungs run: on a
    cluster it is on a file system every node sees, like the repository itself."""
    return REPO_ROOT / "reports" / reg_id / "jobs"


class SlurmLaunch:
    detached_jobs = True

    def __init__(self, ledger: Ledger, reg_id: str, name: str, settings: SlurmLauncher, record: dict[str, Any]):
        self.ledger = ledger
        self.reg_id = reg_id
        self.name = name
        self.settings = settings
        self.record = record  # the resolved launcher, as entries record it

    def start(self, purpose: Purpose, args: list[str], profile: Profile, runs: dict[str, str]) -> SlurmJob:
        import submitit

        per_node = 1 if purpose == "gate" else tasks_per_node(self.name, self.settings, profile)
        nodes = 1 if purpose == "gate" else self.settings.nodes
        module_args = ["engine.gate", *args] if purpose == "gate" else ["engine.rung", *args]
        if purpose == "rung" and profile.world_size > 1:
            module_args += ["--device", profile.device]
        executor = submitit.SlurmExecutor(folder=job_folder(self.reg_id) / "%j")
        extra: dict[str, Any] = {
            "time": self.settings.time,
            "no-requeue": True,
            "signal": f"TERM@{TIME_LIMIT_WARNING_S}",
            **self.settings.sbatch_options(),
        }
        executor.update_parameters(
            job_name=f"prereg-{self.reg_id}-{purpose}",
            partition=self.settings.partition,
            nodes=nodes,
            ntasks_per_node=per_node,
            cpus_per_task=1,
            gpus_per_node=self.settings.gpus_per_node if profile.device == "cuda" else None,
            account=self.settings.account,
            qos=self.settings.qos,
            additional_parameters=extra,
        )
        task = Task(tuple(module_args), str(REPO_ROOT), ((LAUNCHER_VARIABLE, json.dumps(self.record, sort_keys=True)),))
        submitted = executor.submit(task)
        job_id = str(submitted.job_id)
        entry = self.ledger.append(
            "job",
            self.reg_id,
            {
                "launcher": self.record,
                "purpose": purpose,
                "runs": runs,
                "nodes": nodes,
                "tasks_per_node": per_node,
                "folder": str(job_folder(self.reg_id) / job_id),
            },
            ref=job_id,
        )
        return SlurmJob(self.ledger, entry)


def steps_of(ledger: Ledger, reg_id: str) -> int:
    from prereg.state import load_state

    return load_state(ledger, reg_id, with_windows=False).registration().protocol.steps


class SlurmJob:
    """A submitted job, followed: its ledger entries become the progress display's events until it ends."""

    def __init__(self, ledger: Ledger, entry: Entry):
        self.ledger = ledger
        self.entry = entry
        self.job_id = str(entry.ref)
        self.returncode: int | None = None
        self.abandoned = False
        self.last_seen = entry.seq
        self.steps = steps_of(ledger, str(entry.reg_id))

    def signal(self, number: int) -> None:
        """The budget (SIGUSR1) reaches the rung, or cancels a job still queued; the ladder's SIGINT and SIGTERM
        stop the following only: the job runs on, and the next `prereg run` reads its result."""
        if number != signal.SIGUSR1:
            self.abandoned = True
            return
        if job_state(self.job_id).state == "PENDING":
            _run(["scancel", self.job_id])
        else:
            _run(["scancel", "--signal=USR1", self.job_id])

    def new_events(self) -> Iterator[dict[str, Any]]:
        runs = self.entry.data["runs"]
        for entry in self.ledger.entries(
            reg_id=self.entry.reg_id, kinds=("oracle", "window"), after_seq=self.last_seen
        ):
            self.last_seen = entry.seq
            if entry.kind == "oracle" and self.entry.data["purpose"] == "gate":
                yield {"event": "oracle", **{k: entry.data[k] for k in ("oracle", "item", "passed", "reason")}}
            elif entry.kind == "window" and entry.ref in runs:
                yield {
                    "event": "window",
                    "run": entry.ref,
                    "rung": entry.data["rung"],
                    "step": entry.data["step"],
                    "of": self.steps,
                    "loss": entry.data.get("loss"),
                    "s_per_step": entry.data.get("s_per_step"),
                }

    def events(self) -> Iterator[dict[str, Any]]:
        while not self.abandoned:
            yield from self.new_events()
            state = job_state(self.job_id)
            if not state.active:
                yield from self.new_events()
                self.returncode = settle(self.ledger, self.entry, state)
                return
            time.sleep(POLL_S)


def _runs_of(ledger: Ledger, reg_id: str, run_ids: list[str]) -> dict[str, dict[str, Entry]]:
    found: dict[str, dict[str, Entry]] = {run_id: {} for run_id in run_ids}
    for entry in ledger.entries(reg_id=reg_id, kinds=("run-start", "run-end", "interrupted", "window")):
        if entry.ref in found:
            found[entry.ref][entry.kind] = entry  # the last window
    return found


def outcome(state: str, status: str | None) -> str:
    """What becomes of a run of a job that ended in `state`, its status as the rung recorded it (None: no end)."""
    if status is not None:
        return "interrupted" if state in INTERRUPTING and status != "finished" else status
    if state in INTERRUPTING or state.startswith("REQUEUE"):
        return "interrupted"
    return "killed" if state == "CANCELLED" else "failed"


def settle(ledger: Ledger, job: Entry, state: JobState) -> int:
    """Record what became of the ended job's runs (see the module's docstring) and its `job-end`; its exit status
    as the ladder takes a process's: 0 when Slurm says it completed."""
    reg_id = str(job.reg_id)
    job_id = str(job.ref)
    hosts = hostnames(state.nodes) if state.nodes and state.nodes not in ("(null)", "None") else []
    said = f"job {job_id} ended {state.state}" + (f" (exit code {state.exit_code})" if state.exit_code else "")
    outcomes: dict[str, str | None] = {}
    for run_id, entries in _runs_of(ledger, reg_id, list(job.data["runs"])).items():
        start = entries.get("run-start")
        if start is None:
            outcomes[run_id] = None  # never started: nothing of it is in the ledger
            continue
        end = entries.get("run-end")
        if "interrupted" in entries:
            outcomes[run_id] = "interrupted"
            continue
        decided = outcome(state.state, end.data["status"] if end else None)
        outcomes[run_id] = decided
        if decided == "interrupted":
            from engine.reconcile import record_interrupted

            record_interrupted(ledger, start, f"{said}; re-run from scratch")
        elif end is None and decided == "failed":
            # The job's process died (out of memory, a node lost, a segfault): a crash, which the run's kill
            # lines judge as the rung process would have judged its own (engine/crash.py).
            window = entries.get("window")
            fired = end_crashed_run(
                ledger,
                start,
                exit_status(state) or RUNG_FAILED,
                int(job.data["nodes"]) * int(job.data["tasks_per_node"]),
                {"job": job_id, "job_state": state.state, "error": f"{said} without ending its run"},
                {"gpu_s": window.data.get("elapsed_s", 0.0) if window else 0.0, "at_least": True},
            )
            outcomes[run_id] = "killed" if fired else "failed"
        elif end is None:
            window = entries.get("window")
            ledger.append(
                "run-end",
                reg_id,
                {
                    "rung": start.data["rung"],
                    "status": decided,
                    "ended_by": {"job": job_id, "job_state": state.state},
                    "totals": {
                        "rc": exit_status(state),
                        "steps": window.data["step"] if window else 0,
                        "gpu_s": window.data.get("elapsed_s", 0.0) if window else 0.0,
                        "at_least": True,
                    },
                },
                ref=run_id,
            )
    ledger.append(
        "job-end",
        reg_id,
        {"state": state.state, "exit_code": state.exit_code, "hosts": hosts, "runs": outcomes},
        ref=job_id,
    )
    return exit_status(state)


def exit_status(state: JobState) -> int:
    """The job's exit status: Slurm's "CODE:SIGNAL" as a process's (the code, or -SIGNAL); 1 when it has none but
    did not complete."""
    if state.exit_code and ":" in state.exit_code:
        code, number = (int(part) for part in state.exit_code.split(":"))
        if number:
            return -number
        if code or state.state == "COMPLETED":
            return code
    return 0 if state.state == "COMPLETED" else 1


def outstanding(ledger: Ledger, reg_id: str | None = None) -> list[Entry]:
    """The `job` entries (of one registration, or of all) without a `job-end`: queued, running, or ended unsettled."""
    jobs: dict[str, Entry] = {}
    for entry in ledger.entries(reg_id=reg_id, kinds=("job", "job-end")):
        if entry.kind == "job":
            jobs[str(entry.ref)] = entry
        else:
            jobs.pop(str(entry.ref), None)
    return list(jobs.values())
