"""The governance verbs that write the ledger: freeze, amend, record, adopt. Each validates everything first and then
appends in one transaction, so bad input leaves the ledger byte-for-byte unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oracles.judge import judge, observation_problem
from prereg.amend import MeasuredState, apply_amendment, refuse_post_hoc, review_amendment
from prereg.assumed import AssumedValue, assumed_values
from prereg.canonical import canonical_hash, encode_nonfinite, file_hash
from prereg.documents import (
    document_dict,
    document_hash,
    load_amendment,
    load_record,
    load_registration,
    registration_id,
    validate,
)
from prereg.errors import InvalidInput, Refused
from prereg.ledger import Entry, Ledger
from prereg.numerics_guard import frozen_before_the_rule, refuse_unguarded, unguarded_numerics
from prereg.pairing import FIX as PAIRING_FIX
from prereg.pairing import refuse_unpaired, unpaired_comparisons
from prereg.plan import plan_ladder
from prereg.provenance import git_state, tool_version
from prereg.schema import CONFIG_DEFAULTS, RETIRED_FIX, Registration, RetiredUse, retired_uses
from prereg.state import RegistrationState, check_record_rungs, frozen_config_defaults, load_state, require_frozen


@dataclass(frozen=True)
class FreezeResult:
    reg_id: str
    doc_hash: str
    head: str
    seq: int
    already: bool  # freezing the same document again is a no-op


def load_against(ledger: Ledger | None, path: Path) -> tuple[Registration, bytes]:
    """The registration in `path` resolved as this ledger knows it: with the defaults table its id was frozen with
    here, else (a new document, or no ledger) with its workload's current defaults."""
    reg_id = registration_id(path)
    defaults = None if ledger is None or reg_id is None else frozen_config_defaults(ledger, reg_id)
    return load_registration(path, defaults)


def refuse_retired(uses: list[RetiredUse], where: str) -> None:
    if uses:
        message = "; ".join(use.refusal() for use in uses) + "; a new freeze cannot use a retired option"
        raise InvalidInput(message, where=where, fix=RETIRED_FIX)


def refuse_new_freeze(reg: Registration, path: Path) -> None:
    """What a new freeze refuses of a valid document (exit 2): an unpaired comparison, a retired option."""
    refuse_unpaired(reg, str(path))
    refuse_retired(retired_uses(reg), str(path))
    refuse_unguarded(reg, str(path))


@dataclass(frozen=True)
class CheckResult:
    reg: Registration
    frozen: bool  # its id is frozen in the ledger checked against (its run configs resolved with the frozen defaults)
    retired: list[RetiredUse]  # uses of retired options the frozen document already made: notes, not errors
    numerics_note: str | None = None  # a frozen document the numerics guard would refuse now: a note, not an error
    # The values the encoder assumed: the ledger's latest version's marks for a frozen document (amendments add them
    # without changing the frozen text), else the file's own.
    assumed: list[AssumedValue] = field(default_factory=list)
    # A frozen document's values that amendments changed: (path, the value in force), the frozen text unchanged.
    amended: list[tuple[str, Any]] = field(default_factory=list)


def amended_values(file_document: dict[str, Any], in_force: dict[str, Any]) -> list[tuple[str, Any]]:
    """The paths where the ledger's latest version differs from the file, with the value in force (None where an
    amendment removed it); the encoder's marks are shown apart (assumed)."""
    from prereg.amend import diff_paths
    from prereg.assumed import lookup

    out = []
    for path in diff_paths(file_document, in_force):
        if path.split(".")[0] == "assumed" or path.endswith("(order)"):
            continue
        try:
            out.append((path, lookup(in_force, path)))
        except KeyError:
            out.append((path, None))
    return out


def check(ledger: Ledger | None, path: Path) -> CheckResult:
    """Validate a registration as `prereg freeze` would, writing nothing. A retired option that no frozen version
    of the document used is refused, as a new freeze would refuse it; one a frozen version used is a note."""
    reg, _ = load_against(ledger, path)
    refuse_unpaired(reg, str(path))
    source_hashes(reg, path)  # a source the workload names must exist (hashed at freeze)
    uses = retired_uses(reg)
    frozen = ledger is not None and reg.id in ledger.reg_ids()
    known: set[RetiredUse] = set()
    assumed = assumed_values(document_dict(reg))
    amended: list[tuple[str, Any]] = []
    if frozen:
        state = load_state(ledger, reg.id, with_windows=False)
        known = {use for v in state.versions for use in retired_uses(state.registration_at(v.number))}
        assumed = assumed_values(state.document)
        amended = amended_values(document_dict(reg), state.document)
    refuse_retired([use for use in uses if use not in known], str(path))
    return CheckResult(reg, frozen, uses, numerics_check(ledger, reg, path, frozen), assumed, amended)


def numerics_check(ledger: Ledger | None, reg: Registration, path: Path, frozen: bool) -> str | None:
    """An unfrozen document the numerics guard refuses is refused (exit 2); a frozen one is shown as frozen before
    the rule, with its freeze's entry."""
    if not frozen:
        refuse_unguarded(reg, str(path))
        return None
    if not unguarded_numerics(reg):
        return None
    return frozen_before_the_rule(require_frozen(ledger, reg.id).versions[0].seq)


def freeze(ledger: Ledger, path: Path) -> FreezeResult:
    reg, raw = load_against(ledger, path)
    return freeze_registration(ledger, reg, raw, path)


def freeze_registration(ledger: Ledger, reg: Registration, raw: bytes, path: Path) -> FreezeResult:
    """Freeze a registration already loaded (and so validated) from `path`, whose bytes are `raw`."""
    doc_hash = document_hash(reg)
    if reg.id in ledger.reg_ids():
        state = require_frozen(ledger, reg.id)
        frozen = state.versions[0]
        if frozen.doc_hash == doc_hash:
            seq, head = ledger.head()
            return FreezeResult(reg.id, doc_hash, head, frozen.seq, True)
        raise Refused(
            f"{reg.id} is already frozen with document {frozen.doc_hash[:12]}; this file's document is {doc_hash[:12]}",
            where=str(path),
            fix=f"a frozen registration never changes: write the change as an amendment file and run `prereg amend "
            f"{reg.id} FILE`",
        )
    refuse_new_freeze(reg, path)
    sources = source_hashes(reg, path)
    entry = ledger.append(
        "freeze",
        reg.id,
        {
            "document": document_dict(reg),
            "doc_hash": doc_hash,
            "source_file": path.name,
            "source_hash": file_hash(raw),
            "git": git_state(path.resolve().parent),
            "tool": tool_version(),
            # Every run-config key of every rung, defaults included, and the table they came from: what the
            # document means stays what it meant today, whatever later code defaults to.
            "config_defaults": reg.config_defaults,
            "effective_config": reg.effective_configs(),
            **({"sources": sources} if sources else {}),
        },
    )
    return FreezeResult(reg.id, doc_hash, entry.head, entry.seq, False)


def refuse_introduced_numerics(before: Registration, after: Registration, path: Path) -> None:
    """An amendment may not add an unguarded numerics difference (one the document had is its frozen meaning)."""
    known = {(rungs, key) for rungs, key, _ in unguarded_numerics(before)}
    introduced = [(rungs, key, text) for rungs, key, text in unguarded_numerics(after) if (rungs, key) not in known]
    if introduced:
        from prereg.numerics_guard import fix

        rungs, key, _ = introduced[0]
        raise InvalidInput("; ".join(t for _, _, t in introduced), where=str(path), fix=fix(rungs, key))


def measured_state(state: RegistrationState) -> MeasuredState:
    owner = {o: r.item for o, r in state.oracles.items()}
    return MeasuredState(
        oracles_with_results=frozenset(state.oracles),
        items_with_results=frozenset(owner.values()),
        rungs_with_data=state.rungs_with_data(),
        any_run=bool(state.runs),
    )


def amend(ledger: Ledger, reg_id: str, path: Path, *, post_hoc: bool) -> tuple[Entry, tuple[str, ...]]:
    state = require_frozen(ledger, reg_id)
    amendment, raw = load_amendment(path)
    try:
        new_document = apply_amendment(state.document, amendment)
        # New rungs resolve with the document's frozen defaults, as its frozen rungs do.
        context = {CONFIG_DEFAULTS: state.config_defaults}
        new_reg = validate(Registration, new_document, where=str(path), fix=AMENDED_DOCUMENT_FIX, context=context)
        review = review_amendment(
            state.document, document_dict(new_reg), measured_state(state), config_defaults=state.config_defaults
        )
    except InvalidInput as error:
        if error.where is not None:
            raise
        # The amendment's paths and the review name the field; the user needs the file too.
        raise InvalidInput(error.message, where=str(path), fix=error.fix) from None
    if review.post_hoc and not post_hoc:
        refuse_post_hoc(review)
    before = state.registration()
    introduced = set(unpaired_comparisons(new_reg)) - set(unpaired_comparisons(before))
    if introduced:
        raise InvalidInput("; ".join(sorted(introduced)), where=str(path), fix=PAIRING_FIX)
    refuse_retired([use for use in retired_uses(new_reg) if use not in set(retired_uses(before))], str(path))
    refuse_introduced_numerics(before, new_reg, path)
    entry = ledger.append(
        "amend",
        reg_id,
        {
            "reason": amendment.reason,
            "amendment": amendment.model_dump(mode="json"),
            "document": document_dict(new_reg),
            "doc_hash": document_hash(new_reg),
            "changed": list(review.changed),
            "post_hoc": list(review.post_hoc),
            "source_file": path.name,
            "source_hash": file_hash(raw),
            "version": state.version + 1,
            "config_defaults": state.config_defaults,
            "effective_config": new_reg.effective_configs(),
        },
    )
    return entry, review.post_hoc


AMENDED_DOCUMENT_FIX = (
    "correct the amendment: the document it produces must validate like a registration; nothing was written"
)


def record(ledger: Ledger, reg_id: str, path: Path) -> list[Entry]:
    state = require_frozen(ledger, reg_id)
    reg = state.registration()
    rec, raw = load_record(path)
    where = str(path)
    owner = reg.oracle_owner()
    for oracle_id in rec.oracles:
        if oracle_id not in owner:
            raise InvalidInput(
                f"oracles.{oracle_id}: not an oracle of {reg_id}; oracles are {sorted(owner)}",
                where=where,
                fix="name each [oracles.ID] table by an oracle id of the registration; nothing was written",
            )
    probes = reg.declaration().probes
    for oracle_id, observed in rec.oracles.items():
        oracle = next(o for o in reg.item(owner[oracle_id]).oracles if o.id == oracle_id)
        problem = observation_problem(oracle.kind, dict(observed), oracle.bounds, probes[oracle.probe].observes)
        if problem:
            raise InvalidInput(
                f"oracles.{oracle_id}: {problem}",
                where=where,
                fix="name each observed value as the oracle reads it (the frozen bounds judge them); nothing was "
                "written",
            )
    check_record_rungs(reg, list(rec.rungs), where)
    metrics = reg.declaration().metrics
    item_ids = [i.id for i in reg.items]
    for rung_id, rung in rec.rungs.items():
        for item in rung.items:
            if item not in item_ids:
                raise InvalidInput(
                    f"rungs.{rung_id}.items: {item!r} is not an item; items are {item_ids}",
                    where=where,
                    fix="list the items the rung ran with, by the registration's item ids; nothing was written",
                )
        names = set(rung.metrics) | {k for w in rung.windows for k in w if k != "step"} | set(rung.rows)
        unknown = sorted(names - set(metrics))
        if unknown:
            raise InvalidInput(
                f"rungs.{rung_id}: unknown metric(s) {unknown}; the {reg.workload} catalogue has {sorted(metrics)}",
                where=where,
                fix="name metrics as the workload's catalogue does; nothing was written",
            )
        by_row = sorted(m for m in metrics if metrics[m].rows)
        misplaced = sorted(
            {m for m in names - set(rung.rows) if metrics[m].rows} | {m for m in rung.rows if m not in by_row}
        )
        if misplaced:
            raise InvalidInput(
                f"rungs.{rung_id}: {misplaced} recorded in the wrong place: the metrics recorded row by row "
                f"({by_row}) go in [rungs.{rung_id}.rows.METRIC], every other one in metrics or windows",
                where=where,
                fix='write a per-row metric as [rungs.R.rows.METRIC] with "ROW_ID" = value lines; nothing was written',
            )

    # The input is valid (every exit-2 check is above); now the governance rule, exit 3.
    observed_before = sorted(set(rec.oracles) & set(state.oracles))
    if observed_before:
        raise Refused(
            f"oracles {observed_before} already have results: a parity result stands, and re-observing it until it "
            "passes would re-tolerance it",
            where=where,
            fix="remove those [oracles.ID] tables; an item whose oracle failed stays dropped",
        )

    batch: list[tuple[str, str | None, dict[str, Any], str | None]] = []
    dropped = set(state.dropped())
    for oracle_id, observed in rec.oracles.items():
        item = reg.item(owner[oracle_id])
        oracle = next(o for o in item.oracles if o.id == oracle_id)
        verdict = judge(oracle.kind, dict(observed), oracle.bounds)
        if not verdict.passed:
            dropped.add(item.id)
        batch.append(
            (
                "oracle",
                reg_id,
                {
                    "oracle": oracle_id,
                    "item": item.id,
                    "kind": oracle.kind,
                    "probe": oracle.probe,
                    "observed": encode_nonfinite(dict(observed)),
                    "bounds": oracle.bounds,
                    "passed": verdict.passed,
                    "reason": verdict.reason,
                    "version": state.version,
                    "external": True,
                    "provenance": rec.provenance,
                },
                None,
            )
        )
    planned = {p.id: p for p in plan_ladder(reg, dropped)}
    rungs: dict[str, Any] = {}
    for rung_id, rung in rec.rungs.items():
        plan = planned[rung_id]
        flagged = None
        if plan.skip:
            flagged = f"the plan does not run this rung: {plan.skip}"
        elif sorted(rung.items) != sorted(plan.items):
            extra = sorted(set(rung.items) - set(plan.items))
            missing = sorted(set(plan.items) - set(rung.items))
            parts = []
            if extra:
                parts.append(
                    f"ran {extra}"
                    + (" which the oracle gate dropped" if set(extra) & dropped else " which the plan does not include")
                )
            if missing:
                parts.append(f"lacked {missing}")
            flagged = "; ".join(parts)
        measured = rung.model_dump(exclude_none=True)
        measured["metrics"] = encode_nonfinite(measured["metrics"])
        measured["windows"] = [encode_nonfinite(w) for w in measured["windows"]]
        rows = measured.pop("rows")
        if rows:  # a record without rows keeps the body records had before rows existed
            measured["rows"] = {m: encode_nonfinite(r) for m, r in rows.items()}
        rungs[rung_id] = {**measured, "flagged": flagged}
    batch.append(
        (
            "record",
            reg_id,
            {
                "provenance": rec.provenance,
                "source_file": path.name,
                "source_hash": file_hash(raw),
                "version": state.version,
                "rungs": rungs,
                "oracles": sorted(rec.oracles),
            },
            None,
        )
    )
    return ledger.append_many(batch)


@dataclass(frozen=True)
class AdoptResult:
    entry: Entry
    already: bool  # the same adoption was recorded before: nothing was written


def adopt(
    ledger: Ledger,
    reg_id: str,
    items: list[str],
    *,
    outcome: bool,
    commit: str,
    against_verdict: bool,
    reason: str | None,
    repo: Path,
) -> AdoptResult:
    """Record that decided items (or a verdict's outcome) landed in code at `commit` of the git checkout `repo`."""
    from prereg.adoption import adoption_body, resolve_commit, same_adoption

    resolved, checked = resolve_commit(commit, repo)
    state = require_frozen(ledger, reg_id, with_windows=False)
    body = adoption_body(
        state.registration(),
        state,
        items,
        outcome=outcome,
        commit=resolved,
        commit_checked=checked,
        against_verdict=against_verdict,
        reason=reason,
    )
    earlier = next((a for a in state.adoptions if same_adoption(a, body)), None)
    if earlier is not None:
        return AdoptResult(next(ledger.entries(reg_id=reg_id, kinds=("adopt",), after_seq=earlier.seq - 1)), True)
    return AdoptResult(ledger.append("adopt", reg_id, body), False)


def source_hashes(reg: Registration, path: Path) -> dict[str, str]:
    """sha256 of every source file the document's workload names (a command's scripts), by its path relative to
    the registration file's folder. A missing one is bad input: a document must be runnable when it is frozen."""
    hashes = {}
    for source in reg.declaration().sources:
        file = path.parent / source
        if not file.is_file():
            raise InvalidInput(
                f"command.sources: {source!r} is not a file (looked for {file})",
                where=str(path),
                fix="create it, or correct command.sources (paths relative to command.cwd); nothing was written",
            )
        hashes[source] = file_hash(file.read_bytes())
    return hashes


def check_sources_unchanged(ledger: Ledger, reg: Registration, path: Path) -> None:
    """`prereg run` refuses a source file that changed since freeze (or is gone, or was never hashed), naming it."""
    frozen = next(ledger.entries(reg_id=reg.id, kinds=("freeze",)))
    recorded = frozen.data.get("sources", {})
    for source in reg.declaration().sources:
        file = path.parent / source
        if source not in recorded:
            raise Refused(
                f"source {source!r} was not hashed when {reg.id} was frozen",
                where=str(path),
                fix="the sources a ladder runs are fixed at freeze: register the new list under a new id",
            )
        if not file.is_file() or file_hash(file.read_bytes()) != recorded[source]:
            raise Refused(
                f"{file} {'changed' if file.is_file() else 'is gone'} since {reg.id} was frozen",
                where=str(file),
                fix="restore the frozen file (git checkout it); a changed script is another experiment: freeze it "
                "under a new id",
            )


def check_source_unchanged(ledger: Ledger, reg_id: str, path: Path) -> None:
    """`prereg run` refuses a registration file that no longer matches what was frozen (only the freeze entry
    is read: no projection of the registration's windows)."""
    frozen = next(ledger.entries(reg_id=reg_id, kinds=("freeze",)), None)
    if frozen is None:
        raise Refused(
            f"registration {reg_id!r} is not frozen in {ledger.url}", fix=f"prereg freeze registrations/{reg_id}.toml"
        )
    raw = path.read_bytes()
    if file_hash(raw) != frozen.data["source_hash"]:
        reg, _ = load_against(ledger, path)
        same_document = document_hash(reg) == frozen.data["doc_hash"]
        raise Refused(
            f"{path} changed since it was frozen" + (" (formatting only)" if same_document else ""),
            where=str(path),
            fix="restore the frozen file (git checkout it); a change to a frozen registration is an amendment: "
            "prereg amend",
        )


__all__ = [
    "check",
    "CheckResult",
    "load_against",
    "refuse_new_freeze",
    "freeze",
    "freeze_registration",
    "amend",
    "record",
    "adopt",
    "AdoptResult",
    "check_source_unchanged",
    "check_sources_unchanged",
    "source_hashes",
    "FreezeResult",
    "canonical_hash",
]
