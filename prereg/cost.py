"""What a ladder costs, the one cost model: device-seconds per process, read from the ledger, against the ceiling.

The verdict's `cost` (what the ceiling judges, before each rung and after the ladder), `prereg audit costs` and the
report's split all come from here. Every number comes from the ledger; none is estimated. What each part is, and
where it is read:
- total: each process's recorded device-seconds — a gate entry's `gpu_s`, a run-end's `totals.gpu_s` (wall time
  from the process's start, model load included, times its devices; interleaved rungs share one process and the
  engine splits its time evenly among them). The sum is the verdict's `cost.gpu_s`, the number the ceiling judges.
- model load: the run-end's `totals.load_gpu_s` (rung processes). A gate process's own load (its entry's
  `load_s`) is part of the oracle gate.
- oracle gate: the gate entries' `gpu_s`; inside it, each oracle entry's `gpu_s` is its probe, each `calibration`
  entry's `gpu_s` an A/A calibration run (its own load and steps), and the rest is the gate's process start, its
  oracles' model load and its teardown.
- steps: from the end of the model load to the end of the last window, cut at each window's `elapsed_s` (the
  process clock, recorded on every window): a window's share is its `elapsed_s` minus the previous window's (the
  first window's starts where the load ends). It holds the training steps and what runs between them (the
  previous window's ledger write, evaluation windows, saves). Windows at a step <= `discard_first` are the
  warm-up the reads leave out; the others are read.
- other: the process start (before the model load) and the teardown (after the last window: run-end
  `wall_s` minus the last `elapsed_s`). Where the load started on the process clock is read from the run-end's
  `load_start_s` when the engine records it; otherwise it is derived from the ledger's timestamps — the process
  start is each window's timestamp minus its `elapsed_s` (they agree to a millisecond), and the process start is
  taken to end at the run's `run-start` entry; the runner's construction between that entry and the load (the
  workload's imports) is then not recorded on its own and falls into the first window.
- external: rungs entered with `prereg record` count what they report; interrupted runs (no run-end) count the
  last window's `elapsed_s` as a lower bound, unsplit.
A number the split needs and the ledger does not hold is reported as missing, never filled in.

The verdict's summary is the same split in four: model load, oracle gate, steps (everything a rung process spent
after its load, process start and teardown included) and external.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from prereg.ledger import Ledger
from prereg.ledger.envelope import TS_FORMAT
from prereg.state import RegistrationState, load_state

# The split's parts, in the order they are shown and stacked.
PARTS = {
    "load": "model load",
    "oracle_gate": "oracle gate",
    "steps_warmup": "steps: warm-up (not read)",
    "steps_read": "steps: read windows",
    "other": "other: process start + teardown",
    "external": "external (recorded)",
    "interrupted": "interrupted runs (at least)",
    "unsplit": "not separable (see notes)",
}
# A derived process start may disagree with the window clock by the time between reading the clock and stamping
# the entry (a fraction of a millisecond); more than this and the timestamps are not trusted.
CLOCK_SLACK_S = 0.05
COST_ENTRY_KINDS = ("run-start", "window", "gate", "oracle", "calibration")


@dataclass
class ProcessCost:
    """One process of the ladder (a gate, one sequential rung, or interleaved rungs sharing a process)."""

    kind: str  # gate | rung | external | interrupted | running
    label: str
    rungs: list[str]
    runs: list[str]
    status: str
    total: float  # device-seconds, as recorded
    devices: float | None = None
    load: float = 0.0
    probes: float = 0.0  # gate: the oracle probes
    calibration: float = 0.0  # gate: the A/A calibration's runs
    steps_warmup: float = 0.0
    steps_read: float = 0.0
    start: float = 0.0
    teardown: float = 0.0
    unsplit: float = 0.0
    ledger_writes: float = 0.0  # window entries written (every window's ledger_s and the run-end's)
    start_from: str | None = None  # recorded | timestamps | None (not known)
    oracles: list[str] = field(default_factory=list)
    note: str | None = None
    shares: dict[str, float] = field(default_factory=dict)  # run id -> its share of the process (the engine's split)

    @property
    def steps(self) -> float:
        return self.steps_warmup + self.steps_read

    @property
    def other(self) -> float:
        gate_rest = self.total - self.load - self.probes - self.calibration if self.kind == "gate" else 0.0
        return self.start + self.teardown + gate_rest

    def parts(self) -> dict[str, float]:
        if self.kind == "gate":
            return {"oracle_gate": self.total}
        if self.kind == "external":
            return {"external": self.total}
        if self.kind in ("interrupted", "running"):
            return {"interrupted": self.total}
        return {
            "load": self.load,
            "steps_warmup": self.steps_warmup,
            "steps_read": self.steps_read,
            "other": self.start + self.teardown,
            "unsplit": self.unsplit,
        }


def _utc(ts: str) -> float:
    return datetime.strptime(ts, TS_FORMAT).replace(tzinfo=timezone.utc).timestamp()


def _gates(entries: list) -> list[ProcessCost]:
    """Gate processes: each gate entry, with the probe time of the oracle entries it lists."""
    probe_s: dict[str, float] = {}
    calibration_s: dict[str, float] = {}
    gates = []
    for entry in entries:
        if entry.kind == "oracle" and not entry.data.get("external") and "gpu_s" in entry.data:
            probe_s[entry.data["oracle"]] = float(entry.data["gpu_s"])
        elif entry.kind == "calibration" and entry.ref:
            calibration_s[entry.ref] = float(entry.data["gpu_s"])
        elif entry.kind == "gate":
            data = entry.data
            total, wall = float(data.get("gpu_s", 0.0)), data.get("wall_s")
            devices = total / wall if wall else None
            oracles = list(data.get("oracles", []))
            gate = ProcessCost(
                "gate",
                f"oracle gate {len(gates) + 1}",
                [],
                [],
                f"stopped by {data['stopped']}" if data.get("stopped") else "finished",
                total,
                devices=devices,
                oracles=oracles,
            )
            gate.probes = sum(probe_s.get(o, 0.0) for o in oracles)
            gate.calibration = sum(calibration_s.get(ref, 0.0) for ref in data.get("calibration", []))
            if "load_s" in data and devices is not None:
                gate.load = float(data["load_s"]) * devices
            else:
                gate.note = "the gate's load time is not recorded: it is inside the rest of the gate"
            gates.append(gate)
    return gates


def _rung_processes(state: RegistrationState, entries: list, discard_first: int) -> tuple[list[ProcessCost], list[str]]:
    starts = {e.ref: e for e in entries if e.kind == "run-start"}
    windows: dict[str, list] = {}
    for entry in entries:
        if entry.kind == "window":
            windows.setdefault(entry.ref, []).append(entry)
    # Runs that shared a process: the run-start names the others (interleaved_with).
    group_of: dict[str, str] = {}
    for run in state.runs:
        if run.external or run.run_id in group_of:
            continue
        members = (
            [run.run_id] + list(starts[run.run_id].data.get("interleaved_with", []))
            if run.run_id in starts
            else [run.run_id]
        )
        for member in members:
            group_of.setdefault(member, run.run_id)
    processes: list[ProcessCost] = []
    notes: list[str] = []
    by_id = {r.run_id: r for r in state.runs}
    seen: set[str] = set()
    for run in state.runs:
        if run.external:
            processes.append(
                ProcessCost(
                    "external",
                    f"rung {run.rung} (recorded)",
                    [run.rung],
                    [run.run_id],
                    run.status,
                    float(run.totals.get("gpu_s", 0.0)),
                    note=run.provenance,
                    shares={run.run_id: 1.0},
                )
            )
            continue
        key = group_of[run.run_id]
        if key in seen:
            continue
        seen.add(key)
        runs = [by_id[r] for r in by_id if group_of.get(r) == key]
        label = f"rung {runs[0].rung}" if len(runs) == 1 else f"rungs {'+'.join(r.rung for r in runs)} (interleaved)"
        total = sum(float(r.totals.get("gpu_s", 0.0)) for r in runs)
        status = ", ".join(sorted({r.status for r in runs}))
        process = ProcessCost("rung", label, [r.rung for r in runs], [r.run_id for r in runs], status, total)
        process.shares = {
            r.run_id: (float(r.totals.get("gpu_s", 0.0)) / total if total else 1.0 / len(runs)) for r in runs
        }
        if any(r.status == "running" for r in runs):
            process.kind = "running"
            process.note = (
                "no run-end yet: its time is not in the ledger's total until it ends (or is marked interrupted)"
            )
        elif any(r.status == "interrupted" for r in runs):
            process.kind = "interrupted"
            process.note = "ended without a run-end: the last window's elapsed_s is counted, as a lower bound, unsplit"
        else:
            _split_rung_process(
                process,
                [r.totals for r in runs],
                [starts.get(r.run_id) for r in runs],
                [w for r in runs for w in windows.get(r.run_id, [])],
                discard_first,
            )
        if process.note:
            notes.append(f"{process.label}: {process.note}")
        processes.append(process)
    return processes, notes


def _split_rung_process(
    process: ProcessCost, run_totals: list[dict[str, Any]], starts: list, windows: list, discard_first: int
) -> None:
    """Fill in a finished (or killed, failed, over-ceiling) rung process's parts; see the module's docstring."""
    totals = run_totals[0]  # one process: its wall, load and clock are the same on every run it ran
    wall = totals.get("wall_s")
    devices = process.total / float(wall) if wall else None
    process.devices = devices
    if all("load_gpu_s" in t for t in run_totals):
        process.load = sum(float(t["load_gpu_s"]) for t in run_totals)
    elif "load_s" in totals and devices is not None:
        process.load = float(totals["load_s"]) * devices
    else:
        process.unsplit = process.total
        process.note = (
            "its run-end records no load time: load, steps and process start are not separable"
            if wall
            else "its run-end records neither wall_s nor load_gpu_s: the split cannot be made"
        )
        return
    if devices is None:
        process.unsplit = process.total - process.load
        process.note = "its run-end records no wall_s: steps, process start and teardown are not separable"
        return
    load_s = process.load / devices
    clocked = sorted(
        (w for w in windows if isinstance(w.data.get("elapsed_s"), (int, float))), key=lambda w: w.data["elapsed_s"]
    )
    if not clocked:
        process.unsplit = process.total - process.load
        process.note = (
            "no window recorded its elapsed_s (or none finished): steps, process start and teardown are not separable"
        )
        return
    last = float(clocked[-1].data["elapsed_s"])
    process.teardown = max(float(wall) - last, 0.0) * devices
    start_s: float | None = None
    if isinstance(totals.get("load_start_s"), (int, float)):
        start_s, process.start_from = float(totals["load_start_s"]), "recorded"
    elif all(starts):
        origin = min(_utc(w.ts) - float(w.data["elapsed_s"]) for w in clocked)
        derived = max(_utc(s.ts) for s in starts) - origin
        first_end = float(clocked[0].data["elapsed_s"])
        if -CLOCK_SLACK_S <= derived <= first_end - load_s + CLOCK_SLACK_S:
            start_s, process.start_from = min(max(derived, 0.0), first_end - load_s), "timestamps"
    if start_s is None:
        process.unsplit = (last - load_s) * devices
        process.note = (
            "where the load started is neither recorded nor consistent with the ledger's timestamps: "
            "steps and process start are shown together"
        )
        return
    process.start = start_s * devices
    previous = start_s + load_s
    for window in clocked:
        elapsed = float(window.data["elapsed_s"])
        seconds = (elapsed - previous) * devices
        previous = elapsed
        if window.data.get("step", 0) <= discard_first:
            process.steps_warmup += seconds
        else:
            process.steps_read += seconds
        process.ledger_writes += float(window.data.get("ledger_s", 0.0) or 0.0) * devices
    # Each window carries the previous window's append; the last one's is on the run-end of the run that wrote it.
    process.ledger_writes += sum(float(t.get("ledger_s", 0.0) or 0.0) for t in run_totals) * devices


def ladder_processes(
    ledger: Ledger, state: RegistrationState
) -> tuple[list[ProcessCost], list[ProcessCost], list[str]]:
    """(gate processes, rung processes, notes): every process of the ladder, its recorded total split."""
    entries = list(ledger.entries(reg_id=state.reg_id, kinds=COST_ENTRY_KINDS))
    gates = _gates(entries)
    rungs, notes = _rung_processes(state, entries, state.registration().protocol.discard_first)
    notes = [f"{g.label}: {g.note}" for g in gates if g.note] + notes
    orphans = _oracles_without_gate(entries)
    if orphans:
        notes.append(
            f"oracle(s) {', '.join(orphans)} have results but no gate entry (their gate process did not end): "
            "their probe time is in no recorded total"
        )
    return gates, rungs, notes


def _summary(state: RegistrationState, every: list[ProcessCost]) -> dict[str, Any]:
    """The verdict's cost: the split in four, per rung, against the ceiling (what `on_ceiling` judges)."""
    reg = state.registration()
    split = {"load": 0.0, "oracle": 0.0, "steps": 0.0, "external": 0.0}
    for process in every:
        if process.kind == "gate":
            split["oracle"] += process.total
        elif process.kind == "external":
            split["external"] += process.total
        else:  # a rung process: after its load, everything it spent is steps (process start and teardown included)
            split["load"] += process.load
            split["steps"] += process.total - process.load
    per_rung: dict[str, float] = {}
    for run in state.runs:
        per_rung[run.rung] = per_rung.get(run.rung, 0.0) + float(run.totals.get("gpu_s", 0.0))
    total = sum(split.values())
    ceiling_s = reg.cost.ceiling_gpu_h * 3600
    return {
        "gpu_s": round(total, 3),
        "ceiling_gpu_s": ceiling_s,
        "split": {k: round(v, 3) for k, v in split.items()},
        "per_rung": {k: round(v, 3) for k, v in per_rung.items()},
        "overrun": total > ceiling_s,
        "on_ceiling": reg.cost.on_ceiling,
        "ceiling_events": state.ceilings,
    }


def cost_summary(ledger: Ledger, state: RegistrationState) -> dict[str, Any]:
    """Device-seconds: every rung process from its start (model load included) to its end, times its devices;
    the oracle gate's processes likewise. External (recorded) rungs count what they report."""
    gates, rungs, _ = ladder_processes(ledger, state)
    return _summary(state, gates + rungs)


def ladder_cost(ledger: Ledger, reg_id: str, state: RegistrationState | None = None) -> dict[str, Any]:
    """The cost split of one registration, from its ledger entries (see the module's docstring)."""
    state = state or load_state(ledger, reg_id, with_windows=False)
    reg = state.registration()
    gates, rungs, notes = ladder_processes(ledger, state)
    every = gates + rungs
    split = {name: 0.0 for name in PARTS}
    for process in every:
        for name, value in process.parts().items():
            split[name] += value
    total = sum(p.total for p in every if p.kind != "running")
    ceiling_s = reg.cost.ceiling_gpu_h * 3600
    recorded = _summary(state, every)
    per_run = {}
    for process in rungs:
        for run_id, share in process.shares.items():
            parts = {k: v * share for k, v in process.parts().items()}
            per_run[run_id] = {
                "rung": process.rungs[process.runs.index(run_id)],
                "process": process.label,
                "gpu_s": process.total * share,
                **parts,
            }
    starts_from = sorted({p.start_from for p in rungs if p.start_from})
    return {
        "registration": reg_id,
        "schedule": reg.protocol.schedule,
        "discard_first": reg.protocol.discard_first,
        "ceiling_gpu_s": ceiling_s,
        "on_ceiling": reg.cost.on_ceiling,
        "gpu_s": total,
        "recorded_gpu_s": recorded["gpu_s"],
        "share_of_ceiling": total / ceiling_s,
        "overrun": total > ceiling_s,
        "ceiling_events": state.ceilings,
        "split": {
            k: v for k, v in split.items() if v or k in ("load", "oracle_gate", "steps_warmup", "steps_read", "other")
        },
        "gate_load_gpu_s": sum(g.load for g in gates),
        "ledger_writes_gpu_s": sum(p.ledger_writes for p in rungs),
        "rung_processes": len([p for p in rungs if p.kind == "rung"]),
        "start_from": starts_from,
        "processes": [{**asdict(p), "steps": p.steps, "other": p.other} for p in every],
        "per_run": per_run,
        "notes": notes,
    }


def _oracles_without_gate(entries: list) -> list[str]:
    pending: list[str] = []
    for entry in entries:
        if entry.kind == "oracle" and not entry.data.get("external"):
            pending.append(entry.data["oracle"])
        elif entry.kind == "gate":
            listed = set(entry.data.get("oracles", []))
            pending = [o for o in pending if o not in listed]
    return pending
