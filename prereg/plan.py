"""Re-planning a ladder around dropped items (docs/design.md "Parity first").

An item whose oracle failed, or that a kill line's contingency dropped, leaves every rung. A rung left with an
item set equal to an earlier rung's, or whose items were all dropped, is not run. A rung that lost items to a
kill contingency after it ran is re-run as its primed rung (C -> C'), whose measurements stand for C in reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from prereg.schema import Registration


@dataclass(frozen=True)
class PlannedRung:
    id: str
    items: tuple[str, ...]  # what will run: declared items minus dropped ones
    declared: tuple[str, ...]
    skip: str | None  # why the rung does not run; None when it runs

    @property
    def runs(self) -> bool:
        return self.skip is None


def primed(rung_id: str) -> str:
    return rung_id + "'"


def plan_ladder(reg: Registration, dropped: set[str] | frozenset[str]) -> list[PlannedRung]:
    planned: list[PlannedRung] = []
    seen: dict[tuple[str, ...], str] = {}
    for rung in reg.protocol.rungs:
        declared = tuple(rung.items)
        surviving = tuple(i for i in declared if i not in dropped)
        lost = [i for i in declared if i in dropped]
        # Rungs are equal when they run the same items on the same effective config, however each spelled it.
        key = surviving + (repr(reg.effective_config(rung.id)),)
        skip = None
        if declared and not surviving:
            skip = f"every item it tests was dropped ({', '.join(lost)})"
        elif key in seen and lost:
            skip = f"equal to rung {seen[key]} after dropping {', '.join(lost)}"
        planned.append(PlannedRung(rung.id, surviving, declared, skip))
        if skip is None:
            seen.setdefault(key, rung.id)
    return planned
