"""The decoder MLP after its fused [up, gate] projection, `ff_out(silu(gate) * up)`, as one op forward and one op
backward (X11, `fused_swiglu`).

Compiled, the baseline keeps the projection u = [up, gate] and h = silu(gate) * up for the backward, where one
inductor kernel over the [up, gate]-gradient differentiates the SwiGLU element by element, so every (up, gate) pair
is read for both halves of the gradient. Here the backward kernel reads a pair and its incoming gradient once and
writes both halves and h again (for ff_out's weight gradient), so the op keeps only u and the weight: h's bytes a
block less than the baseline. Arithmetic in fp32, one rounding to the output dtype, as inductor's fused kernels.

`swiglu_down(u, weight)` takes u = ff_proj(x), [..., 2 * I] with up first (the checkpoint's order), and ff_out's
weight [H, I], and returns h @ weight.T. On CUDA the SwiGLU halves are Triton kernels (swiglu_kernels.py) around
the same matmuls; elsewhere the same arithmetic in torch. Both ops are torch custom ops, opaque to the compiled
blocks; under CUDA autocast their inputs are cast to bf16, as autocast casts a linear's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32 at least (fp64 stays fp64: the gradient checks run there)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def reference_forward(u: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up in fp32 at least, rounded once to u's dtype."""
    up, gate = _wide(u).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(u.dtype)


def reference_backward(grad: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d/du of h = silu(gate) * up, [..., 2 * I] in u's layout ([grad * silu(gate), grad * up * silu'(gate)]), and
    h again, both rounded once to u's dtype."""
    up, gate = _wide(u).chunk(2, dim=-1)
    g = _wide(grad)
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    d_up = g * silu
    d_gate = g * up * sigmoid * (1 + gate * (1 - sigmoid))
    return torch.cat([d_up, d_gate], dim=-1).to(u.dtype), (silu * up).to(u.dtype)


def _halves(u: torch.Tensor) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The SwiGLU's forward and backward halves for u's device."""
    if u.is_cuda:
        from engine.molmo2.model import swiglu_kernels  # Triton: imported only where a CUDA device runs it

        return swiglu_kernels.forward, swiglu_kernels.backward
    return reference_forward, reference_backward


@torch.library.custom_op("prereg::swiglu_down_forward", mutates_args=())
def _forward(u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    forward, _ = _halves(u)
    return F.linear(forward(u), weight)


@_forward.register_fake
def _(u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return u.new_empty((*u.shape[:-1], weight.shape[0]))


@torch.library.custom_op("prereg::swiglu_down_backward", mutates_args=())
def _backward(grad: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, backward = _halves(u)
    grad_h = grad @ weight.to(grad.dtype)  # [..., I], ff_out's input gradient
    du, h = backward(grad_h, u)
    grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ h.reshape(-1, h.shape[-1])  # [H, I]
    return du, grad_weight.to(weight.dtype)


@_backward.register_fake
def _(grad: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(u), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    u, weight = inputs
    ctx.save_for_backward(u, weight)


def _grad(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u, weight = ctx.saved_tensors
    return _backward(grad.contiguous(), u, weight)


_forward.register_autograd(_grad, setup_context=_setup_context)
torch.library.register_autocast("prereg::swiglu_down_forward", "cuda", torch.bfloat16)


def swiglu_down(u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) of the fused projection u = [up, gate] (last dimension), as the ops
    above."""
    if u.shape[-1] % 2 or u.shape[-1] // 2 != weight.shape[-1]:
        raise ValueError(
            f"swiglu_down needs the fused [up, gate] projection (last dimension 2 x {weight.shape[-1]}, the down "
            f"projection's input width); got u {tuple(u.shape)} and weight {tuple(weight.shape)}"
        )
    return _forward(u.contiguous(), weight)
