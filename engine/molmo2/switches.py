"""The items a Molmo2 registration may test, as switches. All False is the baseline: the training step as the
S-bundle's code sites have it before any item."""

from __future__ import annotations

from dataclasses import dataclass, fields

# Switches whose ladders dropped them. Frozen documents still name them (the declaration keeps them), but their code
# has left the workload: such a document runs only at the commit its provenance records.
RETIRED = {
    "vit_bf16_attention": "X1, the frozen ViT's attention in bf16",
    "pool_fp32_math": "X3, the pooling attention as fp32 arithmetic",
    "fp8_decoder_linears": "X5, the decoder blocks' four linears as float8 matmuls (tensorwise scales)",
    "fp8_rowwise_decoder_linears": "X6, the decoder blocks' four linears as float8 matmuls (rowwise scales)",
    "fp8_normed_input_linears": "X8, the decoder blocks' two RMSNorm-reading linears as float8 matmuls",
    "staged_update": "X9, X7's update in stages, each waited for where the next step's forward first reads it",
    "clip_in_adamw": "X4, the gradient clip folded into the fused AdamW's grad_scale instead of a multiply pass first",
    "packed_query_heads": "X12, the image runs' varlen calls with each key head's query heads as one head's rows",
}


@dataclass(frozen=True)
class Switches:
    # P1: prepend cuDNN to the suffix attention's backend list, in training mode only (decode keeps the baseline's).
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
    # X2: the frozen ViT's attention on fp16 inputs (FLASH under CUDA; 10 bits of mantissa, 3 more than bf16) instead
    # of the hub's fp32, in training mode only, on any device. A numerics change.
    vit_fp16_attention: bool = False
    # X7: the optimizer step (clip and AdamW) on a side stream, under the next step's frozen-ViT forward, which reads
    # no trainable weight; the next step's first trainable read waits for it. The same kernels on the same inputs:
    # bitwise the baseline's update, only its place on the device's timeline moves. CUDA and one process only.
    optimizer_overlaps_vision: bool = False
    # X10: the trainable linears' weights held in bf16 (autocast's cast of them, made once per update instead of
    # before every matmul) over fp32 masters in the optimizer, whose one fused pass per bucket clips, steps AdamW
    # and writes the bf16 weights; their gradients stay bf16. CUDA, one process, one backward chunk. A numerics
    # change where gradients are summed and in the update's rounding.
    bf16_linear_weights: bool = False
    # X11: the decoder MLP's SwiGLU as one op each way (model/swiglu.py), whose backward reads each (up, gate) pair
    # and its gradient once and writes both halves of the [up, gate] gradient and h, which it therefore need not keep
    # for the backward; Triton on CUDA. Training mode only.
    # A numerics change at the last bit: fp32 arithmetic rounded once, as inductor's kernels, in another order.
    fused_swiglu: bool = False

    @classmethod
    def from_names(cls, names: list[str] | tuple[str, ...] | frozenset[str]) -> "Switches":
        retired = sorted(set(names) & set(RETIRED))
        if retired:
            raise ValueError(
                f"switch(es) {retired} are retired ({'; '.join(RETIRED[n] for n in retired)}): their code has left "
                "the workload; run a document that uses them at the commit its provenance records"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"unknown switch(es) {unknown}; the molmo2 workload has {sorted(known)}")
        return cls(**{name: True for name in names})

    def on(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


BASELINE = Switches()
