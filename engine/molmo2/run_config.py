"""The Molmo2 workload's run config: every key, its type, its default on each kind of profile, and every rule
between keys, checked when a document is validated (`prereg check`, `prereg freeze`), never first found after a
model load on a GPU. Torch-free (pydantic only): prereg validates documents without torch.

A key that applies only with another is unset (null) without it: `pack_attention` and `pack_one_pass` without
`pack`, `ddp_wrapper` without `chunk_grad_allreduce`, `compile_tuning` without `compile`. A document that sets one
without the other is refused; a default of one is dropped when the document turns the other off.

Three tables of defaults: a new freeze resolves with `defaults(profile)` and records that table, so a later change
of a default leaves its meaning alone; a document frozen before freezes recorded their defaults resolves with
`UNRECORDED_DEFAULTS`, the values the code used then.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal, Mapping

from pydantic import Field, ValidationInfo, field_validator, model_validator

from engine.molmo2.switches import RETIRED as RETIRED_SWITCHES
from engine.molmo2.switches import Switches
from prereg.workload import (
    CHANGES_NUMERICS,
    REGROUPS_SAMPLES,
    ConfigConflict,
    Profile,
    RetiredOption,
    RunConfig,
    RunConfigDeclaration,
    profile_of,
)

# Every switch a document may name: those the model implements, and the retired ones frozen documents still name.
SWITCH_NAMES = tuple(f.name for f in fields(Switches)) + tuple(RETIRED_SWITCHES)
CAMERA_COUNTS = (1, 2)  # the rig's camera kinds, front and side (data/rig.py CAMERA_KINDS)
AttentionKernel = Literal["sdpa", "flex"]
PackAttention = Literal["packed", "rows", "varlen", "varlen-cudnn", "varlen-fa4"]
CompileTuning = Literal["default", "coordinate-descent"]
PositiveRate = Annotated[float, Field(gt=0, allow_inf_nan=False)]

# A key that applies only when another is on -> that other key.
APPLIES_ONLY_WITH = {
    "pack_attention": "pack",
    "pack_one_pass": "pack",
    "ddp_wrapper": "chunk_grad_allreduce",
    "compile_tuning": "compile",
}
# Landed switches that apply only to a rung of one backward chunk: a defaulted baseline_switches leaves them out of a
# rung of several (X10 would sum the chunks' bf16 gradients in bf16); one the document writes is checked as written.
ONE_CHUNK_ONLY = ("bf16_linear_weights",)


class Molmo2RunConfig(RunConfig):
    """CHANGES_NUMERICS marks the keys that compute the same step in other arithmetic: the reduction's grouping
    (backward_chunks, chunk_by_cameras, zero1, ddp, chunk_grad_allreduce), kernels (compile, compile_tuning,
    prefix_attention, suffix_attention, pack_attention), packing (pack, pack_one_pass) and the baseline's switches.
    Not marked: what the step computes (batch, camera_counts, max_crops, the learning rates, grad_clip, warmup:
    another recipe, not other numerics), bucket_by_length (other steps: prereg/pairing.py's flag), ddp_wrapper (the
    same explicit allreduce with or without the wrapper), memory_snapshot (instrumentation) and the retired keys."""

    BASELINE_KEY = "baseline_switches"

    batch: Annotated[int, Field(ge=1, description="samples per optimizer step (per rank)")]
    backward_chunks: Annotated[
        int,
        CHANGES_NUMERICS,
        Field(ge=1, description="gradient-accumulation chunks per step; batch must divide evenly"),
    ]
    camera_counts: Annotated[
        tuple[int, ...], Field(strict=False, min_length=1, description="camera counts the sampler draws from")
    ]
    max_crops: Annotated[int, Field(ge=1, description="high-resolution crops per image")]
    lr: Annotated[PositiveRate, Field(description="decoder learning rate")]
    # Seed 003's recipe sets two learning rates: --decoder-lr (`lr`) and --backbone-text-lr.
    backbone_text_lr: Annotated[PositiveRate, Field(description="learning rate of the trunk's text decoder blocks")]
    grad_clip: Annotated[PositiveRate, Field(description="gradient-norm clip")]
    warmup: Annotated[int, Field(ge=0, description="learning-rate warm-up steps")]
    zero1: Annotated[bool, CHANGES_NUMERICS, Field(description="ZeRO-1 optimizer sharding (several processes)")]
    ddp: Annotated[bool, CHANGES_NUMERICS, Field(description="wrap in DistributedDataParallel (several processes)")]
    chunk_grad_allreduce: Annotated[
        bool,
        CHANGES_NUMERICS,
        Field(description="explicit in-place gradient allreduce once per step (several processes)"),
    ]
    ddp_wrapper: Annotated[
        bool | None, Field(description="with chunk_grad_allreduce: whether the DDP wrapper stays; null without it")
    ]
    memory_snapshot: Annotated[
        bool, Field(description="record allocation history and dump a snapshot after the first window and at OOM")
    ]
    compile: Annotated[
        bool, CHANGES_NUMERICS, Field(description="torch.compile the decoder layers (and the frozen vision tower)")
    ]
    compile_tuning: Annotated[
        CompileTuning | None,
        CHANGES_NUMERICS,
        Field(
            description="with compile: how inductor sizes its Triton kernels: 'default' (its heuristics) or "
            "'coordinate-descent' (each kernel's block sizes and warps tuned by timing it while compiling; a "
            "reduction's order can move with them); null without compile"
        ),
    ]
    bucket_by_length: Annotated[
        bool,
        REGROUPS_SAMPLES,
        Field(description="the pool's samples regrouped into steps by camera count (other steps than unbucketed)"),
    ]
    chunk_by_cameras: Annotated[
        bool,
        CHANGES_NUMERICS,
        Field(description="each step cut into chunks where its camera counts meet (the same step, less padding)"),
    ]
    pack: Annotated[
        bool,
        CHANGES_NUMERICS,
        Field(description="training chunks packed: each chunk's samples end to end in one row, attention kept to each"),
    ]
    pack_attention: Annotated[
        PackAttention | None,
        CHANGES_NUMERICS,
        Field(
            description="with pack: where a packed chunk attends: 'packed' (the packed row under per-sample block "
            "masks), 'varlen' (FlashAttention varlen calls on per-sample runs; bf16 on CUDA) or 'varlen-cudnn' (the "
            "same segments on cuDNN's SDPA; needs nvidia-cudnn-frontend on CUDA); null without pack"
        ),
    ]
    pack_one_pass: Annotated[
        bool | None,
        CHANGES_NUMERICS,
        Field(description="with pack: prefix and suffix rows joined through every block but the last; null unpacked"),
    ]
    prefix_attention: Annotated[
        AttentionKernel,
        CHANGES_NUMERICS,
        Field(description="the prefix attention's kernel: 'sdpa' (dense mask) or 'flex' (block mask)"),
    ]
    suffix_attention: Annotated[
        AttentionKernel, CHANGES_NUMERICS, Field(description="the suffix attention's kernel in training")
    ]
    baseline_switches: Annotated[
        tuple[str, ...],
        CHANGES_NUMERICS,
        Field(strict=False, description="the switches on in every rung; a rung's items add theirs"),
    ]
    fast_vocab_size: Annotated[
        int,
        Field(
            ge=1,
            description="the FAST block's size: action-token ids [fast_block_base, fast_block_base + n), at the 4b "
            "geometry [152,064, 152,064 + n); FAST tokenizer v2 has 1,026",
        ),
    ]
    # Retired keys (RETIRED): unset in every table; frozen documents that set them still validate.
    pack_multiple: Annotated[int | None, Field(ge=1, description="retired: the packed rows' length multiple")]
    compile_dynamic: Annotated[bool | None, Field(description="retired: with compile, Dynamo's dynamic shapes")]
    fps: Annotated[int | None, Field(description="retired: action frames per second (read by nothing)")]
    truncate_layers: Annotated[
        int | None, Field(description="retired: mount the first N decoder layers (read by nothing)")
    ]

    @classmethod
    def fill(cls, raw: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
        values = {**defaults, **raw}
        for key, parent in APPLIES_ONLY_WITH.items():
            if key not in raw and values.get(parent) is False:
                values[key] = None
        if "baseline_switches" not in raw and values.get("backward_chunks") != 1:
            values["baseline_switches"] = tuple(s for s in values["baseline_switches"] if s not in ONE_CHUNK_ONLY)
        return values

    @field_validator("fast_vocab_size", mode="before")
    @classmethod
    def _fast_block_as_sized_before_the_key(cls, size: Any, info: ValidationInfo) -> Any:
        # UNRECORDED_DEFAULTS leaves it None: a document frozen before the key ran the geometry's own block.
        return FAST_BLOCK_BEFORE_THE_KEY[profile_of(info).geometry] if size is None else size

    @field_validator("camera_counts")
    @classmethod
    def _cameras(cls, counts: tuple[int, ...]) -> tuple[int, ...]:
        if any(isinstance(c, bool) or c not in CAMERA_COUNTS for c in counts):
            raise ValueError(f"allowed: a non-empty list of camera counts from {list(CAMERA_COUNTS)}, e.g. [1, 2]")
        return counts

    @field_validator("baseline_switches")
    @classmethod
    def _known_switches(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(names) - set(SWITCH_NAMES))
        if unknown:
            retired = {r.name for r in RETIRED if r.kind == "switch"}
            raise ValueError(f"unknown switch(es) {unknown}; allowed: {[n for n in SWITCH_NAMES if n not in retired]}")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"{repeated} listed more than once; name each switch once")
        return names

    @model_validator(mode="after")
    def _cross_key_rules(self, info: ValidationInfo) -> "Molmo2RunConfig":
        profile = profile_of(info)
        for rule in CROSS_KEY_RULES:
            rule(self, profile)
        return self


def _batch_splits_into_chunks(c: Molmo2RunConfig, profile: Profile) -> None:
    """Each chunk's loss sum is divided by the whole step's token count, so chunks must cut the batch evenly."""
    if c.batch % c.backward_chunks:
        divisors = [n for n in range(1, c.batch + 1) if c.batch % n == 0]
        raise ConfigConflict(
            ("backward_chunks", "batch"),
            f"batch = {c.batch} does not split evenly into "
            f"backward_chunks = {c.backward_chunks}; allowed with this batch: {divisors}",
        )


def _packing_options_need_pack(c: Molmo2RunConfig, profile: Profile) -> None:
    """pack_attention and pack_one_pass say how a packed chunk is computed: they mean nothing unpacked."""
    for key in ("pack_attention", "pack_one_pass"):
        value = getattr(c, key)
        if not c.pack and value is not None:
            raise ConfigConflict(
                (key, "pack"),
                f"{key} = {value!r} needs pack = true (it says how a packed chunk is "
                f"computed); fix: set pack = true, or remove {key}",
            )
        if c.pack and value is None:
            raise ConfigConflict((key, "pack"), f"pack = true needs {key}; set it (see the run config's description)")


def _compile_tuning_needs_compile(c: Molmo2RunConfig, profile: Profile) -> None:
    """compile_tuning says how the compiled blocks' kernels are sized: it means nothing eager."""
    if not c.compile and c.compile_tuning is not None:
        raise ConfigConflict(
            ("compile_tuning", "compile"),
            f"compile_tuning = {c.compile_tuning!r} needs compile = true (it sizes the compiled blocks' kernels); "
            "fix: set compile = true, or remove compile_tuning",
        )
    if c.compile and c.compile_tuning is None:
        raise ConfigConflict(("compile_tuning", "compile"), "compile = true needs compile_tuning = 'default' or "
                             "'coordinate-descent'")  # fmt: skip


def _ddp_wrapper_needs_allreduce(c: Molmo2RunConfig, profile: Profile) -> None:
    """ddp_wrapper chooses between the two explicit-allreduce modes (seed 003's rungs 6 and 8)."""
    if not c.chunk_grad_allreduce and c.ddp_wrapper is not None:
        raise ConfigConflict(
            ("ddp_wrapper", "chunk_grad_allreduce"),
            f"ddp_wrapper = {str(c.ddp_wrapper).lower()} "
            "applies only with chunk_grad_allreduce = true; fix: set chunk_grad_allreduce = true, or "
            "remove ddp_wrapper",
        )
    if c.chunk_grad_allreduce and c.ddp_wrapper is None:
        raise ConfigConflict(("ddp_wrapper",), "chunk_grad_allreduce = true needs ddp_wrapper = true | false")


def _gradient_sync_fits_the_processes(c: Molmo2RunConfig, profile: Profile) -> None:
    """One process has nothing to synchronise; several must agree on their gradients one way or another."""
    world = profile.world_size
    if world == 1:
        for key in ("zero1", "ddp", "chunk_grad_allreduce"):
            if getattr(c, key):
                raise ConfigConflict(
                    (key,),
                    f"{key} = true needs several processes; profile {profile.name} runs "
                    f"one, where it changes nothing; fix: remove {key} or pick a profile of several "
                    "GPUs",
                )
    elif not (c.ddp or c.chunk_grad_allreduce):
        raise ConfigConflict(
            ("ddp", "chunk_grad_allreduce"),
            f"profile {profile.name} runs {world} processes, which "
            "need a gradient sync; fix: set ddp = true, or chunk_grad_allreduce = true (with "
            "ddp_wrapper = true | false)",
        )


def _flex_needs_cuda(c: Molmo2RunConfig, profile: Profile) -> None:
    """FlexAttention has no backward on the CPU."""
    for key in ("prefix_attention", "suffix_attention"):
        if getattr(c, key) == "flex" and profile.device != "cuda":
            raise ConfigConflict(
                (key,),
                f"{key} = 'flex' needs CUDA (FlexAttention has no backward on the CPU), and "
                f"profile {profile.name} runs on the CPU; allowed there: 'sdpa'",
            )


def _memory_snapshot_needs_cuda(c: Molmo2RunConfig, profile: Profile) -> None:
    """The snapshot records torch.cuda's allocator: on the CPU it would silently record nothing."""
    if c.memory_snapshot and profile.device != "cuda":
        raise ConfigConflict(
            ("memory_snapshot",),
            f"memory_snapshot = true needs CUDA (it records the CUDA "
            f"allocator), and profile {profile.name} runs on the CPU; fix: remove it",
        )


def _compile_dynamic_needs_compile(c: Molmo2RunConfig, profile: Profile) -> None:
    """Dynamic shapes are a way of compiling."""
    if c.compile_dynamic and not c.compile:
        raise ConfigConflict(("compile_dynamic", "compile"), "compile_dynamic = true needs compile = true")


def _pack_multiple_needs_pack(c: Molmo2RunConfig, profile: Profile) -> None:
    """The multiple rounds packed rows: there are none unpacked."""
    if c.pack_multiple is not None and not c.pack:
        raise ConfigConflict(("pack_multiple", "pack"), f"pack_multiple = {c.pack_multiple} needs pack = true")


def _one_cuda_process_for(switch: str, runs: str, c: Molmo2RunConfig, profile: Profile) -> None:
    """`switch` in the baseline `runs` something only one CUDA process can."""
    if switch in c.baseline_switches and (profile.device != "cuda" or profile.world_size > 1):
        raise ConfigConflict(
            ("baseline_switches",),
            f"{switch} in baseline_switches {runs}; profile {profile.name} trains on {profile.device} with "
            f"{profile.world_size} process(es); fix: remove it from baseline_switches",
        )


def _overlap_needs_one_cuda_process(c: Molmo2RunConfig, profile: Profile) -> None:
    """X7 runs the update on a second CUDA stream of the one process that trains."""
    _one_cuda_process_for(
        "optimizer_overlaps_vision", "runs the update on a second CUDA stream of one process", c, profile
    )


def _bf16_weights_need_one_cuda_process_and_chunk(c: Molmo2RunConfig, profile: Profile) -> None:
    """X10 updates one process's whole AdamW state in Triton kernels and keeps the linears' gradients in bf16."""
    _one_cuda_process_for("bf16_linear_weights", "runs its update as Triton kernels in one CUDA process", c, profile)
    if "bf16_linear_weights" in c.baseline_switches and c.backward_chunks != 1:
        raise ConfigConflict(
            ("baseline_switches", "backward_chunks"),
            "bf16_linear_weights in baseline_switches keeps the linears' gradients in bf16; backward_chunks = "
            f"{c.backward_chunks} would sum the chunks' gradients in bf16; fix: set backward_chunks = 1, or remove it "
            "from baseline_switches",
        )


CROSS_KEY_RULES = (
    _batch_splits_into_chunks,
    _packing_options_need_pack,
    _compile_tuning_needs_compile,
    _ddp_wrapper_needs_allreduce,
    _gradient_sync_fits_the_processes,
    _flex_needs_cuda,
    _memory_snapshot_needs_cuda,
    _compile_dynamic_needs_compile,
    _pack_multiple_needs_pack,
    _overlap_needs_one_cuda_process,
    _bf16_weights_need_one_cuda_process_and_chunk,
)

# --- defaults ------------------------------------------------------------------------------------------------

# The FAST block each geometry built before the run config named its size: the 4b geometry's 1,024 ids (two short of
# FAST tokenizer v2's 1,026), the tiny geometry's 48.
FAST_BLOCK_BEFORE_THE_KEY = {"4b": 1024, "tiny": 48}
FAST_V2_VOCAB = 1026  # FAST tokenizer v2: "vocab_total 1,026", ids [152,064, 153,090) at the 4b geometry

_RETIRED_UNSET = {"pack_multiple": None, "compile_dynamic": None, "fps": None, "truncate_layers": None}

# The values the runner used for a key a document did not set, before freezes recorded their defaults: what every
# document frozen then means (the runner's `config.get(key, default)`; ddp_wrapper unset meant "keep the wrapper").
UNRECORDED_DEFAULTS: dict[str, Any] = {
    "batch": 12,
    "backward_chunks": 1,
    "camera_counts": (1, 2),
    "max_crops": 1,
    "lr": 1e-4,
    "backbone_text_lr": 2e-5,
    "grad_clip": 100.0,
    "warmup": 0,
    "zero1": False,
    "ddp": False,
    "chunk_grad_allreduce": False,
    "ddp_wrapper": True,
    "memory_snapshot": False,
    "compile": False,
    "compile_tuning": "default",  # inductor's own heuristics: the only way the code compiled before the key
    "bucket_by_length": False,
    "chunk_by_cameras": False,
    "pack": False,
    "pack_attention": "packed",
    "pack_one_pass": False,
    "prefix_attention": "sdpa",
    "suffix_attention": "sdpa",
    "baseline_switches": (),
    "fast_vocab_size": None,  # the geometry's own block (FAST_BLOCK_BEFORE_THE_KEY), resolved per profile
    **_RETIRED_UNSET,
}

# The switches the verdicts landed, in the baseline of every CUDA rung -> the verdict that landed each.
S_BUNDLE = "molmo2-perf-pass1-h200 (land-bundle; its interleaved twin decided the same)"
LANDED = {
    "suffix_cudnn": S_BUNDLE,
    "windowed_vram_peak": S_BUNDLE,
    "device_assert_patch_count": S_BUNDLE,
    "branchless_extension_lookup": S_BUNDLE,
    "masked_loss_sums": S_BUNDLE,
    "no_embed_clone": S_BUNDLE,
    "vit_fp16_attention": "molmo2-x2-h200 (land-x2)",
    "optimizer_overlaps_vision": "molmo2-overlap-h200 (land-x7)",
    "bf16_linear_weights": "molmo2-x10-recompiled-h200 (land-x10)",
    "fused_swiglu": "molmo2-x11-h200 (land-x11)",
}
# X7 overlaps one process's update with its next step; several ranks' updates wait on their own collectives. X10's
# kernels update one process's whole AdamW state (several ranks would shard or all-reduce it).
ONE_PROCESS_ONLY = ("optimizer_overlaps_vision", "bf16_linear_weights")

# The path the verdicts landed, on CUDA profiles.
CUDA_DEFAULTS: dict[str, Any] = {
    **UNRECORDED_DEFAULTS,
    "backward_chunks": 1,  # molmo2-fast-h200 (default-fast-path): one chunk of the whole batch
    "compile": True,  # molmo2-fast-h200 (default-fast-path)
    "pack": True,  # molmo2-pack-h200 (default-pack): no compute on padding
    "pack_one_pass": True,  # molmo2-pack-one-pass-h200 (default-one-pass)
    "pack_attention": "varlen-cudnn",  # molmo2-pack-cudnn-h200 (default-varlen-cudnn), over varlen and packed
    # the S-bundle (land-bundle), X2 (land-x2), X11 (land-x11); X7 (land-x7) and X10 (land-x10) on one process
    "baseline_switches": tuple(LANDED),
    "fast_vocab_size": FAST_V2_VOCAB,  # the 4b geometry runs FAST tokenizer v2's whole block
}

# The CPU runs tests and the demo at the tiny geometry: it has no cuDNN, and compiling costs more than a tiny
# ladder's steps.
CPU_DEFAULTS: dict[str, Any] = {
    **UNRECORDED_DEFAULTS,
    "compile": False,  # inductor compiles each shape for many seconds on the CPU, longer than a tiny rung trains
    # Unpacked: on the CPU the packed attention runs a per-segment reference loop, slower at the tiny geometry
    # than the one padded batch of a chunk.
    "pack": False,
    # A CPU rung that packs: "varlen" (its CPU path is the per-segment reference; "varlen-cudnn" would run the same
    # reference under cuDNN's name), in one pass as on CUDA.
    "pack_attention": "varlen",
    "pack_one_pass": True,
    # None: the landed switches' gains were measured on CUDA (P1 switches nothing on the CPU), and the CPU ladders
    # (the demo's S-bundle) test them as items, which a baseline that held them would refuse.
    "baseline_switches": (),
    "fast_vocab_size": FAST_BLOCK_BEFORE_THE_KEY["tiny"],  # the tiny geometry's scaled-down block
}


def defaults(profile: Profile) -> dict[str, Any]:
    """The defaults a new freeze on `profile` resolves with (and records)."""
    table = dict(CUDA_DEFAULTS if profile.device == "cuda" else CPU_DEFAULTS)
    table["ddp"] = profile.world_size > 1  # several processes need a gradient sync: DDP's, seed 003's recipe
    if profile.world_size > 1:
        table["baseline_switches"] = tuple(s for s in table["baseline_switches"] if s not in ONE_PROCESS_ONLY)
    return table


# X12's ladder (molmo2-x12-h200) never ran: the gate its header states, the packed-GQA probe on the H200, read
# the packed call slower (bench/results/cudnn_packed_gqa_probe_h200-4b.json).
X12_GATE = "molmo2-x12-h200's gate (on the H200 the packed call ran slower by 0.32 ms; its ladder did not run)"
RETIRED = (
    RetiredOption("value", "pack_attention", "molmo2-pack-rows-h200 (park-rows)", value="rows"),
    RetiredOption("value", "pack_attention", "molmo2-pack-fa4-h200 (park-varlen-fa4)", value="varlen-fa4"),
    RetiredOption("switch", "vit_bf16_attention", "molmo2-x1-h200 (X1 dropped at its oracle X1a)"),
    RetiredOption("switch", "pool_fp32_math", "molmo2-x34-h200 (park-x34: X3 dropped at its oracle X3a)"),
    RetiredOption("switch", "fp8_decoder_linears", "molmo2-fp8-h200 (X5 dropped at its oracle X5b)"),
    RetiredOption("switch", "fp8_rowwise_decoder_linears", "molmo2-fp8-rowwise-h200 (X6 dropped at its oracle X6b)"),
    RetiredOption("switch", "fp8_normed_input_linears", "molmo2-fp8-normed-h200 (X8 dropped at its oracle X8b)"),
    RetiredOption("switch", "staged_update", "molmo2-staged-update-h200 (park-x9)"),
    RetiredOption("switch", "clip_in_adamw", "molmo2-x4-landed-h200 (park-x4)"),
    RetiredOption("switch", "packed_query_heads", X12_GATE),
    RetiredOption("value", "suffix_attention", "molmo2-sflex-h200 (reached no outcome)", value="flex"),
    RetiredOption("key", "pack_multiple", "no ladder landing it"),
    RetiredOption("key", "compile_dynamic", "no ladder landing it"),
    RetiredOption("key", "fps", "nothing reading it"),
    RetiredOption("key", "truncate_layers", "nothing reading it"),
)

RUN_CONFIG = RunConfigDeclaration(
    model=Molmo2RunConfig,
    defaults=defaults,
    unrecorded_defaults=UNRECORDED_DEFAULTS,
    retired=RETIRED,
    landed=LANDED,
)


def resolve(profile: Profile, raw: Mapping[str, Any], table: Mapping[str, Any] | None = None) -> Molmo2RunConfig:
    """`raw` against `profile` and a defaults table (the profile's current defaults unless given)."""
    config = RUN_CONFIG.resolve(raw, profile, defaults(profile) if table is None else table)
    assert isinstance(config, Molmo2RunConfig)
    return config
