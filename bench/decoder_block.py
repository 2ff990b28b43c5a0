"""One decoder block's forward and backward at a geometry's training shapes, compiled as the training step compiles
it, in four arms: the residual stream in fp32 (the baseline: the hub's fp32 embeddings carry it) or in bf16, and
the MLP's SwiGLU as inductor fuses `F.silu(gate) * up` or as X11's ops (engine/molmo2/model/swiglu.py).

The block sees one packed row of the benchmark pool's shape: 12 samples alternating one and two cameras (prefix
580 and 1,023 tokens, 424 image tokens a camera, suffix 71), so 10,470 tokens, attending through the landed varlen
segments on cuDNN; the trainable linears in bf16 (X10, landed), the norms in fp32, bf16 autocast. Each arm: CUDA
events around forward + backward from a fixed upstream gradient, the median of --repeats after --warmup; the
forward alone the same way; the memory the forward leaves saved for the backward; and each arm's output and input
gradient against the baseline arm's.

    python bench/decoder_block.py --geometry 4b --warmup 5 --repeats 30 --out "$OUT"

Writes decoder_block_<geometry>.json under --out and prints the table last. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.molmo2.attention.segments import Sample, plan  # noqa: E402
from engine.molmo2.model.config import Molmo2Config  # noqa: E402
from engine.molmo2.model.text import DecoderBlock, Rope  # noqa: E402

IMAGE_TOKENS = 424  # one camera at max_crops 1: the low-res and one high-res crop with their specials
PREFIXES = (580, 1023)  # one camera, two cameras: the pool's mean prefix is 801.6 tokens
SUFFIX = 71
SAMPLES = 12
ARMS = {  # name -> (residual dtype, X11)
    "fp32-residual": (torch.float32, False),
    "fp32-residual-x11": (torch.float32, True),
    "bf16-residual": (torch.bfloat16, False),
    "bf16-residual-x11": (torch.bfloat16, True),
}


def sample_layout(cameras: int, prefix: int) -> list[bool]:
    """Which of a sample's tokens are image tokens: 40 text, the cameras' image runs 5 text apart, text to the end
    of the prefix, then the suffix."""
    image = [False] * 40
    for camera in range(cameras):
        image += [True] * IMAGE_TOKENS + ([False] * 5 if camera + 1 < cameras else [])
    return image + [False] * (prefix - len(image) + SUFFIX)


def packed_row() -> tuple[list[Sample], torch.Tensor]:
    samples, positions, start = [], [], 0
    for index in range(SAMPLES):
        cameras = 1 + index % 2
        image = sample_layout(cameras, PREFIXES[cameras - 1])
        tokens = list(range(start, start + len(image)))
        samples.append(Sample(tokens, image, tokens))
        positions += range(len(image))
        start += len(image)
    return samples, torch.tensor(positions)


def timed(fn, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def run_arm(block, compiled, x0, grad_out, rope, segments, dtype, fused, args) -> dict:
    x = x0.to(dtype).requires_grad_()
    g = grad_out.to(dtype)

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return compiled(x, rope, segments, None, fused)[0]

    def step():
        x.grad = None
        for p in block.parameters():
            p.grad = None
        forward().backward(g)

    step_ms = timed(step, args.warmup, args.repeats)
    with torch.no_grad():
        forward_ms = timed(forward, args.warmup, args.repeats)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = forward()
    saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.backward(g)
    return {
        "fwd_bwd_ms": statistics.median(step_ms),
        "fwd_bwd_ms_min": min(step_ms),
        "forward_ms": statistics.median(forward_ms),
        "saved_mib": saved / 2**20,
        "out": out.detach().float(),
        "x_grad": x.grad.float(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", default="4b")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Molmo2Config.named(args.geometry)
    t = config.text
    block = DecoderBlock(t).cuda()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    for module in block.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.to(torch.bfloat16)  # X10 (landed): the linears in bf16
    samples, positions = packed_row()
    n = positions.numel()
    segments = plan(samples, [], n, n).on("cudnn").to("cuda")
    rope = Rope(positions[None].cuda(), t.head_dim, t.rope_theta)
    x0 = torch.randn(1, n, t.hidden_size, device="cuda")
    grad_out = torch.randn(1, n, t.hidden_size, device="cuda") * 1e-2
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(block, dynamic=False)
    rows, reference = {}, None
    for name in args.arms.split(","):
        dtype, fused = ARMS[name]
        row = run_arm(block, compiled, x0, grad_out, rope, segments, dtype, fused, args)
        if reference is None:
            reference = row
        for key in ("out", "x_grad"):
            diff = (row[key] - reference[key]).abs().max().item()
            row[f"{key}_max_abs_diff"] = diff
            row[f"{key}_rel"] = diff / reference[key].abs().max().item()
        del row["out"], row["x_grad"]
        rows[name] = row
    base = rows[next(iter(rows))]["fwd_bwd_ms"]
    for row in rows.values():
        row["saving_ms_per_step_36_blocks"] = (base - row["fwd_bwd_ms"]) * t.num_layers
    conditions = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "geometry": args.geometry,
        "tokens": n,
        "samples": SAMPLES,
        "hidden": t.hidden_size,
        "intermediate": t.intermediate_size,
        "dtype": "bf16 autocast; linears bf16, norms fp32",
        "attention": "varlen segments on cuDNN",
        "warmup": args.warmup,
        "repeats": args.repeats,
        "timing": "CUDA events, median",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"decoder_block_{args.geometry}.json").write_text(
        json.dumps({"conditions": conditions, "arms": rows}, indent=2)
    )
    print("conditions", json.dumps(conditions))
    print(f"{'arm':<20} {'fwd+bwd ms':>11} {'min':>8} {'fwd ms':>8} {'saved MiB':>10} {'x36 ms':>8} "
          f"{'out rel':>9} {'dx rel':>9}")  # fmt: skip
    for name, row in rows.items():
        print(f"{name:<20} {row['fwd_bwd_ms']:>11.3f} {row['fwd_bwd_ms_min']:>8.3f} {row['forward_ms']:>8.3f} "
              f"{row['saved_mib']:>10.0f} {row['saving_ms_per_step_36_blocks']:>8.2f} {row['out_rel']:>9.2e} "
              f"{row['x_grad_rel']:>9.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
