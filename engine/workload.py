"""The contract between the engine and a workload's implementation (one process's view).

A workload's declaration (prereg.workload) names what it can do without importing torch; its runner does it.
The engine constructs one runner per process: a sequential rung, an interleaved ladder, or the oracle gate.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

from prereg.workload import Profile, WorkloadDeclaration


class WorkloadRunner(Protocol):
    devices: int  # devices this process holds (1 for a CPU profile: the process is the device)

    def load(self) -> None:
        """Build the model and everything a step needs; timed apart from the steps and counted in the cost."""

    def probe(self, probe: str, switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
        """Baseline vs the item's switch on the same micro-batch and seed; observed values for the oracle's kind,
        or {"error": why} when the probe cannot run on this profile (a failure, never a skip)."""

    def set_switches(self, switches: tuple[str, ...]) -> None:
        """The switches of the items a rung runs; everything else at HEAD."""

    def train_window(self, steps: int, should_stop: Callable[[], bool]) -> dict[str, Any]:
        """Run up to `steps` training steps (fewer if should_stop() turns true between steps) and return the
        window's metrics: steps, s_per_step, tokens_per_s, loss, finite, and the memory fields."""

    def evaluate(self) -> dict[str, float]:
        """Evaluation-window metrics (probe_chunk_mae, probe_first_mae)."""

    def save(self, directory: str) -> None:
        """A checkpoint at a save boundary."""


def make_runner(declaration: WorkloadDeclaration, profile: Profile, config: dict[str, Any], seed: int) -> WorkloadRunner:
    module_name, _, attribute = declaration.runner.partition(":")
    runner_class = getattr(importlib.import_module(module_name), attribute)
    return runner_class(profile=profile, config=config, seed=seed)
