"""The A/A calibration of `[protocol.noise] windows = N`: the baseline rung, twice, before any rung of the ladder.

The gate (engine/gate.py) runs it after the oracles: each run a fresh runner (a model load, or a command's script
started anew) with the baseline rung's effective config and planned items, for the steps that leave N read windows
after discard_first. Each finished run is one `calibration` entry (ref: its own id) with the rung it stands for,
its items, effective config (as a run-start records it), profile, window length and warm-up, its windows, and its
device-seconds: `gpu_s` (its load, `load_gpu_s`, and its steps, `steps_gpu_s`) and `start_gpu_s`, the gate
process's own start, which a rung process pays too. The gate entry's `gpu_s` is the whole
gate process, so the ladder's cost counts the calibration, and before any rung has run the ceiling's projection of
a rung is the calibration's (`rung_cost_estimate`); a run stopped before its last window is not an entry (its time
is still in the gate's).

A calibration stands for the document it measured: runs whose baseline config, items, profile, window length,
warm-up or steps differ from the current document's are not read, and the gate runs the calibration again.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prereg.canonical import decode_nonfinite
from prereg.ledger import Ledger
from prereg.plan import plan_ladder
from prereg.schema import Protocol, Registration
from prereg.sensitivity import (
    NoiseTable,
    NoNoise,
    WindowSeries,
    aa_noise,
    baseline_rung,
    noise_from_ledger,
    preferring,
    read_window_values,
)

CALIBRATION_KIND = "calibration"
CALIBRATION_RUNS = 2  # A/A: the baseline against itself


def calibration_steps(protocol: Protocol) -> int:
    """Steps that end exactly `noise.windows` windows after discard_first (windows end every log_every steps)."""
    assert protocol.noise is not None, "only a protocol with [protocol.noise] has a calibration"
    warm_up_windows = protocol.discard_first // protocol.log_every
    return (warm_up_windows + protocol.noise.windows) * protocol.log_every


def baseline_items(reg: Registration, dropped: set[str] | frozenset[str]) -> tuple[str, ...]:
    """The items the baseline rung runs once the gate's drops are applied (none, for the usual baseline)."""
    baseline = baseline_rung(reg)
    return next(p.items for p in plan_ladder(reg, dropped) if p.id == baseline)


@dataclass(frozen=True)
class CalibrationRun:
    ref: str
    seq: int
    run: int  # 1 or 2
    rung: str  # the baseline rung it stands for
    items: tuple[str, ...]
    data: dict[str, Any]  # the entry as recorded
    windows: tuple[dict[str, Any], ...]

    @property
    def steps(self) -> int:
        return int(self.data["steps"])

    @property
    def gpu_s(self) -> float:
        """Its own device-seconds inside the gate process: its model load and its steps."""
        return float(self.data["gpu_s"])

    def rung_estimate(self, steps: int) -> float:
        """A rung process of `steps` steps on the same baseline: a process start (the gate's, measured), this
        run's model load, and its steps' time scaled to `steps`."""
        fixed = float(self.data["start_gpu_s"]) + float(self.data["load_gpu_s"])
        return fixed + float(self.data["steps_gpu_s"]) * steps / self.steps


def calibration_key(reg: Registration, items: Sequence[str]) -> dict[str, Any]:
    """What a calibration run must share with the document for its windows to stand for this ladder's baseline."""
    protocol = reg.protocol
    return {
        "rung": baseline_rung(reg),
        "items": list(items),
        # The effective config as a run-start records it (every key, defaults included): two documents that leave a
        # key unset but resolved it with different defaults ran different baselines.
        "config": reg.effective_config(baseline_rung(reg)).model_dump(mode="json"),
        "profile": reg.profile,
        "log_every": protocol.log_every,
        "discard_first": protocol.discard_first,
        "steps": calibration_steps(protocol),
    }


def calibration_runs(ledger: Ledger, reg_id: str, reg: Registration, items: Sequence[str]) -> list[CalibrationRun]:
    """The recorded calibration runs that measured this document's baseline, in order, at most CALIBRATION_RUNS."""
    if reg.protocol.noise is None:
        return []
    key = calibration_key(reg, items)
    runs: list[CalibrationRun] = []
    for entry in ledger.entries(reg_id=reg_id, kinds=(CALIBRATION_KIND,)):
        data = entry.data
        if {name: data.get(name) for name in key} != key or len(runs) == CALIBRATION_RUNS:
            continue
        windows = tuple(decode_nonfinite(w) for w in data["windows"])
        runs.append(
            CalibrationRun(entry.ref or "", entry.seq, len(runs) + 1, data["rung"], tuple(data["items"]), data, windows)
        )
    return runs


def calibration_series(reg: Registration, runs: Sequence[CalibrationRun]) -> dict[str, list[WindowSeries]]:
    """metric -> each calibration run's read windows of it (after discard_first), as aa_noise takes them."""
    metrics = reg.declaration().metrics
    found: dict[str, list[WindowSeries]] = {}
    for run in runs:
        for name, series in read_window_values(run.windows, metrics, reg.protocol.discard_first).items():
            found.setdefault(name, []).append(WindowSeries(tuple(series), f"{reg.id}/A-A {run.run}", False))
    return found


def noise_with_calibration(reg: Registration, runs: Sequence[CalibrationRun], ledger_part: NoiseTable) -> NoiseTable:
    """The calibration's noise where it has measured both runs, else the ledger's earlier windows; where neither
    gives it, both reasons."""
    if len(runs) < CALIBRATION_RUNS:
        return ledger_part
    calibrated = aa_noise(reg, calibration_series(reg, runs))
    merged = dict(preferring(calibrated, ledger_part))
    for pair, noise in calibrated.items():
        earlier = ledger_part.get(pair)
        if isinstance(noise, NoNoise) and isinstance(earlier, NoNoise):
            merged[pair] = NoNoise(f"the A/A calibration: {noise.reason}; earlier windows: {earlier.reason}")
    return merged


def noise_at_run(ledger: Ledger, reg_id: str, reg: Registration, items: Sequence[str]) -> NoiseTable:
    """What the ladder knows of its noise before its first rung: its own calibration, then earlier windows."""
    return noise_with_calibration(reg, calibration_runs(ledger, reg_id, reg, items), noise_from_ledger(ledger, reg))


def rung_cost_estimate(runs: Sequence[CalibrationRun], steps: int) -> float | None:
    """Device-seconds of one rung of `steps` steps, from the calibration runs (the same baseline, the same
    machine); None without a run."""
    if not runs:
        return None
    return statistics.fmean(run.rung_estimate(steps) for run in runs)
