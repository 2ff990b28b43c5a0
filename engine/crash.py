"""A rung that raises ends with a crash window: its last window, which the kill lines judge like any other.

A crash measured nothing, so the window holds only what is known at the crash: `step`, the last step a recorded
window reached (the steps of the window the crash cut short are unknown), `rc`, non-zero (the exit status of the
process that failed: a command's script, else the rung process's own), and `world_size`. Every metric a window
measures (`loss`, `s_per_step`, `finite` …) is absent, never zero: `not finite(loss)` is undefined on it, so a
line fires on a crash only when it says so (`rc != 0`).

The window is recorded on the run's `run-end` entry (`crash_window`), never as a `window` entry: reads, rates,
sensitivity and the report see a run's measured windows only, and a crash cannot pull a median or a rate.
"""

from __future__ import annotations

from typing import Any

from engine.killwatch import KillWatch
from prereg.canonical import decode_nonfinite
from prereg.ledger import Entry, Ledger
from prereg.state import load_state

# The rung process's own exit status when it fails (engine/rung.py): a crash whose script exited 0 (a window line
# that broke the contract, say) still ends a failed run.
RUNG_FAILED = 1


def crash_window(windows: list[dict[str, Any]], rc: int, exit_status: int | None, world_size: int) -> dict[str, Any]:
    """The crash window of a run whose recorded windows are `windows`: `rc` is the rung process's exit status,
    `exit_status` that of the process its runner started (None when it started none)."""
    assert rc != 0, "a crash window ends a failed run"
    return {
        "step": windows[-1]["step"] if windows else 0,
        "rc": exit_status if exit_status else rc,
        "world_size": world_size,
    }


def end_crashed_run(ledger: Ledger, start: Entry, rc: int, world_size: int, reason: dict[str, Any],
                    totals: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
    """End a run whose process died without ending it (the ladder saw its rung process exit, or Slurm its job end):
    its crash window from the windows it recorded, the run's kill lines judging it as the rung would have, a `kill`
    entry when one holds, and the `run-end` (`killed` then, else `failed`) with `reason` as what ended it. Returns
    the line that fired, or None."""
    reg_id, run_id = str(start.reg_id), str(start.ref)
    measured = [decode_nonfinite(w.data) for w in ledger.entries(reg_id=reg_id, kinds=("window",), ref=run_id)]
    crash = crash_window(measured, rc, None, world_size)
    declared = start.data.get("declared_rung") or start.data["rung"]
    registration = load_state(ledger, reg_id, with_windows=False).registration()
    fired = KillWatch(registration, declared, tuple(start.data.get("items", ()))).check([*measured, crash], final=True)
    if fired:
        ledger.append("kill", reg_id, {"rung": start.data["rung"], "declared_rung": declared, **fired}, ref=run_id)
    ledger.append(
        "run-end",
        reg_id,
        {
            "rung": start.data["rung"],
            "status": "killed" if fired else "failed",
            "ended_by": {"kill": fired["kill"], **reason} if fired else reason,
            "crash_window": crash,
            "totals": {"rc": rc, "steps": crash["step"], **totals},
            **(extra or {}),
        },
        ref=run_id,
    )
    return fired
