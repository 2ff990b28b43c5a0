"""The Molmo2 workload's declaration: plain data, importable without torch (DESIGN.md, "Names the Molmo2
workload declares"). Extend these lists; never rename an entry — frozen registrations name them."""

from __future__ import annotations

from engine.molmo2.run_config import RUN_CONFIG
from prereg.workload import Metric, Probe, Profile, WorkloadDeclaration

SWITCHES = {
    "suffix_cudnn": "P1: suffix SDPA with cuDNN prepended to the backend list, training mode only",
    "windowed_vram_peak": "P2: per-window vram_window_peak_gib and a peak reset; the lifetime field unchanged",
    "device_assert_patch_count": "P3a: the <im_patch> count validation as a device-side assert (no host sync)",
    "branchless_extension_lookup": "P3b: the extension-embedding lookup without the .any() branch",
    "masked_loss_sums": "P3c: mask-multiplied sums instead of boolean indexing in the sum-form losses",
    "no_embed_clone": "P4: no clone of the prefix embedding before the in-place masked feature add",
    "vit_bf16_attention": "X1 (retired: dropped at its oracle; its code left the workload): the frozen ViT's "
    "attention in bf16 instead of the hub's fp32, training mode only",
    "vit_fp16_attention": "X2: the frozen ViT's attention on fp16 inputs instead of the hub's fp32, training mode only",
    "pool_fp32_math": "X3 (retired: dropped by its ladder; its code left the workload): the pooling attention as "
    "fp32 arithmetic instead of fp32 SDPA, training mode only",
    "clip_in_adamw": "X4 (retired: parked by its ladders; its code left the workload): the gradient clip folded into "
    "the fused AdamW (grad_scale) instead of a multiply pass first",
    "fp8_decoder_linears": "X5 (retired: dropped at its curve oracle; its code left the workload): the decoder "
    "blocks' linears as float8 matmuls (torchao, dynamic tensorwise scales) in training mode only",
    "fp8_rowwise_decoder_linears": "X6 (retired: dropped at its curve oracle; its code left the workload): the "
    "decoder blocks' linears on torchao's rowwise float8 recipe (a scale per row), training mode only",
    "fp8_normed_input_linears": "X8 (retired: dropped at its curve oracle; its code left the workload): X5's recipe "
    "on only the decoder blocks' two linears that read an RMSNorm's output (fused qkv, fused up/gate)",
    "optimizer_overlaps_vision": "X7: the optimizer step on a side stream under the next step's frozen-ViT forward "
    "(the same update, bitwise; CUDA, one process)",
    "staged_update": "X9 (retired: parked by its ladder; its code left the workload): X7's update in stages "
    "(embedding side, each decoder block, head side), each waited for where the next step's forward first reads it",
    "bf16_linear_weights": "X10: the trainable linears' weights held in bf16 over fp32 masters that one fused "
    "update (clip, AdamW, the bf16 copy) writes; their gradients bf16 (CUDA, one process, one backward chunk)",
    "fused_swiglu": "X11: the decoder MLP's SwiGLU as one op each way, whose backward reads each (up, gate) pair and "
    "its gradient once and writes both halves of their gradient (Triton on CUDA), training mode only",
    "packed_query_heads": "X12 (retired: its gate, a probe on the H200, read the packed call slower; its code left "
    "the workload): a packed row's full (image-run) varlen calls with each key head's query heads as one head of 4x "
    "the rows, training mode only",
}

_TOL = frozenset({"tolerance"})
PROBES = {
    "one_step": Probe(
        "one_step",
        "one training step on a fixed micro-batch and seed, baseline vs item: loss, gradient norm, per-parameter "
        "gradient hashes",
        frozenset({"tolerance", "bitwise", "finite"}),
        frozenset({"loss_abs", "loss_rel", "grad_norm_abs", "grad_norm_rel"}),
    ),
    "loss_curve": Probe(
        "loss_curve",
        "an N-step loss curve, baseline vs item, from the same init and data",
        frozenset({"curve_overlay", "finite"}),
        frozenset({"max_abs_diff"}),
    ),
    "decode_bytes": Probe(
        "decode_bytes", "greedy decode of a pinned small eval plan, bytes compared", frozenset({"byte_match"})
    ),
    "planted_mismatch": Probe(
        "planted_mismatch",
        "a batch whose <im_patch> count disagrees with its image features: the forward must abort",
        frozenset({"raises"}),
    ),
    "embed_outputs": Probe(
        "embed_outputs",
        "embedding outputs on fixed batches with and without FAST/extension ids",
        frozenset({"bitwise"}),
    ),
    "loss_sums_fp64": Probe(
        "loss_sums_fp64",
        "the sum-form chunked losses against an fp64 reference; the mean-form losses against the baseline",
        frozenset({"tolerance", "bitwise"}),
        frozenset({"sum_rel", "sum_abs", "mean_abs"}),
    ),
    "window_schema": Probe(
        "window_schema",
        "a few logged windows: both memory fields present, lifetime >= window, lifetime monotone",
        frozenset({"schema"}),
    ),
    "fwd_bwd_outputs": Probe(
        "fwd_bwd_outputs",
        "a fixed micro-batch forward + backward: outputs and every parameter gradient",
        frozenset({"bitwise"}),
    ),
    "memory_peak": Probe(
        "memory_peak", "peak allocated device memory over a few steps", frozenset({"memory"}), frozenset({"peak_gib"})
    ),
}

_m = Metric
# The engine declares rc, steps, load_s, gpu_s, world_size and finite for every workload (prereg.workload).
METRICS = {
    m.name: m
    for m in [
        _m("s_per_step", "s", "median", "device-synchronized seconds per training step"),
        _m("tokens_per_s", "tok/s", "median", "tokens per second (useful tokens, padding excluded)"),
        _m("loss", "nats", "median", "training loss", paired=True),
        _m(
            "vram_peak_gib",
            "GiB",
            "max",
            "allocated device memory, lifetime peak",
            display=True,
            label="vram peak GiB",
            plot="memory",
        ),
        _m(
            "vram_window_peak_gib",
            "GiB",
            "max",
            "allocated device memory, this window's peak",
            display=True,
            label="window peak GiB",
            plot="memory",
        ),
        _m("vram_reserved_peak_gib", "GiB", "max", "the caching allocator's reserved pool, peak"),
        _m(
            "smi_peak_mib",
            "MiB",
            "max",
            "device-level memory as nvidia-smi reports it, context included",
            display=True,
            label="smi peak MiB",
            format=",.0f",
        ),
        _m(
            "probe_chunk_mae",
            "action units",
            "last",
            "greedy-decoded action chunk MAE on held-out episodes",
            True,
            paired=True,
            display=True,
            label="chunk MAE",
        ),
        _m(
            "probe_first_mae",
            "action units",
            "last",
            "greedy-decoded first-action MAE on held-out episodes",
            True,
            paired=True,
        ),
        # The data the run trains on, counted at load and carried by every window (seed 003's E1 data gate): a
        # count, not a rate, so no interval.
        _m("data_datasets", "datasets", "last", "datasets the run trains on", relative_ok=False),
        _m("data_episodes", "episodes", "last", "training episodes the run draws from", relative_ok=False),
        _m("data_frames", "frames", "last", "camera frames over those episodes", relative_ok=False),
        _m("data_state_dim", "dims", "last", "dimensions of the robot state", relative_ok=False),
        _m("data_action_dim", "dims", "last", "dimensions of an action", relative_ok=False),
        # The box's test suite at the launch commit (seed 003's gate "Box pytest green at the launch commit"),
        # entered with `prereg record`: the engine runs no suite of the box's.
        _m("box_pytest_passed", "tests", "last", "tests passed at the launch commit", relative_ok=False),
        _m("box_pytest_failed", "tests", "last", "tests failed or in error at the launch commit", relative_ok=False),
        # The panel's per-frame errors (its npz rows), keyed by frame id, entered with `prereg record`: read 1's
        # paired per-frame delta against an anchor's rows (seed 003 section 5).
        _m("panel_frame_chunk_mae", "action units", "last", "panel chunk MAE per frame", True, paired=True, rows=True),
        _m(
            "panel_frame_first_mae",
            "action units",
            "last",
            "panel first-action MAE per frame",
            True,
            paired=True,
            rows=True,
        ),
        # Endpoint panel evaluation (seed 003 section 5), entered with `prereg record` from the eval cluster.
        _m("panel_chunk_mae", "action units", "last", "panel pooled chunk MAE", True, paired=True),
        _m("panel_first_mae", "action units", "last", "panel pooled first-action MAE", True, paired=True),
        _m("state_copy_chunk_mae", "action units", "last", "state-copy fallback rows, chunk MAE", True, paired=True),
        _m(
            "state_copy_first_mae",
            "action units",
            "last",
            "state-copy fallback rows, first-action MAE",
            True,
            paired=True,
        ),
    ]
}

PROFILES = {
    "cpu-tiny": Profile("cpu-tiny", "cpu", 0, "tiny", "the tiny geometry on the CPU: seconds per step on two cores"),
    # The multi-process path in CI: two gloo ranks under torchrun, one CPU core each.
    "cpu-tiny-x2": Profile(
        "cpu-tiny-x2", "cpu", 0, "tiny", "the tiny geometry on two CPU processes (gloo) under torchrun", processes=2
    ),
    "h200-4b": Profile("h200-4b", "cuda", 1, "4b", "the real Molmo2-4B geometry on one H200, bf16 autocast"),
    "h200x2-4b": Profile("h200x2-4b", "cuda", 2, "4b", "Molmo2-4B on two H200s of one host, under torchrun"),
    # The seeds' box: four H100s under DDP. The engine does not drive it; its results enter by `prereg record`.
    "h100x4-4b": Profile("h100x4-4b", "cuda", 4, "4b", "the seeds' 4xH100 box (external; results are recorded)"),
    "h100-4b": Profile("h100-4b", "cuda", 1, "4b", "one H100, the seeds' local bench GPU (external)"),
}

DECLARATION = WorkloadDeclaration(
    name="molmo2",
    switches=SWITCHES,
    probes=PROBES,
    metrics=METRICS,
    profiles=PROFILES,
    run_config=RUN_CONFIG,
    runner="engine.molmo2.runner:Molmo2Runner",
    # The AR step's functional forward, its sum-form losses, and the step that casts the logits to fp32.
    activation_frames=frozenset({"ar_forward", "ar_loss_sums", "accumulate_gradients"}),
)
