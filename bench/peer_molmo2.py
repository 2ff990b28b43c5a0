"""Our Molmo2 training step against transformers' own Molmo2 at its best, in one run, beside a bf16 matmul ceiling.

Both sides train the same samples the same way: seed 000's bench batch (12 samples, cameras {1, 2}, max-crops 1),
fp32 master weights, bf16 autocast, fused AdamW over the text decoder blocks and the final norm (the vision tower,
the embeddings and the base head frozen), gradient clipping, and the same loss on the same labels
(tests/test_peer_loss.py). Ours also trains its FAST rows and its state projection (5.3 M parameters beside the
decoder's 3.6 B).

The peer (PEER below) is transformers' Molmo2ForConditionalGeneration with our text vocabulary
(bench/molmo2_peer.py), in the configurations a careful user has: its defaults (logits over the whole vocabulary
at every position, the config's use_cache, eager modules, six backward chunks), logits on the loss-bearing tokens
only (`logits_to_keep`, use_cache off), fewer backward chunks, each decoder and vision layer under
`torch.compile(dynamic=True)`, and the attention implementations transformers offers for Molmo2 (sdpa,
flex_attention, flash_attention_2 where flash-attn is installed). Every configuration tried is a row; one that
fails (out of memory, a compile error, a backend that is not there) is a row that carries its error.

Our arms (OURS below) differ from the baseline only by switches and run config (engine/molmo2/attention/
execution.py). An arm is `landed_only` when each of its switches and run-config values is the baseline's or one
a verdict landed (LANDED_SWITCHES, LANDED_CONFIG: tests/test_bench_peer.py reads those verdicts in the ledger).
Each arm loads its own runner (bucketing regroups the same 48 samples into other steps), so every arm and the peer
see the same samples per pass of the pool.

FLOPs per step (chunk_flops) are model FLOPs on real tokens: the work the step needs, whatever an implementation
spends (the peer's logits at every position, ours' Q rows of the last prefix block are not credited):
- decoder blocks, trainable: 6 x the matmul weights (att_proj's Q, K and V rows, attn_out, ff_proj, ff_out) per
  real token, forward, input gradient and weight gradient. A prefix token's last block computes only its keys and
  values (model.decoder's last_layer_kv_only, joined_suffix_hidden): 6 x hidden x 2 kv_width there;
- decoder attention: 12 x heads x head_dim per (query, key) pair of real tokens the masks allow (QK^T and AV,
  forward 4, backward 8; `attention_pairs`), the prefix's pairs in every block but the last, the suffix's in all;
- the heads, per loss-bearing token: the frozen lm_head on the gradient path 4 x hidden x vocab (forward and the
  input gradient, no weight gradient), the trainable FAST head 6 x hidden x fast_vocab;
- the vision tower and adapter, frozen and off the gradient path: forward only, 2 x their matmul weights per
  patch (patch embedding, the stored ViT blocks), per pooled token (pooling query and output, projector) and per
  valid pooling slot (pooling keys and values), plus attention 4 x heads x head_dim per pair: every patch pair of
  a crop in each ViT block, each pooled token's valid slots;
- not counted: norms, RoPE, activations, softmax, embedding lookups, the optimizer.
MFU = FLOPs / s_per_step / the bf16 matmul rate measured in the same run.

    python bench/peer_molmo2.py --profile h200-4b --ours packed-varlen-cudnn-one-pass-x2 \\
        --peer defaults-c6,keep-c2,keep-c2-compiled --name landed-vs-peer-best
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from molmo2_peer import transformers_config, transformers_inputs  # noqa: E402

from engine.molmo2.attention.packing import packed_prefix_mask, packed_suffix_mask  # noqa: E402
from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.model.batch import ARBatch, PrefixInputs  # noqa: E402
from engine.molmo2.model.config import Molmo2Config  # noqa: E402
from engine.molmo2.model.model import prefix_attention_mask  # noqa: E402
from engine.molmo2.run_config import UNRECORDED_DEFAULTS, resolve  # noqa: E402
from engine.molmo2.runner import Molmo2Runner  # noqa: E402
from engine.molmo2.train.master_adamw import MasterAdamW, shadowed_parameters  # noqa: E402
from engine.molmo2.train.step import autocast, synchronize  # noqa: E402

BASE = {"batch": 12, "camera_counts": [1, 2], "max_crops": 1}  # seed 000's bench config, every row's


def arm_config(profile, raw: dict):
    """An arm's run config: its keys over the defaults the arms were written against (the padded eager step), so an
    arm means what its name says whatever the workload defaults to now."""
    return resolve(profile, raw, UNRECORDED_DEFAULTS)


def matmul_ceiling(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """FLOP/s of an n^3 bf16 product on random data: the median of `repeats` timed products after 3 warm-ups."""
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


def attention_pairs(chunk: ARBatch) -> tuple[float, float]:
    """(prefix pairs, suffix pairs): the (query, key) pairs the model attends over between real tokens. The
    prefix's rule is causal OR image (image tokens see every image token of their row, later ones included); each
    suffix token sees the row's real prefix and, causally, its suffix. Padding on either side does not count; in a
    packed chunk, neither do pairs across samples (the packed masks keep attention to each sample)."""
    if chunk.packing is not None:
        k = chunk.packing
        real_p, real_s = k.prefix_doc[0] >= 0, k.suffix_doc[0] >= 0
        prefix_pairs = packed_prefix_mask(k, chunk.prefix.mm_token_type_ids)[0, 0] & real_p[:, None] & real_p[None, :]
        suffix_pairs = packed_suffix_mask(k)[0, 0] & real_s[:, None] & torch.cat([real_p, real_s])[None, :]
        return float(prefix_pairs.sum()), float(suffix_pairs.sum())
    real = chunk.prefix.attention_mask.bool()
    allowed = prefix_attention_mask(chunk.prefix.attention_mask, chunk.prefix.mm_token_type_ids)[:, 0]
    prefix_pairs = float((allowed & real[:, :, None] & real[:, None, :]).sum())
    prefix = chunk.prefix.attention_mask.sum(1).double()
    suffix = chunk.suffix.attention_mask.sum(1).double()
    return prefix_pairs, float((suffix * prefix + suffix * (suffix + 1) / 2).sum())


def vision_flops(config: Molmo2Config, prefix: PrefixInputs) -> dict[str, float]:
    """The frozen vision tower and adapter, forward only (the module docstring says what counts), as
    {"vision_matmuls", "vision_attention"}."""
    v, a, hidden = config.vision, config.adapter, config.text.hidden_size
    crops, patches = prefix.pixel_values.shape[:2]
    pooled = prefix.image_token_pooling.shape[0]
    slots = float((prefix.image_token_pooling >= 0).sum())
    vit_block = 4 * v.hidden_size**2 + 2 * v.hidden_size * v.intermediate_size  # wq, wk, wv, wo; w1, w2
    vit = crops * patches * (v.patch_dim * v.hidden_size + config.vit_stored_layers * vit_block)
    width = a.num_heads * a.head_dim
    pool_in = config.pooling_input_dim
    pooling = pool_in * width + width * a.hidden_size  # the query's projection and the output's
    projector = 2 * a.hidden_size * a.intermediate_size + a.intermediate_size * hidden  # w1, w3; w2
    adapter = pooled * (pooling + projector) + slots * 2 * pool_in * width  # keys and values of the valid slots
    attention = 4 * v.num_heads * v.head_dim * config.vit_stored_layers * crops * patches**2
    attention += 4 * a.num_heads * a.head_dim * slots
    return {"vision_matmuls": float(2 * (vit + adapter)), "vision_attention": float(attention)}


def chunk_flop_parts(config: Molmo2Config, chunk: ARBatch) -> dict[str, float]:
    """Model FLOPs of one chunk's forward and backward (the module docstring says what counts), by part: the
    matmuls (the decoder's and the heads'; the vision tower's and adapter's) and the attention (the decoder's; the
    vision tower's and pooling's). A step's matmul part against its GEMM kernels' time says how near the ceiling
    they run."""
    t = config.text
    prefix_tokens = float(chunk.prefix.attention_mask.sum())
    suffix_tokens = float(chunk.suffix.attention_mask.sum())
    loss_tokens = float((chunk.suffix.labels >= 0).sum())
    block = (
        t.hidden_size * (t.q_width + 2 * t.kv_width)
        + t.q_width * t.hidden_size
        + 3 * t.hidden_size * t.intermediate_size
    )
    last_prefix_block = t.hidden_size * 2 * t.kv_width  # keys and values only
    layers = t.num_layers
    decoder = 6 * (suffix_tokens * layers * block + prefix_tokens * ((layers - 1) * block + last_prefix_block))
    prefix_pairs, suffix_pairs = attention_pairs(chunk)
    attention = 12 * t.num_heads * t.head_dim * ((layers - 1) * prefix_pairs + layers * suffix_pairs)
    head = (4 * t.vocab_size + 6 * config.fast_vocab_size) * t.hidden_size * loss_tokens
    return {"decoder_matmuls": decoder + head, "decoder_attention": attention, **vision_flops(config, chunk.prefix)}


def chunk_flops(config: Molmo2Config, chunk: ARBatch) -> float:
    """Model FLOPs of one chunk's forward and backward: the sum of its parts."""
    return sum(chunk_flop_parts(config, chunk).values())


def step_flop_parts(runner: Molmo2Runner) -> dict[str, float]:
    """The pool's average step's model FLOPs by part (chunk_flop_parts); their sum is the step's count."""
    parts: dict[str, float] = defaultdict(float)
    for step in runner.pool:
        for chunk in step.chunks:
            for part, flops in chunk_flop_parts(runner.config, chunk).items():
                parts[part] += flops / len(runner.pool)
    return dict(parts)


def time_steps(step_fn, steps, warmup: int, repeats: int, device) -> tuple[list[float], list[float]]:
    """(warm-up step times, timed step times); a compiled arm's compilations land in the warm-up."""
    times = []
    for index in range(warmup + repeats):
        drain(device)
        start = time.perf_counter()
        step_fn(steps[index % len(steps)])
        drain(device)
        times.append(time.perf_counter() - start)
    # Work a step left on another stream (X7's update) past its last step is the last step's: the times then sum to
    # the timed steps' wall time.
    start = time.perf_counter()
    synchronize(device)
    times[-1] += time.perf_counter() - start
    return times[:warmup], times[warmup:]


def drain(device: torch.device) -> None:
    """Waits for the current stream: all of a step's work but what it left on another stream for the next step to
    hide (X7's optimizer update under the next step's vision tower). One stream: the whole device."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def profile_pass(step_fn, steps, device: torch.device, out: Path) -> None:
    """The steps under torch.profiler: the top operators by device-seconds (inclusive), printed and
    saved, the top operators by input shape (top_shapes.txt: which matmul of which module runs slow), and the
    top 80 by self time (top_kernels.txt: where the step's device-seconds go, each kernel counted once)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for step in steps:
            step_fn(step)
        synchronize(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
    shapes = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=40, max_name_column_width=40)
    # By self time: kernels themselves (nvjet GEMMs, Triton fusions, attention kernels), each counted once; the
    # inclusive tables above count a kernel again in every wrapper around it.
    self_sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = prof.key_averages().table(sort_by=self_sort, row_limit=80, max_name_column_width=90)
    out.mkdir(parents=True, exist_ok=True)
    (out / "top_ops.txt").write_text(table)
    (out / "top_shapes.txt").write_text(shapes)
    (out / "top_kernels.txt").write_text(kernels)
    print(kernels, flush=True)


# name -> how the peer trains. chunks: backward chunks a step; logits_to_keep: logits on the suffix only (its
# positions and one pad column, bench/molmo2_peer.py) instead of every position; use_cache: the forward's
# use_cache (True is the config's default, which makes a DynamicCache copy every layer's K/V in training too);
# compiled: each decoder and vision layer under torch.compile(dynamic=True); attention: transformers'
# attn_implementation; bf16_linear_weights: X10 on the peer (its trainable linears' weights in bf16 over fp32
# masters in our MasterAdamW, clip and update in its kernels), one chunk only (X10 sums no gradients in bf16).
_PEER = {
    "defaults-c6": {"chunks": 6, "logits_to_keep": False, "use_cache": True, "compiled": False, "attention": "sdpa"},
    **{
        f"keep-c{n}": {"chunks": n, "logits_to_keep": True, "use_cache": False, "compiled": False, "attention": "sdpa"}
        for n in (6, 3, 2, 1)
    },
    **{
        f"keep-c{n}-compiled": {"chunks": n, "logits_to_keep": True, "use_cache": False, "compiled": True,
                                "attention": "sdpa"}
        for n in (3, 2, 1)
    },  # fmt: skip
    "keep-c2-flex": {"chunks": 2, "logits_to_keep": True, "use_cache": False, "compiled": False,
                     "attention": "flex_attention"},
    **{
        f"keep-c{n}-flex-compiled": {"chunks": n, "logits_to_keep": True, "use_cache": False, "compiled": True,
                                     "attention": "flex_attention"}
        for n in (2, 1)
    },
    "keep-c2-flash2": {"chunks": 2, "logits_to_keep": True, "use_cache": False, "compiled": False,
                       "attention": "flash_attention_2"},
}  # fmt: skip
PEER = {
    **{name: {**peer, "bf16_linear_weights": False} for name, peer in _PEER.items()},
    "keep-c1-compiled-bf16-weights": {**_PEER["keep-c1-compiled"], "bf16_linear_weights": True},
}


def peer_trainer(runner: Molmo2Runner, device: torch.device, peer: dict[str, Any]):
    """transformers' model with our vocabulary, seeded normal(0, 0.02) weights (unit norms, zero biases), the
    decoder layers and final norm trainable under fused AdamW; its step and the pool in its input layout."""
    from transformers.models import molmo2 as tfm

    with torch.device("meta"):
        model = tfm.Molmo2ForConditionalGeneration(
            transformers_config(runner.config, peer["attention"], fast_block=True)
        )
    model.to_empty(device=device)
    with torch.no_grad():
        generator = torch.Generator(device=device).manual_seed(0)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
        # RoPE's frequency tables are buffers computed at construction, which on the meta device computed none
        for rope in (model.model.language_model.rotary_emb, model.model.language_model.rotary_emb_unscaled):
            assert rope.rope_type == "default", rope.rope_type  # transformers_config's rope_parameters
            inv_freq, _ = rope.compute_default_rope_parameters(rope.config)
            rope.inv_freq.copy_(inv_freq)
            rope.original_inv_freq.copy_(inv_freq)
    trainable = []
    for name, p in model.named_parameters():
        train = ".layers." in name and "language_model" in name or name.endswith("language_model.norm.weight")
        p.requires_grad_(train)
        if train:
            trainable.append(p)
    if peer["compiled"]:
        # room for the pool's shapes before Dynamo would silently run a layer eagerly (the default limit is 8)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for layer in (*model.model.language_model.layers, *model.model.vision_tower.layers):
            layer.compile(dynamic=True)
    optimizer = torch.optim.AdamW(trainable, lr=2e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda")
    if peer["bf16_linear_weights"]:
        # before the first forward, so the lazily compiled layers compile for the bf16 weights
        optimizer = MasterAdamW.from_adamw(optimizer, shadowed_parameters(model))
    steps = []
    for step in runner.pool:
        total = sum(int((c.suffix.labels >= 0).sum()) for c in step.chunks)
        steps.append([
            ({k: v.to(device) if torch.is_tensor(v) else v
              for k, v in transformers_inputs(chunk, runner.config, logits_to_keep=peer["logits_to_keep"]).items()},
             int((chunk.suffix.labels >= 0).sum()) / total)  # the chunk's share of the step's loss tokens
            for chunk in step.chunks
        ])  # fmt: skip
    model.train()
    use_cache = peer["use_cache"]

    def update():
        torch.nn.utils.clip_grad_norm_(trainable, 100.0)
        optimizer.step()

    if isinstance(optimizer, MasterAdamW):
        update = partial(optimizer.clip_and_step, 100.0)  # the clip inside its update

    def train_step(chunks):
        optimizer.zero_grad(set_to_none=True)
        for inputs, share in chunks:
            with autocast(device):
                out = model(**inputs, use_cache=use_cache)
            (out.loss * share).backward()
        update()

    return model, train_step, steps


ALL_SIX = (
    "suffix_cudnn",
    "windowed_vram_peak",
    "device_assert_patch_count",
    "branchless_extension_lookup",
    "masked_loss_sums",
    "no_embed_clone",
)
# Switches and run-config values a verdict landed: name or (key, value) -> (registration, its verdict's outcome).
# The baseline's own values (BASELINE_CONFIG, no switch) need no verdict.
LANDED_SWITCHES = {
    **{name: ("molmo2-perf-pass1-h200", "land-bundle") for name in ALL_SIX},
    "vit_fp16_attention": ("molmo2-x2-h200", "land-x2"),
    "optimizer_overlaps_vision": ("molmo2-overlap-h200", "land-x7"),
    "bf16_linear_weights": ("molmo2-x10-recompiled-h200", "land-x10"),
    "fused_swiglu": ("molmo2-x11-h200", "land-x11"),
}
LANDED_CONFIG = {
    ("backward_chunks", 1): ("molmo2-fast-h200", "default-fast-path"),
    ("prefix_attention", "flex"): ("molmo2-fast-h200", "default-fast-path"),
    ("compile", True): ("molmo2-fast-h200", "default-fast-path"),
    ("bucket_by_length", True): ("molmo2-fast-h200", "default-fast-path"),
    ("chunk_by_cameras", True): ("molmo2-fast-same-steps-h200", "default-fast-path-same-steps"),
    ("pack", True): ("molmo2-pack-h200", "default-pack"),
    ("pack_one_pass", True): ("molmo2-pack-one-pass-h200", "default-one-pass"),
    ("pack_attention", "varlen"): ("molmo2-pack-varlen-h200", "default-varlen"),
    ("pack_attention", "varlen-cudnn"): ("molmo2-pack-cudnn-h200", "default-varlen-cudnn"),
}
BASELINE_CONFIG = {"backward_chunks": 6}

FAST = {"prefix_attention": "flex", "compile": True, "bucket_by_length": True}
PACKED_ONE_PASS = {"backward_chunks": 1, "compile": True, "pack": True, "pack_one_pass": True}
# name -> (run config on top of BASE, switches)
OURS = {
    "baseline": (BASELINE_CONFIG, ()),
    "six": ({"backward_chunks": 6}, ALL_SIX),
    "six+flex": ({"backward_chunks": 6, "prefix_attention": "flex"}, ALL_SIX),
    "six+flex+compile": ({"backward_chunks": 6, "prefix_attention": "flex", "compile": True}, ALL_SIX),
    "fast-c6": ({"backward_chunks": 6, **FAST}, ALL_SIX),
    "fast-c3": ({"backward_chunks": 3, **FAST}, ALL_SIX),
    "fast-c2": ({"backward_chunks": 2, **FAST}, ALL_SIX),
    "fast-c1": ({"backward_chunks": 1, **FAST}, ALL_SIX),
    # The fast path on the baseline's own steps (chunk_by_cameras): each step keeps its samples and is cut into
    # chunks by camera count, so it trains as the baseline does (bucket_by_length's steps regroup the samples)
    "fast-c1-same-steps": (
        {"backward_chunks": 1, "prefix_attention": "flex", "compile": True, "chunk_by_cameras": True},
        ALL_SIX,
    ),
    # X2 on top: the frozen ViT's attention on fp16 inputs (FLASH)
    "fast-c1-x2": ({"backward_chunks": 1, **FAST}, (*ALL_SIX, "vit_fp16_attention")),
    "fast-c1-same-steps-x2": (
        {"backward_chunks": 1, "prefix_attention": "flex", "compile": True, "chunk_by_cameras": True},
        (*ALL_SIX, "vit_fp16_attention"),
    ),
    # The baseline's steps packed (packing.py), each step's 12 samples end to end, prefix and suffix rows joined
    # through every block but the last (pack_one_pass), the attention as varlen segments on FlashAttention-2 or
    # on cuDNN's fused SDPA (pack_attention)
    "packed-varlen-one-pass-x2": ({**PACKED_ONE_PASS, "pack_attention": "varlen"}, (*ALL_SIX, "vit_fp16_attention")),
    "packed-varlen-cudnn-one-pass-x2": (
        {**PACKED_ONE_PASS, "pack_attention": "varlen-cudnn"},
        (*ALL_SIX, "vit_fp16_attention"),
    ),
    # ... with X7 (the optimizer update on a side stream under the next step's frozen-ViT forward, land-x7)
    "packed-varlen-cudnn-one-pass-x2-x7": (
        {**PACKED_ONE_PASS, "pack_attention": "varlen-cudnn"},
        (*ALL_SIX, "vit_fp16_attention", "optimizer_overlaps_vision"),
    ),
    # ... with X10 (the trainable linears' weights in bf16 over fp32 masters, one fused update, land-x10)
    "packed-varlen-cudnn-one-pass-x2-x7-x10": (
        {**PACKED_ONE_PASS, "pack_attention": "varlen-cudnn"},
        (*ALL_SIX, "vit_fp16_attention", "optimizer_overlaps_vision", "bf16_linear_weights"),
    ),
    # ... with X11 (the MLP's ff_out(silu(gate) * up) as one op each way, land-x11)
    "packed-varlen-cudnn-one-pass-x2-x7-x10-x11": (
        {**PACKED_ONE_PASS, "pack_attention": "varlen-cudnn"},
        (*ALL_SIX, "vit_fp16_attention", "optimizer_overlaps_vision", "bf16_linear_weights", "fused_swiglu"),
    ),
    # ... with inductor's coordinate-descent tuning of every compiled Triton kernel (compile_tuning): not landed
    "packed-varlen-cudnn-one-pass-x2-x7-cdt": (
        {**PACKED_ONE_PASS, "pack_attention": "varlen-cudnn", "compile_tuning": "coordinate-descent"},
        (*ALL_SIX, "vit_fp16_attention", "optimizer_overlaps_vision"),
    ),
}


def landed_only(config: dict[str, Any], switches: tuple[str, ...]) -> bool:
    values = all(BASELINE_CONFIG.get(key) == value or (key, value) in LANDED_CONFIG for key, value in config.items())
    return values and all(name in LANDED_SWITCHES for name in switches)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def release(device: torch.device) -> None:
    """Between rows: no compiled graph, cached block, peak or allocator retry count of one row reaches the next."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()


def failure(error: BaseException) -> str:
    """The row's error: the exception's first line; its traceback goes to stderr, the run's log."""
    traceback.print_exception(error, file=sys.stderr)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


def sequence_lengths(runner: Molmo2Runner) -> dict[str, Any]:
    """Real tokens per sample over the pool (the same samples for every row), and the crops."""
    prefix = [n for s in runner.pool for c in s.chunks for n in c.prefix.attention_mask.sum(1).tolist()]
    suffix = [n for s in runner.pool for c in s.chunks for n in c.suffix.attention_mask.sum(1).tolist()]
    crops = sum(c.prefix.pixel_values.shape[0] for s in runner.pool for c in s.chunks)
    spread = lambda xs: {"min": min(xs), "mean": statistics.fmean(xs), "max": max(xs)}  # noqa: E731
    return {"samples": len(prefix), "pool_steps": len(runner.pool), "prefix_real": spread(prefix),
            "suffix_real": spread(suffix), "crops": crops, "loss_tokens_per_step": statistics.fmean(
                s.loss_tokens for s in runner.pool)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--batch", type=int, default=BASE["batch"])
    parser.add_argument(
        "--ours", default="packed-varlen-cudnn-one-pass-x2", help=f"comma-separated, from {sorted(OURS)}"
    )
    parser.add_argument(
        "--peer", default="defaults-c6,keep-c2", help=f"comma-separated ('' for none), from {sorted(PEER)}"
    )
    parser.add_argument(
        "--name", required=True, help="what the run measures: the JSON is peer_molmo2_PROFILE_NAME.json"
    )
    parser.add_argument("--warmup", type=int, default=4, help="warm-up steps (a compiled run compiles here)")
    parser.add_argument("--cycles", type=int, default=3, help="timed passes over the 4-step pool (3 = 12 timed steps)")
    parser.add_argument("--profile-arm", default="", help="one of --ours to run under torch.profiler after its timing")
    parser.add_argument("--profile-steps", type=int, default=0, help="steps profiled (default 0: one pass of the pool)")
    parser.add_argument("--peer-last", action="store_true", help="time the peer after our arms (default: first)")
    parser.add_argument("--alongside", default="", help="what else ran on the host meanwhile (for the conditions)")
    parser.add_argument(
        "--compile-cache",
        default="cold: this process compiles every graph in its warm-up steps",
        help="the state of inductor's on-disk cache at the start (for the conditions)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    ours_names = [n for n in args.ours.split(",") if n]
    peer_names = [n for n in args.peer.split(",") if n]
    for flag, names, allowed in (("--ours", ours_names, OURS), ("--peer", peer_names, PEER)):
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; allowed: {sorted(allowed)}")
    chunks = {f"--ours {n}": OURS[n][0].get("backward_chunks", 1) for n in ours_names}
    chunks |= {f"--peer {n}": PEER[n]["chunks"] for n in peer_names}
    for what, n in chunks.items():
        if args.batch % n:
            parser.error(f"{what}: {n} backward chunks do not split --batch {args.batch}; give a multiple of {n}")
    if args.profile_arm and args.profile_arm not in ours_names:
        parser.error(f"--profile-arm {args.profile_arm!r} is not among --ours {ours_names}")

    profile = PROFILES[args.profile]
    device = torch.device("cuda" if profile.device == "cuda" else "cpu")
    base = BASE | {"batch": args.batch}
    ceiling = matmul_ceiling(device)
    import transformers

    conditions = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "transformers": transformers.__version__,
        "dtype": "fp32 master weights, bf16 autocast, fused AdamW (rows with bf16_linear_weights, X10: the trainable "
        "linears' weights in bf16 over fp32 masters, clip and AdamW in its Triton kernels)"
        if device.type == "cuda"
        else "fp32 (no autocast on a CPU), AdamW",
        **base,
        "sequence_lengths": None,
        "flops_by_part": None,
        "warmup": args.warmup,
        "cycles": args.cycles,
        "timed_steps": None,
        "bf16_matmul_tflops": ceiling / 1e12 if ceiling else None,
        "ceiling": "8192^3 bf16 matmul on random data, median of 10 after 3 warm-ups, before any row",
        "s_per_step": "mean over whole passes of the pool (every row sees the same samples); median beside it",
        "flops": "model FLOPs on real tokens (chunk_flops): the same count for every row",
        "order": "peer last" if args.peer_last else "peer first",
        "alongside": args.alongside or None,
        "compile_cache": args.compile_cache,
    }
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = out / f"peer_molmo2_{args.profile}_{args.name}.json"

    def record(row: dict[str, Any], runner: Molmo2Runner | None, times, padded: float | None, load_s: float | None,
               error: str | None):  # fmt: skip
        warm, timed = times if times else (None, None)
        retries = torch.cuda.memory_stats().get("num_alloc_retries") if device.type == "cuda" else None
        row |= {"load_s": load_s, "peak_gib": peak_gib(device), "alloc_retries": retries, "error": error,
                "warmup_times": warm, "times": timed, "s_per_step": None, "median_s": None, "tokens_per_s": None,
                "padding": None, "flops_per_step": None, "mfu": None}  # fmt: skip
        first = conditions["sequence_lengths"] is None and hasattr(runner, "pool")
        parts = step_flop_parts(runner) if timed or first else None  # the pool's masks: counted once a row
        if timed:
            flops = sum(parts.values())
            mean = statistics.fmean(timed)
            tokens = statistics.fmean(step.useful_tokens for step in runner.pool)
            row |= {
                "s_per_step": mean,
                "median_s": statistics.median(timed),
                "tokens_per_s": tokens / mean,
                "padding": 1 - tokens / padded,
                "flops_per_step": flops,
                "mfu": flops / mean / ceiling if ceiling else None,
            }
        if first:
            conditions["sequence_lengths"] = sequence_lengths(runner)
            conditions["flops_by_part"] = parts
            conditions["timed_steps"] = args.cycles * len(runner.pool)
        rows.append(row)
        print(json.dumps(row), flush=True)
        # after every row: a run stopped at its time limit keeps the rows it finished
        report.write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1))

    def timed(step_fn: Callable, steps) -> tuple[list[float], list[float]]:
        return time_steps(step_fn, steps, args.warmup, args.cycles * len(steps), device)

    def time_ours(name: str) -> None:
        extra, switches = OURS[name]
        row = {"name": f"ours {name}", "kind": "ours", "landed_only": landed_only(extra, switches),
               "config": extra, "switches": list(switches), "peer_config": None}  # fmt: skip
        start = time.perf_counter()
        runner = load_s = times = None
        try:
            runner = Molmo2Runner(profile, arm_config(profile, base | extra), seed=0)
            runner.load()
            runner.set_switches(switches)
            load_s = time.perf_counter() - start
            release(device)
            times, error = timed(runner.trainer.step, runner.pool), None
        except Exception as caught:  # a row records why the configuration failed, whatever failed
            error = failure(caught)
        padded = times and statistics.fmean(
            sum(c.prefix.input_ids.numel() + c.suffix.input_ids.numel() for c in step.chunks) for step in runner.pool
        )
        record(row, runner, times, padded, load_s, error)
        if error is None and name == args.profile_arm:
            profiled = runner.pool[: args.profile_steps] if args.profile_steps else runner.pool
            profile_pass(runner.trainer.step, profiled, device, Path(args.out) / f"profile_{name}")
        del runner
        release(device)

    data_runners: dict[int, Molmo2Runner] = {}  # the peer's pools by chunk count: its inputs, our collation

    def time_peer(name: str) -> None:
        peer = PEER[name]
        row = {"name": f"transformers {transformers.__version__} Molmo2 {name}", "kind": "peer", "landed_only": None,
               "config": None, "switches": None, "peer_config": peer}  # fmt: skip
        start = time.perf_counter()
        if peer["chunks"] not in data_runners:
            runner = Molmo2Runner(profile, arm_config(profile, base | {"backward_chunks": peer["chunks"]}), seed=0)
            runner.load_data()
            data_runners[peer["chunks"]] = runner
        runner = data_runners[peer["chunks"]]
        model = train_step = steps = load_s = times = None
        try:
            model, train_step, steps = peer_trainer(runner, device, peer)
            load_s = time.perf_counter() - start
            release(device)
            times, error = timed(train_step, steps), None
        except Exception as caught:  # a row records why the configuration failed, whatever failed
            error = failure(caught)
        # the peer's layout adds one pad column a row
        padded = times and statistics.fmean(
            sum(
                c.prefix.input_ids.numel() + c.suffix.input_ids.numel() + c.suffix.input_ids.shape[0]
                for c in step.chunks
            )
            for step in runner.pool
        )
        record(row, runner, times, padded, load_s, error)
        del model, train_step, steps
        release(device)

    # The peer first (unless --peer-last); each row is printed as it completes, so a call cut short by its time
    # limit still has the rows it reached. Rows share the process, and on the H200 the peer's rows ran 12-18% slower
    # after one of our arms than before it (the same configurations, peer first against peer last:
    # bench/results/peer_molmo2_h200-4b_landed-vs-peer-*.json), ours within 3% either way: the peer's numbers are
    # those of a run where it goes first.
    for name in [] if args.peer_last else peer_names:
        time_peer(name)
    for name in ours_names:
        time_ours(name)
    for name in peer_names if args.peer_last else []:
        time_peer(name)

    print(f"\nconditions: {json.dumps(conditions)}\nwritten: {report}")
    print_table(rows)


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows, each against the peer's defaults and the fastest peer row of the same run."""
    peers = [r for r in rows if r["kind"] == "peer" and r["s_per_step"]]
    defaults = next((r for r in peers if not r["peer_config"]["logits_to_keep"]), None)
    best = min(peers, key=lambda r: r["s_per_step"], default=None)
    print(f"\n{'':58} {'s/step':>7} {'median':>7} {'tok/s':>7} {'pad':>5} {'MFU':>6} {'peak GiB':>8} "
          f"{'vs peer defaults':>16} {'vs best peer':>12} landed")  # fmt: skip
    for row in rows:
        if not row["s_per_step"]:
            print(f"{row['name']:58} {row['error']}")
            continue
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "—"
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "—"
        against = [f"{r['s_per_step'] / row['s_per_step']:.2f}x" if r else "—" for r in (defaults, best)]
        landed = {True: "yes", False: "no", None: ""}[row["landed_only"]]
        print(f"{row['name']:58} {row['s_per_step']:7.3f} {row['median_s']:7.3f} {row['tokens_per_s']:7.0f} "
              f"{row['padding']:5.1%} {mfu:>6} {peak:>8} {against[0]:>16} {against[1]:>12} {landed}")  # fmt: skip


if __name__ == "__main__":
    main()
