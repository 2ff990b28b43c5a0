"""How the decoder executes, apart from what it computes: where and with which kernel attention runs, and
torch.compile.

These are run config, not S-bundle switches: they change speed and the order of floating-point reductions, never
the function. Each path's parity with the baseline's eager dense-SDPA path is a test with a stated tolerance
(tests/test_molmo2_execution.py, tests/test_molmo2_packing.py).

- prefix_attention: "sdpa" (the baseline) runs SDPA with `enable_gqa` on the dense causal-OR-image bool mask. With
  a mask and GQA neither FLASH nor EFFICIENT takes the call, so SDPA runs MATH and holds [B, heads, S, S] scores.
  "flex" runs FlexAttention on the same rule as a block mask: all-masked blocks (above the diagonal, outside the
  image blocks) are skipped and the rest run fused. The suffix runs SDPA on its dense mask (the P1 site) unless
  its packed row runs as varlen segments.
- compile: each decoder block, and the frozen vision tower, wrapped in torch.compile with specialised shapes. The
  blocks share one code object, so one graph per input shape serves them all; the norms, RoPE, SwiGLU and residual
  adds fuse. Each new shape compiles once, so compiled runs pad to few shapes (engine/molmo2/runner.py).
- compile_tuning (with compile): "default" sizes each Triton kernel by inductor's heuristics; "coordinate-descent"
  times each kernel's neighbouring block sizes and warp counts while compiling and keeps the fastest. Pointwise
  kernels compute the same values either way; a reduction's order can move with its block size.
- pack_attention (with pack, packing.py): where a packed chunk attends. "packed": on the packed row, under masks
  that keep each sample to itself (dense for SDPA, block masks under prefix_attention = "flex"). "varlen": the
  packed row cut into segments, one per run of text or image tokens of a sample (segments.py), on
  FlashAttention-2's variable-length kernel: no per-pair rule inside the kernel. "varlen-cudnn": the same segments
  on cuDNN's fused SDPA (cudnn.py). Both varlen kernels compute in bf16/fp16 on CUDA; on the CPU both run the same
  per-segment reference. prefix_attention does not apply to them.
- pack_one_pass (with pack, training): a packed chunk's prefix row and suffix row joined into one row through every
  block but the last (model.joined_suffix_hidden), so each weight serves one matmul a layer instead of two: one
  cast to bf16 and one weight gradient, nothing to accumulate.
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
    compile: bool = False
    compile_tuning: str = "default"  # consulted when compile is on
    pack_attention: str = "packed"  # consulted for packed chunks only
    pack_one_pass: bool = False

    @classmethod
    def of(cls, config: "Molmo2RunConfig") -> "Execution":
        packing = (
            {} if not config.pack else {"pack_attention": config.pack_attention, "pack_one_pass": config.pack_one_pass}
        )
        tuning = {} if not config.compile else {"compile_tuning": config.compile_tuning}
        return cls(config.prefix_attention, config.compile, **tuning, **packing)

    def compile_options(self) -> dict[str, bool]:
        """inductor's options for the compiled blocks and tower."""
        return {"coordinate_descent_tuning": True} if self.compile_tuning == "coordinate-descent" else {}


EAGER = Execution()
