"""X10: the trainable linears hold bf16 weights; their fp32 masters live in the optimizer, which writes the bf16
copy in the same pass that updates the master.

Under bf16 autocast every trainable linear's fp32 weight is cast to bf16 before each matmul that reads it (in the
forward, and again where the backward recomputes the cast), and its bf16 gradient is cast up to fp32 for the
optimizer. With X10 the parameter itself is that bf16 weight: the casts are gone, the gradient stays bf16, and the
update (two Triton passes per bucket, engine/molmo2/train/master_kernels.py: the clip's square sums, then clip and
AdamW) reads the bf16 gradient,
updates the fp32 master and its moments, and writes the bf16 weight the next forward reads. The bf16 weight is
what autocast would have cast the master to (round to nearest even) and a one-pass step's bf16 gradient is what
the baseline cast up, so X10 changes numerics only where a weight's gradients are summed (in bf16, not fp32) and
in the rounding of the clip and the update. The other trainables (norms, embeddings, biases) stay fp32, their
masters the parameters themselves, updated by the same kernels.

The optimizer's state_dict is torch.optim.AdamW's (step, exp_avg, exp_avg_sq per parameter): a saved training
state resumes into either; checkpoints write the masters (`Trainer.master_weights`)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

BLOCK = 4096  # elements per kernel program (master_kernels.py); every block lies in one tensor
ALIGN = 16  # elements: every tensor's flat offset is a multiple, so each block starts on a 32-byte boundary


@dataclass
class Bucket:
    """Tensors of one gradient dtype and one learning-rate group, flat: master, moments, and (shadowed) the bf16
    weights the parameters are views of."""

    group: int  # index into the optimizer's param_groups
    params: list[nn.Parameter]
    shadowed: bool  # bf16 parameters over fp32 masters (else the parameters ARE the fp32 masters)
    offsets: list[int]  # each tensor's start in the flat buffers, a multiple of ALIGN
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    shadow: torch.Tensor | None
    # device tables for the kernels
    block_tensor: torch.Tensor
    block_start: torch.Tensor
    sizes: torch.Tensor
    offsets_table: torch.Tensor

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)


def shadowed_names(model: nn.Module) -> set[str]:
    """The trainable linears' weights: what autocast casts to bf16 before every matmul."""
    return {
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module.weight.requires_grad
    }


def shadowed_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of `shadowed_names`: what MasterAdamW holds in bf16 over fp32 masters."""
    names = shadowed_names(model)
    return {p for name, p in model.named_parameters() if name in names}


def forget_compiled_graphs() -> None:
    """The shadowed parameters just changed dtype under the same Parameter objects: Dynamo's guards on a module's
    parameters can pass on the unchanged objects, and a graph compiled for the other dtype would then read a bf16
    weight as fp32, past its end (an illegal address on the H200). Every compiled graph is dropped; the next call
    compiles again, from inductor's on-disk cache when it holds the graph."""
    torch._dynamo.reset()


def _layout(params: list[nn.Parameter], align: int) -> tuple[list[int], int]:
    offsets, end = [], 0
    for p in params:
        offsets.append(end)
        end += -(-p.numel() // align) * align
    return offsets, end


def _bucket(group: int, params: list[nn.Parameter], shadowed: bool, masters: list[torch.Tensor]) -> Bucket:
    device = params[0].device
    offsets, total = _layout(params, ALIGN)
    zeros = lambda dtype: torch.zeros(total, dtype=dtype, device=device)  # noqa: E731
    starts = [torch.arange(0, p.numel(), BLOCK, dtype=torch.int64) for p in params]
    tensors = [torch.full((len(s),), i, dtype=torch.int32) for i, s in enumerate(starts)]
    bucket = Bucket(
        group, params, shadowed, offsets, zeros(torch.float32), zeros(torch.float32), zeros(torch.float32),
        zeros(torch.bfloat16) if shadowed else None,
        torch.cat(tensors).to(device),
        torch.cat(starts).to(device),
        torch.tensor([p.numel() for p in params], dtype=torch.int64, device=device),
        torch.tensor(offsets, dtype=torch.int64, device=device),
    )  # fmt: skip
    for i, (p, master) in enumerate(zip(params, masters)):
        bucket.view(bucket.master, i).copy_(master)
        if shadowed:
            bucket.view(bucket.shadow, i).copy_(master)  # round to nearest even: autocast's own cast
            p.data = bucket.view(bucket.shadow, i)
        else:
            p.data = bucket.view(bucket.master, i)
    return bucket


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over fp32 masters with the gradient clip inside (X10). Built from a torch AdamW over the same
    parameter groups (`from_adamw`, moments and step carried over); `release` hands back fp32 parameters and the state
    a torch AdamW over them takes."""

    def __init__(self, groups: list[dict[str, Any]], shadowed: set[nn.Parameter], betas: tuple[float, float],
                 eps: float, weight_decay: float) -> None:  # fmt: skip
        super().__init__(groups, {"lr": groups[0]["lr"], "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.steps = 0
        self.buckets: list[Bucket] = []
        for index, group in enumerate(self.param_groups):
            for is_shadowed in (True, False):
                params = [p for p in group["params"] if (p in shadowed) == is_shadowed]
                if params:
                    masters = [p.detach().float() for p in params]
                    self.buckets.append(_bucket(index, params, is_shadowed, masters))
        forget_compiled_graphs()

    @classmethod
    def from_adamw(cls, optimizer: torch.optim.Optimizer, shadowed: set[nn.Parameter]) -> "MasterAdamW":
        groups = [dict(g, params=list(g["params"])) for g in optimizer.param_groups]
        first = optimizer.param_groups[0]
        steps = {float(optimizer.state[p]["step"]) for g in groups for p in g["params"] if p in optimizer.state}
        if len(steps) > 1:
            raise ValueError(f"the optimizer's parameters are at different steps {sorted(steps)}; X10 keeps one count")
        states = {p: optimizer.state[p] for g in groups for p in g["params"] if p in optimizer.state}
        new = cls(groups, shadowed, first["betas"], first["eps"], first["weight_decay"])
        new.steps = int(steps.pop()) if steps else 0
        for bucket in new.buckets:
            for i, p in enumerate(bucket.params):
                if p in states:
                    bucket.view(bucket.exp_avg, i).copy_(states[p]["exp_avg"])
                    bucket.view(bucket.exp_avg_sq, i).copy_(states[p]["exp_avg_sq"])
        return new

    def release(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Every parameter back to an fp32 tensor of its own (the master's values); returns torch AdamW's state
        for them (empty before the first step)."""
        states = self._adamw_states(step_on_device=True)  # the fused AdamW keeps its step counts on the device
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                p.data = bucket.view(bucket.master, i).clone()
        self.buckets = []
        forget_compiled_graphs()
        return states

    def _adamw_states(self, step_on_device: bool) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """torch AdamW's per-parameter state (step, exp_avg, exp_avg_sq), copies; none before the first step."""
        if not self.steps:
            return {}
        return {
            p: {
                "step": torch.tensor(
                    float(self.steps), dtype=torch.float32, device=p.device if step_on_device else "cpu"
                ),  # fmt: skip
                "exp_avg": bucket.view(bucket.exp_avg, i).clone(),
                "exp_avg_sq": bucket.view(bucket.exp_avg_sq, i).clone(),
            }
            for bucket in self.buckets
            for i, p in enumerate(bucket.params)
        }

    @contextmanager
    def masters(self) -> Iterator[None]:
        """The shadowed parameters as views of their fp32 masters, for what must read or write full precision
        (checkpoints, eager fp32 decoding); back to the bf16 weights after."""
        for bucket in self.buckets:
            if bucket.shadowed:
                for i, p in enumerate(bucket.params):
                    p.data = bucket.view(bucket.master, i)
        forget_compiled_graphs()
        try:
            yield
        finally:
            for bucket in self.buckets:
                if bucket.shadowed:
                    for i, p in enumerate(bucket.params):
                        bucket.view(bucket.shadow, i).copy_(bucket.view(bucket.master, i))
                        p.data = bucket.view(bucket.shadow, i)
            forget_compiled_graphs()

    def _gradients(self, bucket: Bucket) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The bucket's gradients (kept alive until the kernels are enqueued) and each one's element offset from
        the first one's address (on the device)."""
        grads = []
        for p in bucket.params:
            g = p.grad
            if g is None:
                raise ValueError(
                    f"a trainable parameter of shape {tuple(p.shape)} has no gradient this step; X10 updates every "
                    "trainable each step with one step count: train it, or freeze it"
                )
            assert g.is_contiguous() and g.dtype == p.dtype, (g.dtype, p.dtype, g.stride())
            if g.data_ptr() % 512:  # a view into a larger gradient (a cat's backward): an aligned copy of its own
                g = g.clone()
            grads.append(g)
        base, size = grads[0].data_ptr(), grads[0].element_size()
        offsets = [(g.data_ptr() - base) // size for g in grads]  # multiples of 512 bytes: of ALIGN elements too
        return grads, torch.tensor(offsets, dtype=torch.int64).to(bucket.master.device, non_blocking=True)

    @torch.no_grad()
    def clip_and_step(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_(max_norm) and AdamW's step over every bucket; returns the pre-clip total norm."""
        gradients = [self._gradients(b) for b in self.buckets]
        device = self.buckets[0].master.device
        if device.type != "cuda":
            raise ValueError(f"X10's update is two Triton kernels, CUDA only; these parameters are on {device}")
        from engine.molmo2.train import master_kernels as kernels

        partial = torch.empty(sum(b.block_tensor.numel() for b in self.buckets), dtype=torch.float32, device=device)
        start = 0
        for bucket, (grads, grad_offsets) in zip(self.buckets, gradients):
            end = start + bucket.block_tensor.numel()
            kernels.square_sums(grads[0], grad_offsets, bucket.block_tensor, bucket.block_start, bucket.sizes,
                                partial[start:end])  # fmt: skip
            start = end
        square_sum = partial.sum()
        self.steps += 1
        for bucket, (grads, grad_offsets) in zip(self.buckets, gradients):
            group = self.param_groups[bucket.group]
            beta1, beta2 = group["betas"]
            kernels.adamw(
                grads[0], grad_offsets, bucket.block_tensor, bucket.block_start, bucket.sizes, bucket.offsets_table,
                bucket.master, bucket.exp_avg, bucket.exp_avg_sq, bucket.shadow, square_sum,
                max_norm=max_norm, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], bias_correction1=1 - beta1**self.steps,
                bias_correction2_sqrt=math.sqrt(1 - beta2**self.steps),
            )  # fmt: skip
        return square_sum.sqrt()

    def step(self, closure=None):  # noqa: ANN001
        raise ValueError("MasterAdamW clips inside its step: call clip_and_step(max_norm)")

    def state_dict(self) -> dict[str, Any]:
        """torch AdamW's format: a training state saved here resumes into plain AdamW too."""
        self.state.clear()
        self.state.update(self._adamw_states(step_on_device=False))
        state = super().state_dict()
        self.state.clear()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch AdamW's format, into the flat moments (the masters are the model's weights, loaded apart)."""
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        saved = state_dict["state"]
        steps = {float(s["step"]) for s in saved.values()}
        if len(steps) > 1:
            raise ValueError(f"the saved state's parameters are at different steps {sorted(steps)}; X10 keeps one")
        self.steps = int(steps.pop()) if steps else 0
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                entry = saved.get(index[p])
                bucket.view(bucket.exp_avg, i).copy_(entry["exp_avg"] if entry else 0.0)
                bucket.view(bucket.exp_avg_sq, i).copy_(entry["exp_avg_sq"] if entry else 0.0)
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
