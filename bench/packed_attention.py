"""A packed step's attention alone (forward + backward), beside the same samples padded one row each, under each
kept attention path and a few mask formulations: where the packed path's attention time goes.

On the pool's largest packed step (its real block structure; random q/k/v at the decoder's heads, bf16 on CUDA):

- `prefix padded`: the padded chunk's prefix under the model's prefix_block_mask (FlexAttention);
- `prefix packed`: the packed row under packing.py's block mask (rule by document ids); `prefix packed-bounds`:
  the same rule by each token's document bounds (int32), one comparison cheaper per pair;
- `suffix padded sdpa`, `suffix packed sdpa`: the suffix on SDPA under its dense mask, padded and packed (the
  suffix always runs SDPA unless its row is varlen);
- `varlen`: no mask: the row's segments on FlashAttention's varlen kernel (segments.py, pack_attention "varlen"),
  the gathers in and out included; its output's largest difference from the masks' path on the same q/k/v (the
  flex row for a prefix, the SDPA row for the suffix) is printed beside it;
- `joined`: the one-pass row [prefix | suffix] (pack_one_pass), under the block mask (`joined packed`) or varlen.

Each row's mask allows exactly the pairs of the dense rule it names: a test checks it over the tiny pool
(tests/test_bench_peer.py); this script times, it does not re-check. Every call goes through the model's own
`attend` (engine/molmo2/model/text.py), so a row times the kernel the model runs.

Times are per attention call (one layer); the step has 36 such layers, forward and backward. FLOPs count the
allowed (query, key) pairs: forward 4 x pairs x head_dim x heads, backward 10 x pairs x head_dim x heads.

    python bench/packed_attention.py --profile h200-4b [--warmup 3 --repeats 20] --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask  # noqa: E402

from bench.flex_configs import attention_flops, timed  # noqa: E402
from engine.molmo2.attention.packing import (  # noqa: E402
    Packing,
    block_mask_from_pairs,
    packed_prefix_block_mask,
    packed_prefix_mask,
    packed_suffix_mask,
)
from engine.molmo2.attention.segments import Segments, segments_mask  # noqa: E402
from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.model.model import continuation_mask, prefix_attention_mask, prefix_block_mask  # noqa: E402
from engine.molmo2.model.text import Mask, attend  # noqa: E402
from engine.molmo2.run_config import UNRECORDED_DEFAULTS, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402

BASE = {"batch": 12, "camera_counts": [1, 2], "max_crops": 1, "backward_chunks": 1}


def steps(profile: str, pack: bool):
    flex = PROFILES[profile].device == "cuda"
    config = {
        **BASE,
        "pack": pack,
        "compile": flex,
        **({"prefix_attention": "flex"} if flex else {}),
    }
    # the keys over the defaults this benchmark was written against (the padded eager step)
    runner = Molmo2Runner(PROFILES[profile], resolve(PROFILES[profile], config, UNRECORDED_DEFAULTS), seed=0)
    runner.load_data()
    return [step.chunks[0] for step in runner.pool], runner.config.text


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


@dataclass(frozen=True)
class Row:
    """One timed attention: q [batch, heads, q_len, d] against keys [batch, kv_heads, kv_len, d]."""

    batch: int
    q_len: int
    kv_len: int
    mask: Callable[[], Mask]  # what the call attends under: a BlockMask, a dense bool mask or varlen Segments
    rule: Callable[[], torch.Tensor]  # the dense [batch, 1, q_len, kv_len] rule whose pairs `mask` allows
    reference: Callable[[], Mask] | None = None  # a varlen row: the masks' path its output is compared with


def variants(padded, packed) -> dict[str, Row]:
    """row name -> Row, for the prefix, suffix and joined rows of one padded chunk and its packed self."""
    p, s = padded.prefix, padded.suffix
    P, S = p.input_ids.shape[1], s.input_ids.shape[1]
    k, image = packed.packing, packed.prefix.mm_token_type_ids
    Np, Ns = k.prefix_doc.shape[1], k.suffix_doc.shape[1]
    joined, joined_types = k.joined(image)
    prefix_rule = lambda: prefix_attention_mask(p.attention_mask, p.mm_token_type_ids)  # noqa: E731
    packed_rule = lambda: packed_prefix_mask(k, image)  # noqa: E731
    joined_rule = lambda: packed_prefix_mask(joined, joined_types)  # noqa: E731
    return {
        "prefix padded": Row(
            p.batch_size, P, P, lambda: prefix_block_mask(p.attention_mask, p.mm_token_type_ids), prefix_rule
        ),  # fmt: skip
        "prefix packed": Row(1, Np, Np, lambda: packed_prefix_block_mask(k, image), packed_rule),
        "prefix packed-bounds": Row(1, Np, Np, lambda: bounds_prefix_block_mask(k, image), packed_rule),
        "suffix padded sdpa": Row(
            s.attention_mask.shape[0],
            S,
            P + S,
            lambda: continuation_mask(p.attention_mask, s.attention_mask),
            lambda: continuation_mask(p.attention_mask, s.attention_mask),
        ),  # fmt: skip
        "suffix packed sdpa": Row(1, Ns, Np + Ns, lambda: packed_suffix_mask(k), lambda: packed_suffix_mask(k)),
        "joined packed": Row(1, Np + Ns, Np + Ns, lambda: packed_prefix_block_mask(joined, joined_types), joined_rule),
        "prefix varlen": Row(
            1, Np, Np, lambda: k.segments.prefix, packed_rule, lambda: packed_prefix_block_mask(k, image)
        ),  # fmt: skip
        "suffix varlen": Row(
            1, Ns, Np + Ns, lambda: k.segments.suffix, lambda: packed_suffix_mask(k), lambda: packed_suffix_mask(k)
        ),  # fmt: skip
        "joined varlen": Row(
            1,
            Np + Ns,
            Np + Ns,
            lambda: k.segments.joined,
            joined_rule,
            lambda: packed_prefix_block_mask(joined, joined_types),
        ),  # fmt: skip
    }


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
        "reference": "a varlen row's max |diff|: against the masks' path of its row (flex prefix, SDPA suffix)",
    }
    print("conditions: " + json.dumps(conditions), flush=True)
    rows, out_dir = [], Path(args.out)
    for name in names:
        spec = rows_spec[name]
        batch, q_len, kv_len = spec.batch, spec.q_len, spec.kv_len
        torch._dynamo.reset()  # each row's FlexAttention compiles afresh
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch, heads, q_len, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        k = torch.randn(batch, kv_heads, kv_len, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        v = torch.randn(batch, kv_heads, kv_len, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
        cotangent = torch.randn(batch, heads, q_len, head_dim, device=device, dtype=dtype, generator=g)
        start = time.perf_counter()
        try:
            mask = spec.mask()
            if device.type == "cuda":
                torch.cuda.synchronize()
            mask_s = time.perf_counter() - start
            rule = spec.rule()
            fwd_flops, bwd_flops = attention_flops(rule, heads, head_dim)
            if isinstance(mask, Segments):
                assert torch.equal(segments_mask(mask, kv_len).to(rule.device), rule[0, 0]), f"{name}: plan != rule"
            del rule
            call = lambda mask=mask: attend(q, k, v, mask)  # noqa: E731
            out = call()
            versus = None
            if spec.reference is not None:
                reference = spec.reference()
                with torch.no_grad():
                    versus = float((out - attend(q.detach(), k.detach(), v.detach(), reference)).abs().max())
                del reference
            out.backward(cotangent)
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_call_s = time.perf_counter() - start - mask_s
            print(f"{name}: mask {mask_s:.1f} s, compile + first call {first_call_s:.1f} s", flush=True)
            with torch.no_grad():
                forward_s = timed(call, args.warmup, args.repeats, device)
            both_s = timed(lambda: call().backward(cotangent), args.warmup, args.repeats, device)
            block = mask if isinstance(mask, BlockMask) else None
            row = {
                "name": name,
                "kind": "flex" if block else "varlen" if isinstance(mask, Segments) else "sdpa",
                "q": [batch, q_len],
                "kv": kv_len,
                "mask_build_s": mask_s,
                "partial_blocks": int(block.kv_num_blocks.sum()) if block else None,
                "full_blocks": int(block.full_kv_num_blocks.sum()) if block else None,
                "max_abs_vs_reference": versus,
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
        # after every row: a run stopped at its time limit still leaves the rows it finished
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"packed_attention_{args.profile}.json").write_text(
            json.dumps({"conditions": conditions, "rows": rows}, indent=1)
        )
    print(f"\n{'':30} {'blocks p/f':>11} {'fwd ms':>7} {'f+b ms':>7} {'x layers':>8} {'f+b TF/s':>8}")
    for row in rows:
        if row["error"]:
            print(f"{row['name']:30} {row['error']}")
            continue
        blocks = row["kind"] if row["partial_blocks"] is None else f"{row['partial_blocks']:5}/{row['full_blocks']:<5}"
        versus = "" if row["max_abs_vs_reference"] is None else f"  max |diff| {row['max_abs_vs_reference']:.3g}"
        print(
            f"{row['name']:30} {blocks:>11} {row['forward_ms']:7.2f} {row['fwd_bwd_ms']:7.2f} "
            f"{row['step_ms']:8.1f} {row['fwd_bwd_tflops']:8.1f}{versus}"
        )
    return rows


if __name__ == "__main__":
    main()
