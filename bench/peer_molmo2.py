"""Our Molmo2 training step against transformers' own Molmo2, in one run, beside a bf16 matmul ceiling.

Same geometry, batches, sequence lengths, chunks and precision for both: fp32 master weights, bf16 autocast,
fused AdamW over the same trainable set (the text decoder blocks and final norm; vision tower, embeddings and
the shipped head frozen), gradient clipping. The peer trains as transformers does (logits over the whole base
vocabulary at every position, its own loss); ours computes the suffix only (logits on the loss-bearing tokens).

FLOPs per step are model FLOPs on useful (non-padding) tokens: 6 x (trainable decoder parameters) per token for
forward + backward of the decoder, 2 x (frozen decoder-side parameters on the token path: none beyond the
trainables' matmuls) — plus 2 x (vision tower + adapter parameters) per image patch (forward only, frozen),
plus attention 12 x layers x heads x head_dim x (sum over rows of prefix length^2 / 2 + suffix x full length)
(QK^T and AV, forward 1 + backward 2). The head: 6 x hidden x vocab per loss-bearing token for ours.
MFU = FLOPs / s_per_step / measured bf16 matmul rate.

    python bench/peer_molmo2.py --profile h200-4b [--steps 6 --warmup 2] [--skip-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.peer import transformers_config, transformers_inputs  # noqa: E402
from engine.molmo2.train import autocast, synchronize  # noqa: E402
from engine.molmo2.workload import Molmo2Runner  # noqa: E402


def matmul_ceiling(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


def step_flops(runner: Molmo2Runner) -> float:
    config = runner.config
    t = config.text
    trainable = sum(p.numel() for n, p in runner.model.named_parameters() if n.startswith(("model.transformer.blocks.", "model.transformer.ln_f.")))
    vision = sum(p.numel() for n, p in runner.model.named_parameters() if n.startswith("model.vision_backbone."))
    total = 0.0
    for step in runner.pool[:1]:
        for chunk in step.chunks:
            prefix = chunk.prefix.attention_mask.sum(1).double()
            suffix = chunk.suffix.attention_mask.sum(1).double()
            tokens = float(prefix.sum() + suffix.sum())
            patches = float(chunk.prefix.pixel_values.shape[0] * chunk.prefix.pixel_values.shape[1])
            attention = 12 * t.num_layers * t.num_heads * t.head_dim * float((prefix**2 / 2 + suffix * (prefix + suffix / 2)).sum())
            loss_tokens = float((chunk.suffix.labels >= 0).sum())
            head = 6 * t.hidden_size * (t.vocab_size + config.fast_vocab_size) * loss_tokens
            total += 6 * trainable * tokens + 2 * vision * patches + attention + head
    return total


def time_steps(step_fn, steps, warmup: int, repeats: int, device) -> list[float]:
    times = []
    for index in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        step_fn(steps[index % len(steps)])
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


def peer_runner(runner: Molmo2Runner, device: torch.device, attention: str):
    from transformers.models import molmo2 as tfm

    with torch.device("meta"):
        model = tfm.Molmo2ForConditionalGeneration(transformers_config(runner.config, attention))
    model.to_empty(device=device)
    with torch.no_grad():
        generator = torch.Generator(device=device).manual_seed(0)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    trainable = []
    for name, p in model.named_parameters():
        train = ".layers." in name and "language_model" in name or name.endswith("language_model.norm.weight")
        p.requires_grad_(train)
        if train:
            trainable.append(p)
    optimizer = torch.optim.AdamW(trainable, lr=2e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda")
    inputs = [[{k: v.to(device) for k, v in transformers_inputs(chunk, runner.config).items()} for chunk in step.chunks] for step in runner.pool]
    model.train()

    def step(chunks):
        optimizer.zero_grad(set_to_none=True)
        total = sum(int((c["labels"] >= 0).sum()) for c in chunks)
        for chunk in chunks:
            with autocast(device):
                out = model(**chunk)
            (out.loss * (int((chunk["labels"] >= 0).sum()) / total)).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 100.0)
        optimizer.step()

    return model, step, inputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--peer-attention", default="sdpa")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()

    runner = Molmo2Runner(PROFILES[args.profile], {"batch": args.batch, "backward_chunks": args.chunks, "camera_counts": [1, 2], "max_crops": 1}, seed=0)
    runner.load()
    device = runner.device
    ceiling = matmul_ceiling(device)
    flops = step_flops(runner)
    import transformers

    conditions = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "transformers": transformers.__version__, "batch": args.batch, "backward_chunks": args.chunks,
        "warmup": args.warmup, "repeats": args.steps, "dtype": "fp32 master, bf16 autocast", "peer_attention": args.peer_attention,
        "bf16_matmul_tflops": ceiling / 1e12 if ceiling else None, "model_flops_per_step": flops,
    }
    rows = []

    def record(name, times, peak):
        s = statistics.median(times)
        rows.append({"name": name, "s_per_step": s, "tokens_per_s": sum(step.useful_tokens for step in runner.pool) / len(runner.pool) / s,
                     "mfu": (flops / s / ceiling) if ceiling else None, "peak_gib": peak, "times": times})
        print(json.dumps(rows[-1]), flush=True)

    for name, switches in [("ours HEAD", ()), ("ours all six", ("suffix_cudnn", "windowed_vram_peak", "device_assert_patch_count",
                                                                   "branchless_extension_lookup", "masked_loss_sums", "no_embed_clone"))]:
        runner.set_switches(switches)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = time_steps(lambda step: runner.trainer.step(step), runner.pool, args.warmup, args.steps, device)
        record(name, times, torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)

    if not args.skip_peer:
        runner.model.to("cpu")
        runner.trainer = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model, step, inputs = peer_runner(runner, device, args.peer_attention)
        times = time_steps(step, inputs, args.warmup, args.steps, device)
        record(f"transformers {transformers.__version__} Molmo2 ({args.peer_attention})", times,
               torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"peer_molmo2_{args.profile}.json").write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1))
    print("\nconditions: " + json.dumps(conditions))
    print(f"\n{'':44} {'s/step':>8} {'tok/s':>8} {'MFU':>6} {'peak GiB':>9}")
    for row in rows:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "—"
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "—"
        print(f"{row['name']:44} {row['s_per_step']:8.3f} {row['tokens_per_s']:8.0f} {mfu:>6} {peak:>9}")


if __name__ == "__main__":
    main()
