"""How the decoder executes, apart from what it computes: the prefix attention's kernel and torch.compile.

These are run config (`prefix_attention`, `compile`), not S-bundle switches: they change speed and the order of
floating-point reductions, never the function. Their parity with HEAD's eager SDPA path is a test with a stated
tolerance (tests/test_molmo2_execution.py); HEAD's own path stays the seed's.

- prefix_attention = "sdpa" (HEAD): SDPA with `enable_gqa` and the dense causal-OR-image bool mask. On torch 2.11
  CUDA neither FLASH (no mask) nor EFFICIENT (no GQA with a mask) takes it, so the ~1k-token prefix runs MATH:
  [B, heads, S, S] scores in memory, the step's largest cost (bench/results/peer_molmo2_h200-4b.json).
- prefix_attention = "flex": FlexAttention with the same rule as a block mask; blocks that are all masked
  (above the diagonal, outside the image blocks) are skipped, the rest run fused, GQA included.
- suffix_attention = "flex" (training only): the suffix's attention to the cached prefix and to itself as a block
  mask (continuation_block_mask) instead of the dense [B, 1, T, P + T] bool mask, whose SDPA runs MATH on this
  torch (the fast step's profile: 35 ms of batched matmuls for a 150-token suffix; measured end to end it saves
  about 1% of the step, since its own kernels take 18 ms). Evaluation and decode keep the dense mask and HEAD's
  backend list (seed 000 P1: decode numerics are frozen).
- compile: each decoder block is wrapped in torch.compile, and so is the frozen vision tower. The blocks share one
  code object, so one compiled graph serves all of them per input shape; the norms, RoPE, the SwiGLU and the
  residual adds fuse. Shapes are specialised (each new one compiles once, 10-30 s at 4B on an H200), so compiled
  runs pad to multiples of 16 (engine/molmo2/runner.py).
- pack_attention (with pack, packing.py): where a packed chunk attends. "packed" (the default): on the packed row,
  under block masks that keep each sample to itself. "rows": on one row per sample, gathered from the packed row
  and back, under the padded chunk's own masks; the matmuls stay packed. Measured on the H200, the packed row's
  FlexAttention cost 42 ms a step more than the padded chunk's on the same samples (profile_packed-x2-x34): its
  query blocks straddle samples, the suffix's most. The same function either way (tests/test_molmo2_packing.py).
  "varlen": FlashAttention's variable-length kernel on the packed row cut into segments, one per run of text or
  image tokens of a sample (segments.py): no per-pair rule in the kernel, where FlexAttention's partial blocks
  evaluate the rule pair by pair. bf16/fp16 on CUDA (autocast); prefix_attention and suffix_attention do not apply.
  Measured on the H200 (molmo2-pack-rows-h200, molmo2-pack-varlen-h200): rows parked (-1.2%), varlen landed (2.07%
  of the one-pass packed step). "varlen-cudnn": the same segments on cuDNN's fused SDPA (cudnn_attention.py,
  cudnn-frontend graphs) instead of FlashAttention-2; on the CPU both run the same per-segment reference.
  Measured on the H200 (molmo2-pack-cudnn-h200): landed, 3.96% of the one-pass varlen step.
- pack_one_pass (with pack, training): a packed chunk's prefix row and suffix row joined into one row through
  every block but the last (model.joined_suffix_hidden), instead of the prefix through all blocks and then the
  suffix through all blocks on its K/V. Each weight then serves one matmul a layer, not two: one cast to bf16,
  one weight gradient, nothing to accumulate (the packed step's profile: 21 ms of casts and 10 ms of fp32
  gradient accumulation). The same function: tests/test_molmo2_packing.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.molmo2.run_config import Molmo2RunConfig

VARLEN_KERNELS = {"varlen": "flash", "varlen-cudnn": "cudnn"}  # the segments' CUDA kernel of each varlen choice


@dataclass(frozen=True)
class Execution:
    """The execution options of one model, taken from a validated run config (the run config owns their rules)."""

    prefix_attention: str = "sdpa"
    suffix_attention: str = "sdpa"
    compile: bool = False
    pack_attention: str = "packed"  # consulted for packed chunks only
    pack_one_pass: bool = False

    @classmethod
    def of(cls, config: "Molmo2RunConfig") -> "Execution":
        packing = (
            {} if not config.pack else {"pack_attention": config.pack_attention, "pack_one_pass": config.pack_one_pass}
        )
        return cls(config.prefix_attention, config.suffix_attention, config.compile, **packing)


EAGER = Execution()
