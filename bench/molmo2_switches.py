"""Seconds per step and peak memory of the Molmo2 training step per S-bundle switch setting.

One process, one model load; the settings alternate (the baseline first and last, so drift shows). Each setting
runs `--warmup` steps, then `--steps` timed steps (device-synchronized, median reported). The S-bundle's recipe by
default: batch 12 in 6 backward chunks, camera counts {1, 2}, max-crops 1, fp32 master weights, bf16 autocast,
fused AdamW, random init (kernel-level deltas depend on the geometry, not on the weights).

    python bench/molmo2_switches.py --profile h200-4b [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.molmo2.data.collate import token_counts  # noqa: E402
from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.run_config import UNRECORDED_DEFAULTS, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402

SETTINGS = [
    ("baseline", ()),
    ("P1 suffix cuDNN", ("suffix_cudnn",)),
    ("P2 windowed peak", ("windowed_vram_peak",)),
    ("P3a device assert", ("device_assert_patch_count",)),
    ("P3b branchless lookup", ("branchless_extension_lookup",)),
    ("P3c masked sums", ("masked_loss_sums",)),
    ("P4 no clone", ("no_embed_clone",)),
    (
        "all six",
        (
            "suffix_cudnn",
            "windowed_vram_peak",
            "device_assert_patch_count",
            "branchless_extension_lookup",
            "masked_loss_sums",
            "no_embed_clone",
        ),
    ),
    ("baseline again", ()),
]


def conditions(runner: Molmo2Runner, args) -> dict:
    cuda = torch.cuda.is_available()
    counts = [token_counts(chunk) for step in runner.pool for chunk in step.chunks]
    prefix = [n for c in counts for n in c.prefix_lengths]
    suffix = [n for c in counts for n in c.suffix_lengths]
    return {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": platform.python_version(),
        "profile": args.profile,
        "geometry": runner.geometry.model,
        "dtype": "fp32 master weights, bf16 autocast" if cuda else "fp32",
        "optimizer": "AdamW (fused)" if cuda else "AdamW",
        "batch": runner.train_config.batch,
        "backward_chunks": runner.train_config.backward_chunks,
        "camera_counts": list(runner.camera_counts),
        "max_crops": runner.max_crops,
        "prefix_tokens": {"min": min(prefix), "median": statistics.median(prefix), "max": max(prefix)},
        "suffix_tokens": {"min": min(suffix), "median": statistics.median(suffix), "max": max(suffix)},
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "pool_steps": len(runner.pool),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()

    start = time.monotonic()
    profile = PROFILES[args.profile]
    raw = {"batch": args.batch, "backward_chunks": args.chunks, "camera_counts": [1, 2], "max_crops": 1}
    # the keys over the defaults this benchmark was written against (the padded eager step)
    runner = Molmo2Runner(profile, resolve(profile, raw, UNRECORDED_DEFAULTS), seed=0)
    runner.load()
    load_s = time.monotonic() - start
    info = conditions(runner, args)
    info["load_s"] = round(load_s, 1)
    rows = []
    for name, switches in SETTINGS:
        runner.set_switches(switches)
        runner.train_window(args.warmup, lambda: False)
        window = runner.train_window(args.steps, lambda: False)
        rows.append(
            {
                "setting": name,
                "switches": list(switches),
                **{
                    k: window.get(k)
                    for k in (
                        "s_per_step",
                        "tokens_per_s",
                        "loss",
                        "finite",
                        "vram_peak_gib",
                        "vram_window_peak_gib",
                        "vram_reserved_peak_gib",
                        "smi_peak_mib",
                    )
                },
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {"conditions": info, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"molmo2_switches_{args.profile}.json").write_text(json.dumps(result, indent=1))

    print("\nconditions: " + json.dumps(info))
    baseline = rows[0]["s_per_step"]
    print(f"\n{'setting':24} {'s/step':>8} {'vs base':>8} {'tok/s':>9} {'peak GiB':>9} {'win GiB':>8} {'loss':>7}")
    for row in rows:
        win = row["vram_window_peak_gib"]
        print(
            f"{row['setting']:24} {row['s_per_step']:8.4f} {row['s_per_step'] / baseline - 1:+8.1%} "
            f"{row['tokens_per_s']:9.0f} "
            f"{row['vram_peak_gib']:9.2f} {win if win is not None else float('nan'):8.2f} {row['loss']:7.3f}"
        )


if __name__ == "__main__":
    main()
