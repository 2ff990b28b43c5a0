"""What a ladder costs: device-seconds split into model load, oracle gate, steps and the rest, against the ceiling;
and two registrations of one question that differ only in `protocol.schedule`, side by side.

Every number comes from the ledger; none is estimated. What each part is, and where it is read:
- total: each process's recorded device time — a gate entry's `gpu_s`, a run-end's `totals.gpu_s` (wall time
  from the process's start, model load included, times its devices; interleaved rungs share one process and the
  engine splits its time evenly among them). The sum is the verdict's `cost.gpu_s`, the number the ceiling judges.
- model load: the run-end's `totals.load_gpu_s` (rung processes). A gate process's own load (its entry's
  `load_s`) is part of the oracle gate.
- oracle gate: the gate entries' `gpu_s`; inside it, each oracle entry's `gpu_s` is its probe, and the rest is the
  gate's process start, its model load and its teardown.
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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prereg.errors import InvalidInput
from prereg.ledger import Ledger
from prereg.ledger.envelope import TS_FORMAT
from prereg.state import RegistrationState, load_state
from prereg.verdict import compute_verdict, cost_summary

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
COLOURS = {
    "load": "#d62728",
    "oracle_gate": "#9467bd",
    "steps_warmup": "#aec7e8",
    "steps_read": "#1f77b4",
    "other": "#7f7f7f",
    "external": "#2ca02c",
    "interrupted": "#ff7f0e",
    "unsplit": "#bcbd22",
}
# A derived process start may disagree with the window clock by the time between reading the clock and stamping
# the entry (a fraction of a millisecond); more than this and the timestamps are not trusted.
CLOCK_SLACK_S = 0.05


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
    steps_warmup: float = 0.0
    steps_read: float = 0.0
    start: float = 0.0
    teardown: float = 0.0
    unsplit: float = 0.0
    ledger_writes: float = 0.0  # inside the steps: window entries written (the windows' ledger_s)
    start_from: str | None = None  # recorded | timestamps | None (not known)
    oracles: list[str] = field(default_factory=list)
    note: str | None = None
    shares: dict[str, float] = field(default_factory=dict)  # run id -> its share of the process (the engine's split)

    @property
    def steps(self) -> float:
        return self.steps_warmup + self.steps_read

    @property
    def other(self) -> float:
        return self.start + self.teardown + (self.total - self.load - self.probes if self.kind == "gate" else 0.0)

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
    gates = []
    for entry in entries:
        if entry.kind == "oracle" and not entry.data.get("external") and "gpu_s" in entry.data:
            probe_s[entry.data["oracle"]] = float(entry.data["gpu_s"])
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
    if not wall:
        process.unsplit = process.total
        process.note = "its run-end records no wall_s: the split cannot be made"
        return
    devices = process.total / float(wall)
    process.devices = devices
    if all("load_gpu_s" in t for t in run_totals):
        process.load = sum(float(t["load_gpu_s"]) for t in run_totals)
    elif "load_s" in totals:
        process.load = float(totals["load_s"]) * devices
    else:
        process.note = "its run-end records no load time: load, steps and process start are not separable"
        process.unsplit = process.total
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
        process.note = "where the load started is neither recorded nor consistent with the ledger's timestamps: steps and process start are shown together"
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


def ladder_cost(ledger: Ledger, reg_id: str, state: RegistrationState | None = None) -> dict[str, Any]:
    """The cost split of one registration, from its ledger entries (see the module's docstring)."""
    state = state or load_state(ledger, reg_id, with_windows=False)
    reg = state.registration()
    entries = list(ledger.entries(reg_id=reg_id, kinds=("run-start", "window", "gate", "oracle")))
    gates = _gates(entries)
    rungs, notes = _rung_processes(state, entries, reg.protocol.discard_first)
    notes = [f"{g.label}: {g.note}" for g in gates if g.note] + notes
    processes = gates + rungs
    split = {name: 0.0 for name in PARTS}
    for process in processes:
        for name, value in process.parts().items():
            split[name] += value
    total = sum(p.total for p in processes if p.kind != "running")
    ceiling_s = reg.cost.ceiling_gpu_h * 3600
    recorded = cost_summary(reg, state)
    orphans = [o for o in _oracles_without_gate(entries)]
    if orphans:
        notes.append(
            f"oracle(s) {', '.join(orphans)} have results but no gate entry (their gate process did not end): "
            "their probe time is in no recorded total"
        )
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
        "processes": [{**asdict(p), "steps": p.steps, "other": p.other} for p in processes],
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


# --- Markdown -------------------------------------------------------------------------------------------------


def _s(value: float) -> str:
    return f"{value:,.1f}"


def _pct(value: float, of: float) -> str:
    return f"{100 * value / of:.1f}%" if of else "—"


def cost_markdown(cost: dict[str, Any], image: str | None = None) -> list[str]:
    total, ceiling = cost["gpu_s"], cost["ceiling_gpu_s"]
    split = cost["split"]
    lines = [
        "## Cost: what the ladder cost",
        "",
        f"**{_s(total)} device-seconds of the {ceiling:,.0f} ceiling ({_pct(total, ceiling)})** — on_ceiling = {cost['on_ceiling']}"
        + ("; **OVERRUN**, recorded" if cost["overrun"] else "; no overrun")
        + f"; schedule {cost['schedule']}.",
        "",
    ]
    events = [
        f"- ceiling event: spent {_s(e['spent_gpu_s'])}, projected {_s(e['projected_gpu_s'])} → {e['action']}"
        for e in cost["ceiling_events"]
    ]
    lines += events + ([""] if events else [])
    lines += ["| part | device-s | of the total | of the ceiling |", "|---|---|---|---|"]
    rung_processes = cost["rung_processes"]
    gates = [p for p in cost["processes"] if p["kind"] == "gate"]
    describe = {
        "load": f"model load ({rung_processes} rung process{'es' if rung_processes != 1 else ''}, a load each)",
        "oracle_gate": f"oracle gate ({len(gates)} process{'es' if len(gates) != 1 else ''}, its own loads {_s(cost['gate_load_gpu_s'])} included)",
        "steps_warmup": f"steps: warm-up windows (step ≤ {cost['discard_first']}, left out of every read)",
        "steps_read": "steps: read windows",
    }
    for name, value in split.items():
        lines.append(
            f"| {describe.get(name, PARTS[name])} | {_s(value)} | {_pct(value, total)} | {_pct(value, ceiling)} |"
        )
    lines += [f"| **total** | **{_s(total)}** | 100% | **{_pct(total, ceiling)}** |", ""]
    lines += [
        "Per process (device-seconds):",
        "",
        "| process | status | load | oracle probes | steps: warm-up | steps: read | start | teardown | not separable | total (recorded) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in cost["processes"]:
        if p["kind"] == "gate":
            rest = p["total"] - p["load"] - p["probes"]
            lines.append(
                f"| {p['label']} ({', '.join(p['oracles'])}) | {p['status']} | {_s(p['load'])} | {_s(p['probes'])} | | | "
                f"{_s(rest)} (start, between probes, teardown) | | | {_s(p['total'])} |"
            )
        elif p["kind"] == "rung":
            start = (
                _s(p["start"]) + (" (from timestamps)" if p["start_from"] == "timestamps" else "")
                if p["start_from"]
                else "—"
            )
            lines.append(
                f"| {p['label']} | {p['status']} | {_s(p['load'])} | | {_s(p['steps_warmup'])} | {_s(p['steps_read'])} | {start} | "
                f"{_s(p['teardown'])} | {_s(p['unsplit']) if p['unsplit'] else ''} | {_s(p['total'])} |"
            )
        else:
            lines.append(f"| {p['label']} | {p['status']} | | | | | | | {_s(p['total'])} | {_s(p['total'])} |")
    lines += [
        "",
        "How the parts are read from the ledger:",
        "- total: each process's recorded device time (gate entries' `gpu_s`, run-ends' `totals.gpu_s`: wall time from the "
        "process's start, model load included, times its devices; interleaved rungs split their process's evenly) — the "
        f"number the ceiling judges (the verdict's cost: {_s(cost['recorded_gpu_s'])}).",
        "- model load: run-ends' `totals.load_gpu_s`; oracle probes: each oracle entry's `gpu_s`.",
        "- steps: from the end of the load to the end of the last window, cut at each window's recorded `elapsed_s` "
        f"(process clock); they include the window entries' own ledger writes ({cost['ledger_writes_gpu_s']:.3f} in all), "
        "evaluation windows and saves.",
        "- teardown: run-end `wall_s` minus the last window's `elapsed_s`.",
    ]
    if "timestamps" in cost["start_from"]:
        lines.append(
            "- start (process start to the model load): **not recorded** by this ledger's run-ends (no `load_start_s`); "
            "derived from the ledger's timestamps: the process started at each window's timestamp minus its `elapsed_s`, "
            "and the start is counted up to the `run-start` entry. The runner's construction between that entry and the "
            "load (the workload's imports) is recorded nowhere and falls into the first warm-up window."
        )
    if "recorded" in cost["start_from"]:
        lines.append("- start (process start to the model load): run-ends' `totals.load_start_s`.")
    lines.append(
        "- not counted by the engine (and so not here): the interpreter's start before a process's clock, its exit "
        "after its run-end, and the ladder's own time between processes."
    )
    lines += [f"- {note}" for note in cost["notes"]]
    lines.append("")
    if image:
        lines += [f"![cost split against the ceiling]({image})", ""]
    return lines


# --- plot -----------------------------------------------------------------------------------------------------


def plot_cost_split(costs: list[tuple[str, dict[str, Any]]], path: Path) -> bool:
    """One stacked horizontal bar per registration, its parts in PARTS order, the ceiling as a dashed line."""
    from engine.report.report import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.7 * len(costs)))
    labelled: set[str] = set()
    widest = 0.0
    for row, (label, cost) in enumerate(reversed(costs)):
        left = 0.0
        for name in PARTS:
            value = cost["split"].get(name, 0.0)
            if value <= 0:
                continue
            ax.barh(
                [row],
                [value],
                left=left,
                color=COLOURS[name],
                edgecolor="white",
                height=0.6,
                label=PARTS[name] if name not in labelled else None,
            )
            if value >= 0.08 * max(cost["ceiling_gpu_s"], cost["gpu_s"]):
                ax.text(left + value / 2, row, f"{value:.0f}", ha="center", va="center", fontsize=7, color="white")
            labelled.add(name)
            left += value
        ax.text(
            left, row, f"  {left:.0f} s ({100 * left / cost['ceiling_gpu_s']:.0f}% of ceiling)", va="center", fontsize=8
        )
        widest = max(widest, left, cost["ceiling_gpu_s"])
    ceilings = sorted({c["ceiling_gpu_s"] for _, c in costs})
    for ceiling in ceilings:
        ax.axvline(ceiling, color="black", linestyle="--", linewidth=1)
        ax.text(ceiling, len(costs) - 0.45, f"ceiling {ceiling:.0f}", ha="right", va="bottom", fontsize=8)
    ax.set_yticks(range(len(costs)), [label for label, _ in reversed(costs)])
    ax.set_xlabel("device-seconds")
    ax.set_xlim(0, widest * 1.25)
    ax.set_ylim(-0.6, len(costs) - 0.1)
    ax.grid(axis="y", visible=False)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.set_title("what the ladder cost, against the ceiling")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


# --- two schedules of one question ----------------------------------------------------------------------------

# Prose may differ between two registrations of one question; nothing that is measured or decided may.
PROSE_KEYS = {"id", "title", "notes", "source", "out_of_scope"}


def _substance(value: Any, top: bool = True) -> Any:
    if isinstance(value, dict):
        return {
            k: _substance(v, False) for k, v in value.items() if k not in (PROSE_KEYS if top else {"title", "notes"})
        }
    if isinstance(value, list):
        return [_substance(v, False) for v in value]
    return value


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            where = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                out.append(f"{where} (only in {'the second' if key not in a else 'the first'})")
            else:
                out.extend(_differences(a[key], b[key], where))
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path} ({len(a)} vs {len(b)} entries)"]
        out = []
        for index, (x, y) in enumerate(zip(a, b)):
            name = (
                x.get("id")
                if isinstance(x, dict) and x.get("id") == (y.get("id") if isinstance(y, dict) else None)
                else index
            )
            out.extend(_differences(x, y, f"{path}.{name}" if not isinstance(name, int) else f"{path}[{name}]"))
        return out
    return [] if a == b else [path]


def same_question(first: RegistrationState, second: RegistrationState) -> list[str]:
    """The field paths in which the two registrations' current documents differ, beyond prose and the schedule.

    The schedule's one necessary consequence lies in the document already: an interleaved ladder's rungs share one
    model load, so they cannot set their own config — a sequential ladder whose rungs do has no interleaved twin,
    and the per-rung config shows as a difference."""
    a = _substance(first.registration().model_dump(mode="json", by_alias=True))
    b = _substance(second.registration().model_dump(mode="json", by_alias=True))
    a["protocol"].pop("schedule"), b["protocol"].pop("schedule")
    return _differences(a, b)


def _primary(verdict: dict[str, Any]) -> tuple[str | None, Any]:
    reads = verdict["reads"]
    if "primary" in reads:
        return "primary", reads["primary"]
    return (next(iter(reads)), next(iter(reads.values()))) if reads else (None, None)


def compare_schedules(ledger: Ledger, first_id: str, second_id: str) -> dict[str, Any]:
    """Both registrations' cost splits and verdicts, side by side; InvalidInput (exit 2) unless they ask the same
    question. Reads only: the verdicts are computed, not recorded."""
    if first_id == second_id:
        raise InvalidInput(
            f"--compare names {first_id} itself", fix="name the other schedule's registration of the same question"
        )
    first, second = load_state(ledger, first_id, with_windows=False), load_state(ledger, second_id, with_windows=False)
    differing = same_question(first, second)
    if differing:
        shown = ", ".join(differing[:12]) + (f", … ({len(differing)} in all)" if len(differing) > 12 else "")
        raise InvalidInput(
            f"{first_id} and {second_id} do not ask the same question: they differ in {shown}",
            where=f"prereg report {first_id} --compare {second_id}",
            fix="compare two registrations that differ only in protocol.schedule (and prose: id, title, notes, source)",
        )
    sides = []
    for state in (first, second):
        verdict = compute_verdict(ledger, state.reg_id)
        cost = ladder_cost(ledger, state.reg_id, state)
        name, value = _primary(verdict)
        sides.append(
            {
                "id": state.reg_id,
                "schedule": state.registration().protocol.schedule,
                "cost": cost,
                "outcome": verdict["outcome"],
                "rule": verdict["rule"],
                "land": verdict["land"],
                "park": verdict["park"],
                "dropped": sorted(verdict["dropped"]),
                "reads": verdict["reads"],
                "intervals": verdict["intervals"],
                "undefined": verdict["undefined"],
                "primary": {"read": name, "value": value, "interval": verdict["intervals"].get(name)},
                "rungs": {
                    r["rung"]: {"status": r["status"], "s_per_step": r["summary"].get("s_per_step")}
                    for r in verdict["rungs"]
                },
            }
        )
    a, b = sides
    decided = a["outcome"] is not None and b["outcome"] is not None
    same = decided and (a["outcome"], a["rule"], sorted(a["land"]), sorted(a["park"])) == (
        b["outcome"],
        b["rule"],
        sorted(b["land"]),
        sorted(b["park"]),
    )
    return {
        "registrations": [first_id, second_id],
        "sides": sides,
        "same_verdict": same if decided else None,
        "why": None
        if decided
        else "a verdict is not reached yet: " + ", ".join(s["id"] for s in sides if s["outcome"] is None),
    }


def compare_markdown(comparison: dict[str, Any], image: str | None = None) -> list[str]:
    a, b = comparison["sides"]
    head = f"| | {a['id']} ({a['schedule']}) | {b['id']} ({b['schedule']}) |"
    lines = [
        "## Same question, two schedules",
        "",
        f"{a['id']} and {b['id']} ask the same question (every item, oracle, bound, rung, read, rule, kill line and expectation "
        f"equal); they differ at most in `protocol.schedule` (here: {a['schedule']} vs {b['schedule']}) and in prose.",
        "",
        "Device-seconds:",
        "",
        head,
        "|---|---|---|",
    ]
    for name in PARTS:
        if name in a["cost"]["split"] or name in b["cost"]["split"]:
            lines.append(
                f"| {PARTS[name]} | {_s(a['cost']['split'].get(name, 0.0))} | {_s(b['cost']['split'].get(name, 0.0))} |"
            )

    def total(side: dict[str, Any]) -> str:
        cost = side["cost"]
        return f"**{_s(cost['gpu_s'])}** ({_pct(cost['gpu_s'], cost['ceiling_gpu_s'])} of {cost['ceiling_gpu_s']:,.0f})"

    def primary(side: dict[str, Any]) -> str:
        read, value, interval = side["primary"]["read"], side["primary"]["value"], side["primary"]["interval"]
        if read is None:
            return "—"
        if value is None:
            return f"undefined: {side['undefined'].get(read, '')}"
        shown = f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
        return shown + (f" [{interval[0]:.4g}, {interval[1]:.4g}]" if interval else "")

    def verdict(side: dict[str, Any]) -> str:
        return f"**{side['outcome']}** (rule {side['rule']})" if side["outcome"] else "no rule fired"

    lines.append(f"| **total** (of the ceiling) | {total(a)} | {total(b)} |")
    lines.append(
        f"| rung processes (a model load each) | {a['cost']['rung_processes']} | {b['cost']['rung_processes']} |"
    )
    for rung in a["rungs"]:
        values = [s["rungs"].get(rung, {}) for s in (a, b)]
        lines.append(
            f"| rung {rung} s/step (median of read windows) | "
            + " | ".join(
                f"{v['s_per_step']:.4g}"
                if isinstance(v.get("s_per_step"), (int, float))
                else (v.get("status") or "not run")
                for v in values
            )
            + " |"
        )
    lines.append(
        f"| primary read{' (`' + a['primary']['read'] + '`)' if a['primary']['read'] else ''} [95% interval] | {primary(a)} | {primary(b)} |"
    )
    lines.append(f"| verdict | {verdict(a)} | {verdict(b)} |")
    lines.append(
        f"| land / park | {', '.join(a['land']) or '—'} / {', '.join(a['park']) or '—'} | {', '.join(b['land']) or '—'} / {', '.join(b['park']) or '—'} |"
    )
    lines.append(
        f"| dropped by the gate or a kill | {', '.join(a['dropped']) or '—'} | {', '.join(b['dropped']) or '—'} |"
    )
    same = comparison["same_verdict"]
    lines += [
        "",
        (
            "**Both reach the same verdict**"
            if same
            else "**The verdicts differ**"
            if same is False
            else f"**Not comparable yet**: {comparison['why']}"
        )
        + (f" ({a['outcome']} by rule {a['rule']})." if same else "." if same is False else ""),
        "",
    ]
    saved = a["cost"]["gpu_s"] - b["cost"]["gpu_s"]
    if a["cost"]["gpu_s"] and b["cost"]["gpu_s"]:  # a ladder that has not run saves nothing: no sentence
        lines += [
            f"{b['id']} cost {_s(abs(saved))} device-seconds {'less' if saved >= 0 else 'more'} than {a['id']} "
            f"({_pct(abs(saved), a['cost']['gpu_s'])} of {a['id']}'s total).",
            "",
        ]
    if image:
        lines += [f"![cost split of both schedules]({image})", ""]
    return lines
