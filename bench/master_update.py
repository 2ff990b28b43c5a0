"""The optimizer update alone at a geometry's trainable shapes: the baseline's (clip_grad_norm_ over fp32
gradients, then torch's fused AdamW over fp32 parameters) against X10's (engine/molmo2/train/master_adamw.py: one
Triton pass per bucket over bf16 gradients of the linears, fp32 masters, the bf16 weights written), each on random
gradients, CUDA events around each update after warm-up, the median and the bytes each moves over it.

    python bench/master_update.py --geometry 4b --warmup 3 --repeats 10 --out "$OUT"

Writes master_update_<geometry>.json under --out (conditions and one row per arm) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.molmo2.model.ar import set_ar_trainable  # noqa: E402
from engine.molmo2.model.config import Molmo2Config  # noqa: E402
from engine.molmo2.model.model import Molmo2Model  # noqa: E402
from engine.molmo2.train.master_adamw import MasterAdamW, shadowed_names  # noqa: E402
from engine.molmo2.train.step import ADAM_BETAS  # noqa: E402

MAX_NORM = 1.0


def trainable_shapes(geometry: str) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        model = Molmo2Model(Molmo2Config.named(geometry))
    set_ar_trainable(model)
    shadowed = shadowed_names(model)
    return [(name in shadowed, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]


def timed(update, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        update()
    torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        update()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return seconds


def baseline_arm(shapes, warmup: int, repeats: int) -> dict:
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for _, s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=ADAM_BETAS, weight_decay=0.0, fused=True)

    def update():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()

    seconds = timed(update, warmup, repeats)
    n = sum(p.numel() for p in params)
    # norm: read g; clip: read and write g; AdamW: read p, g, m, v and write p, m, v
    return {"arm": "clip_grad_norm_ + fused AdamW (fp32 gradients)", "seconds": seconds, "bytes": n * 4 * 10}


def x10_arm(shapes, warmup: int, repeats: int) -> dict:
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for _, s in shapes]
    shadowed = {p for p, (is_shadowed, _) in zip(params, shapes) if is_shadowed}
    optimizer = MasterAdamW.from_adamw(
        torch.optim.AdamW(params, lr=1e-5, betas=ADAM_BETAS, weight_decay=0.0, fused=True), shadowed
    )
    for p in params:
        p.grad = torch.randn_like(p)  # bf16 for the shadowed: their parameters are bf16 now
    seconds = timed(lambda: optimizer.clip_and_step(MAX_NORM), warmup, repeats)
    bf16 = sum(p.numel() for p in shadowed)
    fp32 = sum(p.numel() for p in params) - bf16
    # norm: read g; update: read master, g, m, v and write master, m, v (+ the bf16 weight)
    return {"arm": "X10: one fused pass per bucket (bf16 gradients)", "seconds": seconds,
            "bytes": bf16 * (2 + 2 + 12 + 12 + 2) + fp32 * (4 + 4 + 12 + 12)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="4b")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    shapes = trainable_shapes(args.geometry)
    conditions = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "geometry": args.geometry,
        "trainable_tensors": len(shapes),
        "trainable_elements": sum(torch.Size(s).numel() for _, s in shapes),
        "shadowed_elements": sum(torch.Size(s).numel() for is_shadowed, s in shapes if is_shadowed),
        "max_norm": MAX_NORM,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "timing": "CUDA events around one update; median of the repeats",
    }
    rows = []
    for arm in (baseline_arm, x10_arm):
        rows.append(arm(shapes, args.warmup, args.repeats))
        torch.cuda.empty_cache()  # the arm's tensors went with its frame
    for row in rows:
        row["ms"] = statistics.median(row["seconds"]) * 1e3
        row["tb_per_s"] = row["bytes"] / (row["ms"] / 1e3) / 1e12
    out = Path(args.out) / f"master_update_{args.geometry}.json"
    out.write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=2) + "\n")
    print("conditions", json.dumps(conditions))
    print(f"{'arm':52} {'ms':>8} {'GB moved':>9} {'TB/s':>6}")
    for row in rows:
        print(f"{row['arm']:52} {row['ms']:8.2f} {row['bytes'] / 1e9:9.1f} {row['tb_per_s']:6.2f}")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
