"""The two Triton kernels of X10's update (engine/molmo2/train/master_adamw.py), over one bucket of tensors at a
time: the gradients' square sums (the clip's norm), then clip, AdamW and the bf16 copy in one pass.

A bucket's fp32 masters and Adam moments live in flat buffers at `offsets`; its gradients are autograd's own
tensors, reached as element offsets (`grad_offsets`) from the first one (`grads`), so no gradient is copied into
a flat buffer first. Every block of BLOCK elements lies in one tensor: `block_tensor` and `block_start` say which,
and where. Importing this module needs Triton (CUDA only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.molmo2.train.master_adamw import BLOCK

WARPS = 8  # 16 elements per thread at BLOCK = 4096


@triton.jit
def _block(block_tensor, block_start, sizes, BLOCK: tl.constexpr):
    """This program's tensor, its element indices, the load mask (to the tensor's size rounded up to ALIGN, so
    that it is constant over every 16 elements and the loads vectorise) and the mask of its real elements."""
    tensor = tl.load(block_tensor + tl.program_id(0))
    index = tl.multiple_of(tl.load(block_start + tl.program_id(0)), BLOCK) + tl.arange(0, BLOCK)
    size = tl.load(sizes + tensor)
    padded = tl.multiple_of((size + 15) // 16 * 16, 16)
    return tensor, index, index < padded, index < size


@triton.jit
def _gradient(grads, grad_offsets, tensor, index, load_mask, real):
    # Each gradient as an element offset from the first one's address: the kernel indexes one typed pointer, whose
    # 16-byte alignment Triton knows, so the loads vectorise like the flat buffers' (the caching allocator aligns
    # every gradient to 512 bytes, so each offset is a multiple of 16 elements, and rounds its size up to 512 bytes,
    # so the load past a gradient's end to the next 16 elements stays in its block; those elements count as 0).
    start = tl.multiple_of(tl.load(grad_offsets + tensor), 16)
    g = tl.load(grads + start + index, mask=load_mask, other=0.0).to(tl.float32)
    return tl.where(real, g, 0.0)


@triton.jit
def _square_sums_kernel(grads, grad_offsets, block_tensor, block_start, sizes, partial, BLOCK: tl.constexpr):
    tensor, index, load_mask, real = _block(block_tensor, block_start, sizes, BLOCK)
    g = _gradient(grads, grad_offsets, tensor, index, load_mask, real)
    tl.store(partial + tl.program_id(0), tl.sum(g * g, axis=0))


@triton.jit
def _adamw_kernel(
    grads,
    grad_offsets,
    block_tensor,
    block_start,
    sizes,
    offsets,
    master,
    exp_avg,
    exp_avg_sq,
    shadow,
    square_sum,
    max_norm,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    bias_correction1,
    bias_correction2_sqrt,
    BLOCK: tl.constexpr,
    SHADOW: tl.constexpr,
):
    tensor, index, mask, real = _block(block_tensor, block_start, sizes, BLOCK)
    flat = tl.multiple_of(tl.load(offsets + tensor), 16) + index  # the flat buffers hold each tensor's padding too
    # clip_grad_norm_'s coefficient, clamped at 1, from the whole step's norm; applied in fp32 to every gradient
    coefficient = tl.minimum(max_norm / (tl.sqrt(tl.load(square_sum)) + 1e-6), 1.0)
    g = _gradient(grads, grad_offsets, tensor, index, mask, real) * coefficient  # 0 on the padding: it stays 0
    p = tl.load(master + flat, mask=mask)
    m = tl.load(exp_avg + flat, mask=mask)
    v = tl.load(exp_avg_sq + flat, mask=mask)
    # torch's fused AdamW (ADAMW mode), term by term
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * m / denom
    tl.store(master + flat, p, mask=mask)
    tl.store(exp_avg + flat, m, mask=mask)
    tl.store(exp_avg_sq + flat, v, mask=mask)
    if SHADOW:
        tl.store(shadow + flat, p.to(tl.bfloat16), mask=mask)


def square_sums(grads: torch.Tensor, grad_offsets, block_tensor, block_start, sizes, partial: torch.Tensor) -> None:
    blocks = block_tensor.numel()
    _square_sums_kernel[(blocks,)](
        grads, grad_offsets, block_tensor, block_start, sizes, partial, BLOCK=BLOCK, num_warps=WARPS
    )


def adamw(grads: torch.Tensor, grad_offsets, block_tensor, block_start, sizes, offsets, master, exp_avg, exp_avg_sq,
          shadow, square_sum, *, max_norm, lr, beta1, beta2, eps, weight_decay, bias_correction1,
          bias_correction2_sqrt) -> None:  # fmt: skip
    blocks = block_tensor.numel()
    _adamw_kernel[(blocks,)](
        grads, grad_offsets, block_tensor, block_start, sizes, offsets, master, exp_avg, exp_avg_sq,
        shadow if shadow is not None else master, square_sum,
        max_norm, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
        BLOCK=BLOCK, SHADOW=shadow is not None, num_warps=WARPS,
    )  # fmt: skip
