"""The Molmo2 run config (engine/molmo2/run_config.py): one typed, frozen object per rung with every key set, every
cross-key rule refused when a document is checked (exit 2, the field path, the ledger untouched), a dump that
resolves to itself, and CUDA defaults that embody every banked default-/land- verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MINI, Cli, lab_ledger_copy, ledger_fingerprint, prereg_process, write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from engine.molmo2.declaration import DECLARATION, PROFILES
from engine.molmo2.run_config import (
    CAMERA_COUNTS,
    CROSS_KEY_RULES,
    LANDED,
    RUN_CONFIG,
    UNRECORDED_DEFAULTS,
    Molmo2RunConfig,
    defaults,
    resolve,
)
from prereg.ledger import Ledger
from prereg.rules import Scope, compile_expr
from prereg.schema import scope_names
from prereg.state import load_state
from prereg.workload import ConfigError

CPU, CPU_X2, H200, H200_X2 = (PROFILES[p] for p in ("cpu-tiny", "cpu-tiny-x2", "h200-4b", "h200x2-4b"))

# --- one case per cross-key rule: (profile, raw config, the key blamed, what the message says) ---------------------

RULE_CASES = {
    "_batch_splits_into_chunks": (CPU, {"batch": 4, "backward_chunks": 3}, "backward_chunks", "does not split evenly"),
    "_packing_options_need_pack": (CPU, {"pack_attention": "varlen"}, "pack_attention", "needs pack = true"),
    "_ddp_wrapper_needs_allreduce": (CPU_X2, {"ddp_wrapper": False}, "ddp_wrapper", "only with chunk_grad_allreduce"),
    "_gradient_sync_fits_the_processes": (CPU, {"zero1": True}, "zero1", "needs several processes"),
    "_flex_needs_cuda": (CPU, {"prefix_attention": "flex"}, "prefix_attention", "needs CUDA"),
    "_memory_snapshot_needs_cuda": (CPU, {"memory_snapshot": True}, "memory_snapshot", "needs CUDA"),
    "_compile_tuning_needs_compile": (
        CPU,
        {"compile_tuning": "coordinate-descent"},
        "compile_tuning",
        "needs compile = true",
    ),
    "_compile_dynamic_needs_compile": (CPU, {"compile_dynamic": True}, "compile_dynamic", "needs compile = true"),
    "_pack_multiple_needs_pack": (CPU, {"pack_multiple": 16}, "pack_multiple", "needs pack = true"),
    "_overlap_needs_one_cuda_process": (
        CPU,
        {"baseline_switches": ["optimizer_overlaps_vision"]},
        "baseline_switches",
        "second CUDA stream of one process",
    ),
    "_bf16_weights_need_one_cuda_process_and_chunk": (
        CPU,
        {"baseline_switches": ["bf16_linear_weights"]},
        "baseline_switches",
        "Triton kernels in one CUDA process",
    ),
}


def test_every_cross_key_rule_has_a_case():
    assert set(RULE_CASES) == {rule.__name__ for rule in CROSS_KEY_RULES}


@pytest.mark.parametrize("rule", list(RULE_CASES))
def test_each_cross_key_rule_refuses_its_conflict_naming_the_key(rule):
    profile, raw, key, says = RULE_CASES[rule]
    with pytest.raises(ConfigError) as refused:
        resolve(profile, raw)
    assert refused.value.key == key and says in refused.value.message, refused.value


# The same rules' other sides: what each also refuses, and what it allows.
MORE_REFUSED = [
    (CPU, {"pack_one_pass": True}, "pack_one_pass", "needs pack = true"),
    (CPU, {"ddp": True}, "ddp", "needs several processes"),
    (CPU, {"chunk_grad_allreduce": True}, "chunk_grad_allreduce", "needs several processes"),
    (CPU_X2, {"ddp": False}, "ddp", "need a gradient sync"),
    (H200_X2, {"baseline_switches": ["optimizer_overlaps_vision"]}, "baseline_switches", "2 process(es)"),
    (H200_X2, {"baseline_switches": ["bf16_linear_weights"]}, "baseline_switches", "2 process(es)"),
    (
        H200,
        {"baseline_switches": ["bf16_linear_weights"], "backward_chunks": 2},
        "baseline_switches",
        "backward_chunks = 2 would sum the chunks' gradients in bf16",
    ),
    (CPU, {"suffix_attention": "flex"}, "suffix_attention", "needs CUDA"),
    (CPU, {"batch": 12, "backward_chunks": 5}, "backward_chunks", "allowed with this batch: [1, 2, 3, 4, 6, 12]"),
]


@pytest.mark.parametrize(("profile", "raw", "key", "says"), MORE_REFUSED)
def test_the_rules_other_sides_are_refused_too(profile, raw, key, says):
    with pytest.raises(ConfigError) as refused:
        resolve(profile, raw)
    assert refused.value.key == key and says in refused.value.message, refused.value


ALLOWED = [
    (H200, {"prefix_attention": "flex"}),
    (H200, {"memory_snapshot": True}),
    (CPU, {"pack": True, "pack_attention": "packed", "pack_one_pass": False}),
    (CPU_X2, {"ddp": False, "chunk_grad_allreduce": True, "ddp_wrapper": False, "zero1": True}),
    (H200, {"baseline_switches": ["optimizer_overlaps_vision"]}),
    (H200, {"baseline_switches": ["bf16_linear_weights"]}),
    (CPU, {"batch": 12, "backward_chunks": 4}),
]


@pytest.mark.parametrize(("profile", "raw"), ALLOWED)
def test_what_the_rules_allow_resolves(profile, raw):
    config = resolve(profile, raw)
    assert all(getattr(config, key) == (tuple(v) if isinstance(v, list) else v) for key, v in raw.items())


def test_a_key_that_applies_only_with_another_is_unset_without_it():
    """The CUDA defaults pack; a rung that turns packing off keeps none of packing's defaults, and one that turns
    chunk_grad_allreduce on takes the wrapper's default."""
    unpacked = resolve(H200, {"pack": False})
    assert (unpacked.pack_attention, unpacked.pack_one_pass) == (None, None)
    assert resolve(H200, {}).pack_attention == "varlen-cudnn"
    assert resolve(CPU_X2, {}).ddp_wrapper is None
    assert resolve(CPU_X2, {"chunk_grad_allreduce": True}).ddp_wrapper is True


SINGLE_KEY = [
    ({"batch": "12"}, "batch", "valid integer"),
    ({"batch": 0}, "batch", "greater than or equal to 1"),
    ({"lr": 0}, "lr", "greater than 0"),
    ({"grad_clip": True}, "grad_clip", "valid number"),
    ({"compile": "yes"}, "compile", "valid boolean"),
    ({"warmup": -1}, "warmup", "greater than or equal to 0"),
    ({"camera_counts": [3]}, "camera_counts", f"camera counts from {list(CAMERA_COUNTS)}"),
    ({"camera_counts": []}, "camera_counts", "at least 1"),
    ({"prefix_attention": "flexx"}, "prefix_attention", "allowed: ['sdpa', 'flex']"),
    (
        {"pack": True, "pack_attention": "padded"},
        "pack_attention",
        "allowed: ['packed', 'varlen', 'varlen-cudnn']",
    ),
    ({"baseline_switches": ["flash"]}, "baseline_switches", "unknown switch(es) ['flash']"),
    ({"baseline_switches": ["no_embed_clone"] * 2}, "baseline_switches", "more than once"),
    ({"backward_chunk": 2}, "backward_chunk", "unknown config key 'backward_chunk'"),
]


@pytest.mark.parametrize(("raw", "key", "says"), SINGLE_KEY)
def test_a_wrong_type_or_value_names_the_key_and_what_is_allowed(raw, key, says):
    with pytest.raises(ConfigError) as refused:
        resolve(CPU, raw)
    assert refused.value.key == key and says in refused.value.message, refused.value


def test_the_allowed_values_leave_retired_ones_out():
    assert RUN_CONFIG.allowed_values("pack_attention") == ("packed", "varlen", "varlen-cudnn")
    assert RUN_CONFIG.allowed_values("suffix_attention") == ("sdpa",)
    assert "fps" not in RUN_CONFIG.keys() and "pack" in RUN_CONFIG.keys()


def test_the_rigs_camera_counts_are_the_run_configs():
    from engine.molmo2.data.rig import CAMERA_KINDS

    assert CAMERA_COUNTS == tuple(range(1, len(CAMERA_KINDS) + 1))


# --- round trip ----------------------------------------------------------------------------------------------

VALUES = {
    "batch": st.sampled_from([1, 2, 4, 6, 12, 24]),
    "backward_chunks": st.sampled_from([1, 2, 3]),
    "camera_counts": st.lists(st.sampled_from(CAMERA_COUNTS), min_size=1, max_size=3),
    "max_crops": st.integers(1, 4),
    "lr": st.floats(1e-6, 1.0),
    "grad_clip": st.one_of(st.integers(1, 200), st.floats(0.1, 200.0)),
    "warmup": st.integers(0, 2000),
    "zero1": st.booleans(),
    "ddp": st.booleans(),
    "chunk_grad_allreduce": st.booleans(),
    "ddp_wrapper": st.booleans(),
    "compile": st.booleans(),
    "bucket_by_length": st.booleans(),
    "chunk_by_cameras": st.booleans(),
    "pack": st.booleans(),
    "pack_attention": st.sampled_from(["packed", "varlen", "varlen-cudnn"]),
    "pack_one_pass": st.booleans(),
    "prefix_attention": st.sampled_from(["sdpa", "flex"]),
    "memory_snapshot": st.booleans(),
    "baseline_switches": st.lists(st.sampled_from(sorted(LANDED)), unique=True, max_size=4),
}


@st.composite
def resolvable(draw):
    profile = draw(st.sampled_from(sorted(PROFILES.values(), key=lambda p: p.name)))
    keys = draw(st.lists(st.sampled_from(sorted(VALUES)), unique=True, max_size=8))
    raw = {key: draw(VALUES[key]) for key in keys}
    try:
        return profile, raw, resolve(profile, raw)
    except ConfigError:
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(resolvable().filter(lambda case: case is not None))
def test_resolve_dump_resolve_is_the_identity(case):
    profile, raw, config = case
    dumped = json.loads(json.dumps(config.model_dump(mode="json")))  # as the ledger records it
    assert resolve(profile, dumped) == config  # every key set: the dump resolves to itself, whatever the defaults
    assert resolve(profile, dumped, UNRECORDED_DEFAULTS) == config
    assert RUN_CONFIG.load(dumped, profile) == config
    assert set(dumped) == set(Molmo2RunConfig.model_fields)
    with pytest.raises(ValidationError):  # frozen
        config.batch = 3


# --- the defaults -----------------------------------------------------------------------------------------------


def test_every_profiles_defaults_resolve_and_name_every_key():
    for profile in PROFILES.values():
        table = defaults(profile)
        assert set(table) == set(Molmo2RunConfig.model_fields)
        resolve(profile, {})  # the declaration checks this when it is built; here it is said
        assert table["ddp"] is (profile.world_size > 1)
    assert set(UNRECORDED_DEFAULTS) == set(Molmo2RunConfig.model_fields)


def test_the_cpu_defaults_keep_the_tiny_rungs_quick_and_test_the_landed_items():
    cpu = resolve(CPU, {})
    assert (cpu.pack, cpu.compile, cpu.baseline_switches) == (False, False, ())
    assert resolve(CPU, {"pack": True}).pack_attention == "varlen"  # no cuDNN on the CPU


def test_the_unrecorded_defaults_are_the_runners_former_defaults():
    """The values the runner read with config.get(key, default) before freezes recorded defaults."""
    assert UNRECORDED_DEFAULTS == {
        **{"batch": 12, "backward_chunks": 1, "camera_counts": (1, 2), "max_crops": 1, "lr": 1e-4},
        **{"backbone_text_lr": 2e-5, "grad_clip": 100.0, "warmup": 0, "zero1": False, "ddp": False},
        **{"chunk_grad_allreduce": False, "ddp_wrapper": True, "memory_snapshot": False, "compile": False},
        "compile_tuning": "default",  # inductor's heuristics: the only sizing before the key
        **{"bucket_by_length": False, "chunk_by_cameras": False, "pack": False, "pack_attention": "packed"},
        **{"pack_one_pass": False, "prefix_attention": "sdpa", "suffix_attention": "sdpa", "baseline_switches": ()},
        **{"pack_multiple": None, "compile_dynamic": None, "fps": None, "truncate_layers": None},
        "fast_vocab_size": None,  # the block each geometry built: 1,024 ids at 4b, 48 tiny (resolved per profile)
    }


# Each default-/land- verdict's winning rung: the rung its reads compare with rung A.
WINNER = {
    "molmo2-perf-pass1-h200": "C",
    "molmo2-perf-pass1-h200-interleaved": "C",
    "molmo2-fast-h200": "B",
    "molmo2-fast-same-steps-h200": "B",
    "molmo2-x2-h200": "B",
    "molmo2-pack-h200": "B",
    "molmo2-pack-one-pass-h200": "B",
    "molmo2-pack-varlen-h200": "B",
    "molmo2-pack-cudnn-h200": "B",
    "molmo2-overlap-h200": "B",
    "molmo2-x10-recompiled-h200": "B",
    "molmo2-x11-h200": "B",
}
_ONE_CHUNK = "molmo2-fast-h200 (default-fast-path): one backward chunk of the whole batch"
_SAME_STEPS = (
    "molmo2-fast-same-steps-h200: bucketing trained other steps (loss 4.14 vs 2.93); chunk_by_cameras kept them"
)
_VARLEN_KERNELS = (
    "molmo2-pack-cudnn-h200 (default-varlen-cudnn): its winner attends by varlen segments, which run no prefix or "
    "suffix kernel, and left both at sdpa"
)
# A key of a winning rung that a later verdict replaced -> the verdict and why.
SUPERSEDED = {
    ("molmo2-perf-pass1-h200", "backward_chunks"): _ONE_CHUNK,
    ("molmo2-perf-pass1-h200-interleaved", "backward_chunks"): _ONE_CHUNK,
    ("molmo2-fast-h200", "bucket_by_length"): _SAME_STEPS,
    ("molmo2-x2-h200", "bucket_by_length"): _SAME_STEPS,
    ("molmo2-fast-same-steps-h200", "chunk_by_cameras"): "molmo2-pack-h200 (default-pack): a packed chunk has no "
    "padding to save by cutting it at camera counts",
    ("molmo2-pack-varlen-h200", "pack_attention"): "molmo2-pack-cudnn-h200 (default-varlen-cudnn)",
    **{
        (reg_id, "prefix_attention"): _VARLEN_KERNELS
        for reg_id in ("molmo2-fast-h200", "molmo2-fast-same-steps-h200", "molmo2-x2-h200", "molmo2-pack-h200")
        + ("molmo2-pack-one-pass-h200", "molmo2-pack-varlen-h200")
    },
    **{
        (reg_id, "suffix_attention"): _VARLEN_KERNELS + "; suffix_attention = 'flex' is retired (molmo2-sflex-h200)"
        for reg_id in ("molmo2-pack-h200", "molmo2-pack-one-pass-h200", "molmo2-pack-varlen-h200")
    },
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Ledger:
    ledger = Ledger.open(str(lab_ledger_copy(tmp_path_factory.mktemp("lab") / "ledger.db")), create=False)
    yield ledger
    ledger.close()


def rungs_read(reg, text: str, kind: str = "rules") -> set[str]:
    """The rungs an expression reads, through the reads it names."""
    scope = Scope(kind=kind, reads=frozenset(reg.reads), **scope_names(reg, DECLARATION))
    expr = compile_expr(text, scope)
    return set(expr.rungs_used()).union(*(rungs_read(reg, reg.reads[name], "reads") for name in expr.reads_used()))


def _decisive_verdicts(lab: Ledger) -> dict[str, dict]:
    verdicts = {e.reg_id: e.data["verdict"] for e in lab.entries(kinds=("verdict",))}  # the last one stands
    return {r: v for r, v in verdicts.items() if (v["outcome"] or "").startswith(("default-", "land-"))}


def test_the_cuda_defaults_embody_every_default_and_land_verdict(lab: Ledger):
    verdicts = _decisive_verdicts(lab)
    assert set(verdicts) == set(WINNER), "a new default-/land- verdict: name its winning rung (and what it replaced)"
    landed = resolve(H200, {})
    new = landed.model_dump(mode="json")
    used_superseded = set()
    for reg_id, verdict in verdicts.items():
        reg = load_state(lab, reg_id, with_windows=False).registration_at(verdict["version"])
        winner = WINNER[reg_id]
        rule = next(r for r in reg.rules if r.id == verdict["rule"])
        assert winner in rungs_read(reg, rule.when), reg_id  # the deciding rule reads the winner
        for key, value in reg.rung_config(winner).items():
            if json.loads(json.dumps(value)) != new[key]:
                assert (reg_id, key) in SUPERSEDED, (
                    f"{reg_id} chose {key} = {value!r}; the CUDA default is {new[key]!r}"
                )
                used_superseded.add((reg_id, key))
        switches = {reg.item(i).switch for i in [*reg.rung(winner).items, *verdict["land"]]}
        assert switches <= set(landed.baseline()), (reg_id, sorted(switches - set(landed.baseline())))
    assert used_superseded == set(SUPERSEDED), "a superseded key no verdict needs any more"


def test_the_landed_switches_name_the_verdicts_that_landed_them(lab: Ledger):
    verdicts = _decisive_verdicts(lab)
    for switch, landed_by in LANDED.items():
        reg_id = landed_by.split(" ")[0]
        reg = load_state(lab, reg_id, with_windows=False).registration()
        assert switch in {reg.item(i).switch for i in verdicts[reg_id]["land"]}, (switch, landed_by)
        assert f"({verdicts[reg_id]['outcome']}" in landed_by


# --- through the documents: the field path, exit 2 at check, nothing written ----------------------------------------

TINY = """
id = "configs"
title = "run-config conflicts"
question = "is each conflict refused where it is written?"
workload = "molmo2"
profile = "{profile}"

[cost]
ceiling_gpu_h = 0.1

[protocol]
steps = 4
log_every = 2
config = {{ {protocol} }}

  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "B"
  config = {{ {rung} }}
"""

DOCUMENTS = [
    ("cpu-tiny", "batch = 4", 'pack_attention = "varlen"', "protocol.rungs.B.config.pack_attention", "needs pack"),
    ("cpu-tiny", "zero1 = true", "", "protocol.config.zero1", "needs several processes"),
    ("cpu-tiny", "batch = 4", "backward_chunks = 3", "protocol.rungs.B.config.backward_chunks", "split evenly"),
    ("cpu-tiny-x2", "ddp = false", "", "protocol.config.ddp", "need a gradient sync"),
    ("cpu-tiny", "batch = 4", 'prefix_attention = "flex"', "protocol.rungs.B.config.prefix_attention", "needs CUDA"),
    ("cpu-tiny", "memory_snapshot = true", "", "protocol.config.memory_snapshot", "needs CUDA"),
    ("cpu-tiny", "batch = 4", "fsdp = true", "protocol.rungs.B.config.fsdp", "unknown config key 'fsdp'"),
    ("h200-4b", "pack = false", 'pack_attention = "varlen"', "protocol.rungs.B.config.pack_attention", "needs pack"),
]


def document(directory: Path, profile: str, protocol: str, rung: str) -> Path:
    return write(directory, "configs.toml", TINY.format(profile=profile, protocol=protocol, rung=rung))


@pytest.mark.parametrize(("profile", "protocol", "rung", "path", "says"), DOCUMENTS)
def test_a_conflict_is_refused_at_check_and_freeze_with_its_field_path(
    cli: Cli, frozen_mini: Path, tmp_path: Path, profile, protocol, rung, path, says
):
    bad = document(tmp_path, profile, protocol, rung)
    before = ledger_fingerprint(cli.ledger)
    for verb in ("check", "freeze"):
        result = cli.on_ledger(verb, bad)
        assert result.exit_code == 2, (verb, result.stdout, result.stderr)
        assert f"{bad}: {path}: " in result.stderr and says in result.stderr, result.stderr
        assert "fix:" in result.stderr
    assert ledger_fingerprint(cli.ledger) == before


def test_a_conflict_that_comes_from_protocol_config_names_the_rung_it_meets(cli: Cli, tmp_path: Path):
    bad = document(tmp_path, "cpu-tiny", "backward_chunks = 3, batch = 6", "batch = 4")
    result = cli("check", bad)
    assert result.exit_code == 2
    assert "protocol.rungs.B.config.batch" not in result.stderr
    assert "protocol.config.backward_chunks: batch = 4 does not split evenly" in result.stderr
    assert "(in rung B, with its own config)" in result.stderr


@pytest.mark.parametrize("case", [0, 1, 3], ids=["rung-key", "protocol-key", "processes"])
def test_the_cli_process_refuses_a_conflict_and_leaves_the_ledger_byte_for_byte(tmp_path: Path, case: int):
    ledger = lab_ledger_copy(tmp_path / "ledger.db")
    profile, protocol, rung, path, says = DOCUMENTS[case]
    bad = document(tmp_path, profile, protocol, rung)
    before = ledger.read_bytes()
    for verb in ("check", "freeze"):
        result = prereg_process(verb, str(bad), ledger=ledger, check=False)
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert path in result.stderr and says in result.stderr
    assert ledger.read_bytes() == before


def test_the_cuda_baseline_of_a_rung_of_several_chunks_leaves_out_the_one_chunk_switches():
    """X10 sums no gradients in bf16: a defaulted baseline holds it on one chunk only; written, it is refused."""
    assert "bf16_linear_weights" in resolve(H200, {}).baseline_switches
    several = resolve(H200, {"backward_chunks": 6})
    assert set(several.baseline_switches) == set(LANDED) - {"bf16_linear_weights"}
    with pytest.raises(ConfigError, match="backward_chunks = 6 would sum the chunks' gradients in bf16"):
        resolve(H200, {"backward_chunks": 6, "baseline_switches": list(LANDED)})
    assert resolve(CPU, {"backward_chunks": 2}).baseline_switches == ()  # the CPU's defaults hold no switch


def test_an_item_whose_switch_the_baseline_already_runs_is_refused(cli: Cli, tmp_path: Path):
    on_cuda = write(tmp_path, "mini-cuda.toml", MINI.replace('profile = "cpu-tiny"', 'profile = "h200-4b"'))
    result = cli.on_ledger("check", on_cuda)
    assert result.exit_code == 2
    assert "items.P1.switch: 'suffix_cudnn' is already in the baseline; landed by molmo2-perf-pass1-h200" in (
        result.stderr
    )
    assert not cli.ledger.exists()
    # The same items against a baseline without them: valid (a document may name its own baseline).
    own = write(
        tmp_path,
        "mini-own.toml",
        MINI.replace('profile = "cpu-tiny"', 'profile = "h200-4b"').replace(
            "backward_chunks = 2 }", "backward_chunks = 2, baseline_switches = [] }"
        ),
    )
    assert cli("check", own).exit_code == 0
    rung = write(
        tmp_path,
        "mini-rung.toml",
        MINI.replace("backward_chunks = 2 }", 'backward_chunks = 2, baseline_switches = ["windowed_vram_peak"] }'),
    )
    result = cli("check", rung)
    assert result.exit_code == 2 and "items.P2.switch: 'windowed_vram_peak' is already in the baseline" in result.stderr
    assert "this document's baseline_switches puts it there" in result.stderr


def test_a_rungs_switches_are_the_baseline_and_its_items(tmp_path: Path):
    from molmo2_fixtures import make_runner

    runner = make_runner(batch=2, baseline_switches=["no_embed_clone"])
    assert runner.switches.on() == ("no_embed_clone",)
    assert runner.with_switches(["windowed_vram_peak"]).on() == ("windowed_vram_peak", "no_embed_clone")


def test_compile_tuning_reaches_inductor_only_where_it_is_asked_for():
    from engine.molmo2.attention.execution import Execution

    tuned = Execution.of(resolve(H200, {"compile_tuning": "coordinate-descent"}))
    assert tuned.compile_options() == {"coordinate_descent_tuning": True}
    assert Execution.of(resolve(H200, {})).compile_options() == {}  # the landed path: inductor's heuristics
    assert resolve(H200, {}).compile_tuning == "default"
    assert resolve(CPU, {}).compile_tuning is None  # nothing compiles: the key does not apply
    with pytest.raises(ConfigError) as refused:
        resolve(H200, {"compile_tuning": "max-autotune"})
    assert refused.value.key == "compile_tuning" and "'coordinate-descent'" in refused.value.message
