"""The contract between the engine and a workload's implementation (one process's view).

A workload's declaration (prereg.workload) names what it can do without importing torch; its runner does it.
The engine constructs one runner per process: a sequential rung, an interleaved ladder, or the oracle gate, from
the profile, the run config, the seed and a `RunContext`. A runner may do its work in this process (molmo2) or
start a process of its own and pass the context on (the command workload); `close()` ends what it started.
A rung whose profile asks for several processes runs under torchrun: every process joins the group first
(`join_ranks`), then builds its runner; the runner's own data plane (DDP, ZeRO, gradient allreduce) uses the
same default process group, and `Ranks` is the engine's control plane over it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from prereg.workload import Profile, RunConfig, WorkloadDeclaration

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
# The runner writes a `memory_snapshot` rung's allocation snapshots where this variable points (the rung sets it).
MEMORY_DIR_VARIABLE = "PREREG_MEMORY_DIR"


def memory_directory(reg_id: str, run_id: str) -> Path:
    """Where a rung process's allocation snapshots go, relative to the repository root (the rung's cwd); an
    interleaved process is named after its first run."""
    return Path("reports", reg_id, "memory", run_id)


def run_directory(reg_id: str, run_id: str) -> Path:
    """A rung's own fresh folder for scratch files, relative to the repository root (the rung's cwd)."""
    return Path("reports", reg_id, "runs", run_id)


@dataclass(frozen=True)
class RunContext:
    """What the engine knows about the process a runner is built in, beyond profile, config and seed."""

    declaration: WorkloadDeclaration  # as the document resolves it (a command document's: from its table)
    registration_dir: Path | None  # the registration file's folder: the document's own paths are relative to it
    # The rung, when the process runs exactly one (a sequential rung); None in the oracle gate and when rungs
    # interleave. Its switches are known before the load, for a runner that starts a process with them.
    rung: str | None = None
    switches: tuple[str, ...] = ()
    steps: int = 0
    log_every: int = 0
    run_dir: Path | None = None  # the rung's own folder (run_directory), for a runner that needs one to create


class RunnerFailure(Exception):
    """What the runner runs failed, and the message says all there is to say (a script's exit status and the end
    of its stderr, a window line that breaks the contract): the rung ends `failed` with it, without a traceback."""


def snapshots_in(directory: Path) -> list[str] | None:
    """The snapshots a rung process left (after its first window, at an out-of-memory), for its run-end."""
    return sorted(str(p) for p in directory.glob("*.pickle")) or None


class Ranks:
    """The processes of one rung as the engine sees them: who writes the ledger, and how they agree.

    One process (the default): rank 0 of 1, every agreement is the identity, no torch.distributed state.
    Several: the default process group that `join_ranks` joined. Rank 0 is the only ledger writer; every
    agreement is a collective, so every rank must make the same calls in the same order.
    """

    def __init__(self, rank: int = 0, world_size: int = 1):
        assert 0 <= rank < world_size, (rank, world_size)
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def current(cls) -> "Ranks":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def _reduce(self, values: list[float], op: str) -> list[float]:
        if self.world_size == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        # float64: host floats (seconds, losses, byte counts as GiB) cross the wire without rounding.
        tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return tensor.tolist()

    def max(self, values: list[float]) -> list[float]:
        """Elementwise maximum over the ranks (every rank gets it)."""
        return self._reduce(values, "max")

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sum over the ranks (every rank gets it)."""
        return self._reduce(values, "sum")

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value on every rank (any picklable object)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value if self.writer else None]
        dist.broadcast_object_list(box, src=0, device=_collective_device())
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def leave(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _collective_device():
    """Where the default group's collectives take their tensors: the rank's GPU under nccl, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join_ranks(device: str) -> Ranks:
    """Join this process's rung group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT): nccl on CUDA (one GPU per rank, chosen by LOCAL_RANK), gloo on the CPU. Without torchrun
    (WORLD_SIZE unset or 1) the process is alone and nothing is initialised."""
    if device not in BACKENDS:
        raise ValueError(f"device {device!r} is not one of {sorted(BACKENDS)}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Ranks()
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(BACKENDS[device], init_method="env://")
    return Ranks.current()


class WorkloadRunner(Protocol):
    devices: int  # devices this process holds (1 for a CPU profile: the process is the device); a rung of
    # several processes holds devices x world_size
    parallel: dict[str, Any] | None  # how the ranks train (world_size, gradient sync, optimizer): on the run-end

    def load(self) -> None:
        """Build the model and everything a step needs; timed apart from the steps and counted in the cost."""

    def probe(self, probe: str, switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
        """Baseline vs the item's switch on the same micro-batch and seed; observed values for the oracle's kind,
        or {"error": why} when the probe cannot run on this profile (a failure, never a skip)."""

    def set_switches(self, switches: tuple[str, ...]) -> None:
        """The switches of the items a rung runs; everything else at the baseline."""

    def train_window(self, steps: int, should_stop: Callable[[], bool]) -> dict[str, Any]:
        """Run up to `steps` training steps (fewer if should_stop() turns true between steps) and return the
        window's metrics: the window fields (prereg.workload.WINDOW_FIELDS) and the workload's own declared metrics
        (a memory peak, a throughput); the engine adds its own (prereg.workload.ENGINE_METRICS). Several ranks:
        call should_stop() exactly once after every step (it is a collective), and return the rung's window —
        the slowest rank's step times, the largest rank's memory — identical on every rank."""

    def evaluate(self) -> dict[str, float]:
        """An evaluation window's metrics: those the workload's declaration marks `eval_only`."""

    def save(self, directory: str) -> None:
        """A checkpoint at a save boundary (called on every rank; rank 0 writes)."""

    def close(self) -> int | None:
        """End what load() started, once, after the last window and before the rung's end is recorded: the exit
        status of a process the runner started (stopped first if it still runs), or None when it started none."""


def make_runner(profile: Profile, config: RunConfig, seed: int, context: RunContext) -> WorkloadRunner:
    """The workload's runner for one process: `config` is the effective config, typed and resolved against
    `profile` (Registration.effective_config, RunConfigDeclaration.load)."""
    module_name, _, attribute = context.declaration.runner.partition(":")
    runner_class = getattr(importlib.import_module(module_name), attribute)
    return runner_class(profile=profile, config=config, seed=seed, context=context)
