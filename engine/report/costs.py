"""The report's cost sections: what the ladder cost against its ceiling (the split prereg.cost computes, written out),
and two registrations of one question that differ only in `protocol.schedule`, side by side."""

from __future__ import annotations

from typing import Any

from prereg.cost import PARTS, ladder_cost
from prereg.errors import InvalidInput
from prereg.ledger import Ledger
from prereg.state import RegistrationState, load_state
from prereg.verdict import compute_verdict

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
        f"**{_s(total)} device-seconds of the {ceiling:,.0f} ceiling ({_pct(total, ceiling)})**"
        + f" — on_ceiling = {cost['on_ceiling']}"
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
    gate_processes = f"{len(gates)} process{'es' if len(gates) != 1 else ''}"
    describe = {
        "load": f"model load ({rung_processes} rung process{'es' if rung_processes != 1 else ''}, a load each)",
        "oracle_gate": f"oracle gate ({gate_processes}, its own loads {_s(cost['gate_load_gpu_s'])} included)",
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
        "| process | status | load | oracle probes | steps: warm-up | steps: read | start | teardown | not separable "
        "| total (recorded) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in cost["processes"]:
        if p["kind"] == "gate":
            rest = p["total"] - p["load"] - p["probes"] - p["calibration"]
            calibration = f" + A/A calibration {_s(p['calibration'])}" if p["calibration"] else ""
            lines.append(
                f"| {p['label']} ({', '.join(p['oracles'])}) | {p['status']} | {_s(p['load'])} | {_s(p['probes'])}"
                f"{calibration} | | | {_s(rest)} (start, between probes, teardown) | | | {_s(p['total'])} |"
            )
        elif p["kind"] == "rung":
            start = (
                _s(p["start"]) + (" (from timestamps)" if p["start_from"] == "timestamps" else "")
                if p["start_from"]
                else "—"
            )
            lines.append(
                f"| {p['label']} | {p['status']} | {_s(p['load'])} | | {_s(p['steps_warmup'])} | {_s(p['steps_read'])}"
                f" | {start} | {_s(p['teardown'])} | {_s(p['unsplit']) if p['unsplit'] else ''} | {_s(p['total'])} |"
            )
        else:
            lines.append(f"| {p['label']} | {p['status']} | | | | | | | {_s(p['total'])} | {_s(p['total'])} |")
    lines += [
        "",
        "How the parts are read from the ledger:",
        "- total: each process's recorded device-seconds (gate entries' `gpu_s`, run-ends' `totals.gpu_s`: wall time "
        "from the process's start, model load included, times its devices; interleaved rungs split their process's "
        f"evenly) — the number the ceiling judges (the verdict's cost: {_s(cost['recorded_gpu_s'])}).",
        "- model load: run-ends' `totals.load_gpu_s`; oracle probes: each oracle entry's `gpu_s`.",
        "- steps: from the end of the load to the end of the last window, cut at each window's recorded `elapsed_s` "
        "(process clock); they include the window entries' own ledger writes "
        f"({cost['ledger_writes_gpu_s']:.3f} in all), evaluation windows and saves.",
        "- teardown: run-end `wall_s` minus the last window's `elapsed_s`.",
    ]
    if "timestamps" in cost["start_from"]:
        lines.append(
            "- start (process start to the model load): **not recorded** by this ledger's run-ends "
            "(no `load_start_s`); derived from the ledger's timestamps: the process started at each window's "
            "timestamp minus its `elapsed_s`, and the start is counted up to the `run-start` entry. The runner's "
            "construction between that entry and the load (the workload's imports) is recorded nowhere and falls "
            "into the first warm-up window."
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
        f"{a['id']} and {b['id']} ask the same question (every item, oracle, bound, rung, read, rule, kill line and "
        f"expectation equal); they differ at most in `protocol.schedule` (here: {a['schedule']} vs {b['schedule']}) "
        "and in prose.",
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
    read = f" (`{a['primary']['read']}`)" if a["primary"]["read"] else ""
    lines.append(f"| primary read{read} [95% interval] | {primary(a)} | {primary(b)} |")
    lines.append(f"| verdict | {verdict(a)} | {verdict(b)} |")
    decided = [f"{', '.join(s['land']) or '—'} / {', '.join(s['park']) or '—'}" for s in (a, b)]
    lines.append(f"| land / park | {decided[0]} | {decided[1]} |")
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
