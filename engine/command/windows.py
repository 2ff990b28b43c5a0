"""The windows file of a command rung: one JSON object per line, appended by the script (PREREG_WINDOWS).

    {"steps": 20, "s_per_step": 0.031, "loss": 2.31}

`steps` is cumulative at the window's end and required; every other key is a declared metric with a number
(NaN and infinities as Python's json writes them are kept, and make the window not finite). A read returns only
complete lines: a line still being written waits for its newline (or for the writer to exit), so a partial
window never reaches the ledger. A line that breaks the contract fails the rung, naming its line and key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.workload import RunnerFailure


class WindowError(RunnerFailure):
    """A windows-file line that breaks the contract."""


@dataclass
class WindowsReader:
    path: Path
    metrics: frozenset[str]  # the keys a window may carry besides steps (command.metrics)
    total_steps: int  # PREREG_STEPS: no window may pass it
    offset: int = 0  # bytes of the file consumed
    lines_read: int = 0
    last_steps: int = 0
    _partial: bytes = field(default=b"", repr=False)
    _deferred: WindowError | None = field(default=None, repr=False)

    def read(self, *, writer_gone: bool = False) -> list[dict[str, Any]]:
        """The windows completed since the last read. With `writer_gone`, a last line without its newline is
        complete too: nothing more will be written to it. A bad line fails the read it is in, or, when good
        windows came before it in the same read, the next one: those windows stand."""
        if self._deferred is not None:
            raise self._deferred
        size = self.path.stat().st_size  # a stat is all a look costs while nothing was written
        if size < self.offset:
            raise WindowError(
                f"{self.path.name}: the file shrank from {self.offset} to {size} bytes: a script appends its "
                f"windows (open it with mode 'a'), never rewrites them"
            )
        data = b""
        if size > self.offset:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read(size - self.offset)
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if writer_gone and self._partial:
            lines.append(self._partial)
            self._partial = b""
        windows: list[dict[str, Any]] = []
        for raw in lines:
            self.lines_read += 1
            if not raw.strip():
                continue
            try:
                windows.append(self.parse(raw, self.lines_read))
            except WindowError as error:
                if not windows:
                    raise
                self._deferred = error
                break
        return windows

    def parse(self, raw: bytes, number: int) -> dict[str, Any]:
        where = f"{self.path.name} line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise WindowError(f"{where}: not UTF-8 text ({error.reason} at byte {error.start})") from None
        try:
            window = json.loads(text)
        except json.JSONDecodeError as error:
            raise WindowError(f"{where}: not JSON ({error.msg} at column {error.colno}): {text[:120]!r}") from None
        if not isinstance(window, dict):
            raise WindowError(f'{where}: a JSON {type(window).__name__}, not an object like {{"steps": 20, …}}')
        if "steps" not in window:
            raise WindowError(f"{where}: no 'steps' key (the cumulative step count at the window's end, required)")
        steps = window["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise WindowError(f"{where}: key 'steps' = {steps!r} is not a whole number of steps")
        if not self.last_steps < steps <= self.total_steps:
            raise WindowError(
                f"{where}: key 'steps' = {steps} must grow past the previous window's {self.last_steps} and stay "
                f"within PREREG_STEPS = {self.total_steps}"
            )
        for key, value in window.items():
            if key == "steps":
                continue
            if key not in self.metrics:
                raise WindowError(f"{where}: undeclared key {key!r}; command.metrics declares {sorted(self.metrics)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise WindowError(f"{where}: key {key!r} = {value!r} is not a number")
        self.last_steps = steps
        return window


def finite(window: dict[str, Any]) -> bool:
    return all(math.isfinite(value) for key, value in window.items() if key != "steps")
