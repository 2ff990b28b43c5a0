"""X10 (bf16_linear_weights) at a profile's geometry, one stage at a time, each synchronised: the update alone
on the real model's trainables (random gradients), then training steps of the landed defaults with X10 on, with
and without X7 and compile. A stage that fails prints its traceback and the rest still run, so a failure is placed
before anything else runs after it. Run it with CUDA_LAUNCH_BLOCKING=1 to name the failing kernel.

    CUDA_LAUNCH_BLOCKING=1 python bench/master_weights_stages.py --profile h200-4b --stage update --stage eager
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.run_config import LANDED, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402
from engine.molmo2.train.master_adamw import MasterAdamW, shadowed_parameters  # noqa: E402

BASE = {"batch": 12, "camera_counts": [1, 2], "max_crops": 1}
WITHOUT_X7 = [name for name in LANDED if name != "optimizer_overlaps_vision"]
STAGES = {
    # name -> run config over BASE (None: the update alone)
    "update": None,
    "eager": {"compile": False, "compile_tuning": None},
    "eager-no-x7": {"compile": False, "compile_tuning": None, "baseline_switches": WITHOUT_X7},
    "compiled": {},
    "probe": "one_step",  # the gate's probe: the baseline's step, then X10's, from the same weights
}


def update_alone(profile) -> str:
    runner = Molmo2Runner(PROFILES[profile], resolve(PROFILES[profile], BASE), seed=0)
    runner.load()
    trainer, model = runner.trainer, runner.model
    optimizer = MasterAdamW.from_adamw(trainer.optimizer, shadowed_parameters(model))
    for p in trainer.trainable:
        p.grad = torch.randn_like(p)
    norm = optimizer.clip_and_step(1.0)
    torch.cuda.synchronize()
    return f"{len(optimizer.buckets)} buckets, norm {float(norm):.1f}"


def steps(profile, raw: dict, n: int) -> str:
    runner = Molmo2Runner(PROFILES[profile], resolve(PROFILES[profile], BASE | raw), seed=0)
    runner.load()
    runner.set_switches(["bf16_linear_weights"])
    losses = []
    for step in runner.pool[:n]:
        loss, _ = runner.trainer.step(step)
        runner.trainer.settle()
        torch.cuda.synchronize()
        losses.append(f"{float(loss):.4f}")
    return "losses " + " ".join(losses)


def probed(profile, probe: str) -> str:
    runner = Molmo2Runner(PROFILES[profile], resolve(PROFILES[profile], BASE), seed=0)
    runner.load()
    observed = runner.probe(probe, "bf16_linear_weights", {})
    torch.cuda.synchronize()
    return str({k: v for k, v in observed.items() if not isinstance(v, list)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="h200-4b")
    parser.add_argument("--stage", action="append", choices=sorted(STAGES), required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    for stage in args.stage:
        start = time.perf_counter()
        try:
            raw = STAGES[stage]
            if raw is None:
                result = update_alone(args.profile)
            elif isinstance(raw, str):
                result = probed(args.profile, raw)
            else:
                result = steps(args.profile, raw, args.steps)
        except Exception:  # the stage's traceback is the result
            result = "FAILED\n" + traceback.format_exc()
        print(f"stage {stage} ({time.perf_counter() - start:.0f} s): {result}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
