"""The decoder MLP's SwiGLU on the fused [up, gate] projection, as one op forward and one op backward (X11,
`fused_swiglu`).

Compiled, the baseline's `F.silu(gate) * up` backward is one inductor kernel over the [up, gate]-gradient: each of
its elements is computed on its own, so every (up, gate) pair is read for both halves and the incoming gradient
twice. Here one program reads a pair and its gradient once and writes both halves. Arithmetic in fp32, one rounding
to the output dtype (inductor's fused kernels also keep the intermediate in fp32).

`swiglu(u)` takes u = ff_proj(x), [..., 2 * I] with up first (the checkpoint's order), and returns
silu(gate) * up, [..., I]. On CUDA both directions are Triton kernels (swiglu_kernels.py); elsewhere the same
arithmetic in torch. Both are torch custom ops, opaque to the compiled blocks, and the backward saves only u (what
the baseline's backward reads too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32 at least (fp64 stays fp64: the gradient checks run there)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def reference_forward(u: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32 at least, rounded once to u's dtype."""
    up, gate = _wide(u).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(u.dtype)


def reference_backward(grad: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """d/du of silu(gate) * up, [..., 2 * I] in u's layout: [grad * silu(gate), grad * up * silu'(gate)]."""
    up, gate = _wide(u).chunk(2, dim=-1)
    g = _wide(grad)
    sigmoid = torch.sigmoid(gate)
    d_up = g * gate * sigmoid
    d_gate = g * up * sigmoid * (1 + gate * (1 - sigmoid))
    return torch.cat([d_up, d_gate], dim=-1).to(u.dtype)


def _check(u: torch.Tensor) -> None:
    if u.shape[-1] % 2:
        raise ValueError(f"swiglu needs the fused [up, gate] projection (an even last dimension); got {u.shape}")


@torch.library.custom_op("prereg::swiglu_forward", mutates_args=())
def _forward(u: torch.Tensor) -> torch.Tensor:
    return reference_forward(u)


@_forward.register_kernel("cuda")
def _(u: torch.Tensor) -> torch.Tensor:
    from engine.molmo2.model import swiglu_kernels  # Triton: imported only where a CUDA device runs it

    return swiglu_kernels.forward(u)


@_forward.register_fake
def _(u: torch.Tensor) -> torch.Tensor:
    return u.new_empty((*u.shape[:-1], u.shape[-1] // 2))


@torch.library.custom_op("prereg::swiglu_backward", mutates_args=())
def _backward(grad: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return reference_backward(grad, u)


@_backward.register_kernel("cuda")
def _(grad: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    from engine.molmo2.model import swiglu_kernels

    return swiglu_kernels.backward(grad, u)


@_backward.register_fake
def _(grad: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(u)


def _setup_context(ctx, inputs, output) -> None:
    (u,) = inputs
    ctx.save_for_backward(u)


def _grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    (u,) = ctx.saved_tensors
    return _backward(grad.contiguous(), u)


_forward.register_autograd(_grad, setup_context=_setup_context)


def swiglu(u: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused projection u = [up, gate] (last dimension), as the ops above."""
    _check(u)
    return _forward(u.contiguous())
