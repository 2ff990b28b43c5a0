"""A varlen call (segments.VarlenCall) on FlashAttention-4's Hopper kernels: run config pack_attention = "varlen-fa4".

Why: the same segments as "varlen-cudnn", on kernels that keep more of the H200 busy. The flash-attn-4 package
compiles FlashAttention-3's Hopper design (warp-specialised, TMA-fed, asynchronous wgmma) from CuTe DSL at first
use; its forward packs a key head's query heads into one tile where queries are few, as in the text runs' call
(about 60 queries against 350 keys a segment at the 4B geometry). bench/fa4_varlen_probe.py times it per call
against cuDNN and compares outputs and gradients.

How: the call's gathered buffers, q [nq, heads, d] and k, v [nk, kv_heads, d], go to the package's varlen forward
and backward as they are (cumulative segment starts, int32; its causal mask is aligned bottom-right like the
segments' rule). Both are torch custom ops, opaque to the compiled blocks, as cuDNN's are; the forward keeps the
log-sum-exp [heads, nq] (fp32) for the backward. The package's entry points are its interface module's forward and
backward functions, pinned with the package's version in pyproject's `fa4` extra.

The CPU has no such kernel: there pack_attention = "varlen-fa4" runs the same CPU reference as "varlen"
(segments.varlen_call)."""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # segments imports this module when a call runs on FlashAttention-4
    from engine.molmo2.attention.segments import VarlenCall


@cache
def flash_attn_4():
    """The flash-attn-4 interface module, or a ValueError saying how to get it (the runner asks before loading)."""
    try:
        from flash_attn.cute import interface
    except ImportError as error:
        raise ValueError(f"pack_attention = 'varlen-fa4' needs the flash-attn-4 package ({error}): pip install "
                         f"'prereg[fa4]' (bench/device_env.sh installs it from .whl/ and /tmp/fa4), or pick "
                         f"pack_attention 'varlen-cudnn'") from error  # fmt: skip
    return interface


@torch.library.custom_op("prereg::fa4_varlen_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
             max_k: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    out, lse, *_ = flash_attn_4()._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                                  max_seqlen_k=max_k, softmax_scale=1.0 / math.sqrt(q.shape[-1]),
                                                  causal=causal, return_lse=True)  # fmt: skip
    return out, lse


@_forward.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("prereg::fa4_varlen_backward", mutates_args=())
def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
              cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    dq, dk, dv = flash_attn_4()._flash_attn_bwd(q, k, v, o, do, lse, softmax_scale=1.0 / math.sqrt(q.shape[-1]),
                                                causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                max_seqlen_q=max_q, max_seqlen_k=max_k)  # fmt: skip
    return dq, dk, dv


@_backward.register_fake
def _(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.causal = max_q, max_k, causal


def _grad(ctx, do: torch.Tensor, _lse_grad: torch.Tensor | None):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _backward(do.contiguous(), q, k, v, o, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.causal)
    return dq, dk, dv, None, None, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


def fa4_varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: "VarlenCall") -> torch.Tensor:
    """segments.varlen_call's contract on FlashAttention-4 (CUDA, bf16 or fp16): [nq, heads, d], [nk, kv_heads, d]
    x2 -> [nq, heads, d]."""
    assert q.dtype in (torch.bfloat16, torch.float16), q.dtype  # attend_segments casts under autocast, or refuses
    o, _ = _forward(q.contiguous(), k.contiguous(), v.contiguous(), call.cu_q, call.cu_k, call.max_q, call.max_k,
                    call.causal)  # fmt: skip
    return o
