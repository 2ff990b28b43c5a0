"""`prereg run`: the oracle gate, then the ladder, behind every refusal DESIGN.md lists.

Refuses: an unfrozen registration (3), a source file that changed since freeze (3), a profile this machine
cannot honour (3), a ledger that fails verification (4), a second run of the same registration (3).
Resumes: runs found without an end are recorded `interrupted` and their rungs re-run from scratch; finished
rungs are never re-run; oracles with results are not re-run. Kill lines' contingencies drop items and the
affected rungs re-run primed (C -> C'). The cost ceiling is projected before each rung.
Where the gate and the rungs run is the registration's launcher's (engine/launch): processes of this machine
(torchrun's ranks for a profile of several), or cluster jobs, which outlive the ladder: a ladder stopped by a
signal leaves its job running, and the next run waits for it and reads its result before anything else.

Power before compute (prereg.power): with `[protocol.noise]` the gate also runs the A/A calibration; then, once,
before the first rung, `on_underpowered` warns, refuses (exit 3) or extends every rung's steps, and the rung
processes run the steps the ladder gives them.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from engine import process_identity
from engine.crash import end_crashed_run
from engine.launch import Launch
from engine.launch.local import FORWARDED_SIGNALS, LocalLaunch, rung_command
from engine.reconcile import record_interrupted, running
from engine.runlock import RunLock
from engine.workload import memory_directory, snapshots_in
from prereg.actions import check_source_unchanged, check_sources_unchanged
from prereg.calibration import CALIBRATION_RUNS, baseline_items, calibration_runs, noise_at_run, rung_cost_estimate
from prereg.cost import cost_summary
from prereg.errors import InvalidInput, LedgerCorrupt, PreregError, Refused
from prereg.ledger import Ledger
from prereg.plan import PlannedRung, plan_ladder, primed
from prereg.power import EXTENSION_KIND, describe, plan_extension, recorded_extension, refusal, unpowered
from prereg.schema import Registration
from prereg.sensitivity import Assessment, assess, baseline_rung, planned_windows
from prereg.state import RegistrationState, RungRun, load_state, require_frozen
from prereg.verdict import VerdictEnv, judge_until_pass, rung_views
from prereg.workload import Profile

REPO_ROOT = Path(__file__).resolve().parent.parent
# What the ladder has always named for its callers (the local launcher's own now).
__all__ = ["FORWARDED_SIGNALS", "Ladder", "rung_command", "run_ladder"]


def check_profile(profile: Profile) -> None:
    if profile.device == "cpu" and profile.world_size == 1:
        return  # nothing to check (and no torch import in the ladder process)
    import torch

    if profile.world_size > 1 and torch.torch_version.TorchVersion(torch.__version__) < (2, 9):
        raise Refused(
            f"profile {profile.name} runs {profile.world_size} processes under torchrun, which forwards the "
            f"budget's SIGUSR1 to them only from torch 2.9 (--signals-to-handle); this is torch {torch.__version__}",
            fix="upgrade torch, or register a one-process profile",
        )
    if profile.device == "cpu":
        return
    if not torch.cuda.is_available():
        raise Refused(
            f"profile {profile.name} needs CUDA and this machine has none",
            fix="run it on a machine with the GPUs it names, or register a cpu-tiny variant",
        )
    if torch.cuda.device_count() < profile.gpus:
        raise Refused(f"profile {profile.name} needs {profile.gpus} GPUs; this machine has {torch.cuda.device_count()}")


def refuse_calibration_across_processes(reg: Registration, profile: Profile) -> None:
    """The A/A calibration runs in the gate's one process: a profile whose rungs are several processes would have
    its noise measured on a run unlike any of its rungs."""
    if reg.protocol.noise is not None and profile.world_size > 1:
        raise Refused(
            f"[protocol.noise]: the A/A calibration runs in the gate's one process, and profile {profile.name} runs "
            f"each rung as {profile.world_size} processes: it would measure windows unlike its rungs'",
            fix="amend away [protocol.noise] (the noise then comes from earlier windows in the ledger), "
            "or register a one-process profile",
        )


def registration_file(ledger: Ledger, reg_id: str, file: Path | None) -> Path:
    if file is not None:
        return file
    frozen = next(ledger.entries(reg_id=reg_id, kinds=("freeze",)))
    path = Path("registrations") / frozen.data["source_file"]
    if not path.exists():
        path = REPO_ROOT / "registrations" / frozen.data["source_file"]
    if not path.exists():
        raise InvalidInput(
            f"the frozen file {frozen.data['source_file']} is not in ./registrations", fix="pass --file PATH"
        )
    return path


def mark_interrupted(ledger: Ledger, state: RegistrationState) -> list[str]:
    """Under this ladder's run lock, every run of the registration without an end is over: recorded interrupted.
    One whose process still runs (a rung left behind by a ladder that died) is refused: the rung would run twice."""
    marked = []
    for start in running(ledger, state.reg_id):
        if start.data.get("job"):
            continue  # a cluster job's run: its job settles it (Ladder.await_jobs, before this)
        identity = start.data.get("process")
        if process_identity.gone(identity) is False:
            raise Refused(
                f"rung {start.data['rung']} of {state.reg_id} is still running: {process_identity.describe(identity)}",
                fix=f"wait for it to end, or stop it (kill {identity['pid']}); then run again",
            )
        record_interrupted(ledger, start, "found without an end; re-run from scratch")
        marked.append(start.ref)
    return marked


def _done(planned: PlannedRung, runs: list[RungRun], until_pass: bool = False) -> tuple[bool, str]:
    """Whether a planned rung needs no (more) running, and the label its next run would carry. In an until-pass
    ladder a failed run is final too: its pass rule judges it (rc != 0) and the ladder moves on."""
    own = [
        r for r in runs if r.rung in (planned.id, primed(planned.id)) and not r.external and r.status != "interrupted"
    ]
    recorded = [r for r in runs if r.rung == planned.id and r.external and r.flagged is None and r.status == "finished"]
    matching = [r for r in own if sorted(r.items) == sorted(planned.items)]
    if recorded or any(r.status == "finished" for r in matching):
        return True, planned.id
    if any(
        r.status in ("killed", "over-ceiling") and r.ended_by and ("kill" in r.ended_by or "ceiling" in r.ended_by)
        for r in matching
    ):
        return True, planned.id  # ended by a kill line or the ceiling: final for these items
    if until_pass and any(r.status == "failed" for r in matching):
        return True, planned.id
    stale = [r for r in own if sorted(r.items) != sorted(planned.items)]
    return False, primed(planned.id) if stale else planned.id


def pending_rungs(reg: Registration, state: RegistrationState) -> list[tuple[PlannedRung, str]]:
    out = []
    for planned in plan_ladder(reg, set(state.dropped())):
        if not planned.runs:
            continue
        done, label = _done(planned, state.runs, reg.protocol.kind == "until_pass")
        if not done:
            out.append((planned, label))
    return out


def until_pass_decided(reg: Registration, ledger: Ledger, reg_id: str) -> str | None:
    """The rung that passed, judged as the verdict judges it: with the windows, since a pass rule may read a
    window metric (a memory peak, the loss); judged without them, such a rule never passes and the ladder runs on."""
    state = load_state(ledger, reg_id, with_windows=True)
    views = rung_views(reg, state)
    passed, _, _ = judge_until_pass(state, views, VerdictEnv(reg, state, views, None, None))
    return passed


class Ladder:
    def __init__(
        self,
        ledger: Ledger,
        reg_id: str,
        *,
        budget_s: float | None,
        console,
        gate_only: bool = False,
        registration_dir: Path | None = None,
        launch: Launch | None = None,
        detach: bool = False,
    ):
        self.ledger = ledger
        self.reg_id = reg_id
        # The registration file's folder, which the document's own paths are relative to (a command's cwd).
        self.registration_dir = registration_dir
        self.budget_s = budget_s
        # Stop once the gate has answered: on a machine lent by the call, the gate fills one call and a rung
        # process that must run whole (an interleaved one) the next, rather than starting only to be stopped.
        self.gate_only = gate_only
        self.console = console
        self.launch: Launch = launch if launch is not None else LocalLaunch()
        # Submit the ladder's next job and return (a launcher whose jobs outlive the ladder); the next run follows.
        self.detach = detach and self.launch.detached_jobs
        self.submitted: list[str] = []
        self.started = time.monotonic()
        self.child: Any = None
        self.stopping: str | None = None
        self.power: dict[str, Any] | None = None  # what on_underpowered decided (settle_power), for the summary

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)

    def install_signals(self) -> None:
        def forward(number, frame):
            self.stopping = signal.Signals(number).name
            if self.child is not None:
                self.child.signal(number)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)

    def child_ledger_url(self) -> str:
        """The ledger as the child processes (which run from the repository root) must name it."""
        url = self.ledger.url
        if "://" in url and not url.startswith("sqlite:///"):
            return url
        return str(Path(url.removeprefix("sqlite:///")).resolve())

    def child_args(self) -> list[str]:
        """What every gate and rung process is told: the ledger, the registration, and the registration's folder."""
        args = ["--ledger", self.child_ledger_url(), "--reg", self.reg_id]
        if self.registration_dir is not None:
            args += ["--registration-dir", str(self.registration_dir.resolve())]
        return args

    def _budget_expired(self) -> None:
        if self.stopping is None:
            self.stopping = "budget"
        if self.child is not None:
            self.child.signal(signal.SIGUSR1)

    def budget_left(self) -> float | None:
        return None if self.budget_s is None else self.budget_s - (time.monotonic() - self.started)

    def end_abandoned_runs(
        self, state: RegistrationState, run_ids: list[str], rc: int, wall_s: float, profile: Profile
    ) -> None:
        """A rung process that died while the ladder lives (a rank killed by its launcher after another rank's
        out-of-memory, the kernel's OOM killer) leaves its started runs without an end: the ladder ends them
        `failed` with the exit status it saw, so a pass rule judges them (rc != 0) instead of a resume re-running
        them for ever. Snapshots a `memory_snapshot` rung wrote before it died are named on the end. A process
        that died is a crash (a segfault in a kernel, say): the run's kill lines judge its crash window, as the rung
        process judges its own when its runner raises (engine/crash.py)."""
        for run in state.runs:
            if run.run_id not in run_ids or run.status != "running":
                continue
            start = next(self.ledger.entries(reg_id=self.reg_id, kinds=("run-start",), ref=run.run_id))
            fired = end_crashed_run(
                self.ledger,
                start,
                rc,
                profile.world_size,
                {"error": f"the rung process exited with {rc} without ending its run (ended by the ladder)"},
                {
                    "wall_s": round(wall_s, 4),
                    "gpu_s": round(wall_s * profile.world_size / len(run_ids), 4),
                    "world_size": profile.world_size,
                },
                {"memory_snapshots": snapshots_in(REPO_ROOT / memory_directory(self.reg_id, run_ids[0]))},
            )
            self.say(
                f"[bold red]rung {run.rung}[/]: its process exited with {rc} without ending the run; recorded "
                + (f"killed by {fired['kill']}" if fired else "failed")
            )

    def run_child(
        self, purpose: str, args: list[str], profile: Profile, runs: dict[str, str] | None = None
    ) -> int | None:
        """Start the gate or a rung where the launcher puts it and follow it to its end; its exit status (None when
        the ladder stopped following a job that runs on, or submitted it detached)."""
        assert purpose in ("gate", "rung"), purpose
        self.child = self.launch.start(purpose, args, profile, runs or {})  # type: ignore[arg-type]
        job_id = getattr(self.child, "job_id", None)
        if job_id is not None:
            self.submitted.append(job_id)
            self.say(f"  submitted {purpose} as Slurm job {job_id}")
        if self.detach:
            self.child = None
            return None
        return self.follow()

    def follow(self) -> int | None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        timer = None
        left = self.budget_left()
        if left is not None:
            # The time budget: the child stops cleanly between steps (or probes) and the ladder stays resumable.
            timer = threading.Timer(max(left, 0.0), self._budget_expired)
            timer.daemon = True
            timer.start()
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=self.console is None,
            transient=False,
        )
        tasks: dict[str, Any] = {}
        with progress:
            for event in self.child.events():
                if event["event"] == "oracle" and self.console is not None:
                    mark = "[green]pass[/]" if event["passed"] else "[red]FAIL → dropped[/]"
                    progress.console.print(f"  oracle {event['oracle']} ({event['item']}): {mark} · {event['reason']}")
                elif event["event"] == "window":
                    key = event["run"]
                    if key not in tasks:
                        tasks[key] = progress.add_task(f"  rung {event['rung']}", total=event["of"], note="")
                    shown = [(event.get("loss"), "loss {:.3f}"), (event.get("s_per_step"), "{:.3f} s/step")]
                    note = " · ".join(form.format(value) for value, form in shown if value is not None)
                    progress.update(tasks[key], completed=event["step"], note=note)
        if timer is not None:
            timer.cancel()
        rc = self.child.returncode
        self.child = None
        return rc

    def gate(self, reg: Registration, state: RegistrationState) -> None:
        pending = [o.id for i in reg.items for o in i.oracles if o.id not in state.oracles]
        calibrating = self.calibration_pending(reg, state)
        if not pending and not calibrating:
            return
        if pending:
            self.say(f"[bold]oracle gate[/]: {len(pending)} oracle(s) — every one runs before any rung")
        if calibrating:
            assert reg.protocol.noise is not None
            self.say(
                f"[bold]A/A calibration[/]: the baseline rung {baseline_rung(reg)} {CALIBRATION_RUNS} times for "
                f"{reg.protocol.noise.windows} read windows — the noise every bar is assessed against"
            )
        rc = self.run_child("gate", self.child_args(), reg.declaration().profiles[reg.profile])
        if self.stopping is not None or rc is None:
            return
        if rc != 0:
            self.refuse_failed_calibration()
            raise RuntimeError(f"the oracle gate process exited with {rc}")
        if self.calibration_pending(reg, load_state(self.ledger, self.reg_id, with_windows=False)):
            raise RuntimeError("the gate process ended without recording the A/A calibration's runs")

    def refuse_failed_calibration(self) -> None:
        """A gate whose A/A calibration's runner failed (a command's script that exited non-zero) says why on its
        entry: that is the user's to fix, not a bug of the engine."""
        last = None
        for entry in self.ledger.entries(reg_id=self.reg_id, kinds=("gate",)):
            last = entry
        if last is not None and last.data.get("calibration_failed"):
            raise PreregError(
                f"the A/A calibration failed (gate entry {last.seq}): {last.data['calibration_failed']}",
                fix="fix what failed, then run again: the calibration runs again before any rung",
            )

    def calibration_pending(self, reg: Registration, state: RegistrationState) -> bool:
        if reg.protocol.noise is None:
            return False
        items = baseline_items(reg, set(state.dropped()))
        return len(calibration_runs(self.ledger, self.reg_id, reg, items)) < CALIBRATION_RUNS

    def settle_power(self, reg: Registration, state: RegistrationState) -> int:
        """The steps every rung runs. Decided once, before any rung of the ladder has data: from the noise alone
        (the calibration's, else earlier windows in the ledger), as `on_underpowered` says; afterwards the
        recorded decision stands."""
        mode = reg.protocol.on_underpowered
        recorded = recorded_extension(self.ledger, self.reg_id, reg.protocol)
        if recorded is not None or state.runs:
            steps = int(recorded["steps"]) if recorded else reg.protocol.steps
            self.power = {"on_underpowered": mode, "steps": steps, "decided": "before", "extension": recorded}
            if recorded:
                self.say(
                    f"[bold]extended[/] (entry {recorded['seq']}): every rung runs {steps} steps"
                    f" ({recorded['windows']} read windows)"
                )
            return steps
        items = baseline_items(reg, set(state.dropped()))
        assessment = assess(reg, noise_at_run(self.ledger, self.reg_id, reg, items))
        short = unpowered(assessment)
        self.power = {
            "on_underpowered": mode,
            "steps": reg.protocol.steps,
            "decided": "now",
            "sensitivity": assessment.rows_json(),
            "sensitivity_notes": assessment.notes_json(),
            "extension": None,
        }
        self.say_power(assessment)
        if not short:
            return reg.protocol.steps
        if mode == "refuse":
            message, fix = refusal(short, reg.protocol)
            raise Refused(message, fix=fix)
        if mode == "warn":
            return reg.protocol.steps
        return self.extend(reg, state, assessment)

    def say_power(self, assessment: Assessment) -> None:
        for row in assessment.rows:
            if row.powered is False:
                self.say(f"[bold yellow]UNDERPOWERED[/]: {describe(row)}")
            elif row.powered is None:
                why = "; ".join(row.notes) or "no noise is known"
                self.say(f"[yellow]power unknown[/]: {row.read} (rule {row.rule}) bar {row.bar:g}: {why}")

    def extend(self, reg: Registration, state: RegistrationState, assessment: Assessment) -> int:
        """on_underpowered = extend: every rung gets the read windows the neediest reachable bar needs; the cost
        is projected with them (from the calibration's time per step) and the ceiling's on_ceiling follows."""
        extension = plan_extension(reg.protocol, assessment.rows)
        for row in unpowered(assessment):
            if not row.windows_needed:
                self.say(f"[yellow]no extension reaches[/] {row.read} (rule {row.rule}): {'; '.join(row.notes)}")
        if extension is None:
            return reg.protocol.steps
        items = baseline_items(reg, set(state.dropped()))
        per_rung = rung_cost_estimate(calibration_runs(self.ledger, self.reg_id, reg, items), extension.steps)
        cost = cost_summary(self.ledger, state)
        rungs = len(pending_rungs(reg, state))
        projected = None if per_rung is None else cost["gpu_s"] + per_rung * rungs
        projection = {
            "spent_gpu_s": cost["gpu_s"],
            "per_rung_gpu_s": per_rung,
            "rungs": rungs,
            "projected_gpu_s": projected,
            "ceiling_gpu_s": cost["ceiling_gpu_s"],
            "over_ceiling": None if projected is None else projected > cost["ceiling_gpu_s"],
            "on_ceiling": reg.cost.on_ceiling,
        }
        data = extension.entry(reg.protocol, version=state.version, projection=projection)
        entry = self.ledger.append(EXTENSION_KIND, self.reg_id, data)
        self.power.update(steps=extension.steps, extension={**data, "seq": entry.seq})
        self.say(
            f"[bold]extended[/] (entry {entry.seq}): every rung runs {extension.steps} steps, "
            f"{extension.windows} read windows instead of {planned_windows(reg.protocol)}, for "
            + ", ".join(f"{row.read} (rule {row.rule})" for row in extension.reached)
        )
        if projected is None:
            self.say("  no time per step is known before a rung has run: the ceiling projects from the first rung on")
        elif projected > cost["ceiling_gpu_s"]:
            self.say(
                f"[bold red]the extension does not fit the ceiling[/]: projected {projected:.1f} of"
                f" {cost['ceiling_gpu_s']:.0f} device-s; on_ceiling = {reg.cost.on_ceiling} decides"
            )
        return extension.steps

    def print_plan(self, reg: Registration, state: RegistrationState) -> None:
        if self.console is None:
            return
        from rich.markup import escape

        from engine.report.terminal import Column, print_table

        dropped = state.dropped()
        rows = []
        for planned in plan_ladder(reg, set(dropped)):
            done, label = (
                _done(planned, state.runs, reg.protocol.kind == "until_pass") if planned.runs else (False, planned.id)
            )
            note = planned.skip or (
                "done" if done else ("primed: re-run without dropped items" if label != planned.id else "")
            )
            will_run = ", ".join(planned.items) or "—" if planned.runs else "not run"
            rows.append([escape(text) for text in (label, ", ".join(planned.declared) or "—", will_run, note)])
        columns = [
            Column("rung", key=True, min_width=6),
            Column("declared", min_width=12),
            Column("will run", min_width=12),
        ]
        print_table(self.console, "the plan that will run", columns + [Column("note", min_width=16)], rows)
        for item, why in dropped.items():
            where = f"oracle {why['oracle']}" if why["cause"] == "oracle" else f"kill {why['kill']}"
            self.console.print(f"  dropped {item} ({where}): {why['reason']}")

    def ceiling_allows(
        self, reg: Registration, state: RegistrationState, remaining: int, steps: int | None = None
    ) -> tuple[bool, float | None]:
        """Project the ladder's total before a rung; apply on_ceiling. Returns (start the rung?, in-rung deadline).
        A rung's cost is the mean of the finished ones, or before any has finished the A/A calibration's at the
        rungs' `steps` (the protocol's unless an extension gave more)."""
        steps = reg.protocol.steps if steps is None else steps
        cost = cost_summary(self.ledger, state)
        spent, ceiling = cost["gpu_s"], cost["ceiling_gpu_s"]
        finished = [
            r.totals["gpu_s"] for r in state.runs if not r.external and r.status == "finished" and "gpu_s" in r.totals
        ]
        calibrated = calibration_runs(self.ledger, self.reg_id, reg, baseline_items(reg, set(state.dropped())))
        estimate = statistics.mean(finished) if finished else rung_cost_estimate(calibrated, steps)
        projected = spent + (estimate * remaining if estimate is not None else 0.0)
        mode = reg.cost.on_ceiling
        if spent >= ceiling or projected > ceiling:
            event = {
                "spent_gpu_s": spent,
                "projected_gpu_s": projected,
                "ceiling_gpu_s": ceiling,
                "on_ceiling": mode,
                "remaining_rungs": remaining,
            }
            if mode == "stop" or (mode == "finish-rung" and spent >= ceiling):
                self.ledger.append("ceiling", self.reg_id, {**event, "action": "stopped before the next rung"})
                self.say(
                    f"[bold red]cost ceiling[/]: spent {spent:.1f} + projected → {projected:.1f} of {ceiling:.0f}"
                    f" device-s; on_ceiling = {mode}: stopping"
                )
                return False, None
            action = "finishing one more rung" if mode == "finish-rung" else "continuing; the overrun is recorded"
            self.ledger.append("ceiling", self.reg_id, {**event, "action": action})
            self.say(
                f"[yellow]cost ceiling[/]: projected {projected:.1f} of {ceiling:.0f} device-s;"
                f" on_ceiling = {mode}: {action}"
            )
        deadline = ceiling - spent if mode == "stop" else None
        return True, deadline

    def stopped_elsewhere(self, state: RegistrationState, run_ids: list[str]) -> bool:
        """Whether a run of the job just ended was killed by no kill line and no signal of this ladder (scancel, the
        time limit): the ladder stops and says so, as a local ladder does when it is stopped; a next run re-runs it."""
        killed = [
            r
            for r in state.runs
            if r.run_id in run_ids and r.status == "killed" and not {"kill", "ceiling"} & set(r.ended_by or {})
        ]
        for run in killed:
            self.say(
                f"[bold red]rung {run.rung} was killed[/] ({_ended_by(run.ended_by)}), not by this ladder:"
                f" stopping — `prereg run {self.reg_id}` re-runs it"
            )
        return bool(killed)

    def await_jobs(self) -> bool:
        """Before anything else, the cluster jobs an earlier run left (detached, or still running when it stopped):
        each is followed to its end and settled. Returns False when the ladder must return now (detached, and a
        job still runs)."""
        from engine.launch.slurm import SlurmJob, job_state, outstanding, settle

        for job in outstanding(self.ledger, self.reg_id):
            state = job_state(str(job.ref))
            if not state.active:
                settle(self.ledger, job, state)
                self.say(f"  Slurm job {job.ref} ({job.data['purpose']}) ended {state.state}: its result is read")
                continue
            if self.detach:
                self.say(f"  Slurm job {job.ref} ({job.data['purpose']}) is {state.state}: the ladder waits for it")
                return False
            self.say(f"  following Slurm job {job.ref} ({job.data['purpose']}), {state.state}")
            self.child = SlurmJob(self.ledger, job)
            self.follow()
            if self.stopping is not None:
                return False
        return True

    def run(self, reg: Registration) -> dict[str, Any]:
        self.install_signals()
        if self.launch.detached_jobs and not self.await_jobs():
            return self.summary("detached" if self.stopping is None else f"signal {self.stopping}")
        state = load_state(self.ledger, self.reg_id, with_windows=False)
        interrupted = mark_interrupted(self.ledger, state)
        if interrupted:
            self.say(
                f"[yellow]interrupted[/]: {', '.join(interrupted)} ended without a run-end;"
                " their rungs re-run from scratch"
            )
        self.gate(reg, load_state(self.ledger, self.reg_id, with_windows=False))
        if self.detach and self.submitted:
            return self.summary("detached")  # the gate's job: no rung is submitted before its oracles are in
        state = load_state(self.ledger, self.reg_id, with_windows=False)
        stopped = "gate-only" if self.gate_only and self.stopping is None else None
        steps = reg.protocol.steps
        if self.stopping is None and not self.gate_only:
            steps = self.settle_power(state.registration(), state)
        if self.stopping is None:
            self.print_plan(reg, state)
        while self.stopping is None and not self.gate_only:
            state = load_state(self.ledger, self.reg_id, with_windows=False)
            reg = state.registration()
            if reg.protocol.kind == "until_pass" and until_pass_decided(reg, self.ledger, self.reg_id):
                break
            pending = pending_rungs(reg, state)
            if not pending:
                break
            batch = pending if reg.protocol.schedule == "interleaved" else pending[:1]
            if reg.protocol.kind == "until_pass":
                batch = pending[:1]  # until-pass ladders are ordered: a rung runs only if every earlier one failed
            allowed, deadline = self.ceiling_allows(reg, state, len(pending), steps=steps)
            if not allowed:
                stopped = "ceiling"
                break
            left = self.budget_left()
            estimate = [r.totals.get("wall_s") for r in state.runs if r.status == "finished" and r.totals.get("wall_s")]
            if left is not None and estimate and statistics.mean(estimate) > left:
                stopped = "budget"
                self.say(
                    f"[yellow]time budget[/]: {left:.0f} s left, a rung takes ~{statistics.mean(estimate):.0f} s;"
                    " stopping cleanly — run again to resume"
                )
                break
            args = [*self.child_args(), "--steps", str(steps)]
            for planned, label in batch:
                args += ["--run-spec", f"{uuid.uuid4().hex[:12]}={label}:{planned.id}:{','.join(planned.items)}"]
            if deadline is not None:
                args += ["--deadline-s", f"{deadline:.3f}"]
            self.say(
                f"[bold]rung {', '.join(label for _, label in batch)}[/]"
                + (" (interleaved)" if len(batch) > 1 else "")
                + f": items {', '.join(sorted({i for p, _ in batch for i in p.items})) or '— (baseline)'}"
            )
            kills_before = len(state.kills)
            run_ids = [a.split("=", 1)[0] for a in args[args.index("--run-spec") :] if "=" in a]
            profile = reg.declaration().profiles[reg.profile]
            child_start = time.monotonic()
            rc = self.run_child("rung", args, profile, {run_id: label for run_id, (_, label) in zip(run_ids, batch)})
            if self.stopping == "budget":
                stopped = "budget"
                break
            if rc is None:
                break  # detached, or a job the ladder stopped following: the next run reads its result
            state = load_state(self.ledger, self.reg_id, with_windows=False)
            if rc != 0 and self.stopping is None:
                self.end_abandoned_runs(state, run_ids, rc, time.monotonic() - child_start, profile)
                state = load_state(self.ledger, self.reg_id, with_windows=False)
            ended = {r.run_id for r in state.runs if r.status not in ("running", "interrupted")}
            if not set(run_ids) <= ended:
                # A rung process that leaves no end in this ledger (it crashed before its run-start, or wrote
                # elsewhere) would be re-run forever: stop and say so; the next run records it as interrupted.
                raise RuntimeError(
                    f"the rung process exited with {rc} without ending its runs {sorted(set(run_ids) - ended)}"
                    f" in {self.ledger.url}"
                )
            for kill in state.kills[kills_before:]:
                drops = f"; contingency: drop {', '.join(kill['drops'])} and re-plan" if kill["drops"] else ""
                self.say(
                    f"[bold red]kill {kill['kill']}[/] on rung {kill['rung']} at step {kill['step']}:"
                    f" {kill['reason']}{drops}"
                )
            if self.launch.detached_jobs and self.stopped_elsewhere(state, run_ids):
                stopped = "killed"
                break
            failed = [r for r in state.runs if r.run_id in run_ids and r.status == "failed"]
            if failed and reg.protocol.kind != "until_pass":
                # Re-running it at once would fail the same way, for ever: stop, say why; `prereg run` retries it.
                for run in failed:
                    self.say(
                        f"[bold red]rung {run.rung} failed[/]:"
                        f" {(run.ended_by or {}).get('error', 'see the rung process output')}"
                    )
                stopped = "failed"
                break
            over = [r for r in state.runs if r.run_id in run_ids and r.status == "over-ceiling"]
            if over:
                # The rung outlasted what was left under the ceiling (on_ceiling = stop): the ladder stops here, and
                # says so even when that rung was its last; the over-ceiling rung's windows are never read.
                for run in over:
                    self.say(
                        f"[bold red]rung {run.rung} ended over the ceiling[/]:"
                        " it outlasted the device-seconds left under it"
                    )
                stopped = "ceiling"
                break
            cost = cost_summary(self.ledger, state)
            if reg.cost.on_ceiling == "finish-rung" and cost["gpu_s"] >= cost["ceiling_gpu_s"]:
                stopped = "ceiling"
                break
        if self.stopping == "budget":
            stopped = "budget"
        elif self.stopping:
            stopped = f"signal {self.stopping}"
        elif self.detach and self.submitted:
            stopped = "detached"
        return self.summary(stopped)

    def summary(self, stopped: str | None) -> dict[str, Any]:
        from engine.launch.slurm import outstanding

        state = load_state(self.ledger, self.reg_id, with_windows=False)
        reg = state.registration()
        remaining = [f"oracle {o.id}" for i in reg.items for o in i.oracles if o.id not in state.oracles]
        remaining += [label for _, label in pending_rungs(reg, state)]
        if reg.protocol.kind == "until_pass" and until_pass_decided(reg, self.ledger, self.reg_id):
            remaining = []
        seq, head = self.ledger.head()
        cost = cost_summary(self.ledger, state)
        summary = {
            "id": self.reg_id,
            "complete": not remaining and stopped is None,
            "stopped": stopped,
            "remaining": remaining,
            "dropped": state.dropped(),
            "runs": [{"run": r.run_id, "rung": r.rung, "status": r.status, "windows": r.n_windows} for r in state.runs],
            "cost": cost,
            "power": self.power,
            "head": head,
        }
        if self.launch.detached_jobs:
            jobs = outstanding(self.ledger, self.reg_id)
            summary["jobs"] = [
                {"job": job.ref, "purpose": job.data["purpose"], "runs": job.data["runs"]} for job in jobs
            ]
            for job in jobs:
                self.say(
                    f"  Slurm job {job.ref} ({job.data['purpose']}) runs on; `prereg run {self.reg_id}` waits for it"
                    f" and reads its result (`scancel {job.ref}` stops it)"
                )
        if remaining:
            self.say(
                f"ladder not complete ({stopped or 'stopped'}); remaining: {', '.join(remaining)}"
                f" — `prereg run {self.reg_id}` resumes"
            )
        elif stopped:
            self.say(
                f"ladder stopped ({stopped}) · {cost['gpu_s']:.1f} device-s of {cost['ceiling_gpu_s']:.0f} ceiling"
                f" · ledger head {head[:16]} (entry {seq})"
            )
        else:
            self.say(
                f"ladder complete · {cost['gpu_s']:.1f} device-s of {cost['ceiling_gpu_s']:.0f} ceiling"
                f" · ledger head {head[:16]} (entry {seq})"
            )
        return summary


def make_launch(ledger: Ledger, reg_id: str, reg: Registration, profile: Profile, start: Path) -> Launch:
    """The registration's launcher, resolved from the nearest prereg.toml above `start`; a Slurm one is refused
    (exit 3) when its nodes cannot reach the ledger, or cannot run the profile's processes."""
    from prereg.launchers import SlurmLauncher, resolve_launcher

    name, launcher = resolve_launcher(reg.launcher, start)
    if reg.launcher is None:
        return LocalLaunch()
    record = {"name": name, **launcher.model_dump(mode="json")}
    if not isinstance(launcher, SlurmLauncher):
        return LocalLaunch(record)
    from engine.launch.slurm import SlurmLaunch, check_ledger_reachable, tasks_per_node

    tasks_per_node(name, launcher, profile)
    check_ledger_reachable(ledger.url, name, launcher)
    return SlurmLaunch(ledger, reg_id, name, launcher, record)


def _ended_by(ended_by: dict[str, Any] | None) -> str:
    if not ended_by:
        return "no reason recorded"
    if "job_state" in ended_by:
        return f"job {ended_by.get('job')} {ended_by['job_state']}"
    return ", ".join(f"{key} {value}" if value is not True else key for key, value in ended_by.items())


def run_ladder(
    ledger: Ledger,
    reg_id: str,
    *,
    file: Path | None,
    dry_run: bool,
    budget_s: float | None,
    console,
    gate_only: bool = False,
    detach: bool = False,
    launchers_from: Path | None = None,
) -> dict[str, Any]:
    state = require_frozen(ledger, reg_id, with_windows=False)
    path = registration_file(ledger, reg_id, file)
    check_source_unchanged(ledger, reg_id, path)
    check_sources_unchanged(ledger, state.registration(), path)
    report = ledger.verify()
    if not report.ok:
        raise LedgerCorrupt(
            f"the ledger failed verification at entry {report.first_bad}: {report.reason}",
            first_bad=report.first_bad,
            fix="`prereg audit verify` names the entry; restore the ledger from its export before running",
        )
    reg = state.registration()
    profile = reg.declaration().profiles[reg.profile]
    launch = make_launch(ledger, reg_id, reg, profile, launchers_from or Path.cwd())
    if detach and not launch.detached_jobs:
        raise InvalidInput(
            f"--detach needs a launcher whose jobs outlive `prereg run`; {reg_id} runs on this machine",
            fix="name a slurm launcher in the registration (launcher = NAME in prereg.toml), or run without --detach",
        )
    if not launch.detached_jobs:
        check_profile(profile)  # a cluster job's machine is not this one: its rung checks its own ranks
    refuse_calibration_across_processes(reg, profile)
    ladder = Ladder(
        ledger,
        reg_id,
        budget_s=budget_s,
        console=console,
        gate_only=gate_only,
        registration_dir=path.parent,
        launch=launch,
        detach=detach,
    )
    if dry_run:
        ladder.print_plan(reg, state)
        return {
            "id": reg_id,
            "dry_run": True,
            "pending": [label for _, label in pending_rungs(reg, state)],
            "oracles_pending": [o.id for i in reg.items for o in i.oracles if o.id not in state.oracles],
        }
    with RunLock(ledger.url, reg_id):
        return ladder.run(reg)
