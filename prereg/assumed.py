"""Values the encoder assumed: what a registration says that its source does not.

A registration that encodes a written practice (its `source`) states some values the practice never stated: a
cost ceiling the write-up gives no number for, a tolerance where the write-up says "equality", an `on_ceiling`
it never chose. `[assumed]` names each such value by its field path, with the encoder's reason:

    [assumed]
    "cost.ceiling_gpu_h" = "the source costs the run but declares no ceiling; three hours of the 4-GPU box"
    "items.P3c.oracles.P3c-fp64.bounds.sum_rel" = "the source says 'fp64 reference equality' and gives no bound"

Paths walk the document as amendments do (prereg.amend): table keys, and list elements by their id (an
expectation by its number and part). Every path must name a field the document has. A frozen document gets its
marks by amendment (`[add.assumed]`), which changes no value and so is never post-hoc. Every value not marked is
the source's (or, in a document without a source, the author's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AssumedValue:
    path: str
    value: Any
    reason: str


def _key(element: Any) -> str | None:
    if not isinstance(element, dict):
        return None
    if "id" in element:
        return str(element["id"])
    if "n" in element:
        return f"{element['n']}{element.get('part') or ''}"
    return None


def lookup(document: dict[str, Any], path: str) -> Any:
    """The value at a dotted path of the document; KeyError naming the first segment that is not there, and what
    is there instead."""
    node: Any = document
    walked: list[str] = []
    for segment in path.split("."):
        if isinstance(node, dict) and segment in node:
            node = node[segment]
        elif isinstance(node, list) and any(_key(e) == segment for e in node):
            node = next(e for e in node if _key(e) == segment)
        else:
            if isinstance(node, dict):
                there = sorted(node)
            elif isinstance(node, list):
                there = [k for k in map(_key, node) if k is not None]
            else:
                there = []
            where = ".".join(walked) or "the document"
            raise KeyError(f"{where} has no {segment!r}" + (f"; it has {there}" if there else " (it is a value)"))
        walked.append(segment)
    return node


def check_paths(document: dict[str, Any], assumed: dict[str, str]) -> None:
    """Every marked path names a field of the document (ValueError naming the first that does not)."""
    for path, reason in assumed.items():
        if not reason.strip():
            raise ValueError(f"assumed.{path!r}: the reason is empty; say why the value is the encoder's")
        if path.split(".")[0] == "assumed":
            raise ValueError(f"assumed.{path!r}: marks name the document's values, not the marks themselves")
        try:
            lookup(document, path)
        except KeyError as error:
            raise ValueError(
                f"assumed: {path!r} names no field of the document: {error.args[0]}; name an existing field by its "
                f"path (items.ID.oracles.ID.bounds.NAME, cost.ceiling_gpu_h, protocol.log_every, kill.ID.when)"
            ) from None


def assumed_values(document: dict[str, Any]) -> list[AssumedValue]:
    """The document's marked values, in the order they are marked."""
    return [AssumedValue(path, lookup(document, path), reason) for path, reason in document.get("assumed", {}).items()]
