"""Is the image runs' varlen call on cuDNN faster with each key head's query heads packed into one head? (X12's
gate: registrations/molmo2-x12-h200.toml; on the H200 it read the packed call slower, and X12 was retired.)

In the landed step cuDNN's backward writes each key's gradient once per query head, in fp32, then reduces it over
the 4 query heads that share a key head (`fmha_reduce_head_ragged`, about 7 ms a step over both calls of each
block). The image runs' call has no causal band, so every query row attends on its own: the 4 query heads of a key
head can be one head of 4x the rows (q [nq, heads, d] ordered (token, query head in its group) under each key head),
k and v are then read by as many heads as they have, and the key gradient is summed inside the kernel, with nothing
left to reduce. The causal text runs' call cannot be packed so (a packed row's number is not its position).

The packing is one permutation of q (and its inverse on the output; on the backward the same on dO and dq). Timed
here with those copies (as an eager call pays them) and without them (as they cost where a compiled block fuses the
permutation into the gathers around the call). On the pool's largest one-pass (joined) plan, random bf16 q/k/v at
the decoder's heads: forward, and forward + backward through autograd, CUDA-event medians after warm-up, and the
packed call's largest difference from the grouped call's output and gradients (another summation order in the key
gradients, so a numerics change: a ladder's question).

    python bench/cudnn_packed_gqa_probe.py --profile h200-4b [--warmup 3 --repeats 20] --out DIR
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.cudnn_varlen_probe import call_inputs, largest_joined_plan, probe_arguments  # noqa: E402
from bench.flex_configs import timed  # noqa: E402
from engine.molmo2.attention import cudnn as ours  # noqa: E402


def pack(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [nq, heads, d] (head h in key head h // group) -> [nq * group, kv_heads, d], row t * group + g."""
    nq, heads, d = q.shape
    group = heads // kv_heads
    return q.view(nq, kv_heads, group, d).transpose(1, 2).reshape(nq * group, kv_heads, d)


def unpack(o: torch.Tensor, heads: int) -> torch.Tensor:
    """pack's inverse: [nq * group, kv_heads, d] -> [nq, heads, d]."""
    rows, kv_heads, d = o.shape
    group = heads // kv_heads
    return o.view(rows // group, group, kv_heads, d).transpose(1, 2).reshape(rows // group, heads, d)


def grouped_call(q, k, v, call):
    return ours.cudnn_varlen_call(q, k, v, call)


def packed_call(q_packed, k, v, call, group: int):
    """The call on q already packed: each segment has group x the rows; the output stays packed."""
    return ours.cudnn_varlen_call(q_packed, k, v, replace(call, cu_q=call.cu_q * group, max_q=call.max_q * group))


def main(argv: list[str] | None = None) -> dict:
    args, out_dir, device = probe_arguments(argv)
    if device.type != "cuda":
        raise SystemExit(f"profile {args.profile} runs on the CPU: cuDNN's SDPA is a CUDA kernel")
    cudnn = ours.cudnn_frontend()
    plan, text = largest_joined_plan(args.profile)
    plan = plan.to(device)
    call = next(c for c in plan.calls if not c.causal)
    heads, kv_heads = text.num_heads, text.num_kv_heads
    group = heads // kv_heads
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = call_inputs(call, text, device, g)
    assert torch.equal(unpack(pack(q, kv_heads), heads), q)  # the permutation and its inverse, exactly

    def fwd_bwd(forward, leaves, grad_out):
        return torch.autograd.grad(forward(*leaves), leaves, grad_out)

    grouped = [t.clone().requires_grad_() for t in (q, k, v)]
    packed_eager = lambda q_, k_, v_: unpack(packed_call(pack(q_, kv_heads), k_, v_, call, group), heads)  # noqa: E731
    packed_fused = lambda qp, k_, v_: packed_call(qp, k_, v_, call, group)  # noqa: E731
    q_packed, do_packed = pack(q, kv_heads).contiguous(), pack(do, kv_heads).contiguous()
    fused_leaves = [q_packed.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()]

    reference = grouped_call(*grouped, call)
    reference_grads = fwd_bwd(lambda *t: grouped_call(*t, call), grouped, do)
    out = packed_eager(*grouped)
    grads = fwd_bwd(packed_eager, grouped, do)
    diffs = {"max_abs_o": float((out.float() - reference.float()).abs().max())}
    for name, ours_, theirs in zip(("dq", "dk", "dv"), grads, reference_grads):
        diffs[f"max_abs_{name}"] = float((ours_.float() - theirs.float()).abs().max())
        diffs[f"max_abs_{name}_reference"] = float(theirs.float().abs().max())

    times = {
        "grouped_forward_ms": timed(lambda: grouped_call(q, k, v, call), args.warmup, args.repeats, device),
        "grouped_fwd_bwd_ms": timed(
            lambda: fwd_bwd(lambda *t: grouped_call(*t, call), grouped, do), args.warmup, args.repeats, device
        ),
        "packed_forward_ms": timed(lambda: packed_eager(q, k, v), args.warmup, args.repeats, device),
        "packed_fwd_bwd_ms": timed(lambda: fwd_bwd(packed_eager, grouped, do), args.warmup, args.repeats, device),
        "packed_fused_forward_ms": timed(lambda: packed_fused(q_packed, k, v), args.warmup, args.repeats, device),
        "packed_fused_fwd_bwd_ms": timed(
            lambda: fwd_bwd(packed_fused, fused_leaves, do_packed), args.warmup, args.repeats, device
        ),
    }
    times = {key: seconds * 1e3 for key, seconds in times.items()}
    result = {
        "conditions": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "dtype": "bfloat16",
            "cudnn_frontend": getattr(cudnn, "__version__", "?"),
            "cudnn_backend": cudnn.backend_version(),
            "call": "full (image runs) of the pool's largest one-pass plan",
            "segments": call.cu_q.shape[0] - 1,
            "queries": call.queries.shape[0],
            "keys": call.keys.shape[0],
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": text.head_dim,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "timing": "median of CUDA-event times per call after warm-up",
            "packed_fused": "q and dO already packed, o and dq left packed: the permutations' copies not timed",
        },
        **times,
        **diffs,
    }
    (out_dir / f"cudnn_packed_gqa_probe_{args.profile}.json").write_text(json.dumps(result, indent=1))
    print(f"{'call':34} {'forward ms':>10} {'fwd+bwd ms':>10}")
    for label, key in (("grouped (as landed)", "grouped"), ("packed, permutations timed", "packed"),
                       ("packed, permutations fused away", "packed_fused")):  # fmt: skip
        print(f"{label:34} {times[key + '_forward_ms']:10.3f} {times[key + '_fwd_bwd_ms']:10.3f}")
    print("packed vs grouped, max |diff|: " + ", ".join(f"{k[8:]} {v:.3g}" for k, v in diffs.items()
                                                         if not k.endswith("_reference")))  # fmt: skip
    return result


if __name__ == "__main__":
    main()
