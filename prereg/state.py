"""A registration's state, projected from its ledger entries: versions, oracle results, drops, runs, verdicts.

Everything here is derived; the entries are the truth. Entry kinds and their `data`:
- freeze / amend: the document (and for amend: reason, post_hoc paths), its hash, the source file's hash.
- oracle: oracle id, item, kind, observed values, bounds, passed, reason, version, external.
- run-start / window / run-end (ref = run id): rung, items, config, version; window metrics; status and totals
  (and a crashed run's crash window: engine/crash.py).
- interrupted (ref = run id): a run found without an end.
- kill (ref = run id): kill line, rung, step, drops.
- record: provenance, version, recorded oracle observations are separate oracle entries; rungs with their
  status, metrics, windows, and whether their item set matched the plan.
- verdict: the verdict's JSON.
- adopt: items (or a verdict's outcome) that landed in code at a commit; the verdict it was judged against, what
  of it went against that verdict and why (prereg.adoption).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from prereg.canonical import decode_nonfinite
from prereg.errors import InvalidInput, Refused
from prereg.ledger import Entry, Ledger
from prereg.registry import get_workload
from prereg.schema import CONFIG_DEFAULTS, Registration
from prereg.workload import WorkloadDeclaration

RUN_KINDS = ("run-start", "run-end", "interrupted", "kill", "gate", "ceiling")


@dataclass(frozen=True)
class Version:
    seq: int
    number: int  # 0 = the frozen document, 1.. = amendments in order
    document: dict[str, Any]
    doc_hash: str
    reason: str | None
    post_hoc: tuple[str, ...]
    ts: str


@dataclass
class RungRun:
    """One attempt at a rung: an engine run or a recorded (external) rung."""

    run_id: str
    rung: str
    items: tuple[str, ...]
    version: int  # document version number in force when it was measured
    status: str  # running | finished | killed | failed | over-ceiling | interrupted
    external: bool
    start_seq: int
    windows: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, Any] = field(
        default_factory=dict
    )  # run-end metrics (rc, steps, load_s, gpu_s) or recorded summary
    flagged: str | None = None  # why a recorded rung is kept out of every read
    kill: dict[str, Any] | None = None
    primed_from: str | None = None  # C' re-runs C after a contingency dropped items
    provenance: str | None = None
    n_windows: int = 0
    ended_by: dict[str, Any] | None = (
        None  # {"kill": id} | {"signal": name} | {"budget": True} | {"ceiling": True} | {"error": …}
    )
    memory_snapshots: tuple[str, ...] = ()  # allocation snapshots a `memory_snapshot` rung wrote (paths on its machine)
    # A run that crashed: the window its kill lines judged last (engine/crash.py), kept apart from `windows` so
    # that no read, rate or sensitivity takes it for a measurement.
    crash_window: dict[str, Any] | None = None
    rows: dict[str, dict[str, float]] = field(default_factory=dict)  # a recorded rung's per-row metrics


@dataclass
class OracleResult:
    oracle: str
    item: str
    kind: str
    observed: dict[str, Any]
    bounds: dict[str, float]
    passed: bool
    reason: str
    version: int
    external: bool
    seq: int


@dataclass(frozen=True)
class Adoption:
    """One `adopt` entry: what landed in code at a commit, and how it stood with the verdict then."""

    seq: int
    ts: str
    items: tuple[str, ...]  # empty when a verdict's outcome was adopted as a whole
    outcome: str | None
    commit: str
    commit_checked: bool  # False: no git checkout to check it against; recorded as given
    verdict_seq: int | None  # the verdict entry it was judged against; None: no verdict was recorded
    against_verdict: dict[str, str]  # item -> why adopting it went against the verdict (parked, dropped, not landed)
    reason: str | None  # the reason given with --against-verdict
    without_verdict: bool  # no decided verdict when it was adopted


@dataclass
class RegistrationState:
    reg_id: str
    versions: list[Version]
    oracles: dict[str, OracleResult]  # the first (the standing) result per oracle
    runs: list[RungRun]
    kills: list[dict[str, Any]]
    verdicts: list[Entry]
    entry_counts: dict[str, int]
    gates: list[dict[str, Any]] = field(default_factory=list)  # oracle-gate processes: their device-seconds
    ceilings: list[dict[str, Any]] = field(default_factory=list)  # what the engine did at the cost ceiling
    adoptions: list[Adoption] = field(default_factory=list)
    config_defaults: dict[str, Any] = field(default_factory=dict)  # the table its run configs resolve with

    def adopted_against_verdict(self) -> bool:
        return any(a.against_verdict for a in self.adoptions)

    @property
    def document(self) -> dict[str, Any]:
        return self.versions[-1].document

    def registration(self) -> Registration:
        return self.registration_at(self.version)

    @property
    def version(self) -> int:
        return self.versions[-1].number

    def registration_at(self, number: int) -> Registration:
        """Document version `number`, its run configs resolved with the frozen defaults (every version alike)."""
        context = {CONFIG_DEFAULTS: self.config_defaults}
        return Registration.model_validate(self.versions[number].document, context=context)

    def post_hoc_paths(self) -> list[str]:
        return [f"amendment {v.number}: {p}" for v in self.versions for p in v.post_hoc]

    def dropped(self) -> dict[str, dict[str, Any]]:
        """item -> why it was dropped: the failing oracle with its observed value and bound, or the kill line."""
        out: dict[str, dict[str, Any]] = {}
        for result in sorted(self.oracles.values(), key=lambda r: r.seq):
            if not result.passed and result.item not in out:
                out[result.item] = {
                    "cause": "oracle",
                    "oracle": result.oracle,
                    "kind": result.kind,
                    "observed": result.observed,
                    "bound": result.bounds,
                    "reason": result.reason,
                }
        for kill in self.kills:
            for item in kill.get("drops", []):
                out.setdefault(
                    item,
                    {
                        "cause": "kill",
                        "kill": kill["kill"],
                        "rung": kill["rung"],
                        "step": kill.get("step"),
                        "reason": kill.get("reason", ""),
                    },
                )
        return out

    def rungs_with_data(self) -> frozenset[str]:
        return frozenset(r.rung for r in self.runs if r.status != "interrupted")


def config_defaults_of(freeze: dict[str, Any]) -> dict[str, Any]:
    """The defaults table a frozen registration resolves with, from its freeze entry's data: the one the freeze
    recorded, or for a freeze that recorded none, its workload's defaults from before freezes recorded them."""
    recorded = freeze.get("config_defaults")
    if recorded is not None:
        return recorded
    document = freeze["document"]
    return dict(get_workload(document["workload"], document.get("command")).run_config.unrecorded_defaults)


def frozen_config_defaults(ledger: Ledger, reg_id: str) -> dict[str, Any] | None:
    """The defaults table of `reg_id` as frozen in this ledger; None when it is not frozen here."""
    frozen = next(ledger.entries(reg_id=reg_id, kinds=("freeze",)), None)
    return None if frozen is None else config_defaults_of(frozen.data)


def load_state(ledger: Ledger, reg_id: str, *, with_windows: bool = True) -> RegistrationState:
    versions: list[Version] = []
    config_defaults: dict[str, Any] = {}
    oracles: dict[str, OracleResult] = {}
    runs: dict[str, RungRun] = {}
    kills: list[dict[str, Any]] = []
    gates: list[dict[str, Any]] = []
    ceilings: list[dict[str, Any]] = []
    verdicts: list[Entry] = []
    adoptions: list[Adoption] = []
    counts: dict[str, int] = {}
    kinds = ("freeze", "amend", "oracle", "record", "verdict", "adopt") + RUN_KINDS
    for entry in ledger.entries(reg_id=reg_id, kinds=kinds):
        data = entry.data
        counts[entry.kind] = counts.get(entry.kind, 0) + 1
        if entry.kind == "freeze":
            config_defaults = config_defaults_of(data)
        if entry.kind in ("freeze", "amend"):
            versions.append(
                Version(
                    entry.seq,
                    len(versions),
                    data["document"],
                    data["doc_hash"],
                    data.get("reason"),
                    tuple(data.get("post_hoc", ())),
                    entry.ts,
                )
            )
        elif entry.kind == "oracle":
            # An oracle's first result is its result: a later observation never un-drops an item (never re-toleranced).
            oracles.setdefault(
                data["oracle"],
                OracleResult(
                    data["oracle"],
                    data["item"],
                    data["kind"],
                    data["observed"],
                    data["bounds"],
                    data["passed"],
                    data["reason"],
                    data["version"],
                    data.get("external", False),
                    entry.seq,
                ),
            )
        elif entry.kind == "run-start":
            runs[entry.ref] = RungRun(
                entry.ref,
                data["rung"],
                tuple(data["items"]),
                data["version"],
                "running",
                False,
                entry.seq,
                primed_from=data.get("primed_from"),
            )
        elif entry.kind == "run-end":
            run = runs[entry.ref]
            run.status = data["status"]
            run.totals = decode_nonfinite(data.get("totals", {}))
            run.ended_by = data.get("ended_by")
            run.memory_snapshots = tuple(data.get("memory_snapshots") or ())
            run.crash_window = data.get("crash_window")
        elif entry.kind == "interrupted":
            runs[entry.ref].status = "interrupted"
            runs[entry.ref].totals = data.get("totals", {})
        elif entry.kind == "gate":
            gates.append(data)
        elif entry.kind == "ceiling":
            ceilings.append(data)
        elif entry.kind == "kill":
            kills.append(data)
            runs[entry.ref].kill = data
        elif entry.kind == "record":
            for rung_id, rung in data["rungs"].items():
                run_id = f"record-{entry.seq}-{rung_id}"
                runs[run_id] = RungRun(
                    run_id,
                    rung_id,
                    tuple(rung["items"]),
                    data["version"],
                    rung["status"],
                    True,
                    entry.seq,
                    windows=[decode_nonfinite(w) for w in rung.get("windows", [])],
                    totals=decode_nonfinite(rung.get("metrics", {})),
                    flagged=rung.get("flagged"),
                    provenance=data["provenance"],
                    n_windows=len(rung.get("windows", [])),
                    rows={m: decode_nonfinite(r) for m, r in rung.get("rows", {}).items()},
                )
        elif entry.kind == "verdict":
            verdicts.append(entry)
        elif entry.kind == "adopt":
            adoptions.append(
                Adoption(
                    entry.seq,
                    entry.ts,
                    tuple(data["items"]),
                    data["outcome"],
                    data["commit"],
                    data["commit_checked"],
                    data["verdict_seq"],
                    dict(data["against_verdict"]),
                    data["reason"],
                    data["without_verdict"],
                )
            )
    if not versions:
        raise Refused(
            f"registration {reg_id!r} is not frozen in this ledger", fix=f"prereg freeze registrations/{reg_id}.toml"
        )
    windows = ledger.count_by(reg_id, "window")
    for run_id, n in windows.items():
        if run_id in runs:
            runs[run_id].n_windows = n
            if with_windows and n:
                runs[run_id].windows = [
                    decode_nonfinite(e.data) for e in ledger.entries(reg_id=reg_id, kinds=("window",), ref=run_id)
                ]
    counts["window"] = sum(windows.values())
    return RegistrationState(
        reg_id,
        versions,
        oracles,
        sorted(runs.values(), key=lambda r: r.start_seq),
        kills,
        verdicts,
        counts,
        gates,
        ceilings,
        adoptions,
        config_defaults,
    )


def require_frozen(ledger: Ledger, reg_id: str, *, with_windows: bool = True) -> RegistrationState:
    if reg_id not in ledger.reg_ids():
        raise Refused(
            f"registration {reg_id!r} is not frozen in {ledger.url}", fix=f"prereg freeze registrations/{reg_id}.toml"
        )
    return load_state(ledger, reg_id, with_windows=with_windows)


# --- rung summaries -------------------------------------------------------------------------------------------


def summarize(
    run: RungRun, discard_first: int, workload: WorkloadDeclaration
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """A rung's summary per metric, and the per-window samples it was taken over (kept windows only)."""
    metrics = workload.metrics
    kept = [w for w in run.windows if w.get("step", 0) > discard_first]
    samples: dict[str, list[float]] = {}
    for window in kept:
        for name, value in window.items():
            if name in metrics and isinstance(value, (int, float)):
                samples.setdefault(name, []).append(value)
    summary: dict[str, Any] = {}
    for name, values in samples.items():
        how = metrics[name].summary
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            summary[name] = math.nan  # a NaN window makes the summary NaN: a broken window cannot hide behind good ones
        elif how == "median":
            summary[name] = statistics.median(values)
        elif how == "max":
            summary[name] = max(values)
        elif how == "sum":
            summary[name] = sum(values)
        else:
            summary[name] = values[-1]
    if kept:
        summary.setdefault("finite", all(bool(w.get("finite", True)) for w in kept))
    for name, value in run.totals.items():
        if name in metrics:
            summary[name] = value  # run-end totals and recorded summaries are authoritative
    return summary, samples


def rung_index(reg: Registration) -> dict[str, int]:
    return {r.id: i for i, r in enumerate(reg.protocol.rungs)}


def check_record_rungs(reg: Registration, rung_ids: list[str], where: str) -> None:
    known = [r.id for r in reg.protocol.rungs]
    for rung_id in rung_ids:
        if rung_id not in known:
            raise InvalidInput(
                f"rungs.{rung_id}: not a rung of {reg.id}; rungs are {known}",
                where=where,
                fix="record only planned rungs (amend to add a rung first)",
            )
