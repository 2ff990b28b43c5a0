"""Does cuDNN's SDPA run the varlen calls faster than torch's FlashAttention-2? Per call, pack_attention
"varlen-cudnn"'s kernel (engine/molmo2/attention/cudnn.py) beside "varlen"'s, outside the training step.

The varlen one-pass step spends 106 ms a step in FlashAttention-2 (bench/results/profile_packed-varlen-one-pass-x2-x34):
the image runs' call at ~200 TFLOP/s, the text runs' at ~115. cuDNN's Hopper SDPA kernels (the ones the vision
tower already runs through torch) take the same segments as ragged (THD) tensors with per-segment lengths, grouped
keys and values, and a bottom-right causal band; torch does not expose that path (its varlen_attn is FlashAttention-2
only), the cudnn-frontend Python package (nvidia-cudnn-frontend, carried as a wheel) does.

On the pool's largest packed step, one-pass (joined) plan, random bf16 q/k/v at the decoder's heads, for each of the
plan's two calls: each kernel's forward, and forward + backward through autograd, on the same gathered THD buffers.
Printed per call: times (median of CUDA-event times after warm-up), cuDNN's largest difference from
FlashAttention-2 in the output and each gradient, and whatever stage failed, with its reason.

    python bench/cudnn_varlen_probe.py --profile h200-4b [--warmup 3 --repeats 20] --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.flex_configs import timed  # noqa: E402
from engine.molmo2.attention.segments import varlen_call  # noqa: E402
from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.run_config import UNRECORDED_DEFAULTS, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402


def largest_joined_plan(profile: str):
    raw = {"batch": 12, "camera_counts": [1, 2], "max_crops": 1, "backward_chunks": 1, "compile": True, "pack": True,
           "pack_one_pass": True, "pack_attention": "varlen"}  # fmt: skip
    runner = Molmo2Runner(PROFILES[profile], resolve(PROFILES[profile], raw, UNRECORDED_DEFAULTS), seed=0)
    runner.load_data()
    chunks = [step.chunks[0] for step in runner.pool]
    chunk = max(chunks, key=lambda c: c.prefix.input_ids.shape[1])
    return chunk.packing.segments.joined, runner.config.text


def probe_arguments(argv: list[str] | None) -> tuple[argparse.Namespace, Path, torch.device]:
    """The varlen probes' command line (--profile, --warmup, --repeats, --out): the arguments, the output folder
    (made), and the profile's device."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return args, out_dir, torch.device(PROFILES[args.profile].device)


def call_inputs(call, text, device: torch.device, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random bf16 q [nq, heads, d], k and v [nk, kv_heads, d] and an output gradient for one varlen call at the
    decoder's heads."""
    nq, nk = call.queries.shape[0], call.keys.shape[0]
    heads, kv_heads, d = text.num_heads, text.num_kv_heads, text.head_dim
    q = torch.randn(nq, heads, d, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(nk, kv_heads, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn(nq, heads, d, device=device, dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def main(argv: list[str] | None = None) -> list[dict]:
    args, out_dir, device = probe_arguments(argv)
    conditions = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "dtype": "bfloat16", "warmup": args.warmup, "repeats": args.repeats,
                  "timing": "median of CUDA-event times per call after warm-up"}  # fmt: skip
    rows: list[dict] = []

    def save(row: dict) -> None:  # after every row: a call that runs out of time still brings back what it finished
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out_dir / f"cudnn_varlen_probe_{args.profile}.json").write_text(
            json.dumps({"conditions": conditions, "rows": rows}, indent=1)
        )

    if device.type != "cuda":
        save(
            {
                "name": "setup",
                "error": f"profile {args.profile} runs on the CPU: cuDNN and FlashAttention are CUDA kernels",
            }
        )
        return rows
    try:
        import cudnn

        conditions["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        conditions["cudnn_backend"] = cudnn.backend_version()
    except Exception as error:  # the probe's first question: does the package load here at all
        save({"name": "setup", "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"})
        return rows
    plan, text = largest_joined_plan(args.profile)
    plan = plan.to(device)
    g = torch.Generator(device=device).manual_seed(0)
    for call in plan.calls:
        name = "causal (text runs)" if call.causal else "full (image runs)"
        nq, nk = call.queries.shape[0], call.keys.shape[0]
        q, k, v, do = call_inputs(call, text, device, g)
        row = {
            "name": name,
            "segments": call.cu_q.shape[0] - 1,
            "queries": nq,
            "keys": nk,
            "max_q": call.max_q,
            "max_k": call.max_k,
        }
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fa_out = varlen_call(*leaves, call)  # FlashAttention-2
        fa_grads = torch.autograd.grad(fa_out, leaves, do)
        row["fa2_forward_ms"] = timed(lambda: varlen_call(q, k, v, call), args.warmup, args.repeats, device) * 1e3
        row["fa2_fwd_bwd_ms"] = timed(lambda: torch.autograd.grad(varlen_call(*leaves, call), leaves, do), args.warmup,
                                      args.repeats, device) * 1e3  # fmt: skip
        stage = "forward"
        try:
            cudnn_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = varlen_call(*cudnn_leaves, call, "cudnn")
            row["max_abs_out_vs_fa2"] = float((out.float() - fa_out.float()).abs().max())
            stage = "backward"
            grads = torch.autograd.grad(out, cudnn_leaves, do)
            for grad_name, ours, theirs in zip(("dq", "dk", "dv"), grads, fa_grads):
                row[f"max_abs_{grad_name}_vs_fa2"] = float((ours.float() - theirs.float()).abs().max())
            stage = "timing"
            row["cudnn_forward_ms"] = (
                timed(lambda: varlen_call(q, k, v, call, "cudnn"), args.warmup, args.repeats, device) * 1e3
            )
            backward = lambda: torch.autograd.grad(varlen_call(*cudnn_leaves, call, "cudnn"), cudnn_leaves, do)  # noqa: E731
            row["cudnn_fwd_bwd_ms"] = timed(backward, args.warmup, args.repeats, device) * 1e3
            row["error"] = None
        except Exception as error:  # a stage cuDNN refuses is a row with its reason, not a crash
            row["error"] = f"{stage}: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        save(row)
    print(
        f"\n{'call':20} {'segs':>5} {'FA2 fwd':>8} {'FA2 f+b':>8} {'cuDNN fwd':>9} {'cuDNN f+b':>9}  "
        "max |cuDNN - FA2| (o, dq, dk, dv)"
    )
    for row in rows:
        if "segments" not in row:
            print(f"{row['name']:20} {row['error']}")
            continue
        cudnn_times = (f"{row['cudnn_forward_ms']:9.3f} {row['cudnn_fwd_bwd_ms']:9.3f}" if row.get("error") is None
                       else f"{'—':>9} {'—':>9}")  # fmt: skip
        diffs = ", ".join(f"{row[key]:.3g}" for key in ("max_abs_out_vs_fa2", "max_abs_dq_vs_fa2", "max_abs_dk_vs_fa2",
                                                        "max_abs_dv_vs_fa2") if key in row)  # fmt: skip
        print(
            f"{row['name']:20} {row['segments']:5} {row['fa2_forward_ms']:8.3f} {row['fa2_fwd_bwd_ms']:8.3f} "
            f"{cudnn_times}  "
            f"{diffs}{'  ' + row['error'] if row.get('error') else ''}"
        )
    return rows


if __name__ == "__main__":
    main()
