"""The `memory_snapshot` instrument: the CUDA allocator's history recorded from process start, dumped as a
torch snapshot pickle at an OOM and, when asked, right after the first optimizer step.

Seed 003's rung-7 instrument (BIJOU_MEM_SNAPSHOT), as a rung config key: the ladder's arithmetic missed
>= 10 GiB for three rungs, the snapshot found it (engine/memory/forensics.py reads the pickle). Started
before the model is built, every allocation keeps its stack: parameters from `to_empty`, optimizer state from
AdamW's `_init_group`, DDP's buckets from the Reducer's constructor, autocast's casts from `cached_cast`.

A dump also records which live storages are the model's parameters (and buffers), their gradients and the
optimizer state (`ROLES_KEY`), because a stack cannot say it: autograd's AccumulateGrad usually *steals* the
backward op's output as the gradient, so the gradient's allocation stack names the op.

One file per rank (`rank{RANK}-{label}.pickle`, RANK from torchrun's environment, 0 without it) in the
directory the rung gives. The instrument needs CUDA and refuses anything else: a requested snapshot that
silently records nothing is exactly the evidence gap it exists to close.
"""

from __future__ import annotations

import os
import pickle
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from engine.memory.forensics import ROLES_KEY

CONFIG_KEY = "memory_snapshot"

# The history is a ring buffer of this many alloc/free/segment events. Blocks live at dump time keep their own
# stacks whatever the ring dropped; the ring only has to hold the steps around the peak. Measured on an H200
# (tiny geometry, 6 layers, 2 chunks): ~6,000 events a step, ~200 bytes an event in the pickle, 0.08 s to dump
# 12,600 events. The 4B geometry (61 layers, 6 chunks) extrapolates to ~2e5 events a step: a million keeps the
# last ~5 steps, a ~200 MB pickle per rank.
DEFAULT_MAX_ENTRIES = 1_000_000

Holders = Callable[[], "tuple[torch.nn.Module | None, torch.optim.Optimizer | None]"]


def rank_from_env() -> int:
    value = os.environ.get("RANK", "0")
    if not value.isdigit():
        raise ValueError(f"RANK = {value!r} must be a non-negative integer (torchrun sets it; unset means 0)")
    return int(value)


def _storage_addresses(tensors: Iterable[torch.Tensor], device: torch.device) -> list[int]:
    addresses = []
    for t in tensors:
        if t.device == device and t.untyped_storage().nbytes():
            addresses.append(t.untyped_storage().data_ptr())  # a block's address is its storage's base
    return sorted(set(addresses))


def tensor_roles(
    device: torch.device, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """{"device": index, "parameters": [...], "gradients": [...], "optimizer_state": [...]}: storage addresses.
    A storage named by two roles keeps the first (a parameter stays a parameter)."""
    parameters = [] if model is None else [*model.parameters(), *model.buffers()]
    gradients = [p.grad for p in parameters if getattr(p, "grad", None) is not None]
    state: list[torch.Tensor] = []
    for opt in (optimizer, getattr(optimizer, "optim", None)):  # ZeroRedundancyOptimizer keeps its shard in .optim
        if opt is not None:
            state += [v for per_param in opt.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    roles: dict[str, Any] = {"device": device.index}
    taken: set[int] = set()
    for role, tensors in (("parameters", parameters), ("gradients", gradients), ("optimizer_state", state)):
        roles[role] = [a for a in _storage_addresses(tensors, device) if a not in taken]
        taken.update(roles[role])
    return roles


class MemoryInstrument:
    """Start it before the model exists; dump_on_oom around the training; dump_once after the first step."""

    def __init__(self, device: torch.device, directory: str | Path, max_entries: int = DEFAULT_MAX_ENTRIES):
        if device.type != "cuda":
            raise ValueError(
                f"{CONFIG_KEY} = true needs a CUDA device (it records torch.cuda.memory history); "
                f"this run's device is {device.type!r}, allowed: 'cuda'"
            )
        if not torch.cuda.is_available():
            raise ValueError(f"{CONFIG_KEY} = true needs CUDA, and torch.cuda.is_available() is False here")
        if max_entries < 1:
            raise ValueError(f"max_entries = {max_entries} must be >= 1")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.directory = Path(directory)
        self.max_entries = max_entries
        self.rank = rank_from_env()
        self.recording = False
        self.dumped: set[str] = set()

    @classmethod
    def from_config(cls, requested: bool, device: torch.device, directory: str | Path) -> "MemoryInstrument | None":
        """The instrument a rung's run config asks for with `memory_snapshot` (None when it is false)."""
        return cls(device, directory) if requested else None

    def start(self) -> "MemoryInstrument":
        # context="all" keeps the stack of every alloc AND free; stacks="all" adds the C++ frames, without which
        # autocast casts, reducer buckets and everything on the autograd thread have no telling frame.
        # The history is process-wide (every device this process touches); the forensics picks the device.
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks="all", max_entries=self.max_entries
        )
        self.recording = True
        return self

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False

    def path(self, label: str) -> Path:
        return self.directory / f"rank{self.rank}-{label}.pickle"

    def dump(
        self, path: str | Path, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> Path:
        """torch.cuda.memory._snapshot() plus the tensor roles, pickled at `path`."""
        if not self.recording:
            raise ValueError("dump() before start(): the snapshot would carry no allocation history")
        snapshot = torch.cuda.memory._snapshot()
        snapshot[ROLES_KEY] = tensor_roles(self.device, model, optimizer)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(snapshot, f, protocol=pickle.HIGHEST_PROTOCOL)
        return path

    def dump_once(
        self, label: str, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> Path | None:
        """Dump `rank{R}-{label}.pickle` the first time only (e.g. "first-step", right after the first
        optimizer.step(): gradients and optimizer state exist, and the history holds the step's peak)."""
        if label in self.dumped:
            return None
        self.dumped.add(label)
        return self.dump(self.path(label), model, optimizer)

    @contextmanager
    def dump_on_oom(self, holders: Holders = lambda: (None, None)) -> Iterator[None]:
        """Around the training: an OutOfMemoryError dumps `rank{R}-oom.pickle` and propagates unchanged.
        `holders` returns (model, optimizer) at that moment, for the tensor roles."""
        try:
            yield
        except torch.OutOfMemoryError:
            model, optimizer = holders()
            path = self.dump(self.path("oom"), model, optimizer)
            print(f"{CONFIG_KEY}: out of memory; snapshot written to {path}", file=sys.stderr, flush=True)
            raise
