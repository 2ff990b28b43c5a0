"""Do FlashAttention-4's Hopper kernels (the flash-attn-4 package's CuTe DSL port of FlashAttention-3) run the
varlen calls faster than cuDNN? Per call, beside pack_attention "varlen-cudnn" (engine/molmo2/attention/cudnn.py).

On the pool's largest one-pass (joined) plan, random bf16 q/k/v at the decoder's heads, for each of the plan's two
calls: cuDNN's forward and forward + backward, then flash-attn-4's `flash_attn_varlen_func` with grouped-query heads
packed into the query tile (`pack_gqa`) and without, on the same THD buffers (a causal call is FlashAttention's
causal mask, aligned bottom-right like cuDNN's band). The text runs' call is short queries against long keys (about
60 queries against 350 keys a segment), where packing a key head's 4 query heads into one tile matters most.
Printed per call and kernel: median ms, and the largest difference from cuDNN in the output and each gradient.
Each kernel compiles on its first call (not timed: the warm-up absorbs it).

    python bench/fa4_varlen_probe.py --profile h200-4b [--warmup 3 --repeats 20] --out DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.cudnn_varlen_probe import call_inputs, largest_joined_plan, probe_arguments  # noqa: E402
from bench.flex_configs import timed  # noqa: E402
from engine.molmo2.attention.segments import varlen_call  # noqa: E402

KERNELS = {"fa4": {"pack_gqa": False}, "fa4-pack-gqa": {"pack_gqa": True}}


def main(argv: list[str] | None = None) -> list[dict]:
    args, out_dir, device = probe_arguments(argv)
    if device.type != "cuda":
        raise SystemExit(f"profile {args.profile} runs on the CPU: cuDNN and FlashAttention are CUDA kernels")
    from importlib.metadata import version

    from flash_attn.cute.interface import flash_attn_varlen_func

    conditions = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
                  "flash_attn_4": version("flash-attn-4"), "cutlass_dsl": version("nvidia-cutlass-dsl-libs-base"),
                  "warmup": args.warmup, "repeats": args.repeats,
                  "timing": "median of CUDA-event times per call after warm-up (the first call compiles)"}  # fmt: skip
    rows: list[dict] = []
    plan, text = largest_joined_plan(args.profile)
    plan = plan.to(device)
    g = torch.Generator(device=device).manual_seed(0)

    def save(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out_dir / f"fa4_varlen_probe_{args.profile}.json").write_text(
            json.dumps({"conditions": conditions, "rows": rows}, indent=1)
        )

    for call in plan.calls:
        name = "causal (text runs)" if call.causal else "full (image runs)"
        nq, nk = call.queries.shape[0], call.keys.shape[0]
        q, k, v, do = call_inputs(call, text, device, g)
        head = {"call": name, "segments": call.cu_q.shape[0] - 1, "queries": nq, "keys": nk, "max_q": call.max_q,
                "max_k": call.max_k}  # fmt: skip
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = varlen_call(*leaves, call, "cudnn")
        ref_grads = torch.autograd.grad(ref_out, leaves, do)
        save({**head, "kernel": "cudnn",
              "forward_ms": timed(lambda: varlen_call(q, k, v, call, "cudnn"), args.warmup, args.repeats, device) * 1e3,
              "fwd_bwd_ms": timed(lambda: torch.autograd.grad(varlen_call(*leaves, call, "cudnn"), leaves, do),
                                  args.warmup, args.repeats, device) * 1e3, "error": None})  # fmt: skip
        for kernel, options in KERNELS.items():
            row, stage = {**head, "kernel": kernel}, "forward"
            try:
                ours = [t.clone().requires_grad_() for t in (q, k, v)]

                def attend(a, b, c):
                    out = flash_attn_varlen_func(a, b, c, cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k,
                                                 max_seqlen_q=call.max_q, max_seqlen_k=call.max_k,
                                                 causal=call.causal, **options)  # fmt: skip
                    return out[0] if isinstance(out, tuple) else out

                out = attend(*ours)
                row["max_abs_out_vs_cudnn"] = float((out.float() - ref_out.float()).abs().max())
                stage = "backward"
                grads = torch.autograd.grad(out, ours, do)
                for grad_name, mine, theirs in zip(("dq", "dk", "dv"), grads, ref_grads):
                    row[f"max_abs_{grad_name}_vs_cudnn"] = float((mine.float() - theirs.float()).abs().max())
                stage = "timing"
                with torch.no_grad():
                    row["forward_ms"] = timed(lambda: attend(q, k, v), args.warmup, args.repeats, device) * 1e3
                row["fwd_bwd_ms"] = timed(lambda: torch.autograd.grad(attend(*ours), ours, do), args.warmup,
                                          args.repeats, device) * 1e3  # fmt: skip
                row["error"] = None
            except Exception as error:  # a stage the package refuses is a row with its reason
                row["error"] = (
                    f"{stage}: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
                )
            save(row)
    print(f"\n{'call':20} {'kernel':14} {'fwd ms':>8} {'f+b ms':>8}  max |kernel - cuDNN| (o, dq, dk, dv)")
    for row in rows:
        times = (f"{row['forward_ms']:8.3f} {row['fwd_bwd_ms']:8.3f}" if row.get("error") is None
                 else f"{'—':>8} {'—':>8}")  # fmt: skip
        diffs = ", ".join(f"{value:.3g}" for key, value in row.items() if key.startswith("max_abs_"))
        print(f"{row['call']:20} {row['kernel']:14} {times}  {diffs}{'  ' + row['error'] if row.get('error') else ''}")
    return rows


if __name__ == "__main__":
    main()
