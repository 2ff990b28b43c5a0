"""A varlen call (segments.VarlenCall) on cuDNN's fused SDPA: run config pack_attention = "varlen-cudnn".

Why: the same segments as pack_attention = "varlen", on a faster kernel. torch's varlen_attn is FlashAttention-2,
Ampere's kernel; cuDNN's Hopper SDPA kernels take ragged segments too, and torch does not expose them with
per-segment lengths and a bottom-right causal band, so this goes through the cudnn-frontend package's graphs.
bench/cudnn_varlen_probe.py times both kernels per call and compares their outputs and gradients.

How: a call's gathered buffers, q [nq, heads, d] and k, v [nk, kv_heads, d] (token-major, segment after segment),
are cuDNN ragged tensors: dims [segments, heads, S, d] with each segment's real length (the padding mask) and
where it starts in the buffer, in elements (the ragged offset). A causal call is cuDNN's diagonal band aligned
bottom-right (a segment's last query sees its last key); grouped-query attention is k and v's fewer heads. A graph
is built once per shape (segments, longest segment rounded up to 64; the backward also the totals, rounded up, by
which it sizes its scratch) and kept for the process: a run meets one shape per distinct packed chunk. The
forward and backward are torch custom ops, so compiled blocks keep them opaque, as they keep varlen_attn.

The CPU has no cuDNN: there pack_attention = "varlen-cudnn" runs the same CPU reference as "varlen"
(segments.varlen_call), so a tiny registration's dry run takes the same path through the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # segments imports this module when a call runs on cuDNN
    from engine.molmo2.attention.segments import VarlenCall

ROUND = 64  # graph dims are rounded up to this, so nearby packed chunks share a graph


def _round_up(n: int) -> int:
    return -(-n // ROUND) * ROUND


@dataclass(frozen=True)
class RaggedLayout:
    """cuDNN's view of one call's packed buffers (all [B (+1), 1, 1, 1] as cuDNN takes them)."""

    seq_len_q: torch.Tensor  # int32 [B]: each segment's queries
    seq_len_kv: torch.Tensor  # int32 [B]: each segment's keys
    q_offset: torch.Tensor  # int64 [B + 1]: where each segment starts in q (and o, dO, dq), in elements
    k_offset: torch.Tensor  # int64 [B + 1]: the same in k and v (and dk, dv)


def ragged_layout(cu_q: torch.Tensor, cu_k: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> RaggedLayout:
    """The layout of a call from its cumulative segment starts ([B + 1] int32, as FlashAttention takes them)."""
    column = lambda t: t.view(-1, 1, 1, 1)  # noqa: E731
    return RaggedLayout(
        column((cu_q[1:] - cu_q[:-1]).int()),
        column((cu_k[1:] - cu_k[:-1]).int()),
        column(cu_q.long() * (heads * head_dim)),
        column(cu_k.long() * (kv_heads * head_dim)),
    )


@dataclass(frozen=True)
class GraphShape:
    """What a cuDNN graph is built for; totals only for the backward (0 in a forward's shape)."""

    segments: int
    max_q: int  # rounded up to ROUND
    max_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype
    device: int
    total_q: int = 0  # rounded up to ROUND
    total_k: int = 0


@cache
def cudnn_frontend():
    """The cudnn-frontend package, or a ValueError saying how to get it (the runner asks before loading a model)."""
    try:
        import cudnn
    except ImportError as error:
        raise ValueError(f"pack_attention = 'varlen-cudnn' needs the cudnn-frontend package ({error}): pip install "
                         f"nvidia-cudnn-frontend (the device scripts install it from .whl/), or pick pack_attention "
                         f"'varlen'") from error  # fmt: skip
    return cudnn


@cache
def _handle(device: int):
    with torch.cuda.device(device):
        return cudnn_frontend().create_handle()


def describe(shape: GraphShape, backward: bool):
    """The SDPA graph of a shape, lowered but with no execution plan yet, and its tensors by name (the forward's
    q, k, v, o, stats; the backward's also dO, dq, dk, dv; and the layout's). bench/cudnn_plans.py times every plan
    cuDNN offers for it."""
    cudnn = cudnn_frontend()
    io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[shape.dtype]
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=_handle(shape.device))  # fmt: skip
    B, h, kv_h, d = shape.segments, shape.heads, shape.kv_heads, shape.head_dim
    dims = {"q": ([B, h, shape.max_q, d], [shape.max_q * h * d, d, h * d, 1]),
            "k": ([B, kv_h, shape.max_k, d], [shape.max_k * kv_h * d, d, kv_h * d, 1])}  # fmt: skip
    t: dict = {}
    for name, length in (("seq_len_q", B), ("seq_len_kv", B)):
        t[name] = graph.tensor(dim=[length, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    for name in ("q_offset", "k_offset"):
        t[name] = graph.tensor(dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)

    def ragged(which: str):
        tensor = graph.tensor(dim=dims[which][0], stride=dims[which][1], data_type=io)
        tensor.set_ragged_offset(t[f"{which}_offset"])
        return tensor

    t["q"], t["k"], t["v"] = ragged("q"), ragged("k"), ragged("k")
    band = ({"diagonal_band_right_bound": 0, "diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT}
            if shape.causal else {})  # fmt: skip
    common = {"attn_scale": 1.0 / math.sqrt(d), "use_padding_mask": True, "seq_len_q": t["seq_len_q"],
              "seq_len_kv": t["seq_len_kv"], **band}  # fmt: skip
    stats_dims = ([B, h, shape.max_q, 1], [h * shape.max_q, shape.max_q, 1, 1])
    if backward:
        t["o"], t["dO"] = ragged("q"), ragged("q")
        t["stats"] = graph.tensor(dim=stats_dims[0], stride=stats_dims[1], data_type=cudnn.data_type.FLOAT)
        outputs = graph.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"],
                                      stats=t["stats"], max_total_seq_len_q=shape.total_q,
                                      max_total_seq_len_kv=shape.total_k, **common)  # fmt: skip
        names = (("dq", "q"), ("dk", "k"), ("dv", "k"))
    else:
        outputs = graph.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True, **common)
        names = (("o", "q"), ("stats", None))
    for (name, like), tensor in zip(names, outputs):
        if like is None:
            tensor.set_output(True).set_dim(stats_dims[0]).set_stride(stats_dims[1]).set_data_type(
                cudnn.data_type.FLOAT
            )
        else:
            tensor.set_output(True).set_dim(dims[like][0]).set_stride(dims[like][1]).set_ragged_offset(
                t[f"{like}_offset"]
            )
        t[name] = tensor
    graph.validate()
    graph.build_operation_graph()
    return graph, t


class _Graph:
    """One built cuDNN graph (cuDNN's first plan by its heuristics), its tensors by name, and its workspace size."""

    def __init__(self, shape: GraphShape, backward: bool):
        cudnn = cudnn_frontend()
        self.shape, self.handle = shape, _handle(shape.device)
        graph, t = describe(shape, backward)
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph, self.tensors, self.workspace_size = graph, t, graph.get_workspace_size()

    def execute(self, layout: RaggedLayout, **buffers: torch.Tensor) -> None:
        pack = {self.tensors[name]: tensor for name, tensor in vars(layout).items()}
        pack.update({self.tensors[name]: tensor for name, tensor in buffers.items()})
        workspace = torch.empty(self.workspace_size, dtype=torch.uint8, device=f"cuda:{self.shape.device}")
        cudnn_frontend().set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(pack, workspace, handle=self.handle)


@cache
def _graph(shape: GraphShape, backward: bool) -> _Graph:
    return _Graph(shape, backward)


def _shape(q: torch.Tensor, k: torch.Tensor, cu_q: torch.Tensor, max_q: int, max_k: int, causal: bool,
           backward: bool) -> GraphShape:  # fmt: skip
    totals = {"total_q": _round_up(q.shape[0]), "total_k": _round_up(k.shape[0])} if backward else {}
    return GraphShape(cu_q.shape[0] - 1, _round_up(max_q), _round_up(max_k), q.shape[1], k.shape[1], q.shape[2], causal,
                      q.dtype, q.device.index, **totals)  # fmt: skip


def _stats(q: torch.Tensor, segments: int, max_q: int) -> torch.Tensor:
    """The forward's softmax statistics (log-sum-exp per query, padded per segment), which its backward reads."""
    return q.new_empty((segments, q.shape[1], _round_up(max_q), 1), dtype=torch.float32)


@torch.library.custom_op("prereg::cudnn_varlen_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
             max_k: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    o, stats = torch.empty_like(q), _stats(q, cu_q.shape[0] - 1, max_q)
    layout = ragged_layout(cu_q, cu_k, q.shape[1], k.shape[1], q.shape[2])
    _graph(_shape(q, k, cu_q, max_q, max_k, causal, False), False).execute(layout, q=q, k=k, v=v, o=o, stats=stats)
    return o, stats


@_forward.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    return torch.empty_like(q), _stats(q, cu_q.shape[0] - 1, max_q)


@torch.library.custom_op("prereg::cudnn_varlen_backward", mutates_args=())
def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, stats: torch.Tensor,
              cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    layout = ragged_layout(cu_q, cu_k, q.shape[1], k.shape[1], q.shape[2])
    _graph(_shape(q, k, cu_q, max_q, max_k, causal, True), True).execute(layout, q=q, k=k, v=v, o=o, dO=do,
                                                                         stats=stats, dq=dq, dk=dk, dv=dv)  # fmt: skip
    return dq, dk, dv


@_backward.register_fake
def _(do, q, k, v, o, stats, cu_q, cu_k, max_q, max_k, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal = inputs
    o, stats = output
    ctx.save_for_backward(q, k, v, o, stats, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.causal = max_q, max_k, causal


def _grad(ctx, do: torch.Tensor, _stats_grad: torch.Tensor | None):
    q, k, v, o, stats, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _backward(do.contiguous(), q, k, v, o, stats, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.causal)
    return dq, dk, dv, None, None, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


def cudnn_varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: "VarlenCall") -> torch.Tensor:
    """segments.varlen_call's contract on cuDNN (CUDA, bf16 or fp16): [nq, heads, d], [nk, kv_heads, d] x2 ->
    [nq, heads, d]."""
    assert q.dtype in (torch.bfloat16, torch.float16), q.dtype  # attend_segments casts under autocast, or refuses
    o, _ = _forward(q.contiguous(), k.contiguous(), v.contiguous(), call.cu_q, call.cu_k, call.max_q, call.max_k,
                    call.causal)  # fmt: skip
    return o
