"""Several ranks, one training step: seed 003's memory plumbing as config a rung can set.

The ranks are the processes torchrun started and engine.workload.join_ranks joined (the default process group:
nccl on CUDA, gloo on the CPU). Each rank trains on its own slice of the data (global batch = world x per-rank
batch). The normalisation that makes the ranks' gradient the global batch's:

    every rank divides its chunks' loss SUMS by the GLOBAL count of loss-bearing tokens (the ranks' host-side
    counts, all-reduced once at load for the prepared step pool: `with_global_loss_tokens`), and the ranks'
    gradients are SUMMED (never averaged) — so sum over ranks and chunks of d(loss_sum)/d(theta) / N_global is
    exactly the single-process global-batch mean-loss gradient, up to fp reduction order.

Gradient sync modes (`grad_sync_mode`, from the config keys `ddp`, `chunk_grad_allreduce`, `ddp_wrapper`):
- `ddp`: DistributedDataParallel; the chunks before the last under no_sync, the last chunk's backward runs the
  reducer (its comm hook SUMS, see `sum_allreduce_hook`).
- `ddp+allreduce` (chunk_grad_allreduce, ddp_wrapper = true; seed 003 rung 6): the DDP wrapper stays, every
  chunk's backward is under no_sync, and one in-place allreduce of the accumulated fp32 gradients per step.
- `allreduce` (chunk_grad_allreduce, ddp_wrapper = false; rung 8): no wrapper at all. Rank 0's parameters and
  buffers are broadcast at start (`broadcast_module_states`, DDP's constructor broadcast), plain autograd
  accumulates the chunks, the same in-place allreduce is the whole per-step sync.
`zero1`: ZeroRedundancyOptimizer over AdamW with the run's two parameter groups (each rank keeps the Adam
state of its shard; updated shards are broadcast every step). Its checkpoints are consolidated on rank 0 and
resume sharded (`resume_sharded`) or into plain AdamW (`resume_unsharded`).

In one process (the oracle gate, a one-process profile) there is nothing to synchronise: these keys leave the
step exactly the baseline's, plain AdamW included (ZeRO-1's update is AdamW's bit for bit —
tests/test_molmo2_distributed.py checks it over two ranks — and it needs a process group). The run-end records
which mode and optimizer ran.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engine.molmo2.model.ar import ar_forward, set_ar_trainable
from engine.molmo2.model.batch import ARBatch
from engine.molmo2.model.model import Molmo2Model
from engine.molmo2.run_config import Molmo2RunConfig
from engine.molmo2.train.step import ADAM_BETAS, GradientSync, OptimizerFactory, Step, TrainConfig, Trainer, adamw
from engine.workload import Ranks

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

GRAD_SYNC_MODES = {
    "none": "one process: nothing to synchronise",
    "ddp": "DistributedDataParallel; chunks before the last under no_sync",
    "ddp+allreduce": "DDP wrapper, every chunk under no_sync, one in-place gradient allreduce per step",
    "allreduce": "no DDP wrapper: rank 0's module states broadcast at start, one in-place gradient allreduce per step",
}
OPTIMIZER_STATE = "optimizer.pt"  # beside the weights in a checkpoint directory


def grad_sync_mode(config: Molmo2RunConfig, world_size: int) -> str:
    """The gradient sync a rung's config asks for, on `world_size` ranks (a key of GRAD_SYNC_MODES). The run
    config's rules made the keys agree with its profile's processes; one process (the oracle gate of any profile)
    has nothing to synchronise."""
    if world_size == 1:
        return "none"
    if config.chunk_grad_allreduce:
        return "ddp+allreduce" if config.ddp_wrapper else "allreduce"
    assert config.ddp, "the run config asks several processes for a gradient sync"
    return "ddp"


class ARForward(nn.Module):
    """The AR training forward as a module's forward(): DDP prepares its reducer in forward(), and the AR step
    runs through Molmo2Model's prefill/extend methods, which DDP cannot see."""

    def __init__(self, model: Molmo2Model):
        super().__init__()
        self.model = model

    def forward(self, chunk: ARBatch) -> torch.Tensor:
        return ar_forward(self.model, chunk)


@torch.no_grad()
def broadcast_module_states(module: nn.Module, src: int = 0) -> None:
    """Rank `src`'s parameters and buffers on every rank, in place: what DDP's constructor does (every parameter,
    frozen ones included, then every buffer), for the path that has no DDP wrapper."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.detach(), src=src)


def allreduce_gradients_(params: list[nn.Parameter]) -> None:
    """SUM every gradient over the ranks, in place: one collective per gradient tensor, all in flight at once,
    and no flat copy — the point of seed 003's rung 6/8 was never to hold a second copy of the fp32 gradients."""
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        # Ranks that disagree on which gradients exist would pair up different tensors in the collectives.
        raise RuntimeError(f"trainable parameters {missing[:8]} have no gradient after the step's backward")
    works = [dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True) for p in params]
    for work in works:
        work.wait()


def sum_allreduce_hook(
    state, bucket
):  # no annotations: DDP compares them to dist.GradBucket, and they are strings here
    """DDP's reducer with SUM instead of its default average (our losses are already over the global count)."""
    future = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


class DataParallelSync(GradientSync):
    """The Trainer's gradient seam for several ranks, in one of GRAD_SYNC_MODES (not "none")."""

    def __init__(self, model: Molmo2Model, mode: str, device: torch.device, ranks: Ranks):
        if mode not in GRAD_SYNC_MODES or mode == "none":
            raise ValueError(f"gradient sync {mode!r} is not one of {sorted(set(GRAD_SYNC_MODES) - {'none'})}")
        assert ranks.world_size > 1 and dist.is_initialized(), "join_ranks() first"
        self.mode = mode
        self.ranks = ranks
        self.world_size = ranks.world_size
        self.model = model
        self.ddp: DistributedDataParallel | None = None
        # DDP fixes the parameters it reduces at construction: the AR freezing split first (the Trainer's
        # make_optimizer applies it again, idempotently).
        set_ar_trainable(model)
        if mode == "allreduce":
            broadcast_module_states(model)
        else:
            # The constructor broadcasts rank 0's parameters and buffers (DDP's defaults otherwise; the seed's run
            # kept gradient_as_bucket_view=True).
            device_ids = [torch.cuda.current_device()] if device.type == "cuda" else None  # join_ranks set it per rank
            self.ddp = DistributedDataParallel(ARForward(model), device_ids=device_ids, gradient_as_bucket_view=True)
            if mode == "ddp":
                self.ddp.register_comm_hook(None, sum_allreduce_hook)

    def forward(self, model: Molmo2Model, chunk: ARBatch) -> torch.Tensor:
        assert model is self.model, "the Trainer's model is the one this sync was built around"
        return ar_forward(model, chunk) if self.ddp is None else self.ddp(chunk)

    def chunk_context(self, last: bool) -> ContextManager:
        if self.ddp is None or (self.mode == "ddp" and last):
            return nullcontext()
        return self.ddp.no_sync()

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        if self.mode != "ddp":
            allreduce_gradients_(params)

    def reduce_window(self, seconds: list[float], losses: list[float], tokens: list[int], memory: dict[str, float]):
        keys = sorted(memory)
        n = len(seconds)
        peaks = self.ranks.max([*seconds, *(memory[k] for k in keys)])
        sums = self.ranks.sum([*losses, *map(float, tokens)])
        return peaks[:n], sums[:n], sums[n:], dict(zip(keys, peaks[n:]))


def make_gradient_sync(model: Molmo2Model, config: Molmo2RunConfig, device: torch.device, ranks: Ranks) -> GradientSync:
    mode = grad_sync_mode(config, ranks.world_size)
    return GradientSync() if mode == "none" else DataParallelSync(model, mode, device, ranks)


def zero_adamw(groups: list[dict[str, Any]], config: TrainConfig, fused: bool) -> ZeroRedundancyOptimizer:
    """ZeRO-1: AdamW with exactly `adamw`'s settings and groups, each rank holding its shard's state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        groups, optimizer_class=torch.optim.AdamW, betas=ADAM_BETAS, weight_decay=config.weight_decay, fused=fused
    )


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is ZeRO-1's. torch.distributed.optim is imported by zero_adamw only (FSDP and DTensor
    come with it, about a second of every process's start), so without it loaded no optimizer can be one."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def optimizer_factory(config: Molmo2RunConfig, world_size: int) -> OptimizerFactory:
    return zero_adamw if config.zero1 and world_size > 1 else adamw


def with_global_loss_tokens(steps: list[Step], ranks: Ranks) -> list[Step]:
    """The prepared steps with `loss_tokens` summed over the ranks' slices (one collective for the whole pool,
    at load; each rank's count is a host-side count from collate time)."""
    if ranks.world_size == 1:
        return steps
    totals = ranks.sum([float(s.loss_tokens) for s in steps])  # exact: counts are far below 2**53
    return [dataclasses.replace(s, loss_tokens=int(total)) for s, total in zip(steps, totals)]


def describe(config: Molmo2RunConfig, world_size: int) -> dict[str, Any]:
    """How the ranks train, for the run's record."""
    optimizer = "zero1-adamw" if optimizer_factory(config, world_size) is zero_adamw else "adamw"
    return {"world_size": world_size, "grad_sync": grad_sync_mode(config, world_size), "optimizer": optimizer}


# ---- optimizer checkpoints ----


def consolidated_optimizer_state(optimizer: torch.optim.Optimizer, ranks: Ranks) -> dict[str, Any] | None:
    """The whole optimizer's state on rank 0 (None elsewhere), in plain AdamW's state_dict format. A collective
    under ZeRO-1 (consolidate_state_dict(to=0)): every rank must call it."""
    if is_zero1(optimizer):
        optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if ranks.writer else None


def save_training_state(trainer: Trainer, path: str, ranks: Ranks) -> None:
    """Rank 0 writes the consolidated optimizer state and the step counter (the warm-up schedule's position);
    every rank returns once the file exists."""
    state = consolidated_optimizer_state(trainer.optimizer, ranks)
    if ranks.writer:
        torch.save({"optimizer": state, "steps_done": trainer.steps_done, "world_size": ranks.world_size}, path)
    ranks.barrier()


def load_training_state(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def resume_sharded(trainer: Trainer, state: dict[str, Any]) -> None:
    """A consolidated state into a ZeRO-1 trainer: each rank keeps the Adam state of its own shard."""
    if not is_zero1(trainer.optimizer):
        raise ValueError(
            f"resume_sharded needs a ZeroRedundancyOptimizer, not {type(trainer.optimizer).__name__}; "
            "use resume_unsharded"
        )
    # ZeRO blanks the other ranks' entries of the dict it loads; the optimizer must not alias the caller's tensors.
    trainer.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    trainer.steps_done = int(state["steps_done"])


def resume_unsharded(trainer: Trainer, state: dict[str, Any]) -> None:
    """A consolidated state into plain AdamW (one process, or every rank holding the whole state)."""
    if is_zero1(trainer.optimizer):
        raise ValueError("resume_unsharded needs a plain optimizer, not a ZeroRedundancyOptimizer; use resume_sharded")
    trainer.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    trainer.steps_done = int(state["steps_done"])
