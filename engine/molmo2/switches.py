"""The S-bundle of seed 000 as switches. All False is HEAD: the baseline faithful to the seed's code sites."""

from __future__ import annotations

from dataclasses import dataclass, fields

# Registration switch name -> the seed's item id, for messages and reports.
SEED_ITEM = {
    "suffix_cudnn": "P1",
    "windowed_vram_peak": "P2",
    "device_assert_patch_count": "P3a",
    "branchless_extension_lookup": "P3b",
    "masked_loss_sums": "P3c",
    "no_embed_clone": "P4",
}


@dataclass(frozen=True)
class Switches:
    # P1: prepend cuDNN to the suffix attention's backend list, in training mode only (decode keeps HEAD's list).
    suffix_cudnn: bool = False
    # P2: emit vram_window_peak_gib per window and reset the peak; the lifetime field keeps its monotone meaning.
    windowed_vram_peak: bool = False
    # P3a: the <im_patch>-count validation as a device-side assert instead of int(is_patch.sum()) on the host.
    device_assert_patch_count: bool = False
    # P3b: the extension-embedding lookup without the bool(is_extension.any()) branch.
    branchless_extension_lookup: bool = False
    # P3c: mask-multiplied sums instead of boolean indexing in the sum-form (chunked) losses.
    masked_loss_sums: bool = False
    # P4: no clone of the prefix embedding before the in-place masked feature add.
    no_embed_clone: bool = False
    # X1 (not a seed item; issue 5's profile): the frozen ViT's attention in the autocast dtype (bf16 under CUDA
    # autocast: FLASH) instead of the hub's fp32 float32_attention, in training mode only. A numerics change.
    vit_bf16_attention: bool = False
    # X2 (not a seed item; X1's successor after X1a refused it): the frozen ViT's attention on fp16 inputs (FLASH
    # under CUDA; 10 bits of mantissa, 3 more than bf16), in training mode only, on any device. A numerics change.
    vit_fp16_attention: bool = False
    # X3 (not a seed item; the fast step's profile by self time): the pooling attention (one query against the 4
    # patches of a 2x2 window) as fp32 arithmetic instead of fp32 SDPA, whose memory-efficient kernel spends 9 ms a
    # step on 1-row queries at 4B; in training mode only. A numerics change (fp32 reduction order).
    pool_fp32_math: bool = False
    # X4 (not a seed item; same profile): the gradient clip folded into the fused AdamW (its grad_scale, as
    # GradScaler uses it) instead of a multiply over every gradient first (8 ms a step at 4B). Below the clip the
    # update is HEAD's bitwise; above it, a divide by 1/c instead of a multiply by c. Needs the fused AdamW.
    clip_in_adamw: bool = False

    def __post_init__(self) -> None:
        if self.vit_bf16_attention and self.vit_fp16_attention:
            raise ValueError("vit_bf16_attention (X1) and vit_fp16_attention (X2) are two precisions for the same "
                             "ViT attention; switch on at most one")  # fmt: skip

    @classmethod
    def from_names(cls, names: list[str] | tuple[str, ...] | frozenset[str]) -> "Switches":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"unknown switch(es) {unknown}; the molmo2 workload has {sorted(known)}")
        return cls(**{name: True for name in names})

    def on(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


HEAD = Switches()
