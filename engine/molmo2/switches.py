"""The items a Molmo2 registration may test, as switches. All False is the baseline: the training step as the
S-bundle's code sites have it before any item."""

from __future__ import annotations

from dataclasses import dataclass, fields

# Switches whose ladders dropped them. Frozen documents still name them (the declaration keeps them), but their code
# has left the workload: such a document runs only at the commit its provenance records.
RETIRED = {
    "vit_bf16_attention": "X1, the frozen ViT's attention in bf16",
    "pool_fp32_math": "X3, the pooling attention as fp32 arithmetic",
}


# The decoder blocks' four linears: the fused qkv and the attention's output (Attention), the fused up/gate and the
# down projection (MLP).
DECODER_LINEARS = frozenset({"att_proj", "attn_out", "ff_proj", "ff_out"})
# float8 switch -> (torchao recipe, the linears it converts)
FLOAT8_SWITCHES = {
    "fp8_decoder_linears": ("tensorwise", DECODER_LINEARS),
    "fp8_rowwise_decoder_linears": ("rowwise", DECODER_LINEARS),
    "fp8_normed_input_linears": ("tensorwise", frozenset({"att_proj", "ff_proj"})),
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
    # X4: the gradient clip folded into the fused AdamW (its grad_scale, as GradScaler uses it) instead of a multiply
    # over every gradient first. Below the clip the update is the baseline's bitwise; above it, a divide by 1/c
    # instead of a multiply by c. Needs the fused AdamW.
    clip_in_adamw: bool = False
    # X5: the decoder blocks' four linears (fused qkv, attention out, fused up/gate, down) as float8 matmuls in
    # training (torchao's float8 training: dynamic tensorwise scales, e4m3 forward, e5m2 gradients); evaluation and
    # decode keep bf16. A numerics change.
    fp8_decoder_linears: bool = False
    # X6: the same linears on torchao's rowwise float8 recipe (one scale per row, e4m3 throughout, power-of-two
    # scales): finer scaling than X5's one scale per tensor. At most one of X5 and X6 is on.
    fp8_rowwise_decoder_linears: bool = False
    # X8: X5's recipe on only the two linears that read an RMSNorm's output (the fused qkv and the fused up/gate,
    # about two thirds of the decoder's linear FLOPs). Their inputs are normalised per token; the other two read the
    # attention's output and SwiGLU's product, whose outlier channels one e4m3 scale serves worst.
    fp8_normed_input_linears: bool = False
    # X7: the optimizer step (clip and AdamW) on a side stream, under the next step's frozen-ViT forward, which reads
    # no trainable weight; the next step's first trainable read waits for it. The same kernels on the same inputs:
    # bitwise the baseline's update, only its place on the device's timeline moves. CUDA and one process only.
    optimizer_overlaps_vision: bool = False

    def __post_init__(self) -> None:
        on = [name for name in FLOAT8_SWITCHES if getattr(self, name)]
        if len(on) > 1:
            raise ValueError(
                f"{on} are float8 plans for the same decoder linears: turn on at most one of {list(FLOAT8_SWITCHES)}"
            )

    def float8_plan(self) -> tuple[str, frozenset[str]] | None:
        """(recipe, the decoder linears it converts) of the float8 switch that is on, or None."""
        for name, plan in FLOAT8_SWITCHES.items():
            if getattr(self, name):
                return plan
        return None

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
