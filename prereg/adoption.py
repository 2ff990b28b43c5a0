"""Adoption: what a verdict decided, and what landed in code.

A verdict decides what lands and what parks; landing happens later, in code. `prereg adopt ID ITEM… --commit SHA`
appends an `adopt` entry: those items landed at that commit. A verdict whose rule lands no items (an outcome that
decides run config, `default-pack`) is adopted as a whole with `--outcome`. An adoption is judged against the
registration's latest verdict when it is made: an item the verdict parked, dropped or did not land goes against
it and needs `--against-verdict --reason "…"`, and the entry keeps which items and why, so every later audit line
of the registration can flag it; with no decided verdict the adoption is recorded as "without a verdict".

Adoption checks (`[[adoption]]` in a registration) are questions only later data answers, such as a transfer
check, "the 4-GPU box smoke shows at least half the local gain". They stay inside the reads/records model: the
measurements a check needs are rungs of the registration (declared with it, or added by amendment once the local
ladder is done, since the engine runs every planned rung it has no record of), entered with `prereg record`.
`requires` names those rungs, or RUNG.metric. A check is pending until each required rung has a recorded
(external), finished, unflagged run carrying the metric; then `when`, a condition over reads like a rule's, is
evaluated over the registration's measurements as a verdict sees them: true is met, false is failed, undefined is
still pending, with the reason. Nothing about a check is stored: the audit projects it from the ledger each time.

    [reads]
    gain = "(A.s_per_step - C.s_per_step) / A.s_per_step"
    box_gain = "(box_A.s_per_step - box_C.s_per_step) / box_A.s_per_step"

    [[adoption]]
    id = "T1"
    claim = "the 4-GPU box smoke shows at least half the local gain"
    when = "box_gain >= 0.5 * gain"
    requires = ["box_A.s_per_step", "box_C.s_per_step"]

A check added or changed by amendment once a rung it requires has data is post-hoc, like a rule written after
its inputs (prereg.amend).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prereg.errors import InvalidInput, Refused
from prereg.rules import Undefined, compile_expr
from prereg.schema import Registration
from prereg.state import Adoption, RegistrationState

COMMIT_PATTERN = re.compile(r"^[0-9a-fA-F]{7,64}$")  # an abbreviated or full SHA-1, or a SHA-256 object id

# Statuses of `prereg audit adoption`, one per decided item (or outcome) and per adoption outside them.
LANDED_ADOPTED = "landed-adopted"
LANDED_NOT_ADOPTED = "landed-not-adopted"
AGAINST_VERDICT = "against-verdict"
WITHOUT_VERDICT = "without-verdict"
CHECK_STATUSES = ("pending", "met", "failed")


# --- the commit ----------------------------------------------------------------------------------------------


def resolve_commit(commit: str, repo: Path) -> tuple[str, bool]:
    """The commit as recorded, and whether git confirmed it: inside a git checkout it must name a commit of that
    repository (recorded as its full id); outside one it is recorded as given."""
    if not COMMIT_PATTERN.match(commit):
        raise InvalidInput(
            f"{commit!r} is not a commit id (7 to 64 hex digits)",
            where="--commit",
            fix="give the commit where the items landed, e.g. --commit $(git rev-parse HEAD); nothing was written",
        )
    try:
        inside = subprocess.run(
            ["git", "rev-parse", "--is-inside-work-tree"], cwd=repo, capture_output=True, timeout=30
        )
    except OSError:  # no git on this machine: nothing to check the commit against
        return commit.lower(), False
    if inside.returncode != 0:
        return commit.lower(), False
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], cwd=repo, capture_output=True, timeout=30
    )
    if found.returncode != 0:
        raise InvalidInput(
            f"{commit!r} is not a commit of the git repository at {repo}",
            where="--commit",
            fix="give a commit that exists here (`git log` lists them); nothing was written",
        )
    return found.stdout.decode().strip(), True


# --- what an adoption is judged against ----------------------------------------------------------------------


@dataclass(frozen=True)
class Standing:
    """The verdict an adoption is judged against: the registration's latest, if it decided anything."""

    seq: int | None  # the verdict entry; None when no verdict was recorded
    outcome: str | None  # None: no verdict, or no rule fired
    rule: str | None
    land: tuple[str, ...]
    park: tuple[str, ...]
    dropped: dict[str, dict[str, Any]]

    @property
    def decided(self) -> bool:
        return self.outcome is not None

    def describe(self) -> str:
        if self.seq is None:
            return "the oracle gate (no verdict is recorded)"
        if not self.decided:
            return f"verdict entry {self.seq}, where no rule fired"
        return f"outcome {self.outcome} by rule {self.rule} (verdict entry {self.seq})"


def standing(state: RegistrationState) -> Standing:
    if not state.verdicts:
        # No verdict yet: the oracle gate's drops still stand (an item that failed parity never lands quietly).
        return Standing(None, None, None, (), (), state.dropped())
    entry = state.verdicts[-1]
    verdict = entry.data["verdict"]
    return Standing(
        entry.seq,
        verdict["outcome"],
        verdict["rule"],
        tuple(verdict["land"]),
        tuple(verdict["park"]),
        verdict["dropped"],
    )


def why_not_landed(item: str, verdict: Standing) -> str | None:
    """Why adopting `item` goes against the verdict, or None when the verdict landed it."""
    if item in verdict.dropped:
        why = verdict.dropped[item]
        cause = f"oracle {why['oracle']} failed" if why["cause"] == "oracle" else f"kill line {why['kill']} fired"
        return f"dropped: {cause} ({why['reason']})" if why.get("reason") else f"dropped: {cause}"
    if not verdict.decided:
        return None  # nothing was decided: the adoption is flagged "without a verdict" instead
    if item in verdict.park:
        return f"parked by rule {verdict.rule} (outcome {verdict.outcome})"
    if item not in verdict.land:
        return f"not landed by rule {verdict.rule} (outcome {verdict.outcome}, which lands {list(verdict.land)})"
    return None


def adoption_body(
    reg: Registration,
    state: RegistrationState,
    items: list[str],
    *,
    outcome: bool,
    commit: str,
    commit_checked: bool,
    against_verdict: bool,
    reason: str | None,
) -> dict[str, Any]:
    """The `adopt` entry's data, after every check: invalid input first (exit 2), then the governance rule (3)."""
    item_ids = [i.id for i in reg.items]
    verdict = standing(state)
    if outcome and items:
        raise InvalidInput(
            f"ITEMs {items} and --outcome: an adoption names the items that landed, or the verdict's outcome",
            where="--outcome",
            fix="adopt items by name, or the outcome alone (prereg adopt ID --outcome --commit SHA)",
        )
    if not outcome and not items:
        raise InvalidInput(
            f"nothing to adopt for {reg.id}",
            fix="name the ITEMs that landed (items are " + f"{item_ids}) or pass --outcome; nothing was written",
        )
    unknown = [i for i in items if i not in item_ids]
    if unknown:
        raise InvalidInput(
            f"{unknown[0]!r} is not an item of {reg.id}; its items are {item_ids}",
            where="ITEM",
            fix="name items by the registration's item ids"
            + ("; a verdict that decided run config is adopted with --outcome" if not item_ids else "")
            + "; nothing was written",
        )
    repeated = sorted({i for i in items if items.count(i) > 1})
    if repeated:
        raise InvalidInput(f"{repeated} named twice", where="ITEM", fix="name each item once; nothing was written")
    if reason is not None and not reason.strip():
        raise InvalidInput("--reason is empty", where="--reason", fix="say why; nothing was written")
    if against_verdict and reason is None:
        raise InvalidInput(
            "--against-verdict needs --reason",
            where="--against-verdict",
            fix='say why the code goes against the verdict: --reason "…"; nothing was written',
        )
    if reason is not None and not against_verdict:
        raise InvalidInput(
            "--reason goes with --against-verdict",
            where="--reason",
            fix="drop --reason, or pass --against-verdict with it; nothing was written",
        )
    if outcome:
        if not verdict.decided:
            raise InvalidInput(
                f"{reg.id} has no decided verdict: "
                + ("none is recorded" if verdict.seq is None else f"no rule fired in verdict entry {verdict.seq}"),
                where="--outcome",
                fix=f"--outcome adopts the outcome of a recorded verdict; run `prereg verdict {reg.id}` first, or "
                "name the items that landed; nothing was written",
            )
        if verdict.land:
            raise InvalidInput(
                f"the verdict's outcome {verdict.outcome} lands items {list(verdict.land)}",
                where="--outcome",
                fix=f"adopt its items by name: prereg adopt {reg.id} {' '.join(verdict.land)} --commit SHA",
            )
        if against_verdict:
            raise InvalidInput(
                "--against-verdict with --outcome: the outcome is the verdict's own decision",
                where="--against-verdict",
                fix="drop --against-verdict and --reason; nothing was written",
            )
    against = {item: why for item in items if (why := why_not_landed(item, verdict))}
    if against_verdict and not against:
        raise InvalidInput(
            f"nothing here goes against {verdict.describe()}",
            where="--against-verdict",
            fix="drop --against-verdict and --reason: an adoption the verdict allows is not flagged",
        )

    # The input is valid (every exit-2 check is above); now the governance rule, exit 3.
    if against and not against_verdict:
        first, why = next(iter(against.items()))
        raise Refused(
            f"{first} was {why}: adopting it goes against {verdict.describe()}",
            where="ITEM",
            fix='if the code lands it deliberately, pass --against-verdict --reason "…": it is flagged on every audit '
            f"line of {reg.id}",
        )
    return {
        "items": list(items),
        "outcome": verdict.outcome if outcome else None,
        "commit": commit,
        "commit_checked": commit_checked,
        "verdict_seq": verdict.seq,
        "verdict_outcome": verdict.outcome,
        "verdict_rule": verdict.rule,
        "against_verdict": against,
        "reason": reason,
        "without_verdict": not verdict.decided,
        "version": state.version,
    }


def same_adoption(adoption: Adoption, body: dict[str, Any]) -> bool:
    """An adoption already recorded: the same items (or outcome) at the same commit, judged against the same
    verdict. Recording it again would only repeat it."""
    return (
        sorted(adoption.items) == sorted(body["items"])
        and adoption.outcome == body["outcome"]
        and adoption.commit == body["commit"]
        and adoption.verdict_seq == body["verdict_seq"]
    )


# --- adoption checks -----------------------------------------------------------------------------------------


def _recorded(state: RegistrationState, need: str) -> int | None:
    """The record entry that brings a requirement (RUNG or RUNG.metric), the latest one; None while none does."""
    rung_id, _, metric = need.partition(".")
    found = None
    for run in state.runs:
        if run.rung != rung_id or not run.external or run.flagged is not None or run.status != "finished":
            continue
        if metric and metric not in run.totals and not any(metric in w for w in run.windows):
            continue
        found = run.start_seq
    return found


def _touches(path: str, check_path: str) -> bool:
    """Whether an amended path is the check, inside it, or the whole list it is in."""
    return path == check_path or path.startswith(check_path + ".") or check_path.startswith(path + ".")


def check_results(reg: Registration, state: RegistrationState) -> list[dict[str, Any]]:
    """Every adoption check of the registration's latest document: pending, met or failed, and why. `state` must
    be loaded with its windows: `when` sees the rungs' summaries as a verdict does."""
    if not reg.adoption:
        return []
    from prereg.verdict import VerdictEnv, judge_until_pass, read_scope, rung_views

    views = rung_views(reg, state)
    env = VerdictEnv(reg, state, views, None, None)
    if reg.protocol.kind == "until_pass":
        passed, _, pass_reason = judge_until_pass(state, views, env)
        env = VerdictEnv(reg, state, views, passed, pass_reason)
    scope = replace(read_scope(reg), kind="rules")
    post_hoc = state.post_hoc_paths()
    results = []
    for check in reg.adoption:
        records = {need: _recorded(state, need) for need in check.requires}
        missing = [need for need, seq in records.items() if seq is None]
        value: Any = None
        if missing:
            status, why = "pending", f"waiting for a `prereg record` of {', '.join(missing)}"
        else:
            value = compile_expr(check.when, scope).evaluate(env)
            if isinstance(value, Undefined):
                status, why = "pending", f"undefined: {value.reason}"
            else:
                status, why = ("met" if value is True else "failed"), None
        results.append(
            {
                "id": check.id,
                "claim": check.claim,
                "when": check.when,
                "requires": list(check.requires),
                "status": status,
                "why": why,
                "records": sorted({seq for seq in records.values() if seq is not None}),
                "post_hoc": [p for p in post_hoc if _touches(p.split(": ", 1)[-1], f"adoption.{check.id}")],
            }
        )
    return results


# --- the audit -----------------------------------------------------------------------------------------------


def _adoption_dict(adoption: Adoption) -> dict[str, Any]:
    return {
        "seq": adoption.seq,
        "ts": adoption.ts,
        "items": list(adoption.items),
        "outcome": adoption.outcome,
        "commit": adoption.commit,
        "commit_checked": adoption.commit_checked,
        "verdict_seq": adoption.verdict_seq,
        "against_verdict": adoption.against_verdict,
        "reason": adoption.reason,
        "without_verdict": adoption.without_verdict,
    }


def adoptions_of(state: RegistrationState) -> list[dict[str, Any]]:
    """The registration's adopt entries, for `audit show`."""
    return [_adoption_dict(a) for a in state.adoptions]


def _row(what: str, kind: str, status: str, adoption: Adoption | None, why: str | None) -> dict[str, Any]:
    return {
        "what": what,
        "kind": kind,  # item | outcome
        "status": status,
        "commit": adoption.commit if adoption else None,
        "commit_checked": adoption.commit_checked if adoption else None,
        "seq": adoption.seq if adoption else None,
        "reason": adoption.reason if adoption else None,
        "why": why,
    }


def adoption_rows(state: RegistrationState) -> list[dict[str, Any]]:
    """Every decided item (or outcome) of the latest verdict, landed and adopted or not, then every adoption
    outside them: against the verdict, or without one."""
    verdict = standing(state)
    rows = []
    covered: set[tuple[str, str]] = set()
    if verdict.decided:
        decided = [(item, "item") for item in verdict.land] or [(verdict.outcome, "outcome")]
        for what, kind in decided:
            adopted = [a for a in state.adoptions if (what in a.items if kind == "item" else a.outcome == what)]
            latest = adopted[-1] if adopted else None
            rows.append(_row(what, kind, LANDED_ADOPTED if latest else LANDED_NOT_ADOPTED, latest, None))
            covered.add((what, kind))
    for adoption in state.adoptions:
        named = [(item, "item") for item in adoption.items] or [(adoption.outcome, "outcome")]
        for what, kind in named:
            if (what, kind) in covered:
                continue
            if what in adoption.against_verdict:
                status, why = AGAINST_VERDICT, adoption.against_verdict[what]
            elif adoption.without_verdict:
                status, why = WITHOUT_VERDICT, "no decided verdict when it was adopted"
            else:  # judged against an earlier verdict that landed it; the latest one does not
                status, why = AGAINST_VERDICT, f"the latest verdict ({verdict.describe()}) does not land it"
            rows.append(_row(what, kind, status, adoption, why))
    return rows
