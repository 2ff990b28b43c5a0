"""A packed row's attention as FlashAttention's variable-length calls (run config pack_attention = "varlen").

Within a sample the rule is causal OR both image tokens (the hub's `token_type_ids_mask_function`), so every query
of one run of same-kind tokens sees the same keys up to causality:

- a run of text tokens ending at t: keys [0, t) of its sample, causally: a causal segment, whose queries are the
  last tokens of its keys (FlashAttention aligns the causal diagonal bottom-right);
- a run of image tokens ending at t: keys [0, t) and every later image token of its sample: a full segment.

A one-camera prefix is three runs (text, image, text); a two-camera one five. The segments of each kind go to one
varlen call: queries gathered from the row segment after segment, keys gathered the same way (a sample's keys
repeat in each of its segments: ~3x the keys at h200-4b), outputs gathered back into the row. Each query belongs
to exactly one segment, so nothing is merged: the calls compute the rule's attention, no more pairs (the dense
masks' tail-pad rule included: a pad sees itself).

Why: FlexAttention evaluates the rule pair by pair in its partial blocks, most of a packed row's blocks; the
varlen kernel has no rule to evaluate.

The plans are built on the host once per packed chunk (pack()). On CUDA the calls are torch's FlashAttention
varlen kernel (bf16/fp16), or cuDNN's SDPA on the same segments (Segments.kernel "cudnn", pack_attention
"varlen-cudnn", cudnn.py); on the CPU, where neither exists, each segment is one SDPA call with the same rule as a
dense mask: the function the tests check against the padded chunk in fp32."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

KERNELS = ("flash", "cudnn")  # a varlen call's CUDA kernel


@dataclass(frozen=True)
class VarlenCall:
    """One varlen call: segments laid end to end, each its queries and its keys."""

    queries: torch.Tensor  # [nq] long: the query-row position of each query, segment after segment
    keys: torch.Tensor  # [nk] long: the key-row position of each key, segment after segment
    cu_q: torch.Tensor  # [segments + 1] int32: where each segment's queries start in `queries`
    cu_k: torch.Tensor  # [segments + 1] int32
    max_q: int
    max_k: int
    causal: bool  # bottom-right: a segment's last query sees its last key and every key before it

    def to(self, device: torch.device | str) -> "VarlenCall":
        return VarlenCall(self.queries.to(device), self.keys.to(device), self.cu_q.to(device), self.cu_k.to(device),
                          self.max_q, self.max_k, self.causal)  # fmt: skip


@dataclass(frozen=True)
class Segments:
    """A row's attention as varlen calls; every query of the row is in exactly one call's segments. The gathers
    are one per tensor for all calls, each with the table its backward sums by (`Gather`)."""

    calls: tuple[VarlenCall, ...]
    queries: torch.Tensor  # [N] long: the calls' queries, concatenated (a permutation of the row)
    inverse: torch.Tensor  # [N] long: where each query-row token's output is in the calls' outputs, concatenated
    keys: torch.Tensor  # [S] long: the calls' keys, concatenated (a key-row position per slot)
    key_copies: torch.Tensor  # [Nk, C] long: the slots of each key-row position, padded with S (no slot)
    kernel: str = "flash"  # on CUDA, the calls' kernel: "flash" (FlashAttention-2) or "cudnn" (cudnn.py)

    def to(self, device: torch.device | str) -> "Segments":
        return Segments(tuple(call.to(device) for call in self.calls), *(t.to(device) for t in
                        (self.queries, self.inverse, self.keys, self.key_copies)), self.kernel)  # fmt: skip

    def on(self, kernel: str) -> "Segments":
        """The same plan on another CUDA kernel."""
        assert kernel in KERNELS, kernel  # Execution validates pack_attention, which picks it
        return replace(self, kernel=kernel)


class Gather(torch.autograd.Function):
    """x.index_select(0, index), whose backward sums each row's copies by gathering them through `copies` ([rows
    of x, C] indices into index's slots, padded with len(index)), in fp32 at least: index_select's own backward is an
    atomic bf16 index_add, slow on the GPU where many slots hold the same row (a sample's keys repeat in each of its
    segments)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(copies)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (copies,) = ctx.saved_tensors
        if copies.shape == (grad.shape[0], 1):  # as many rows as slots, at most one slot each: a permutation
            return grad.index_select(0, copies[:, 0]), None, None
        padded = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])  # slot len(index): no slot, a zero
        accumulate = torch.promote_types(grad.dtype, torch.float32)  # bf16 copies summed in fp32
        return padded[copies].to(accumulate).sum(1).to(grad.dtype), None, None


@dataclass(frozen=True)
class PackedSegments:
    """The three rows a packed chunk attends on: the prefix row (prefill), the suffix row on the prefix's keys and
    its own ([prefix | suffix] key row, extend), and the joined row [prefix | suffix] (pack_one_pass)."""

    prefix: Segments
    suffix: Segments
    joined: Segments

    def to(self, device: torch.device | str) -> "PackedSegments":
        return PackedSegments(self.prefix.to(device), self.suffix.to(device), self.joined.to(device))


@dataclass(frozen=True)
class Sample:
    """One sample's tokens in its own order: their key-row positions, whether each is an image token, and each
    one's query-row position (-1: not a query of this row, e.g. the prefix seen from the suffix row)."""

    keys: list[int]
    image: list[bool]
    queries: list[int]


def plan(samples: list[Sample], pads: list[tuple[int, int]], n_queries: int, n_keys: int) -> Segments:
    """The varlen calls of a row of `n_queries` queries on a key row of `n_keys`: `samples`, and the tail pads as
    (query, key) positions, each seeing only itself."""
    causal: list[tuple[list[int], list[int]]] = []
    full: list[tuple[list[int], list[int]]] = []
    for sample in samples:
        images = [j for j, is_image in enumerate(sample.image) if is_image]
        start = 0
        for is_image, run in itertools.groupby(sample.image):
            end = start + len(list(run))
            queries = [q for q in sample.queries[start:end] if q >= 0]
            if queries and is_image:
                full.append((queries, sample.keys[:end] + [sample.keys[j] for j in images if j >= end]))
            elif queries:
                assert all(q >= 0 for q in sample.queries[end - len(queries) : end]), (
                    "a causal segment's queries end its keys"
                )
                causal.append((queries, sample.keys[:end]))
            start = end
    causal.extend(([q], [k]) for q, k in pads)
    calls = tuple(_call(segments, is_causal) for segments, is_causal in ((causal, True), (full, False)) if segments)
    order = torch.cat([call.queries for call in calls])
    assert torch.equal(order.sort().values, torch.arange(n_queries)), "every query in exactly one segment"
    inverse = torch.empty(n_queries, dtype=torch.long)
    inverse[order] = torch.arange(n_queries)
    keys = torch.cat([call.keys for call in calls])
    return Segments(calls, order, inverse, keys, _copies(keys, n_keys))


def _copies(index: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, C] the slots of `index` holding each row (C: the most any row has), padded with len(index)."""
    counts = torch.bincount(index, minlength=rows)
    by_row = torch.argsort(index, stable=True)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(index.shape[0]) - first[index[by_row]]
    copies = torch.full((rows, int(counts.max())), index.shape[0], dtype=torch.long)
    copies[index[by_row], rank] = by_row
    return copies


def _call(segments: list[tuple[list[int], list[int]]], causal: bool) -> VarlenCall:
    q_lengths = torch.tensor([len(q) for q, _ in segments])
    k_lengths = torch.tensor([len(k) for _, k in segments])
    starts = lambda lengths: torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])  # noqa: E731
    queries = torch.tensor([i for q, _ in segments for i in q])
    keys = torch.tensor([i for _, k in segments for i in k])
    return VarlenCall(
        queries, keys, starts(q_lengths), starts(k_lengths), int(q_lengths.max()), int(k_lengths.max()), causal
    )


def packed_segments(prefix_doc: torch.Tensor, suffix_doc: torch.Tensor, image: torch.Tensor) -> PackedSegments:
    """The plans of a packed chunk from its rows' documents ([N] long, -1 on tail padding) and the prefix row's
    image flags ([Np] bool)."""
    Np, Ns = prefix_doc.shape[0], suffix_doc.shape[0]
    docs = int(prefix_doc.max()) + 1
    p_at = [torch.nonzero(prefix_doc == d)[:, 0].tolist() for d in range(docs)]
    s_at = [torch.nonzero(suffix_doc == d)[:, 0].tolist() for d in range(docs)]
    image_at = image.tolist()
    p_pads = torch.nonzero(prefix_doc < 0)[:, 0].tolist()
    s_pads = torch.nonzero(suffix_doc < 0)[:, 0].tolist()
    prefix = plan([Sample(p, [image_at[i] for i in p], p) for p in p_at], [(i, i) for i in p_pads], Np, Np)
    suffix = plan([Sample(p + [Np + j for j in s], [image_at[i] for i in p] + [False] * len(s), [-1] * len(p) + s)
                   for p, s in zip(p_at, s_at)], [(j, Np + j) for j in s_pads], Ns, Np + Ns)  # fmt: skip
    joined_samples = []
    for p, s in zip(p_at, s_at):
        keys = p + [Np + j for j in s]
        joined_samples.append(Sample(keys, [image_at[i] for i in p] + [False] * len(s), keys))
    joined = plan(joined_samples, [(i, i) for i in p_pads] + [(Np + j, Np + j) for j in s_pads], Np + Ns, Np + Ns)
    return PackedSegments(prefix, suffix, joined)


def segments_mask(segments: Segments, n_keys: int) -> torch.Tensor:
    """[N, n_keys] bool: the pairs the calls attend, each query's row (what tests compare with the dense rules)."""
    inverse = segments.inverse.cpu()
    allowed = torch.zeros(inverse.shape[0], n_keys, dtype=torch.bool)
    for call in segments.calls:
        cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
        for s in range(len(cu_q) - 1):
            queries, keys = call.queries[cu_q[s] : cu_q[s + 1]].cpu(), call.keys[cu_k[s] : cu_k[s + 1]].cpu()
            pairs = _segment_mask(len(queries), len(keys), call.causal)
            allowed[queries[:, None], keys[None, :]] = pairs if pairs is not None else True
    return allowed


def _segment_mask(n_q: int, n_k: int, causal: bool) -> torch.Tensor | None:
    """Bottom-right causal: query i of n_q sees keys up to n_k - n_q + i."""
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q) if causal else None


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """q [1, heads, N, d], k and v [1, kv_heads, Nk, d] -> [1, heads, N, d]."""
    if q.device.type == "cuda":
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"pack_attention = 'varlen' on CUDA computes in bf16 or fp16 (FlashAttention, cuDNN), "
                             f"got {dtype}; run it under autocast (the h200 profiles do) or pick pack_attention "
                             f"'packed'")  # fmt: skip
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    rows = lambda t: t[0].transpose(0, 1)  # noqa: E731  [1, h, N, d] -> [N, h, d]
    q = Gather.apply(rows(q), segments.queries, segments.inverse[:, None])
    k = Gather.apply(rows(k), segments.keys, segments.key_copies)
    v = Gather.apply(rows(v), segments.keys, segments.key_copies)
    outputs, q_at, k_at = [], 0, 0
    for call in segments.calls:
        nq, nk = call.queries.shape[0], call.keys.shape[0]
        outputs.append(
            varlen_call(q[q_at : q_at + nq], k[k_at : k_at + nk], v[k_at : k_at + nk], call, segments.kernel)
        )
        q_at, k_at = q_at + nq, k_at + nk
    out = Gather.apply(torch.cat(outputs), segments.inverse, segments.queries[:, None])
    return out.transpose(0, 1)[None]


def varlen_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: VarlenCall, kernel: str = "flash"
) -> torch.Tensor:
    """One varlen call on its gathered buffers: [nq, heads, d], [nk, kv_heads, d] x2 -> [nq, heads, d]."""
    if q.device.type == "cuda" and kernel == "cudnn":
        from engine.molmo2.attention.cudnn import cudnn_varlen_call

        return cudnn_varlen_call(q, k, v, call)
    if q.device.type == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        window = (-1, 0) if call.causal else (-1, -1)  # (-1, 0): causal, bottom-right
        return varlen_attn(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, window_size=window, **_GQA)
    # The CPU's kernel: one SDPA call per segment under the same rule as a dense mask.
    cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
    outputs = []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t, a, b in ((q, cu_q[s], cu_q[s + 1]), (k, cu_k[s], cu_k[s + 1]),
                                                                   (v, cu_k[s], cu_k[s + 1])))  # fmt: skip
        mask = _segment_mask(qs.shape[2], ks.shape[2], call.causal)
        outputs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outputs)


def _gqa_argument() -> dict:
    """varlen_attn grew `enable_gqa` after torch 2.11; FlashAttention itself takes fewer key heads either way."""
    from torch.nn.attention import varlen

    return {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters else {}


# Read at import, outside any compiled block's trace, and only where varlen_call's CUDA branch can run: importing
# torch.nn.attention.varlen imports torch._dynamo, about a second of every CPU process's start.
_GQA = _gqa_argument() if torch.cuda.is_available() else {}
