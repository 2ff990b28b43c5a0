"""Kill lines as the engine checks them on every window (engine/killwatch.py, docs/design.md "Kill lines"): a line
with at = "save" that holds waits for the next save boundary, even if it stops holding; a window line kills at
once; a line scoped to rungs or suspecting items watches only those."""

from __future__ import annotations

import tomllib

import pytest
from conftest import MINI

from engine.killwatch import KillWatch
from prereg.schema import Registration

KILLS = """
[[kill]]
id = "K-save"
when = "loss > 5"
at = "save"

[[kill]]
id = "K-window"
when = "loss > 50"

[[kill]]
id = "K-cudnn"
when = "not finite(loss)"
rungs = ["B", "C"]
drops = ["P1"]
"""


@pytest.fixture(scope="module")
def reg() -> Registration:
    text = MINI.replace("discard_first = 10\n", "discard_first = 10\nsave_every = 20\n") + KILLS
    return Registration.model_validate(tomllib.loads(text))


def windows(*losses: float, every: int = 10) -> list[dict]:
    return [{"step": every * (n + 1), "loss": loss} for n, loss in enumerate(losses)]


def test_a_save_line_that_held_kills_at_the_next_boundary_even_if_it_stopped_holding(reg):
    watch = KillWatch(reg, "A")
    assert watch.check(windows(6.0)) is None  # holds at step 10; 10 is no save boundary (save_every 20)
    kill = watch.check(windows(6.0, 1.0))  # no longer holds at 20, but it held: the boundary kills
    assert kill is not None and kill["kill"] == "K-save" and kill["step"] == 20 and kill["held_since"] == 10
    assert "held at step 10; killed at the save boundary 20" in kill["reason"]


def test_a_save_line_that_never_held_never_kills(reg):
    watch = KillWatch(reg, "A")
    assert [watch.check(windows(*[1.0] * n)) for n in range(1, 5)] == [None] * 4


def test_a_window_line_kills_at_once(reg):
    kill = KillWatch(reg, "A").check(windows(60.0))
    assert kill is not None and kill["kill"] == "K-window" and kill["step"] == 10 and kill["drops"] == []


@pytest.mark.parametrize(
    ("rung", "items", "watched"),
    [("A", (), False), ("B", ("P1",), True), ("C", ("P1", "P2"), True), ("C", ("P2",), False)],
)
def test_a_line_watches_only_its_rungs_and_runs_that_carry_what_it_suspects(reg, rung, items, watched):
    """K-cudnn is about P1 on rungs B and C: a C re-run without P1 (primed after a drop) is not its business."""
    kill = KillWatch(reg, rung, items).check(windows(float("nan")))
    assert (kill is not None and kill["kill"] == "K-cudnn" and kill["drops"] == ["P1"]) is watched
