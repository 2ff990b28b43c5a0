"""What a workload declares, without importing torch: the names a registration may use.

Validation resolves every switch, probe, metric, profile and config key of a registration against this
declaration, so a document that names something the workload cannot do is refused before it is frozen.
The implementation behind a declaration (engine/…) is imported only to run.
"""

from __future__ import annotations

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
    # Processes of a rung; 0: one per GPU, one on the CPU. More than one: the engine starts them under torchrun.
    # 1 on several GPUs: one engine process holds them all and its runner starts the ranks (the command workload).
    processes: int = 0

    def __post_init__(self) -> None:
        if self.processes < 0:
            raise ValueError(f"profile {self.name}: processes = {self.processes} must be >= 0 (0: one per GPU)")
        if self.device == "cuda" and self.processes not in (0, 1, self.gpus):
            # One engine process per GPU: each rank owns one device (nccl), so the two counts cannot differ.
            raise ValueError(
                f"profile {self.name}: processes = {self.processes} on {self.gpus} GPUs; allowed: 0, 1 or {self.gpus}"
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
    # Files the document's behaviour rests on beyond the workload's own code, relative to the registration file's
    # folder: hashed at freeze, and a run refused when one changed (a command workload's scripts).
    sources: tuple[str, ...] = ()
    # Whether its runner does a rung's work in a process of its own (a command's script) rather than in the rung
    # process: such a rung runs from start to finish (no interleaved schedule), and the engine's own torch and
    # devices describe nothing that process ran.
    own_process: bool = False
