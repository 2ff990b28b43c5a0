"""Amendments: `add` appends, `set` replaces, by path; then the governance of what changed.

Paths walk the document: a table key descends into a table; inside a list of tables with ids (items, rungs,
rules, kill lines, oracles) or numbers (expectations) a key selects the element by id. `add` appends to lists
and adds new keys to tables; `set` replaces existing values (tables merge recursively).

What an amendment may change is decided by diffing the document before and after, against what has been
measured: DESIGN.md "Frozen bounds" and "Amendments and external records".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from prereg.errors import InvalidInput, Refused
from prereg.rules import compile_expr
from prereg.schema import Amendment


def element_key(element: dict[str, Any]) -> str:
    """How a path names a list element: its id, or an expectation's number and part ("3", "3a")."""
    if "id" in element:
        return str(element["id"])
    return f"{element['n']}{element.get('part') or ''}"


def _keyed(elements: list[Any]) -> bool:
    return all(isinstance(e, dict) and ("id" in e or "n" in e) for e in elements)


def _select(elements: list[Any], key: str, where: str) -> Any:
    for element in elements:
        if isinstance(element, dict) and element_key(element) == key:
            return element
    ids = [element_key(e) for e in elements if isinstance(e, dict)]
    raise InvalidInput(
        f"{where}: no element {key!r}; the list has {ids}",
        fix="name an existing element by its id (or n); append new ones with [[add.…]]",
    )


def _add(target: Any, change: Any, where: str) -> None:
    if isinstance(target, list):
        if isinstance(change, list):
            target.extend(copy.deepcopy(change))
            return
        if isinstance(change, dict):
            for key, value in change.items():
                _add(_select(target, key, where), value, f"{where}.{key}")
            return
    if isinstance(target, dict) and isinstance(change, dict):
        for key, value in change.items():
            if key not in target or target[key] is None:
                target[key] = copy.deepcopy(value)
            elif isinstance(target[key], (dict, list)):
                _add(target[key], value, f"{where}.{key}")
            else:
                raise InvalidInput(
                    f"{where}.{key} already exists: add appends to lists and adds new keys",
                    fix=f"use [set.{where}] to replace it",
                )
        return
    raise InvalidInput(
        f"{where}: cannot add {change!r} to {type(target).__name__}",
        fix="add appends to lists ([[add.protocol.rungs]]) and adds keys to tables",
    )


def _set(target: Any, change: dict[str, Any], where: str) -> None:
    for key, value in change.items():
        path = f"{where}.{key}" if where else key
        if isinstance(target, list):
            element = _select(target, key, path)
            if not isinstance(value, dict):
                raise InvalidInput(
                    f"{path}: set on a list element needs a table of its fields",
                    fix=f"write [set.{path}] with the fields to replace",
                )
            _set(element, value, path)
            continue
        if not isinstance(target, dict) or key not in target:
            raise InvalidInput(
                f"set.{path} does not exist in the document", fix="set replaces existing values; use add to append"
            )
        if isinstance(value, dict) and isinstance(target[key], (dict, list)) and target[key] != {}:
            _set(target[key], value, path)
        else:
            target[key] = copy.deepcopy(value)


def apply_amendment(document: dict[str, Any], amendment: Amendment) -> dict[str, Any]:
    result = copy.deepcopy(document)
    if amendment.add:
        _add(result, amendment.add, "add")
    if amendment.set:
        _set(result, amendment.set, "")
    return result


def diff_paths(before: Any, after: Any, path: str = "") -> list[str]:
    """Dotted paths whose values differ, with list elements named by their id/n."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: list[str] = []
        for key in sorted(set(before) | set(after)):
            sub = f"{path}.{key}" if path else key
            if key not in before or key not in after:
                out.append(sub)
            else:
                out.extend(diff_paths(before[key], after[key], sub))
        return out
    if isinstance(before, list) and isinstance(after, list) and _keyed(before + after):
        keyed_before = {element_key(e): e for e in before}
        keyed_after = {element_key(e): e for e in after}
        out = []
        for key in sorted(set(keyed_before) | set(keyed_after)):
            sub = f"{path}.{key}"
            if key not in keyed_before or key not in keyed_after:
                out.append(sub)
            else:
                out.extend(diff_paths(keyed_before[key], keyed_after[key], sub))
        order_before = [k for k in keyed_before]
        order_after = [k for k in keyed_after if k in keyed_before]
        if order_before != order_after:
            out.append(f"{path}(order)")
        return out
    return [] if before == after else [path]


@dataclass(frozen=True)
class MeasuredState:
    """What exists in the ledger for a registration, as far as amendments are concerned."""

    oracles_with_results: frozenset[str]
    items_with_results: frozenset[str]
    rungs_with_data: frozenset[str]
    any_run: bool

    @property
    def verdict_inputs_exist(self) -> bool:
        return bool(self.rungs_with_data)


@dataclass(frozen=True)
class AmendmentReview:
    changed: tuple[str, ...]
    post_hoc: tuple[str, ...]  # paths that change something already judged or measured


IMMUTABLE = ("id", "workload", "profile")
# Protocol fields that relabel measured windows if changed after data exists.
PROTOCOL_MEASUREMENT = (
    "kind",
    "schedule",
    "steps",
    "log_every",
    "discard_first",
    "seed",
    "eval_every",
    "save_every",
    "config",
)
COSMETIC = ("title", "notes", "source", "out_of_scope")


def review_amendment(
    before: dict[str, Any],
    after: dict[str, Any],
    measured: MeasuredState,
    *,
    config_defaults: dict[str, Any] | None = None,
) -> AmendmentReview:
    """What the amendment changes, and which of its changes are post-hoc. `config_defaults`: the frozen document's
    defaults table, which the amended document resolves with."""
    changed = diff_paths(before, after)
    if not changed:
        raise InvalidInput(
            "the amendment changes nothing in the document", fix="check its paths against the registration"
        )
    post_hoc: list[str] = []
    for path in changed:
        head, *rest = path.split(".")
        leaf = rest[-1] if rest else head
        if head in IMMUTABLE:
            raise InvalidInput(
                f"{path} cannot be amended: it names the experiment", fix="register a new document with its own id"
            )
        if head == "assumed":
            continue  # marks which values are the encoder's (prereg.assumed): it changes no value, so judges nothing
        if leaf in COSMETIC and head != "protocol":
            continue
        if head == "items" and rest:
            item_id = rest[0]
            if item_id in measured.items_with_results:
                removed_item = len(rest) == 1 and not _has_item(after, item_id)
                removed_oracle = (
                    len(rest) == 3
                    and rest[1] == "oracles"
                    and rest[2] in measured.oracles_with_results
                    and not _has_oracle(after, item_id, rest[2])
                )
                if removed_item or removed_oracle:
                    # Removing what has a result would hide it (a failed oracle, a dropped item) from every verdict.
                    raise InvalidInput(
                        f"{path}: {item_id} has oracle results; removing it edits history",
                        fix="items and oracles with results stay; park the item with a rule instead",
                    )
                if len(rest) >= 2 and rest[1] == "switch":
                    raise InvalidInput(
                        f"{path}: item {item_id} has oracle results; changing what it switches edits history",
                        fix="add a new item instead",
                    )
                if len(rest) >= 3 and rest[1] == "oracles" and rest[2] in measured.oracles_with_results:
                    post_hoc.append(path)  # a bound (or kind, probe) changed after that oracle has a result
        elif head == "protocol":
            field = rest[0] if rest else ""
            if field == "rungs" and len(rest) >= 2:
                rung_id = rest[1]
                if rung_id in measured.rungs_with_data and (len(rest) < 3 or rest[2] in ("items", "config", "id")):
                    raise InvalidInput(
                        f"{path}: rung {rung_id} has measurements; changing it edits history",
                        fix="add a new rung instead",
                    )
                if rest[-1] == "(order)" and measured.rungs_with_data:
                    raise InvalidInput(
                        f"{path}: the order of rungs that have run cannot change", fix="add rungs at the end"
                    )
            elif field in PROTOCOL_MEASUREMENT and measured.rungs_with_data:
                raise InvalidInput(
                    f"{path}: rungs have been measured under this protocol; changing it edits history",
                    fix="register a variant with its own id",
                )
            # pass_rule: honoured only for rungs measured after the amendment, so always admissible.
        elif (
            head in ("rules", "expectations")
            and rest
            and _judges_existing_data(after, head, rest[0], measured, config_defaults)
        ):
            post_hoc.append(path)
        elif (
            head == "reads" and measured.verdict_inputs_exist and len(rest) == 1 and rest[0] in before.get("reads", {})
        ):
            post_hoc.append(path)  # redefining a read after data; adding a new read decides nothing by itself
        elif head == "adoption" and _requirement_measured(before, after, rest[0] if rest else None, measured):
            post_hoc.append(path)  # an adoption check written or changed after the data it waits for exists
        elif head in ("cost", "question") and measured.any_run:
            post_hoc.append(path)
    return AmendmentReview(changed=tuple(changed), post_hoc=tuple(post_hoc))


CONTEXT_FUNCTIONS = ("passed(", "all_oracles_passed(", "killed(", "dropped(")


def _judges_existing_data(
    document: dict[str, Any], head: str, key: str, measured: MeasuredState, config_defaults: dict[str, Any] | None
) -> bool:
    """Whether a (new or changed) rule or expectation reads something already measured: a rung with data
    (directly or through reads; PASS means any rung), or oracle results and kills that exist. A prediction
    declared before its rung's smoke (seed 003's F1 amendments) is not post-hoc; one written after is."""
    from prereg.schema import CONFIG_DEFAULTS, Registration
    from prereg.verdict import read_scope

    context = None if config_defaults is None else {CONFIG_DEFAULTS: config_defaults}
    reg = Registration.model_validate(document, context=context)
    element = next((e for e in document.get(head, []) if element_key(e) == key), None)
    if element is None:  # removed: removal of a rule or expectation after data is itself post-hoc
        return measured.verdict_inputs_exist
    texts = [element["when"]] if head == "rules" else [element["check"]]
    if head == "rules":
        texts += [entry["if"] for entry in element.get("land", []) if isinstance(entry, dict)]
    scope = read_scope(reg)
    rungs: set[str] = set()
    pending = [compile_expr(text, replace(scope, kind=head)) for text in texts]
    seen_reads: set[str] = set()
    while pending:
        expr = pending.pop()
        rungs |= set(expr.rungs_used())
        for name in expr.reads_used() - seen_reads:
            seen_reads.add(name)
            pending.append(compile_expr(reg.reads[name], scope))
    if "PASS" in rungs and measured.rungs_with_data:
        return True
    if rungs & measured.rungs_with_data:
        return True
    all_texts = texts + [reg.reads[name] for name in seen_reads]
    uses_context = any(fn in text for text in all_texts for fn in CONTEXT_FUNCTIONS)
    return uses_context and (bool(measured.oracles_with_results) or measured.any_run)


def _requirement_measured(
    before: dict[str, Any], after: dict[str, Any], check_id: str | None, measured: MeasuredState
) -> bool:
    """Whether a rung the adoption check requires (in either version of it; every check when None, the whole
    list added or removed) already has data."""
    required = {
        need.partition(".")[0]
        for document in (before, after)
        for check in document.get("adoption", [])
        if check_id is None or check["id"] == check_id
        for need in check["requires"]
    }
    return bool(required & measured.rungs_with_data)


def _has_item(document: dict[str, Any], item_id: str) -> bool:
    return any(item["id"] == item_id for item in document.get("items", []))


def _has_oracle(document: dict[str, Any], item_id: str, oracle_id: str) -> bool:
    return any(
        o["id"] == oracle_id for item in document.get("items", []) if item["id"] == item_id for o in item["oracles"]
    )


def refuse_post_hoc(review: AmendmentReview) -> None:
    raise Refused(
        f"post-hoc change of {', '.join(review.post_hoc)}: what it changes has already been measured or judged",
        fix="frozen bounds and rules do not move after the data; if this is deliberate, pass --post-hoc and it will be "
        "printed on every verdict, report and audit line that depends on it",
    )
