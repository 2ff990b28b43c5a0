"""Audit queries over everything ever registered, run and decided: projections of the ledger, nothing stored."""

from __future__ import annotations

from typing import Any

from prereg.adoption import CHECK_STATUSES, adoption_rows, adoptions_of, check_results
from prereg.assumed import assumed_values
from prereg.cost import cost_summary
from prereg.ledger import Ledger
from prereg.power import every_state, power_before_data
from prereg.rules import Undefined
from prereg.schema import CONFIDENCE_PROBABILITY
from prereg.state import load_state
from prereg.verdict import verdict_detail


def _latest_verdict(state) -> dict[str, Any] | None:
    return state.verdicts[-1].data["verdict"] if state.verdicts else None


def status_of(state) -> str:
    if state.verdicts:
        return "decided"
    if any(r.status == "running" for r in state.runs):
        return "running"
    if state.runs or state.oracles:
        return "measured"
    return "frozen"


def audit_list(ledger: Ledger) -> list[dict[str, Any]]:
    rows = []
    for reg_id in ledger.reg_ids():
        state = load_state(ledger, reg_id, with_windows=False)
        verdict = _latest_verdict(state)
        rows.append(
            {
                "id": reg_id,
                "title": state.document["title"],
                "profile": state.document["profile"],
                "versions": len(state.versions),
                "status": status_of(state),
                "outcome": verdict["outcome"] if verdict else None,
                "post_hoc": bool(state.post_hoc_paths()),
                "against_verdict": state.adopted_against_verdict(),
                "frozen": state.versions[0].ts,
            }
        )
    return rows


def audit_show(ledger: Ledger, reg_id: str) -> dict[str, Any]:
    state = load_state(ledger, reg_id, with_windows=False)
    verdict = _latest_verdict(state)
    return {
        "id": reg_id,
        "title": state.document["title"],
        "question": state.document["question"],
        "workload": state.document["workload"],
        "profile": state.document["profile"],
        "status": status_of(state),
        "versions": [
            {
                "version": v.number,
                "seq": v.seq,
                "ts": v.ts,
                "doc_hash": v.doc_hash,
                "reason": v.reason,
                "post_hoc": list(v.post_hoc),
            }
            for v in state.versions
        ],
        "oracles": [
            {
                "oracle": r.oracle,
                "item": r.item,
                "kind": r.kind,
                "passed": r.passed,
                "reason": r.reason,
                "observed": r.observed,
                "bounds": r.bounds,
                "version": r.version,
                "external": r.external,
                "seq": r.seq,
            }
            for r in sorted(state.oracles.values(), key=lambda r: r.seq)
        ],
        "dropped": state.dropped(),
        "runs": [
            {
                "run": r.run_id,
                "rung": r.rung,
                "items": list(r.items),
                "status": r.status,
                "windows": r.n_windows,
                "external": r.external,
                "version": r.version,
                "flagged": r.flagged,
                "kill": r.kill,
                "crash_window": r.crash_window,
                "totals": r.totals,
                "provenance": r.provenance,
                "seq": r.start_seq,
            }
            for r in state.runs
        ],
        "entries": state.entry_counts,
        "verdict": None
        if verdict is None
        else {
            "outcome": verdict["outcome"],
            "rule": verdict["rule"],
            "land": verdict["land"],
            "park": verdict["park"],
            "expectations": [
                {"n": e["n"], "part": e.get("part"), "result": e["result"]} for e in verdict["expectations"]
            ],
            "post_hoc": verdict["post_hoc"],
            "seq": state.verdicts[-1].seq,
        },
        "post_hoc": state.post_hoc_paths(),
        "adoptions": adoptions_of(state),
        "jobs": jobs_of(ledger, reg_id),
        "source": state.document.get("source"),
        "assumed": assumed_rows(state.document),
    }


def jobs_of(ledger: Ledger, reg_id: str) -> list[dict[str, Any]]:
    """The registration's cluster jobs, as submitted (`job`) and settled (`job-end`): queued or running until then.
    A job's live state (queued or running) is the cluster's; the ledger knows only that it has not ended."""
    jobs: dict[str, dict[str, Any]] = {}
    for entry in ledger.entries(reg_id=reg_id, kinds=("job", "job-end", "run-start")):
        if entry.kind == "job":
            launcher = entry.data.get("launcher") or {}
            jobs[str(entry.ref)] = {
                "job": entry.ref,
                "purpose": entry.data["purpose"],
                "runs": entry.data["runs"],
                "launcher": launcher.get("name"),
                "partition": launcher.get("partition"),
                "state": "queued",
                "hosts": [],
                "ended": False,
                "seq": entry.seq,
            }
        elif entry.kind == "run-start" and (entry.data.get("job") or {}).get("id") in jobs:
            job = jobs[entry.data["job"]["id"]]
            job.update(state="running", hosts=entry.data["job"].get("hosts", []))
        elif entry.kind == "job-end" and str(entry.ref) in jobs:
            jobs[str(entry.ref)].update(
                state=entry.data["state"].lower(), hosts=entry.data.get("hosts") or [], ended=True
            )
    return list(jobs.values())


def assumed_rows(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The latest document's values the encoder assumed (prereg.assumed); every other value is the source's."""
    return [{"path": v.path, "value": v.value, "reason": v.reason} for v in assumed_values(document)]


def audit_costs(ledger: Ledger) -> list[dict[str, Any]]:
    rows = []
    for reg_id in ledger.reg_ids():
        state = load_state(ledger, reg_id, with_windows=False)
        cost = cost_summary(ledger, state)
        rows.append({"id": reg_id, **cost, "post_hoc": bool(state.post_hoc_paths())})
    return rows


def audit_calibration(ledger: Ledger) -> dict[str, Any]:
    """Hits per confidence level over every scored expectation of every latest verdict, and the Brier score."""
    levels: dict[str, dict[str, int]] = {level: {"n": 0, "hits": 0, "undefined": 0} for level in CONFIDENCE_PROBABILITY}
    squared_errors: list[float] = []
    post_hoc: list[str] = []  # registrations whose scored verdict stands on a post-hoc amendment
    for reg_id in ledger.reg_ids():
        state = load_state(ledger, reg_id, with_windows=False)
        verdict = _latest_verdict(state)
        if verdict is None:
            continue
        if verdict["post_hoc"]:
            post_hoc.append(reg_id)
        for expectation in verdict["expectations"]:
            level = levels[expectation["confidence"]]
            if expectation["result"] == "undefined":
                level["undefined"] += 1
                continue
            level["n"] += 1
            hit = expectation["result"] == "hit"
            level["hits"] += hit
            squared_errors.append((CONFIDENCE_PROBABILITY[expectation["confidence"]] - float(hit)) ** 2)
    rows = [
        {
            "confidence": name,
            "p": CONFIDENCE_PROBABILITY[name],
            "n": v["n"],
            "hits": v["hits"],
            "undefined": v["undefined"],
            "hit_rate": (v["hits"] / v["n"]) if v["n"] else None,
        }
        for name, v in levels.items()
    ]
    brier = sum(squared_errors) / len(squared_errors) if squared_errors else None
    return {"levels": rows, "scored": len(squared_errors), "brier": brier, "post_hoc": post_hoc}


def audit_adoption(ledger: Ledger) -> dict[str, Any]:
    """For every decided verdict, and every registration adopted or with adoption checks: each decided item (or
    outcome) landed and adopted or not, adoptions against the verdict or without one, and the checks' status."""
    registrations = []
    counts = {status: 0 for status in ("landed-adopted", "landed-not-adopted", "against-verdict", "without-verdict")}
    counts.update({f"check-{status}": 0 for status in CHECK_STATUSES})
    for reg_id in ledger.reg_ids():
        state = load_state(ledger, reg_id, with_windows=False)
        reg = state.registration()
        verdict = _latest_verdict(state)
        decided = verdict is not None and verdict["outcome"] is not None
        if not (decided or state.adoptions or reg.adoption):
            continue
        if reg.adoption:  # the checks read rung summaries, which need the windows
            state = load_state(ledger, reg_id)
        rows = adoption_rows(state)
        checks = check_results(reg, state)
        for row in rows:
            counts[row["status"]] += 1
        for check in checks:
            counts[f"check-{check['status']}"] += 1
        registrations.append(
            {
                "id": reg_id,
                "outcome": verdict["outcome"] if verdict else None,
                "rule": verdict["rule"] if verdict else None,
                "verdict_seq": state.verdicts[-1].seq if state.verdicts else None,
                "decided": decided,
                "rows": rows,
                "checks": checks,
                "post_hoc": bool(state.post_hoc_paths()),
            }
        )
    return {"registrations": registrations, "counts": counts}


def audit_sensitivity(ledger: Ledger) -> dict[str, Any]:
    """For every decided registration, each read its decision compared with a bar: the bar, the read's value, its
    bootstrap flip probability and `fragile` (robustness, recomputed from the windows), and the power it had
    before its data (prereg.power.power_before_data): the MDE, the windows it needed, `powered`."""
    states = every_state(ledger)
    rows: list[dict[str, Any]] = []
    without_bars: list[str] = []
    decided = 0
    for state in states:
        verdict = _latest_verdict(state)
        if verdict is None or verdict["outcome"] is None:
            continue
        decided += 1
        detail = verdict_detail(ledger, state.reg_id)
        before = power_before_data(ledger, state, states)
        shown = detail.verdict["robustness"]
        if not shown:
            without_bars.append(state.reg_id)
        for read, entry in shown.items():
            # The bar robustness shows (the one the read is likeliest to cross), as assessed before the data.
            power = next(r for r in before.rows if r.read == read and r.bar == entry["bar"])
            value = detail.compared.get(read)
            rows.append(
                {
                    "id": state.reg_id,
                    "outcome": verdict["outcome"],
                    "post_hoc": bool(state.post_hoc_paths()),
                    **power.as_json(),
                    "value": None if isinstance(value, Undefined) else value,
                    "flip_probability": entry["flip_probability"],
                    "fragile": entry["fragile"],
                    "notes": list(power.notes),
                }
            )
    counts = {
        "decided": decided,
        "compared": len(rows),
        "fragile": sum(row["fragile"] is True for row in rows),
        "underpowered": sum(row["powered"] is False for row in rows),
        "power_unknown": sum(row["powered"] is None for row in rows),
    }
    return {"reads": rows, "without_bars": without_bars, "counts": counts}
