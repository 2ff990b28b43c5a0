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
