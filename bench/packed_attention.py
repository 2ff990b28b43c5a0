"""A packed step's attention alone (the prefix's and the suffix's FlexAttention, forward + backward), beside the same
samples padded one row each, under several mask formulations: where the packed path's attention time goes.

The profile of the packed arm (bench/results/profile_packed-x2-x34) spent 144 ms a step in FlexAttention where the
padded fast path spent 102 ms on the same samples, with about as many mask blocks (a CPU count: 1,234 partial and
1,029 full prefix blocks packed, 1,205 and 1,024 padded, over the pool). This measures the rows that could explain
it, on the pool's largest packed step (its real block structure; random q/k/v at the decoder's heads, bf16):

- `padded`: the padded chunk of the same 12 samples, the model's prefix_block_mask / continuation_block_mask;
- `packed`: packing.py's masks as they are (rule by document ids);
- `packed-bounds`: the same rule by each token's document bounds (int32), one comparison cheaper per pair;
- `*-128`: the row padded to a multiple of 128, so the kernels know every tile is whole (IS_DIVISIBLE);
- `varlen`: no FlexAttention: FlashAttention's varlen kernel on segments of the row (segments.py, pack_attention
  "varlen"), the gathers in and out included; its output's largest difference from the flex row's on the same
  q/k/v is printed beside it (both bf16);
- `joined`: the one-pass row [prefix | suffix] (pack_one_pass), under flex (`joined packed`) or varlen.

Each formulation's block mask allows exactly the pairs of packing.py's dense masks: a test checks it over the tiny
pool at both lengths (tests/test_bench_peer.py), and it was checked by hand over the h200-4b pool; this script
times, it does not re-check.

Times are per attention call (one layer); the step has 36 such layers, forward and backward. FLOPs count the
allowed (query, key) pairs: forward 4 x pairs x head_dim x heads, backward 10 x pairs x head_dim x heads.

    python bench/packed_attention.py --profile h200-4b [--warmup 3 --repeats 20] --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from bench.flex_configs import attention_flops, timed  # noqa: E402
from engine.molmo2.attention.packing import (  # noqa: E402
    Packing,
    block_mask_from_pairs,
    packed_prefix_block_mask,
    packed_prefix_mask,
    packed_suffix_block_mask,
    packed_suffix_mask,
)
from engine.molmo2.attention.segments import attend_segments, segments_mask  # noqa: E402
from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.model.model import (
    continuation_block_mask,
    continuation_mask,
    prefix_attention_mask,
    prefix_block_mask,
)  # noqa: E402
from engine.molmo2.run_config import UNRECORDED_DEFAULTS, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402

BASE = {"batch": 12, "camera_counts": [1, 2], "max_crops": 1, "backward_chunks": 1}


def steps(profile: str, pack: bool):
    flex = PROFILES[profile].device == "cuda"
    config = {
        **BASE,
        "pack": pack,
        "compile": flex,
        **({"prefix_attention": "flex", "suffix_attention": "flex"} if flex else {}),
    }
    # the keys over the defaults this benchmark was written against (the padded eager step)
    runner = Molmo2Runner(PROFILES[profile], resolve(PROFILES[profile], config, UNRECORDED_DEFAULTS), seed=0)
    runner.load_data()
    return [step.chunks[0] for step in runner.pool], runner.config.text


def pad_packing(packing: Packing, image: torch.Tensor, multiple: int) -> tuple[Packing, torch.Tensor]:
    """The packed rows lengthened to a multiple of `multiple` with tail padding (document -1, not image)."""

    def grow(t: torch.Tensor, fill: int) -> torch.Tensor:
        extra = -t.shape[1] % multiple
        return torch.cat([t, torch.full((1, extra), fill, dtype=t.dtype, device=t.device)], dim=1)

    return Packing(
        grow(packing.prefix_doc, -1),
        grow(packing.prefix_pos, 0),
        grow(packing.suffix_doc, -1),
        grow(packing.suffix_pos, 0),
    ), grow(image, 0)


def document_spans(doc: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[count] first index and one-past-last index of each document in a packed row (-1: tail padding)."""
    index = torch.arange(doc.shape[0], device=doc.device)
    real = doc >= 0
    first = torch.full((count,), doc.shape[0], device=doc.device).scatter_reduce(0, doc[real], index[real], "amin")
    last = torch.zeros(count, dtype=torch.long, device=doc.device).scatter_reduce(0, doc[real], index[real], "amax")
    return first, last + 1


def document_bounds(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] int32 first index and one-past-last index of each token's document; a tail pad (-1) is its own."""
    index = torch.arange(doc.shape[0], device=doc.device)
    first, end = document_spans(doc, int(doc.max()) + 1)
    real, own = doc >= 0, doc.clamp(min=0)
    return torch.where(real, first[own], index).int(), torch.where(real, end[own], index + 1).int()


def bounds_prefix_block_mask(packing: Packing, image_ids: torch.Tensor):
    doc = packing.prefix_doc[0]
    start, end = document_bounds(doc)
    image = image_ids[0] == 1

    def allowed(b, h, q, kv):
        return (kv >= start[q]) & ((kv <= q) | (image[q] & image[kv] & (kv < end[q])))

    return block_mask_from_pairs(packed_prefix_mask(packing, image_ids)[0, 0], allowed)


def bounds_suffix_block_mask(packing: Packing):
    p_doc, s_doc = packing.prefix_doc[0], packing.suffix_doc[0]
    Np = p_doc.shape[0]
    # a suffix token's keys: its document's prefix span, then its document's suffix up to itself; a tail pad sees
    # no prefix (an empty span at 0) and only itself (its own document bounds)
    p_first, p_end = document_spans(p_doc, int(s_doc.max()) + 1)
    real, own = s_doc >= 0, s_doc.clamp(min=0)
    q_p_start = torch.where(real, p_first[own], 0).int()
    q_p_end = torch.where(real, p_end[own], 0).int()
    s_start = (document_bounds(s_doc)[0] + Np).int()

    def allowed(b, h, q, kv):
        return ((kv >= q_p_start[q]) & (kv < q_p_end[q])) | ((kv >= s_start[q]) & (kv <= q + Np))

    return block_mask_from_pairs(packed_suffix_mask(packing)[0, 0], allowed)


def variants(padded, packed):
    """row name -> (batch, query length, key length, block mask builder, dense mask builder), prefix and suffix rows."""
    p, s = padded.prefix, padded.suffix
    rows = {
        "prefix padded": (
            p.input_ids.shape[0],
            p.input_ids.shape[1],
            p.input_ids.shape[1],
            lambda: prefix_block_mask(p.attention_mask, p.mm_token_type_ids),
            lambda: prefix_attention_mask(p.attention_mask, p.mm_token_type_ids),
        ),
        "suffix padded": (
            s.input_ids.shape[0],
            s.input_ids.shape[1],
            p.input_ids.shape[1] + s.input_ids.shape[1],
            lambda: continuation_block_mask(p.attention_mask, s.attention_mask),
            lambda: continuation_mask(p.attention_mask, s.attention_mask),
        ),
    }
    image = packed.prefix.mm_token_type_ids
    for suffix_name, multiple in (("", 1), ("-128", 128)):
        packing, image_ids = pad_packing(packed.packing, image, multiple) if multiple > 1 else (packed.packing, image)
        Np, Ns = packing.prefix_doc.shape[1], packing.suffix_doc.shape[1]
        dense_p = lambda k=packing, i=image_ids: packed_prefix_mask(k, i)  # noqa: E731
        dense_s = lambda k=packing: packed_suffix_mask(k)  # noqa: E731
        rows[f"prefix packed{suffix_name}"] = (
            1,
            Np,
            Np,
            lambda k=packing, i=image_ids: packed_prefix_block_mask(k, i),
            dense_p,
        )
        rows[f"prefix packed-bounds{suffix_name}"] = (
            1,
            Np,
            Np,
            lambda k=packing, i=image_ids: bounds_prefix_block_mask(k, i),
            dense_p,
        )
        rows[f"suffix packed{suffix_name}"] = (1, Ns, Np + Ns, lambda k=packing: packed_suffix_block_mask(k), dense_s)
        rows[f"suffix packed-bounds{suffix_name}"] = (
            1,
            Ns,
            Np + Ns,
            lambda k=packing: bounds_suffix_block_mask(k),
            dense_s,
        )
    k = packed.packing
    Np, Ns = k.prefix_doc.shape[1], k.suffix_doc.shape[1]
    joined, joined_types = k.joined(image)
    dense_j = lambda: packed_prefix_mask(joined, joined_types)  # noqa: E731
    rows["joined packed"] = (1, Np + Ns, Np + Ns, lambda: packed_prefix_block_mask(joined, joined_types), dense_j)
    # varlen rows: (plan, the flex block mask it is checked against) in place of a block mask
    rows["prefix varlen"] = (1, Np, Np, lambda: (k.segments.prefix, packed_prefix_block_mask(k, image)),
                             lambda: packed_prefix_mask(k, image))  # fmt: skip
    rows["suffix varlen"] = (
        1,
        Ns,
        Np + Ns,
        lambda: (k.segments.suffix, packed_suffix_block_mask(k)),
        lambda: packed_suffix_mask(k),
    )
    rows["joined varlen"] = (
        1,
        Np + Ns,
        Np + Ns,
        lambda: (k.segments.joined, packed_prefix_block_mask(joined, joined_types)),
        dense_j,
    )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated row names (default: all)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    device = torch.device(PROFILES[args.profile].device)
    packed_steps, text = steps(args.profile, pack=True)
    padded_steps, _ = steps(args.profile, pack=False)
    largest = max(range(len(packed_steps)), key=lambda k: packed_steps[k].prefix.input_ids.shape[1])
    packed = replace(packed_steps[largest], packing=packed_steps[largest].packing.to(device))
    packed = replace(
        packed, prefix=replace(packed.prefix, mm_token_type_ids=packed.prefix.mm_token_type_ids.to(device))
    )
    padded = padded_steps[largest]
    padded = replace(
        padded,
        prefix=replace(
            padded.prefix,
            attention_mask=padded.prefix.attention_mask.to(device),
            mm_token_type_ids=padded.prefix.mm_token_type_ids.to(device),
        ),
        suffix=replace(padded.suffix, attention_mask=padded.suffix.attention_mask.to(device)),
    )
    heads, kv_heads, head_dim = text.num_heads, text.num_kv_heads, text.head_dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows_spec = variants(padded, packed)
    names = [n for n in args.only.split(",") if n] or list(rows_spec)
    conditions = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "step": largest,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "layers_per_step": text.num_layers,
        "timing": "median of CUDA-event times per call after warm-up; flex compiled afresh per row",
    }
    print("conditions: " + json.dumps(conditions), flush=True)
    options = {"BACKEND": "TRITON"} if device.type == "cuda" else None
    rows, out_dir = [], Path(args.out)
    for name in names:
        batch, q_len, kv_len, block_builder, dense_builder = rows_spec[name]
        torch._dynamo.reset()
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch, heads, q_len, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        k = torch.randn(batch, kv_heads, kv_len, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        v = torch.randn(batch, kv_heads, kv_len, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        cotangent = torch.randn(batch, heads, q_len, head_dim, device=device, dtype=dtype, generator=g)
        start = time.perf_counter()
        try:
            block = block_builder()
            plan, block = block if isinstance(block, tuple) else (None, block)
            if device.type == "cuda":
                torch.cuda.synchronize()
            mask_s = time.perf_counter() - start
            dense = dense_builder()
            fwd_flops, bwd_flops = attention_flops(dense, heads, head_dim)
            compiled = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
            flex_call = lambda q=q, k=k, v=v: compiled(
                q, k, v, block_mask=block, enable_gqa=True, kernel_options=options
            )  # noqa: E731
            call = flex_call if plan is None else (lambda: attend_segments(q, k, v, plan))
            out = call()
            versus_flex = None
            if plan is not None:
                assert torch.equal(segments_mask(plan, kv_len).to(dense.device), dense[0, 0]), f"{name}: plan != rule"
                with torch.no_grad():
                    versus_flex = float((out - flex_call(q.detach(), k.detach(), v.detach())).abs().max())
            out.backward(cotangent)
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_call_s = time.perf_counter() - start - mask_s
            print(f"{name}: mask {mask_s:.1f} s, compile + first call {first_call_s:.1f} s", flush=True)
            del dense
            with torch.no_grad():
                forward_s = timed(call, args.warmup, args.repeats, device)
            both_s = timed(lambda: call().backward(cotangent), args.warmup, args.repeats, device)
            row = {
                "name": name,
                "q": [batch, q_len],
                "kv": kv_len,
                "mask_build_s": mask_s,
                "partial_blocks": None if plan else int(block.kv_num_blocks.sum()),
                "full_blocks": None if plan else int(block.full_kv_num_blocks.sum()),
                "max_abs_vs_flex": versus_flex,
                "forward_ms": forward_s * 1e3,
                "fwd_bwd_ms": both_s * 1e3,
                "step_ms": both_s * 1e3 * text.num_layers,
                "forward_tflops": fwd_flops / forward_s / 1e12,
                "fwd_bwd_tflops": (fwd_flops + bwd_flops) / both_s / 1e12,
                "first_call_s": first_call_s,
                "error": None,
            }
        except Exception as error:  # a row the compiler refuses is a row with its reason, not a crash
            row = {"name": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        # after every row: a device call that runs out of time still brings back the rows it finished
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"packed_attention_{args.profile}.json").write_text(
            json.dumps({"conditions": conditions, "rows": rows}, indent=1)
        )
    print(f"\n{'':30} {'blocks p/f':>11} {'fwd ms':>7} {'f+b ms':>7} {'x layers':>8} {'f+b TF/s':>8}")
    for row in rows:
        if row["error"]:
            print(f"{row['name']:30} {row['error']}")
            continue
        blocks = "varlen" if row["partial_blocks"] is None else f"{row['partial_blocks']:5}/{row['full_blocks']:<5}"
        versus = "" if row["max_abs_vs_flex"] is None else f"  max |varlen - flex| {row['max_abs_vs_flex']:.3g}"
        print(
            f"{row['name']:30} {blocks:>11} {row['forward_ms']:7.2f} {row['fwd_bwd_ms']:7.2f} "
            f"{row['step_ms']:8.1f} {row['fwd_bwd_tflops']:8.1f}{versus}"
        )
    return rows


if __name__ == "__main__":
    main()
