"""The Molmo2 training step on N GPUs of one host under torchrun, beside the one-GPU figure for the same per-rank
batch: seconds per step (the slowest rank's, as a window reports it) and the largest per-rank peak memory.

    torchrun --standalone --nproc-per-node 2 bench/ddp_step.py --sync ddp      # two GPUs, DDP
    python bench/ddp_step.py                                                   # one GPU, the same per-rank batch

Conditions: the baseline switches, batch 12 per rank in 6 chunks, cameras {1, 2}, max-crops 1, bf16 autocast,
fp32 master weights, fused AdamW; `--warmup` steps first (not timed), then one window of `--steps`. Each rank trains
its own slice of the data (engine/molmo2/runner.py), so two ranks process twice the samples per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.run_config import UNRECORDED_DEFAULTS, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402
from engine.workload import join_ranks  # noqa: E402

SYNC = {"ddp": {"ddp": True}, "ddp+allreduce": {"ddp": True, "chunk_grad_allreduce": True, "ddp_wrapper": True},
        "allreduce": {"chunk_grad_allreduce": True, "ddp_wrapper": False}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", default="ddp", choices=sorted(SYNC))
    parser.add_argument("--zero1", action="store_true")
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()

    ranks = join_ranks("cuda")
    config = {"batch": 12, "backward_chunks": args.chunks, "camera_counts": [1, 2], "max_crops": 1}
    if ranks.world_size > 1:
        config |= SYNC[args.sync] | ({"zero1": True} if args.zero1 else {})
    profile = PROFILES["h200x2-4b" if ranks.world_size == 2 else "h200-4b"]
    # the keys over the defaults this benchmark was written against (the padded eager step)
    runner = Molmo2Runner(profile, resolve(profile, config, UNRECORDED_DEFAULTS), seed=0)
    runner.load()
    runner.train_window(args.warmup, lambda: False)
    window = runner.train_window(args.steps, lambda: False)
    if ranks.writer:
        row = {
            "world_size": ranks.world_size,
            "config": config,
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "warmup": args.warmup,
            **window,
        }
        print(json.dumps(row), flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "ddp_step.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    ranks.leave()


if __name__ == "__main__":
    main()
