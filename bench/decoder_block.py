"""One decoder block's forward and backward at a geometry's training shapes, compiled as the training step compiles
it, in arms that change one thing each against the landed block: the MLP's SwiGLU as X11's ops
(engine/molmo2/model/swiglu.py) instead of inductor's fusion of `F.silu(gate) * up`; the residual stream in bf16
instead of fp32 (the hub's fp32 embeddings carry it); inductor's coordinate-descent tuning of every Triton kernel
(run config compile_tuning = "coordinate-descent").

The block sees one packed row of the benchmark pool's shape: 12 samples alternating one and two cameras (prefix
580 and 1,023 tokens, 424 image tokens a camera, suffix 71), so 10,470 tokens, attending through the landed varlen
segments on cuDNN; the trainable linears in bf16 (X10, landed), the norms in fp32, bf16 autocast. After --warmup
steps of every arm, --repeats rounds each time every arm's forward + backward (CUDA events around 5 steps back to
back, from a fixed upstream gradient, so the host's launches run ahead as in a training step), so drift reaches every
arm alike; the median and the minimum per arm. Then per arm: the forward alone, the memory the forward leaves saved
for the backward, the time of its kernels by name over 3 profiled steps (torch.profiler), the SwiGLU's
kernels among them, and its output and input gradient against the first arm's.

    python bench/decoder_block.py --geometry 4b --warmup 5 --repeats 30 --out "$OUT"

Writes decoder_block_<geometry>.json under --out and prints the table last. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
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
TOP_KERNELS = 12
STEPS_PER_ROUND = 5  # back to back between two events, so the host's launches run ahead of the device as in a step
# The SwiGLU's kernels by name: inductor's fusions of F.silu(gate) * up and its backward, or X11's two
SWIGLU_KERNELS = re.compile(r"silu|^_forward_kernel$|^_backward_kernel$")
ARMS = {  # name -> (residual dtype, X11, inductor's options)
    "landed": (torch.float32, False, {}),
    "x11": (torch.float32, True, {}),
    "bf16-residual": (torch.bfloat16, False, {}),
    "coordinate-descent": (torch.float32, False, {"coordinate_descent_tuning": True}),
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


def event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class Arm:
    def __init__(self, name: str, block: DecoderBlock, x0, grad_out, rope, segments) -> None:
        dtype, self.fused, options = ARMS[name]
        self.name, self.block, self.rope, self.segments = name, block, rope, segments
        self.compiled = torch.compile(block, dynamic=False, options=options)
        self.x = x0.detach().to(dtype).clone().requires_grad_()
        self.grad = grad_out.to(dtype)

    def forward(self) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.compiled(self.x, self.rope, self.segments, None, self.fused)[0]

    def step(self) -> None:
        self.x.grad = None
        for p in self.block.parameters():
            p.grad = None
        self.forward().backward(self.grad)

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.step()

    def kernels_ms(self, steps: int = 3) -> dict[str, float]:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(steps):
                self.step()
            torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for event in profiler.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] += event.device_time_total / 1e3 / steps
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def kernel_summary(self) -> dict:
        kernels = self.kernels_ms()
        return {
            "kernels_ms": dict(list(kernels.items())[:TOP_KERNELS]),
            "kernels_total_ms": sum(kernels.values()),
            "swiglu_ms": sum(ms for name, ms in kernels.items() if SWIGLU_KERNELS.search(name)),
        }

    def summary(self, step_ms: list[float]) -> dict:
        kernels = self.kernel_summary()
        with torch.no_grad():
            forward_ms = [event_ms(self.forward) for _ in range(10)]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = self.forward()
        saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        self.x.grad = None
        out.backward(self.grad)
        return {
            "fwd_bwd_ms": statistics.median(step_ms),
            "fwd_bwd_ms_min": min(step_ms),
            "forward_ms": statistics.median(forward_ms),
            "saved_mib": saved / 2**20,
            **kernels,
            "out": out.detach().float(),
            "x_grad": self.x.grad.float(),
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
    arms = [Arm(name, block, x0, grad_out, rope, segments) for name in args.arms.split(",")]
    for arm in arms:
        for _ in range(args.warmup):
            arm.step()
    times: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for _ in range(args.repeats):
        for arm in arms:
            times[arm.name].append(event_ms(lambda: arm.steps(STEPS_PER_ROUND)) / STEPS_PER_ROUND)
    rows, reference = {}, None
    for arm in arms:
        row = arm.summary(times[arm.name])
        if reference is None:
            reference = {key: row[key] for key in ("out", "x_grad")}
        for key in ("out", "x_grad"):
            diff = (row[key] - reference[key]).abs().max().item()
            row[f"{key}_max_abs_diff"] = diff
            row[f"{key}_rel"] = diff / reference[key].abs().max().item()
        del row["out"], row["x_grad"]
        rows[arm.name] = row
    base = rows[arms[0].name]
    for row in rows.values():
        row["saving_ms_per_step_36_blocks"] = (base["fwd_bwd_ms"] - row["fwd_bwd_ms"]) * t.num_layers
        row["saving_ms_per_step_36_blocks_min"] = (base["fwd_bwd_ms_min"] - row["fwd_bwd_ms_min"]) * t.num_layers
        row["swiglu_saving_ms_per_step_36_blocks"] = (base["swiglu_ms"] - row["swiglu_ms"]) * t.num_layers
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
        "timing": f"CUDA events around {STEPS_PER_ROUND} steps; rounds interleave the arms; median and minimum",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"decoder_block_{args.geometry}.json").write_text(
        json.dumps({"conditions": conditions, "arms": rows}, indent=2)
    )
    print("conditions", json.dumps(conditions))
    for name, row in rows.items():
        print(f"{name}: top kernels, ms a step")
        for kernel, ms in list(row["kernels_ms"].items())[:8]:
            print(f"  {ms:8.3f}  {kernel[:100]}")
    print(f"{'arm':<20} {'fwd+bwd ms':>11} {'min':>8} {'fwd ms':>8} {'saved MiB':>10} {'x36 ms':>8} {'x36 min':>8} "
          f"{'swiglu ms':>9} {'x36':>6} {'out rel':>9} {'dx rel':>9}")  # fmt: skip
    for name, row in rows.items():
        saving, saving_min = row["saving_ms_per_step_36_blocks"], row["saving_ms_per_step_36_blocks_min"]
        print(f"{name:<20} {row['fwd_bwd_ms']:>11.3f} {row['fwd_bwd_ms_min']:>8.3f} {row['forward_ms']:>8.3f} "
              f"{row['saved_mib']:>10.0f} {saving:>8.2f} {saving_min:>8.2f} {row['swiglu_ms']:>9.3f} "
              f"{row['swiglu_saving_ms_per_step_36_blocks']:>6.2f} {row['out_rel']:>9.2e} "
              f"{row['x_grad_rel']:>9.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
