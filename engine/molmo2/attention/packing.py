"""Packed chunks (run config `pack`, training only): a chunk's samples laid end to end in one row, no padding
between them, instead of one padded row each.

A padded chunk computes every matmul on its padding and, cut by camera count to limit that padding, needs several
backward chunks a step and a gradient accumulation between them. A packed chunk has neither: its prefix row holds
each sample's real prefix tokens in turn, its suffix row each sample's real suffix tokens, and what the rows were
is kept beside them:

- `prefix_doc`, `suffix_doc` [1, N]: the sample (document) of each token, -1 on the row's tail padding (up to the
  compile pad multiple only);
- `prefix_pos`, `suffix_pos` [1, N]: each token's RoPE position in its own sample, what the padded layout gives it
  (`positions_from_mask`: the prefix counts from 0, the suffix continues after its prefix).

Attention keeps to its document: the prefix's rule is the padded one (causal OR both image tokens, real keys)
within a document; a suffix token sees its document's prefix and, causally, its document's suffix. A tail pad
sees only itself. Everything else is unchanged: the images (their `<im_patch>` ids keep their order, since both
layouts flatten the samples in order), the state slots (`state_rows` and `state_positions` name their packed
column), the labels and the loss. So a packed chunk computes the padded chunk's function: forward parity and
gradient parity with the padded chunk are tests (tests/test_molmo2_packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.nn.attention.flex_attention import BlockMask

from engine.molmo2.attention.segments import PackedSegments, packed_segments
from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch, positions_from_mask


@dataclass(frozen=True)
class Packing:
    prefix_doc: torch.Tensor  # [1, Np] long: the sample of each prefix token, -1 on the tail padding
    prefix_pos: torch.Tensor  # [1, Np] long: its RoPE position within its sample
    suffix_doc: torch.Tensor  # [1, Ns] long
    suffix_pos: torch.Tensor  # [1, Ns] long
    segments: PackedSegments  # the varlen plans of its rows, for the varlen choices of pack_attention

    def to(self, device: torch.device | str) -> "Packing":
        moved = (t.to(device) for t in (self.prefix_doc, self.prefix_pos, self.suffix_doc, self.suffix_pos))
        return Packing(*moved, self.segments.to(device))

    def joined(self, mm_token_type_ids: torch.Tensor) -> tuple["Packing", torch.Tensor]:
        """The prefix row and the suffix row as one row [prefix | suffix] (pack_one_pass), as this Packing's prefix
        fields (the joined row's varlen plan as its prefix plan), and that row's mm_token_type_ids; the suffix fields
        stay the suffix's. Every suffix token comes after its whole sample's prefix, so the prefix's rule on the
        joined row (within a sample, causal OR both image, real keys) is both rules at once: a prefix token sees its
        sample's prefix (the suffix comes later and has no image tokens), a suffix token its sample's prefix and,
        causally, its suffix."""
        types = torch.cat([mm_token_type_ids, torch.zeros_like(self.suffix_doc)], dim=1)
        packing = replace(self, prefix_doc=torch.cat([self.prefix_doc, self.suffix_doc], dim=1),
                          prefix_pos=torch.cat([self.prefix_pos, self.suffix_pos], dim=1),
                          segments=replace(self.segments, prefix=self.segments.joined))  # fmt: skip
        return packing, types


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _flatten(values: torch.Tensor, real: torch.Tensor, length: int, fill: int | bool) -> torch.Tensor:
    """The real entries of a [B, L] tensor, row after row, in one row of `length`, `fill` after them."""
    out = torch.full((1, length), fill, dtype=values.dtype)
    flat = values[real]
    out[0, : flat.numel()] = flat
    return out


def _documents(real: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc, position within the doc) of each packed token of a [B, L] real-token mask."""
    doc = _flatten(torch.arange(real.shape[0])[:, None].expand_as(real).contiguous(), real, length, -1)
    return doc, _flatten(positions_from_mask(real), real, length, 0)


def pack(batch: ARBatch, multiple: tuple[int, int] = (1, 1)) -> ARBatch:
    """A padded chunk (prefix LEFT-padded, suffix RIGHT-padded; on the host) as one packed row each for the
    prefix and the suffix, their lengths rounded up to `multiple` (the compile pad multiple)."""
    if batch.packing is not None:
        raise ValueError("pack: this chunk is packed already")
    p, s = batch.prefix, batch.suffix
    p_real, s_real = p.attention_mask.bool(), s.attention_mask.bool()
    Np = _round_up(int(p_real.sum()), multiple[0])
    Ns = _round_up(int(s_real.sum()), multiple[1])
    prefix_doc, prefix_pos = _documents(p_real, Np)
    suffix_doc, suffix_pos = _documents(s_real, Ns)
    lengths = p_real.sum(1)
    suffix_pos = torch.where(suffix_doc >= 0, suffix_pos + lengths[suffix_doc.clamp(min=0)], 0)
    # The state slot of sample b: its column among b's real tokens, after the samples before it.
    offsets = torch.cumsum(lengths, 0) - lengths
    state_within = positions_from_mask(p_real).gather(1, p.state_positions[:, None])[:, 0]
    assert bool(p_real.gather(1, p.state_positions[:, None]).all()), "a state slot on padding"
    pad_id = 0  # the tail padding: any id but <im_patch>; a tail token attends only to itself and nothing reads it
    prefix = replace(
        p,
        input_ids=_flatten(p.input_ids, p_real, Np, pad_id),
        attention_mask=prefix_doc >= 0,
        mm_token_type_ids=_flatten(p.mm_token_type_ids, p_real, Np, 0),
        state_positions=offsets + state_within,
        state_rows=torch.zeros_like(p.state_positions),
    )
    suffix = replace(
        s,
        input_ids=_flatten(s.input_ids, s_real, Ns, pad_id),
        attention_mask=suffix_doc >= 0,
        labels=_flatten(s.labels, s_real, Ns, IGNORE_INDEX),
        action_mask=_flatten(s.action_mask, s_real, Ns, False),
    )
    segments = packed_segments(prefix_doc[0], suffix_doc[0], prefix.mm_token_type_ids[0] == 1)
    packing = Packing(prefix_doc, prefix_pos, suffix_doc, suffix_pos, segments)
    return replace(batch, prefix=prefix, suffix=suffix, packing=packing)


# ---- masks: the padded rules within each document ----


def block_mask_from_pairs(pairs: torch.Tensor, mask_mod, block: int = 128) -> BlockMask:
    """The BlockMask create_block_mask(mask_mod) builds, from the rule's [Q, KV] bool pairs: the blocks with every
    pair allowed are full, those with some are partial (mask_mod decides within them), the rest are skipped.

    create_block_mask would evaluate mask_mod on every pair with int64 intermediates of Q x KV (gigabytes at a
    packed 4B prefix) eagerly, or through torch.compile, once per new packed length (tens of seconds each). The
    bool pairs cost a byte a pair and no compilation. The tail of a row not a multiple of `block` counts as
    disallowed, as in create_block_mask, so a ragged block is never full."""
    Q, KV = pairs.shape
    padded = torch.nn.functional.pad(pairs, (0, -KV % block, 0, -Q % block))
    allowed = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block).sum((1, 3))
    full = allowed == block * block
    partial = (allowed > 0) & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # per query block: how many key blocks, and their indices first, ascending (create_block_mask's order)
        count = blocks.sum(-1).to(torch.int32)
        indices = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
        return count[None, None].contiguous(), indices[None, None].contiguous()

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(Q, KV)
    )


def packed_prefix_mask(packing: Packing, mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, Np, Np] bool: (causal OR both image tokens) within a document, real keys; a tail pad sees itself."""
    doc = packing.prefix_doc[0]
    N = doc.shape[0]
    image = mm_token_type_ids[0] == 1
    index = torch.arange(N, device=doc.device)
    allowed = (doc[:, None] == doc[None, :]) & ((index[:, None] >= index[None, :]) | (image[:, None] & image[None, :]))
    allowed = (allowed & (doc[None, :] >= 0)) | torch.eye(N, dtype=torch.bool, device=doc.device)
    return allowed[None, None]


def packed_prefix_block_mask(packing: Packing, mm_token_type_ids: torch.Tensor) -> BlockMask:
    doc = packing.prefix_doc[0]
    image = mm_token_type_ids[0] == 1

    def allowed(b, h, q, kv):
        same = (doc[q] == doc[kv]) & ((q >= kv) | (image[q] & image[kv])) & (doc[kv] >= 0)
        return same | (q == kv)

    return block_mask_from_pairs(packed_prefix_mask(packing, mm_token_type_ids)[0, 0], allowed)


def packed_suffix_mask(packing: Packing) -> torch.Tensor:
    """[1, 1, Ns, Np + Ns] bool: a suffix token sees its document's prefix and, causally, its document's suffix;
    a tail pad sees itself."""
    p_doc, s_doc = packing.prefix_doc[0], packing.suffix_doc[0]
    Ns = s_doc.shape[0]
    index = torch.arange(Ns, device=s_doc.device)
    to_prefix = (s_doc[:, None] == p_doc[None, :]) & (p_doc[None, :] >= 0)
    to_suffix = (s_doc[:, None] == s_doc[None, :]) & (index[:, None] >= index[None, :]) & (s_doc[None, :] >= 0)
    to_suffix = to_suffix | torch.eye(Ns, dtype=torch.bool, device=s_doc.device)
    return torch.cat([to_prefix, to_suffix], dim=1)[None, None]
