"""Power before compute: what `check`, `freeze` and `run` do with the sensitivity of a ladder's bars.

Before the ladder (`check`, `freeze`): every bar assessed from earlier windows in the ledger; with
`[protocol.noise]` the summaries the A/A calibration will measure are marked as awaiting it (their rows have
`noise_source = "aa"` and no estimate yet).

At `run`, once, before the first rung has any data, `[protocol] on_underpowered` acts on the bars whose MDE exceeds
their distance from no effect: `warn` says so; `refuse` stops (exit 3) naming them; `extend` gives every rung the
read windows the neediest reachable bar needs. The decision is made from the noise alone (no rung of the ladder has
data yet) and recorded as an `extension` entry: the steps, the windows, the bars and why, the cost projected with
it. Once a rung has run the recorded decision stands: a later `prereg run` resumes with the same steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prereg.calibration import CALIBRATION_RUNS, baseline_items, calibration_runs, noise_with_calibration
from prereg.ledger import Ledger
from prereg.schema import Protocol, Registration
from prereg.sensitivity import (
    WINDOWS_CAP,
    Assessment,
    NoiseTable,
    NoNoise,
    Sensitivity,
    assess,
    baseline_rung,
    ledger_noise,
    planned_windows,
    rungs_like_baseline,
)
from prereg.state import RegistrationState, load_state

EXTENSION_KIND = "extension"


def awaiting_calibration(reg: Registration) -> NoiseTable:
    """(rung, metric) -> marked as to be measured by the A/A calibration: every rung that runs the baseline's
    effective config (aa_noise's reach), every metric summarised by a median. Empty without [protocol.noise]."""
    noise = reg.protocol.noise
    if noise is None:
        return {}
    reason = (
        f"to be measured by the A/A calibration at run (the baseline {baseline_rung(reg)} {CALIBRATION_RUNS} times "
        f"for {noise.windows} read windows)"
    )
    metrics = [name for name, m in reg.declaration().metrics.items() if m.summary == "median"]
    awaited = NoNoise(reason, measured_by="aa")
    return {(rung, metric): awaited for rung in rungs_like_baseline(reg) for metric in metrics}


def every_state(ledger: Ledger) -> list[RegistrationState]:
    return [load_state(ledger, reg_id) for reg_id in ledger.reg_ids()]


def states_before(states: Iterable[RegistrationState], reg_id: str, seq: int | None) -> list[RegistrationState]:
    """Every other registration's state; with `seq`, only its runs that started before that entry (the windows
    that existed then)."""
    return [
        s if seq is None else replace(s, runs=[r for r in s.runs if r.start_seq < seq])
        for s in states
        if s.reg_id != reg_id
    ]


def assessment_before_run(reg: Registration, ledger: Ledger | None, unread: str | None = None) -> Assessment:
    """What `check` and `freeze` show: the bars against the ledger's earlier windows (none when `ledger` is None,
    `unread` saying why), the summaries the calibration will measure marked as awaiting it."""
    noise: dict[Any, Any] = dict(ledger_noise(reg, every_state(ledger) if ledger else []))
    if ledger is None:
        noise = {pair: NoNoise(f"no earlier windows were read: {unread}") for pair in noise}
    return assess(reg, {**noise, **awaiting_calibration(reg)})


def power_before_data(ledger: Ledger, state: RegistrationState, states: Sequence[RegistrationState]) -> Assessment:
    """The power a registration's bars had before its data, as `check` would have assessed them at its freeze:
    noise from the windows that existed before its freeze entry (and its own A/A calibration, measured before
    any rung), at the read windows its rungs were planned to run (a recorded extension included). The bars are
    those of the document the verdict decided under: the decision rests on them."""
    reg = state.registration()
    earlier = ledger_noise(reg, states_before(states, state.reg_id, state.versions[0].seq))
    runs = calibration_runs(ledger, state.reg_id, reg, baseline_items(reg, set(state.dropped())))
    extension = recorded_extension(ledger, state.reg_id, reg.protocol)
    planned = with_windows(reg, int(extension["windows"])) if extension else reg
    return assess(planned, noise_with_calibration(reg, runs, earlier))


def with_windows(reg: Registration, windows: int) -> Registration:
    """`reg` with the steps that give `windows` read windows per rung (the document is not changed)."""
    protocol = reg.protocol.model_copy(update={"steps": steps_for_windows(reg.protocol, windows)})
    return reg.model_copy(update={"protocol": protocol})


def steps_for_windows(protocol: Protocol, windows: int) -> int:
    """The steps whose windows after discard_first number `windows` (windows end every log_every steps)."""
    return (protocol.discard_first // protocol.log_every + windows) * protocol.log_every


def unpowered(assessment: Assessment) -> list[Sensitivity]:
    return [row for row in assessment.rows if row.powered is False]


def describe(row: Sensitivity) -> str:
    """One bar's power in a line a person reads: the read, its rule, the bar, the MDE and the windows it needs."""
    needs = (
        f"needs {row.windows_needed} windows per rung"
        if row.windows_needed
        else f"no number of windows up to {WINDOWS_CAP} per rung reaches it"
    )
    return (
        f"{row.read} (rule {row.rule}) bar {row.bar:g}: MDE {row.mde:.3g} at {row.windows_per_rung} read windows "
        f"per rung (noise CV {row.noise_cv:.3g}, {row.noise_source}); {needs}"
    )


@dataclass(frozen=True)
class ExtensionPlan:
    """What `extend` decides: the windows (and steps) every rung runs, and the bars on either side of reach."""

    windows: int
    steps: int
    reached: tuple[Sensitivity, ...]  # unpowered at the plan, powered at `windows`
    unreachable: tuple[Sensitivity, ...]  # unpowered at any number of windows up to WINDOWS_CAP

    def entry(self, protocol: Protocol, *, version: int, projection: dict[str, Any]) -> dict[str, Any]:
        """The `extension` entry's data."""
        return {
            "from_steps": protocol.steps,
            "steps": self.steps,
            "from_windows": planned_windows(protocol),
            "windows": self.windows,
            "log_every": protocol.log_every,
            "discard_first": protocol.discard_first,
            "bars": [{**row.as_json(), "notes": list(row.notes)} for row in self.reached],
            "unreachable": [{**row.as_json(), "notes": list(row.notes)} for row in self.unreachable],
            "projection": projection,
            "version": version,
        }


def plan_extension(protocol: Protocol, rows: Sequence[Sensitivity]) -> ExtensionPlan | None:
    """The windows the neediest reachable unpowered bar needs (None when no unpowered bar can be reached)."""
    reached = tuple(row for row in rows if row.powered is False and row.windows_needed)
    unreachable = tuple(row for row in rows if row.powered is False and not row.windows_needed)
    if not reached:
        return None
    windows = max(row.windows_needed or 0 for row in reached)
    return ExtensionPlan(windows, steps_for_windows(protocol, windows), reached, unreachable)


def recorded_extension(ledger: Ledger, reg_id: str, protocol: Protocol) -> dict[str, Any] | None:
    """The standing extension: the last one recorded for this protocol's steps, window length and warm-up (an
    amendment of those makes it another plan, which an extension of the old one does not stretch)."""
    standing = None
    for entry in ledger.entries(reg_id=reg_id, kinds=(EXTENSION_KIND,)):
        data = entry.data
        if (data["from_steps"], data["log_every"], data["discard_first"]) == (
            protocol.steps,
            protocol.log_every,
            protocol.discard_first,
        ):
            standing = {**data, "seq": entry.seq}
    return standing


def rung_steps(ledger: Ledger, reg_id: str, protocol: Protocol) -> int:
    """The steps every rung of the ladder runs: the protocol's, or its recorded extension's."""
    extension = recorded_extension(ledger, reg_id, protocol)
    return int(extension["steps"]) if extension else protocol.steps


def refusal(rows: Iterable[Sensitivity], protocol: Protocol) -> tuple[str, str]:
    """(message, fix) of `on_underpowered = "refuse"`."""
    rows = list(rows)
    lines = "; ".join(describe(row) for row in rows)
    needed = [row.windows_needed for row in rows if row.windows_needed]
    options = (
        [f"steps = {steps_for_windows(protocol, max(needed))} ({max(needed)} read windows per rung)"] if needed else []
    )
    options += ["a bar the ladder can see", 'on_underpowered = "extend" (more windows, within the ceiling) or "warn"']
    message = (
        f"on_underpowered = refuse: {len(rows)} bar(s) cannot be told from no effect at the planned "
        f"{planned_windows(protocol)} read windows per rung: {lines}"
    )
    return message, "amend the registration before any rung runs: " + ", or ".join(options)
