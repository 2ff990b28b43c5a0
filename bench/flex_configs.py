"""The prefix's FlexAttention alone, forward and forward + backward, under several kernel configurations, beside
SDPA on the same inputs: which configuration the fast path should ask for.

The inputs are the workload's own: the largest prefix chunk of the fast path's pool (its attention mask and
image tokens, so the block mask has the real causal-OR-image structure and padding), random q/k/v at the
decoder's heads (bf16, as under autocast). Each row compiles `flex_attention` afresh with its kernel options.

FLOPs count the allowed (query, key) pairs of the dense mask, not the tiles a kernel visits: forward
4 x pairs x head_dim x heads (QK^T and PV), backward 10 x pairs x head_dim x heads (the recomputed QK^T, dV, dP,
dQ, dK), so a row's TFLOP/s is useful work. Peers in the same run: SDPA on the dense bool mask (the baseline's
call, with whichever backend SDPA picks for GQA with a mask), and SDPA causal with no mask (FLASH): not the same
attention (its rate counts the causal pairs it computes), the rate a dense kernel reaches on this shape.

    python bench/flex_configs.py --profile h200-4b [--configs default,tma,...] [--warmup 3 --repeats 20] --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.model.model import prefix_attention_mask, prefix_block_mask  # noqa: E402
from engine.molmo2.run_config import UNRECORDED_DEFAULTS, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402

# name -> kernel options for flex_attention (None: SDPA peers). "default" is what the model asks for: no options, so
# FlexAttention's own choice (the main Triton kernel at a prefix's lengths). The others name that kernel and tune
# it. H200 (sm90) defaults at head_dim 128, bf16: forward BLOCK_M 128, BLOCK_N 64, 3 stages, 8 warps; backward
# BLOCK_M1 64, BLOCK_N1 128, BLOCK_M2 128, BLOCK_N2 64, 3 stages, 8 warps (torch 2.11's template heuristics).
CONFIGS: dict[str, dict] = {
    "default": {},
    "rows-safe": {"BACKEND": "TRITON", "ROWS_GUARANTEED_SAFE": True},  # every query row keeps its own key
    "tma": {"BACKEND": "TRITON", "USE_TMA": True},
    "fwd-128x128": {
        "BACKEND": "TRITON",
        "fwd_BLOCK_M": 128,
        "fwd_BLOCK_N": 128,
        "fwd_num_warps": 8,
        "fwd_num_stages": 2,
    },
    "bwd-64x64-w4": {
        "BACKEND": "TRITON",
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 64,
        "bwd_num_warps": 4,
        "bwd_num_stages": 3,
    },
    "bwd-s2": {"BACKEND": "TRITON", "bwd_num_stages": 2},
    "bwd-s4": {"BACKEND": "TRITON", "bwd_num_stages": 4},
    "bwd-w4": {"BACKEND": "TRITON", "bwd_num_warps": 4},
}
PEERS = ("sdpa-dense-mask", "sdpa-causal-flash")


def largest_prefix(profile: str):
    """(attention_mask, mm_token_type_ids) of the fast path's largest prefix chunk (most real tokens), and the
    decoder's TextConfig."""
    raw = {
        "batch": 12,
        "camera_counts": [1, 2],
        "max_crops": 1,
        "backward_chunks": 1,
        "prefix_attention": "flex" if PROFILES[profile].device == "cuda" else "sdpa",
        "compile": PROFILES[profile].device == "cuda",
        "bucket_by_length": True,
    }
    # the keys over the defaults this benchmark was written against (the padded eager step)
    runner = Molmo2Runner(PROFILES[profile], resolve(PROFILES[profile], raw, UNRECORDED_DEFAULTS), seed=0)
    runner.load_data()
    chunks = [c.prefix for step in runner.pool for c in step.chunks]
    prefix = max(chunks, key=lambda p: int(p.attention_mask.sum()))
    return prefix.attention_mask, prefix.mm_token_type_ids, runner.config.text


def attention_flops(dense: torch.Tensor, heads: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs over the allowed pairs of a [B, 1, S, S] bool mask."""
    pairs = float(dense.sum()) * heads
    return 4 * pairs * head_dim, 10 * pairs * head_dim


def timed(fn, warmup: int, repeats: int, device: torch.device) -> float:
    """Median seconds of fn() after warm-up (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {sorted(CONFIGS)}")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; allowed: {sorted(CONFIGS)}")

    profile = PROFILES[args.profile]
    device = torch.device(profile.device)
    attention_mask, image_tokens, text = largest_prefix(args.profile)
    heads, kv_heads, head_dim = text.num_heads, text.num_kv_heads, text.head_dim
    B, S = attention_mask.shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, heads, S, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, kv_heads, S, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, kv_heads, S, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
    cotangent = torch.randn(B, heads, S, head_dim, device=device, dtype=dtype, generator=g)
    dense = prefix_attention_mask(attention_mask, image_tokens)
    block = prefix_block_mask(attention_mask, image_tokens)
    fwd_flops, bwd_flops = attention_flops(dense, heads, head_dim)
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()[None, None].expand(B, 1, S, S)
    causal_flops = attention_flops(causal, heads, head_dim)  # the causal peer's own pairs: less work than the mask's
    conditions = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": B,
        "seq": S,
        "real_tokens": int(attention_mask.sum()),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "allowed_pairs_fraction": float(dense.float().mean()),
        "block_mask_sparsity_pct": float(block.sparsity()),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "timing": "median of CUDA-event times per call after warm-up; each flex row compiled afresh",
    }
    print("conditions: " + json.dumps(conditions), flush=True)

    rows, reference = [], None
    for name in [*names, *PEERS]:
        torch._dynamo.reset()
        if name in CONFIGS:
            options = (CONFIGS[name] or None) if device.type == "cuda" else None  # a CPU run checks the script
            compiled = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
            call = lambda: compiled(q, k, v, block_mask=block, enable_gqa=True, kernel_options=options)  # noqa: E731
        elif name == "sdpa-dense-mask":
            call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)  # noqa: E731
        else:

            def call():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        start = time.perf_counter()
        try:
            out = call()
            out.backward(cotangent)
            compile_s = time.perf_counter() - start
            deviation = (
                None
                if reference is None or name == "sdpa-causal-flash"
                else float((out.float() - reference).abs().max())
            )
            if reference is None and name in CONFIGS:
                reference = out.detach().float()
            with torch.no_grad():
                forward_s = timed(call, args.warmup, args.repeats, device)
            both_s = timed(lambda: call().backward(cotangent), args.warmup, args.repeats, device)
            fwd, bwd = causal_flops if name == "sdpa-causal-flash" else (fwd_flops, bwd_flops)
            row = {
                "name": name,
                "kernel_options": CONFIGS.get(name),
                "first_call_s": compile_s,
                "forward_ms": forward_s * 1e3,
                "fwd_bwd_ms": both_s * 1e3,
                "forward_tflops": fwd / forward_s / 1e12,
                "fwd_bwd_tflops": (fwd + bwd) / both_s / 1e12,
                "max_abs_vs_default": deviation,
                "error": None,
            }
        except Exception as error:  # a configuration the compiler refuses is a row with its reason, not a crash
            row = {
                "name": name,
                "kernel_options": CONFIGS.get(name),
                "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}",
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
        q.grad = k.grad = v.grad = None

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"flex_configs_{args.profile}.json").write_text(
        json.dumps({"conditions": conditions, "rows": rows}, indent=1)
    )
    print(f"\n{'':20} {'fwd ms':>8} {'fwd TF/s':>8} {'f+b ms':>8} {'f+b TF/s':>8} {'vs default':>10}")
    for row in rows:
        if row["error"]:
            print(f"{row['name']:20} {row['error']}")
            continue
        dev = "—" if row["max_abs_vs_default"] is None else f"{row['max_abs_vs_default']:.1e}"
        print(
            f"{row['name']:20} {row['forward_ms']:8.2f} {row['forward_tflops']:8.1f} {row['fwd_bwd_ms']:8.2f} "
            f"{row['fwd_bwd_tflops']:8.1f} {dev:>10}"
        )
    return rows


if __name__ == "__main__":
    main()
