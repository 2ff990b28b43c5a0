"""What a workload declares, without importing torch: the names a registration may use.

Validation resolves every switch, probe, metric, profile and config key of a registration against this
declaration, so a document that names something the workload cannot do is refused before it is frozen.
The implementation behind a declaration (engine/…) is imported only to run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

SummaryKind = Literal["median", "max", "last", "sum"]


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    summary: SummaryKind  # how a rung's windows reduce to one value: median for times and rates, max for peaks
    description: str
    eval_only: bool = False  # present only on evaluation windows (probe metrics)
    relative_ok: bool = True  # whether a bootstrap interval makes sense for reads over it
    # Whether the value depends on which samples shared each step (a loss, an evaluation of the trained weights):
    # two rungs compare on it only if they trained on the same steps (prereg/pairing.py). Speed and memory do not.
    paired: bool = False
    # How a person sees it. The CLI and the report show every rung's WINDOW_FIELDS; a metric marked `display` is
    # shown beside them, as a column headed `label` (units included: people read the table, not the catalogue),
    # its values written with `format` (a format spec: ",.0f" for a count in the hundred thousands, not 1.435e+05).
    display: bool = False
    label: str = ""
    format: str = ".4g"
    # The report's per-window plot it is drawn on (a lowercase name, also its file's); the metrics that name the
    # same plot share it, and its unit.
    plot: str = ""

    def __post_init__(self) -> None:
        if self.plot and not re.fullmatch(r"[a-z][a-z0-9_-]*", self.plot):
            raise ValueError(f"metric {self.name}: plot = {self.plot!r} must be a lowercase name such as 'memory'")
        if self.display and not self.label:
            raise ValueError(f"metric {self.name}: display = True needs a label (the column heading it is shown under)")
        try:
            format(1.5, self.format)
        except ValueError:
            raise ValueError(
                f"metric {self.name}: format = {self.format!r} is not a format spec for numbers (e.g. '.4g', ',.0f')"
            ) from None

    @property
    def heading(self) -> str:
        """What a column or a legend calls it."""
        return self.label or self.name

    def written(self, value: Any) -> str:
        """A value of it as a person reads it: `format` for numbers, yes/no for booleans, "—" when absent."""
        if value is None:
            return "—"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, (int, float)):
            return format(value, self.format)
        return str(value)


# The engine's own metrics: what every rung process reports whatever its workload (engine/rung.py writes them on
# the run-end and on every window). Merged into every workload's catalogue, so reads, pass rules and kill lines
# name them for any workload; a workload does not declare them again.
ENGINE_METRICS: dict[str, Metric] = {
    m.name: m
    for m in [
        Metric("rc", "code", "last", "the rung process's exit status", relative_ok=False),
        Metric("steps", "steps", "last", "steps completed", relative_ok=False),
        Metric("load_s", "s", "last", "model load time of the rung process"),
        Metric("gpu_s", "GPU-s", "last", "device-seconds held by the rung: wall time from start to end x devices"),
        Metric("world_size", "ranks", "last", "processes in the rung", relative_ok=False),
        Metric("finite", "bool", "last", "every loss and gradient in the window was finite", relative_ok=False),
    ]
}

# The fields every window carries, for every workload (engine/workload.py, WorkloadRunner.train_window): the CLI
# and the report show these for every rung, then what the workload's declaration marks `display`.
WINDOW_FIELDS = ("steps", "s_per_step", "loss", "finite")


@dataclass(frozen=True)
class Probe:
    name: str
    description: str
    oracle_kinds: frozenset[str]  # the oracle kinds that can judge what this probe measures
    observes: frozenset[str] = frozenset()  # for tolerance oracles: the bound names it reports


@dataclass(frozen=True)
class Profile:
    name: str
    device: Literal["cpu", "cuda"]
    gpus: int  # 0 for CPU profiles
    geometry: str
    description: str
    processes: int = 0  # processes of a rung; 0: one per GPU, one on the CPU. More than one: under torchrun

    def __post_init__(self) -> None:
        if self.processes < 0:
            raise ValueError(f"profile {self.name}: processes = {self.processes} must be >= 0 (0: one per GPU)")
        if self.device == "cuda" and self.processes not in (0, self.gpus):
            # One process per GPU: each rank owns one device (nccl), so the two counts cannot differ.
            raise ValueError(
                f"profile {self.name}: processes = {self.processes} on {self.gpus} GPUs; allowed: 0 or {self.gpus}"
            )

    @property
    def world_size(self) -> int:
        """The rung's processes (ranks); the oracle gate is always one process."""
        return self.processes or max(self.gpus, 1)


@dataclass(frozen=True)
class ConfigKey:
    name: str
    type: type | tuple[type, ...]
    description: str
    regroups_samples: bool = False  # a value that puts other samples together in a step (bucketing): unpaired rungs
    allowed: tuple[Any, ...] = ()  # the values it takes, where they are a closed set; () for any value of its type


@dataclass(frozen=True)
class WorkloadDeclaration:
    name: str
    switches: dict[str, str]  # name -> what it changes
    probes: dict[str, Probe]
    metrics: dict[str, Metric]
    profiles: dict[str, Profile]
    config_keys: dict[str, ConfigKey]
    runner: str  # "module:callable" of the implementation, imported only to run
    notes: dict[str, str] = field(default_factory=dict)
    # Functions of the workload's own code whose allocations are activations although no module's `forward` is
    # on their stack (a functional forward, the loss, the step that casts the logits): the memory forensics
    # (engine/memory/forensics.py) reads the workload's snapshots with these beside its generic frame rules.
    activation_frames: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        redeclared = sorted(set(self.metrics) & set(ENGINE_METRICS))
        if redeclared:
            raise ValueError(
                f"workload {self.name}: metrics {redeclared} are the engine's own, declared for every workload "
                f"(prereg.workload.ENGINE_METRICS); remove them from the workload's metrics"
            )
        # The catalogue that validation and verdicts read: the workload's metrics, then the engine's.
        object.__setattr__(self, "metrics", {**self.metrics, **ENGINE_METRICS})
        units: dict[str, str] = {}
        for metric in self.metrics.values():
            if metric.plot and units.setdefault(metric.plot, metric.unit) != metric.unit:
                raise ValueError(
                    f"workload {self.name}: metric {metric.name} ({metric.unit}) is drawn on plot {metric.plot!r}, "
                    f"whose metrics are in {units[metric.plot]}; one plot has one unit: name another plot"
                )
