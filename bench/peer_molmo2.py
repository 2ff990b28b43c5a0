"""Our Molmo2 training step against transformers' own Molmo2, in one run, beside a bf16 matmul ceiling.

Same geometry, batches, sequence lengths, chunks and precision for both: fp32 master weights, bf16 autocast,
fused AdamW over the same trainable set (the text decoder blocks and final norm; vision tower, embeddings and
the shipped head frozen), gradient clipping. The peer trains as transformers does (logits over the whole base
vocabulary at every position, its own loss); ours computes the suffix only (logits on the loss-bearing tokens).

FLOPs per step are model FLOPs on useful (non-padding) tokens: 6 x (trainable decoder parameters) per token for
forward + backward of the decoder, 2 x (frozen decoder-side parameters on the token path: none beyond the
trainables' matmuls) — plus 2 x (vision tower + adapter parameters) per image patch (forward only, frozen),
plus attention 12 x layers x heads x head_dim x (the pairs of real tokens the masks allow: causal OR image-block in
the prefix, the suffix against its prefix and causally; `attention_pairs`) (QK^T and AV, forward 1 + backward 2).
The head: 6 x hidden x vocab per loss-bearing token for ours. Rows banked before 2026-11-30 counted prefix^2 / 2
pairs a row, as if the prefix were causal: 8.65 attention TFLOP a step at h200-4b where the image block makes it
13.56, so their MFU reads 1.9% (relative) low.
MFU = FLOPs / s_per_step / measured bf16 matmul rate.

Our arms (OURS below) differ from HEAD only by switches and run config: FlexAttention for the prefix, compiled
decoder blocks, length-bucketed steps (or HEAD's steps cut into chunks by camera count), fewer backward chunks
(engine/molmo2/attention/execution.py). Each arm loads its own runner (its own pool: bucketing regroups the same 48 samples
into other steps), so every arm and the peer see the same samples per pass of the pool.

    python bench/peer_molmo2.py --profile h200-4b --ours head,fast-c2 --peer-chunks 6 [--warmup 4 --cycles 3]
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
from molmo2_peer import transformers_config, transformers_inputs  # noqa: E402

from engine.molmo2.attention.packing import packed_prefix_mask, packed_suffix_mask  # noqa: E402
from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.model.model import Molmo2Model, prefix_attention_mask  # noqa: E402
from engine.molmo2.run_config import UNRECORDED_DEFAULTS, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402
from engine.molmo2.train.step import autocast, synchronize  # noqa: E402


def arm_config(profile, raw: dict):
    """An arm's run config: its keys over the defaults the arms were written against (the padded eager step), so an
    arm means what its name says whatever the workload defaults to now."""
    return resolve(profile, raw, UNRECORDED_DEFAULTS)


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


def attention_pairs(chunk) -> float:
    """(query, key) pairs the model attends over between real tokens: the prefix's causal-OR-image rule (image
    tokens see every image token of their row, later ones included), then each suffix token against the row's
    real prefix and, causally, its suffix. Padding on either side does not count; in a packed chunk, neither do
    pairs across samples (the packed masks keep attention to each sample)."""
    if chunk.packing is not None:
        k = chunk.packing
        real_p, real_s = k.prefix_doc[0] >= 0, k.suffix_doc[0] >= 0
        prefix_pairs = packed_prefix_mask(k, chunk.prefix.mm_token_type_ids)[0, 0] & real_p[:, None] & real_p[None, :]
        suffix_pairs = packed_suffix_mask(k)[0, 0] & real_s[:, None] & torch.cat([real_p, real_s])[None, :]
        return float(prefix_pairs.sum()) + float(suffix_pairs.sum())
    real = chunk.prefix.attention_mask.bool()
    allowed = prefix_attention_mask(chunk.prefix.attention_mask, chunk.prefix.mm_token_type_ids)[:, 0]
    prefix_pairs = float((allowed & real[:, :, None] & real[:, None, :]).sum())
    prefix = chunk.prefix.attention_mask.sum(1).double()
    suffix = chunk.suffix.attention_mask.sum(1).double()
    return prefix_pairs + float((suffix * prefix + suffix * (suffix + 1) / 2).sum())


def step_flops(runner: Molmo2Runner) -> float:
    """Model FLOPs of the pool's average step, on useful tokens (the module docstring says what counts)."""
    config = runner.config
    t = config.text
    with torch.device("meta"):  # parameter counts only
        params = dict(Molmo2Model(config).named_parameters())
    trainable = sum(
        p.numel() for n, p in params.items() if n.startswith(("model.transformer.blocks.", "model.transformer.ln_f."))
    )
    vision = sum(p.numel() for n, p in params.items() if n.startswith("model.vision_backbone."))
    total = 0.0
    for step in runner.pool:
        for chunk in step.chunks:
            prefix = chunk.prefix.attention_mask.sum(1).double()
            suffix = chunk.suffix.attention_mask.sum(1).double()
            tokens = float(prefix.sum() + suffix.sum())
            patches = float(chunk.prefix.pixel_values.shape[0] * chunk.prefix.pixel_values.shape[1])
            attention = 12 * t.num_layers * t.num_heads * t.head_dim * attention_pairs(chunk)
            loss_tokens = float((chunk.suffix.labels >= 0).sum())
            head = 6 * t.hidden_size * (t.vocab_size + config.fast_vocab_size) * loss_tokens
            total += 6 * trainable * tokens + 2 * vision * patches + attention + head
    return total / len(runner.pool)


def time_steps(step_fn, steps, warmup: int, repeats: int, device) -> tuple[list[float], list[float]]:
    """(warm-up step times, timed step times); a compiled arm's compilations land in the warm-up."""
    times = []
    for index in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        step_fn(steps[index % len(steps)])
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times[:warmup], times[warmup:]


def profile_pass(step_fn, steps, device: torch.device, out: Path) -> None:
    """One pass over the pool under torch.profiler: the top operators by device time (inclusive), printed and
    saved, the top operators by input shape (top_shapes.txt: which matmul of which module runs slow), and the
    top 80 by self time (top_kernels.txt: where the step's device time goes, each kernel counted once)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for step in steps:
            step_fn(step)
        synchronize(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
    shapes = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=40, max_name_column_width=40)
    # By self time: kernels themselves (nvjet GEMMs, Triton fusions, FlexAttention's templates), each counted once;
    # the inclusive tables above count a kernel again in every wrapper around it.
    self_sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = prof.key_averages().table(sort_by=self_sort, row_limit=80, max_name_column_width=90)
    out.mkdir(parents=True, exist_ok=True)
    (out / "top_ops.txt").write_text(table)
    (out / "top_shapes.txt").write_text(shapes)
    (out / "top_kernels.txt").write_text(kernels)
    print(table, flush=True)


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
    inputs = [
        [{k: v.to(device) for k, v in transformers_inputs(chunk, runner.config).items()} for chunk in step.chunks]
        for step in runner.pool
    ]
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


ALL_SIX = (
    "suffix_cudnn",
    "windowed_vram_peak",
    "device_assert_patch_count",
    "branchless_extension_lookup",
    "masked_loss_sums",
    "no_embed_clone",
)
FAST = {"prefix_attention": "flex", "compile": True, "bucket_by_length": True}
# name -> (run config on top of the base, switches). The base is seed 000's: batch 12, cameras {1, 2}, max-crops 1.
OURS = {
    "head": ({"backward_chunks": 6}, ()),
    "six": ({"backward_chunks": 6}, ALL_SIX),
    "six+flex": ({"backward_chunks": 6, "prefix_attention": "flex"}, ALL_SIX),
    "six+flex+compile": ({"backward_chunks": 6, "prefix_attention": "flex", "compile": True}, ALL_SIX),
    "fast-c6": ({"backward_chunks": 6, **FAST}, ALL_SIX),
    "fast-c3": ({"backward_chunks": 3, **FAST}, ALL_SIX),
    "fast-c2": ({"backward_chunks": 2, **FAST}, ALL_SIX),
    "fast-c1": ({"backward_chunks": 1, **FAST}, ALL_SIX),
    # The fast path on HEAD's own steps (chunk_by_cameras): each step keeps its samples and is cut into chunks by
    # camera count, so it trains as HEAD does (bucket_by_length's steps regroup the samples: another trajectory)
    "fast-c1-same-steps": (
        {"backward_chunks": 1, "prefix_attention": "flex", "compile": True, "chunk_by_cameras": True},
        ALL_SIX,
    ),
    # ... compiled with automatic dynamic shapes: fewer compilations for HEAD's many chunk shapes (warm-up times
    # in the row say what it saves); whether its kernels are as fast is the s/step beside fast-c1-same-steps
    "fast-c1-same-steps-dyn": (
        {
            "backward_chunks": 1,
            "prefix_attention": "flex",
            "compile": True,
            "chunk_by_cameras": True,
            "compile_dynamic": True,
        },
        ALL_SIX,
    ),
    # X1 on top: the frozen ViT's attention in bf16 (a numerics change: an item with oracles before it lands)
    "fast-c1-x1": ({"backward_chunks": 1, **FAST}, (*ALL_SIX, "vit_bf16_attention")),
    # X2 on top: the same on fp16 inputs (X1's successor: 3 more bits of mantissa, the same FLASH kernel family)
    "fast-c1-x2": ({"backward_chunks": 1, **FAST}, (*ALL_SIX, "vit_fp16_attention")),
    # ... and the suffix's attention on FlexAttention too (its dense mask runs SDPA's MATH: 35 ms a step)
    "fast-c1-x2-sflex": ({"backward_chunks": 1, **FAST, "suffix_attention": "flex"}, (*ALL_SIX, "vit_fp16_attention")),
    "fast-c1-same-steps-x2": (
        {"backward_chunks": 1, "prefix_attention": "flex", "compile": True, "chunk_by_cameras": True},
        (*ALL_SIX, "vit_fp16_attention"),
    ),
    # HEAD's steps packed (packing.py): each step's 12 samples end to end in one chunk, no compute on padding and
    # no gradient accumulation; both attentions on FlexAttention (dense masks over a packed row of ~12k tokens
    # would not fit)
    "packed-x2": (
        {"backward_chunks": 1, "prefix_attention": "flex", "suffix_attention": "flex", "compile": True, "pack": True},
        (*ALL_SIX, "vit_fp16_attention"),
    ),
    # X3 (the pooling attention as fp32 arithmetic) and X4 (the clip folded into the fused AdamW) on top: numerics
    # items, each with its CPU tests; landing them is a ladder's question
    "fast-c1-x2-sflex-x34": (
        {"backward_chunks": 1, **FAST, "suffix_attention": "flex"},
        (*ALL_SIX, "vit_fp16_attention", "pool_fp32_math", "clip_in_adamw"),
    ),
    "packed-x2-x34": (
        {"backward_chunks": 1, "prefix_attention": "flex", "suffix_attention": "flex", "compile": True, "pack": True},
        (*ALL_SIX, "vit_fp16_attention", "pool_fp32_math", "clip_in_adamw"),
    ),
    # ... its packed rows whole FlexAttention tiles (pack_multiple 128): no bounds checks in the attention kernels,
    # for at most 127 tail tokens a row
    # ... attending on one row per sample, gathered from the packed row and back (pack_attention "rows"): the
    # padded chunk's attention cost, the packed chunk's matmuls
    "packed-rows-x2-x34": (
        {
            "backward_chunks": 1,
            "prefix_attention": "flex",
            "suffix_attention": "flex",
            "compile": True,
            "pack": True,
            "pack_attention": "rows",
        },
        (*ALL_SIX, "vit_fp16_attention", "pool_fp32_math", "clip_in_adamw"),
    ),
    # ... the prefix and suffix rows joined through every block but the last (pack_one_pass): one matmul per weight
    # a layer, one cast, no gradient accumulation; and with the attention on per-sample rows too
    "packed-one-pass-x2-x34": (
        {
            "backward_chunks": 1,
            "prefix_attention": "flex",
            "suffix_attention": "flex",
            "compile": True,
            "pack": True,
            "pack_one_pass": True,
        },
        (*ALL_SIX, "vit_fp16_attention", "pool_fp32_math", "clip_in_adamw"),
    ),
    "packed-rows-one-pass-x2-x34": (
        {
            "backward_chunks": 1,
            "prefix_attention": "flex",
            "suffix_attention": "flex",
            "compile": True,
            "pack": True,
            "pack_attention": "rows",
            "pack_one_pass": True,
        },
        (*ALL_SIX, "vit_fp16_attention", "pool_fp32_math", "clip_in_adamw"),
    ),
    "packed-x2-x34-128": (
        {
            "backward_chunks": 1,
            "prefix_attention": "flex",
            "suffix_attention": "flex",
            "compile": True,
            "pack": True,
            "pack_multiple": 128,
        },
        (*ALL_SIX, "vit_fp16_attention", "pool_fp32_math", "clip_in_adamw"),
    ),
    # ... the packed rows' attention as FlashAttention varlen calls on segments (pack_attention "varlen"), in two
    # passes and in one
    "packed-varlen-x2-x34": (
        {"backward_chunks": 1, "compile": True, "pack": True, "pack_attention": "varlen"},
        (*ALL_SIX, "vit_fp16_attention", "pool_fp32_math", "clip_in_adamw"),
    ),
    "packed-varlen-one-pass-x2-x34": (
        {"backward_chunks": 1, "compile": True, "pack": True, "pack_attention": "varlen", "pack_one_pass": True},
        (*ALL_SIX, "vit_fp16_attention", "pool_fp32_math", "clip_in_adamw"),
    ),
    # ... X3 out (it failed its one-step loss oracle at 4B: molmo2-x34-h200), and the varlen segments on cuDNN's SDPA
    # (pack_attention "varlen-cudnn") beside FlashAttention-2's
    "packed-varlen-one-pass-x2-x4": (
        {"backward_chunks": 1, "compile": True, "pack": True, "pack_attention": "varlen", "pack_one_pass": True},
        (*ALL_SIX, "vit_fp16_attention", "clip_in_adamw"),
    ),
    # ... and with only what landed (X4 passed its oracle but molmo2-x34-h200 parked it with X3): the S-bundle, X2
    "packed-varlen-cudnn-one-pass-x2": (
        {"backward_chunks": 1, "compile": True, "pack": True, "pack_attention": "varlen-cudnn", "pack_one_pass": True},
        (*ALL_SIX, "vit_fp16_attention"),
    ),
    "packed-varlen-cudnn-one-pass-x2-x4": (
        {"backward_chunks": 1, "compile": True, "pack": True, "pack_attention": "varlen-cudnn", "pack_one_pass": True},
        (*ALL_SIX, "vit_fp16_attention", "clip_in_adamw"),
    ),
}


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--ours", default="head,fast-c2", help=f"comma-separated, from {sorted(OURS)}")
    parser.add_argument("--peer-chunks", default="6", help="comma-separated chunk counts for the peer ('' for none)")
    parser.add_argument(
        "--warmup", type=int, default=4, help="warm-up steps (a compiled run compiles each new shape here)"
    )
    parser.add_argument("--cycles", type=int, default=3, help="timed passes over the 4-step pool (3 = 12 timed steps)")
    parser.add_argument("--peer-attention", default="sdpa")
    parser.add_argument(
        "--profile-arm", default="", help="one of --ours to run under torch.profiler for a pool pass after timing"
    )
    parser.add_argument("--peer-last", action="store_true", help="time the peer after our arms (default: first)")
    parser.add_argument(
        "--alongside", default="", help="what else ran on the host meanwhile (recorded in the conditions)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    unknown = set(args.ours.split(",")) - set(OURS)
    if unknown:
        raise SystemExit(f"--ours: unknown {sorted(unknown)}; allowed: {sorted(OURS)}")

    profile = PROFILES[args.profile]
    device = torch.device("cuda" if profile.device == "cuda" else "cpu")
    ceiling = matmul_ceiling(device)
    import transformers

    conditions = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "transformers": transformers.__version__,
        "batch": args.batch,
        "camera_counts": [1, 2],
        "max_crops": 1,
        "warmup": args.warmup,
        "timed_steps": None,
        "dtype": "fp32 master weights, bf16 autocast, fused AdamW"
        if device.type == "cuda"
        else "fp32 (no autocast on a CPU), AdamW",
        "peer_attention": args.peer_attention,
        "bf16_matmul_tflops": ceiling / 1e12 if ceiling else None,
        "s_per_step": "mean over whole passes of the pool (every arm sees the same pool of samples); median beside it",
        "order": "peer last" if args.peer_last else "peer first",
        "alongside": args.alongside or None,
    }
    rows = []

    def record(name: str, runner: Molmo2Runner, times, peak, load_s: float, error: str | None = None):
        warm, times = times if times else (None, None)
        retries = torch.cuda.memory_stats().get("num_alloc_retries") if device.type == "cuda" else None
        row = {
            "name": name,
            "load_s": load_s,
            "peak_gib": peak,
            "alloc_retries": retries,
            "error": error,
            "warmup_times": warm,
            "times": times,
        }
        if times:
            flops = step_flops(runner)
            mean = statistics.fmean(times)
            tokens = statistics.fmean(step.useful_tokens for step in runner.pool)
            padded = statistics.fmean(
                sum(c.prefix.input_ids.numel() + c.suffix.input_ids.numel() for c in step.chunks)
                for step in runner.pool
            )
            row |= {
                "s_per_step": mean,
                "median_s": statistics.median(times),
                "tokens_per_s": tokens / mean,
                "padding": 1 - tokens / padded,
                "flops_per_step": flops,
                "mfu": flops / mean / ceiling if ceiling else None,
            }
        rows.append(row)
        print(json.dumps(row), flush=True)

    def time_ours(name: str) -> None:
        extra, switches = OURS[name]
        start = time.perf_counter()
        raw = {"batch": args.batch, "camera_counts": [1, 2], "max_crops": 1, **extra}
        runner = Molmo2Runner(profile, arm_config(profile, raw), seed=0)
        runner.load()
        runner.set_switches(switches)
        load_s = time.perf_counter() - start
        release(device)
        steps = args.cycles * len(runner.pool)
        conditions["timed_steps"] = steps
        try:
            times = time_steps(lambda step: runner.trainer.step(step), runner.pool, args.warmup, steps, device)
            record(f"ours {name}", runner, times, peak_gib(device), load_s)
            if name == args.profile_arm:
                profile_pass(
                    lambda step: runner.trainer.step(step), runner.pool, device, Path(args.out) / f"profile_{name}"
                )
        except torch.OutOfMemoryError as error:
            record(
                f"ours {name}",
                runner,
                None,
                peak_gib(device),
                load_s,
                f"OutOfMemoryError: {str(error).splitlines()[0]}",
            )
        del runner
        release(device)

    def time_peer(chunks: int) -> None:
        start = time.perf_counter()
        raw = {"batch": args.batch, "camera_counts": [1, 2], "max_crops": 1, "backward_chunks": chunks}
        runner = Molmo2Runner(profile, arm_config(profile, raw), seed=0)
        runner.load_data()  # the same pool as our unbucketed arms; the peer builds its own model
        name = f"transformers {transformers.__version__} Molmo2 ({args.peer_attention}, {chunks} chunks)"
        model, step, inputs = peer_runner(runner, device, args.peer_attention)
        load_s = time.perf_counter() - start
        release(device)
        try:
            times = time_steps(step, inputs, args.warmup, args.cycles * len(inputs), device)
            record(name, runner, times, peak_gib(device), load_s)
        except torch.OutOfMemoryError as error:
            record(name, runner, None, peak_gib(device), load_s, f"OutOfMemoryError: {str(error).splitlines()[0]}")
        del model, step, inputs
        release(device)

    # The peer first (unless --peer-last): the reference row and the cheapest; each row is printed as it completes,
    # so a call cut short by its time limit still has the peer beside whatever of ours it reached.
    peer_chunks = [int(c) for c in args.peer_chunks.split(",") if c]
    for chunks in [] if args.peer_last else peer_chunks:
        time_peer(chunks)
    for name in args.ours.split(","):
        time_ours(name)
    for chunks in peer_chunks if args.peer_last else []:
        time_peer(chunks)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"peer_molmo2_{args.profile}.json").write_text(
        json.dumps({"conditions": conditions, "rows": rows}, indent=1)
    )
    print("\nconditions: " + json.dumps(conditions))
    peer = next((r for r in rows if r["name"].startswith("transformers") and r.get("s_per_step")), None)
    print(f"\n{'':52} {'s/step':>7} {'median':>7} {'tok/s':>7} {'pad':>5} {'MFU':>6} {'peak GiB':>8} {'vs peer':>7}")
    for row in rows:
        if not row.get("s_per_step"):
            print(f"{row['name']:52} {row['error']}")
            continue
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "—"
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "—"
        ratio = f"{peer['s_per_step'] / row['s_per_step']:.2f}x" if peer else "—"
        print(
            f"{row['name']:52} {row['s_per_step']:7.3f} {row['median_s']:7.3f} {row['tokens_per_s']:7.0f} {row['padding']:5.1%} {mfu:>6} {peak:>8} {ratio:>7}"
        )


if __name__ == "__main__":
    main()
