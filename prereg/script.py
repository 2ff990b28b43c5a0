"""A small helper for Python scripts that a command-workload registration runs. Optional: the contract itself is
environment variables and one file, and a script in any language can keep it without prereg.

    from prereg import script

    batch = script.config()["batch"]
    fast = script.switch("fast_kernel")
    for step in range(1, script.steps() + 1):
        ...                                           # one training step
        if step % script.log_every() == 0 or step == script.steps():
            script.window(steps=step, s_per_step=seconds, loss=loss)
        if script.should_stop():                      # the engine sent SIGTERM: end cleanly
            break

Importing it turns SIGTERM into a request: `should_stop()` turns true and the script ends its step, writes its
last window if it likes, and exits (the engine sends SIGKILL after its grace period). Under torchrun every rank
sees the same windows file and only rank 0 (RANK = 0) writes it; `window()` does nothing on the other ranks.
Nothing here imports torch, or anything outside the standard library.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

_stop_requested = False


def _on_sigterm(number: int, frame: Any) -> None:
    global _stop_requested
    _stop_requested = True


signal.signal(signal.SIGTERM, _on_sigterm)


def _variable(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: this script runs under `prereg run` (or set {name} to try it by hand)")
    return value


def switches() -> frozenset[str]:
    """The switches on for this rung (none for the baseline)."""
    return frozenset(name for name in _variable("PREREG_SWITCHES").split(",") if name)


def switch(name: str) -> bool:
    """Whether switch `name` is on for this rung."""
    return name in switches()


def config() -> dict[str, Any]:
    """The rung's effective config (protocol.config with the rung's own overrides)."""
    return json.loads(_variable("PREREG_CONFIG"))


def steps() -> int:
    """The steps the rung runs; the last window reports exactly this many."""
    return int(_variable("PREREG_STEPS"))


def log_every() -> int:
    """Steps per window."""
    return int(_variable("PREREG_LOG_EVERY"))


def seed() -> int:
    return int(_variable("PREREG_SEED"))


def rung() -> str:
    """The rung's id (C' for a rung re-run without an item a contingency dropped)."""
    return _variable("PREREG_RUNG")


def run_dir() -> Path:
    """A fresh folder of the rung's own for scratch files."""
    return Path(_variable("PREREG_RUN_DIR"))


def window(steps: int, **metrics: float) -> None:
    """Append one window: `steps` cumulative at its end, then the declared metrics (NaN and infinities are kept
    as json writes them, and make the window not finite). On a rank other than 0 it does nothing."""
    if os.environ.get("RANK", "0") != "0":
        return
    line = json.dumps({"steps": steps, **metrics}) + "\n"
    with open(_variable("PREREG_WINDOWS"), "a", encoding="utf-8") as handle:
        handle.write(line)


def should_stop() -> bool:
    """Whether the engine asked the script to stop (SIGTERM)."""
    return _stop_requested
