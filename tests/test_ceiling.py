"""The cost ceiling before each rung (engine/ladder.py `Ladder.ceiling_allows`, docs/design.md "Cost"): the engine
projects the ladder's total from what it spent and the mean of its finished rungs, and `on_ceiling` decides. The
ledger holds the spending (a finished rung of 60 device-seconds against a 100-second ceiling, written as the
engine writes it), so every mode is judged deterministically, without timing a real rung."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MINI, write

from engine.ladder import Ladder
from prereg import actions
from prereg.ledger import Ledger
from prereg.state import load_state

CEILING_S = 100.0


def ladder_after(tmp_path: Path, on_ceiling: str, spent: list[float]) -> tuple[Ladder, Ledger]:
    text = MINI.replace("ceiling_gpu_h = 0.5", f"ceiling_gpu_h = {CEILING_S / 3600!r}").replace(
        'on_ceiling = "stop"', f'on_ceiling = "{on_ceiling}"'
    )
    ledger = Ledger.open(str(tmp_path / "ledger.db"), create=True)
    actions.freeze(ledger, write(tmp_path, "mini.toml", text))
    for n, seconds in enumerate(spent):
        run = f"run{n}"
        ledger.append("run-start", "mini", {"rung": "A", "items": [], "version": 0}, ref=run)
        ledger.append(
            "run-end",
            "mini",
            {"rung": "A", "status": "finished", "totals": {"gpu_s": seconds, "load_gpu_s": 5.0}},
            ref=run,
        )
    return Ladder(ledger, "mini", budget_s=None, console=None), ledger


def decide(ladder: Ladder, ledger: Ledger, remaining: int):
    state = load_state(ledger, "mini", with_windows=False)
    allowed, deadline = ladder.ceiling_allows(state.registration(), state, remaining)
    events = load_state(ledger, "mini", with_windows=False).ceilings
    return allowed, deadline, events


@pytest.mark.parametrize(("mode", "allowed", "action"), [
    ("stop", False, "stopped before the next rung"),
    ("finish-rung", True, "finishing one more rung"),
    ("continue", True, "continuing; the overrun is recorded"),
])  # fmt: skip
def test_a_projection_over_the_ceiling_is_recorded_and_the_mode_decides(tmp_path, mode, allowed, action):
    ladder, ledger = ladder_after(tmp_path, mode, [60.0])  # spent 60 < 100; two more rungs project 60 + 2 x 60 = 180
    result = decide(ladder, ledger, remaining=2)
    ledger.close()
    assert result[0] is allowed
    [event] = result[2]
    assert event["action"] == action and event["spent_gpu_s"] == 60.0 and event["projected_gpu_s"] == 180.0
    assert event["ceiling_gpu_s"] == CEILING_S and event["remaining_rungs"] == 2


def test_under_the_projection_nothing_is_recorded_and_stop_gives_the_rung_what_is_left(tmp_path):
    ladder, ledger = ladder_after(tmp_path, "stop", [30.0])  # 30 + 30 = 60 <= 100
    allowed, deadline, events = decide(ladder, ledger, remaining=1)
    ledger.close()
    assert allowed and events == []
    assert deadline == pytest.approx(70.0)  # the rung ends over-ceiling if it runs past the 70 s left


@pytest.mark.parametrize("mode", ["finish-rung", "stop"])
def test_once_the_ceiling_is_spent_finish_rung_starts_nothing_more(tmp_path, mode):
    ladder, ledger = ladder_after(tmp_path, mode, [60.0, 45.0])  # spent 105 >= 100
    allowed, _, events = decide(ladder, ledger, remaining=1)
    ledger.close()
    assert not allowed and events[-1]["action"] == "stopped before the next rung"


def test_continue_never_stops_but_records_every_overrun(tmp_path):
    ladder, ledger = ladder_after(tmp_path, "continue", [60.0, 45.0])
    allowed, deadline, events = decide(ladder, ledger, remaining=1)
    ledger.close()
    assert allowed and deadline is None and events[-1]["spent_gpu_s"] == 105.0
