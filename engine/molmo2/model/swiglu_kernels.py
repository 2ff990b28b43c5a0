"""The Triton kernels of X11's SwiGLU (swiglu.py). A program owns BLOCK columns of one row: it reads each column's
(up, gate) pair, and in the backward its incoming gradient, once, and writes h = silu(gate) * up (forward), or both
halves of the [up, gate] gradient and h again (backward, for the down projection's weight gradient). A 2D grid
(rows, column blocks) leaves no division per element, and the row width is a multiple of 16 at every geometry, so
Triton's integer specialisation vectorises the loads. Importing this module needs Triton (CUDA only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
WARPS = 4  # 8 elements a thread: one 16-byte load of bf16 per tensor


@triton.jit
def _forward_kernel(u, out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pair = u + row * 2 * width + cols
    up = tl.load(pair, mask=mask).to(tl.float32)
    gate = tl.load(pair + width, mask=mask).to(tl.float32)
    silu = gate * tl.sigmoid(gate)
    tl.store(out + row * width + cols, (silu * up).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(grad, u, du, h, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pair = row * 2 * width + cols
    up = tl.load(u + pair, mask=mask).to(tl.float32)
    gate = tl.load(u + pair + width, mask=mask).to(tl.float32)
    g = tl.load(grad + row * width + cols, mask=mask).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    d_gate = g * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(du + pair, (g * silu).to(du.dtype.element_ty), mask=mask)
    tl.store(du + pair + width, d_gate.to(du.dtype.element_ty), mask=mask)
    tl.store(h + row * width + cols, (silu * up).to(h.dtype.element_ty), mask=mask)


def _grid(rows: int, width: int) -> tuple[int, int]:
    return rows, triton.cdiv(width, BLOCK)


def forward(u: torch.Tensor) -> torch.Tensor:
    width = u.shape[-1] // 2
    out = u.new_empty((*u.shape[:-1], width))
    rows = u.numel() // (2 * width)
    if rows:
        _forward_kernel[_grid(rows, width)](u, out, width, BLOCK=BLOCK, num_warps=WARPS)
    return out


def backward(grad: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad: contiguous, [..., width] (the down projection's input gradient, a matmul's output)."""
    assert grad.is_contiguous() and u.is_contiguous(), "the kernel reads rows at a stride of their width"
    width = u.shape[-1] // 2
    du, h = torch.empty_like(u), u.new_empty((*u.shape[:-1], width))
    rows = u.numel() // (2 * width)
    if rows:
        _backward_kernel[_grid(rows, width)](grad, u, du, h, width, BLOCK=BLOCK, num_warps=WARPS)
    return du, h
