"""bench/peer_molmo2.py end to end at the tiny geometry on the CPU: our arms and transformers' Molmo2 in one run,
every row with the numbers the README's table prints, and the conditions a reader needs to judge them; its FLOP
count against a hand count; its landed tables against the ledger. No timing is asserted (timings belong in
benchmarks): this keeps the H200 benchmark from rotting between GPU runs."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from molmo2_fixtures import make_runner

CONDITIONS = {"device", "torch", "cuda", "cudnn", "transformers", "dtype", "batch", "camera_counts", "max_crops",
              "sequence_lengths", "flops_by_part", "warmup", "cycles", "timed_steps", "bf16_matmul_tflops", "ceiling",
              "s_per_step", "flops", "order", "alongside", "compile_cache"}  # fmt: skip
ROW = {"name", "kind", "landed_only", "config", "switches", "peer_config", "load_s", "peak_gib", "alloc_retries",
       "error", "warmup_times", "times", "s_per_step", "median_s", "tokens_per_s", "padding", "flops_per_step",
       "mfu"}  # fmt: skip
PEER_CONFIG = {"chunks", "logits_to_keep", "use_cache", "compiled", "attention", "bf16_linear_weights"}


def test_the_peer_benchmark_runs_both_sides_every_peer_configuration_a_row(tmp_path):
    """Ours, the peer with logits on the suffix only, and a peer attention that cannot run here (transformers
    refuses flash_attention_2 for Molmo2, or flash-attn is missing): a row with its error. (The peer's defaults
    differ in its inputs' layout, which tests/test_peer_loss.py covers, and in use_cache.)"""
    # batch 6: the baseline's six backward chunks of one sample each, half the CPU time of the default 12
    command = [sys.executable, "bench/peer_molmo2.py", "--profile", "cpu-tiny", "--batch", "6", "--ours", "baseline",
               "--peer", "keep-c2,keep-c2-flash2", "--name", "harness", "--warmup", "1", "--cycles", "1",
               "--peer-last", "--alongside", "nothing", "--profile-arm", "baseline", "--profile-steps", "2",
               "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "peer_molmo2_cpu-tiny_harness.json").read_text())
    conditions = report["conditions"]
    assert CONDITIONS <= set(conditions) and conditions["batch"] == 6
    assert conditions["order"] == "peer last" and conditions["alongside"] == "nothing"
    assert conditions["dtype"].startswith("fp32 (no autocast")  # the CPU trains in fp32: said so
    lengths = conditions["sequence_lengths"]
    assert lengths["samples"] == 6 * lengths["pool_steps"] and lengths["prefix_real"]["min"] > 0
    ours, *peers = report["rows"]
    assert ours["name"] == "ours baseline" and ours["kind"] == "ours" and ours["landed_only"] is True
    assert [p["kind"] for p in peers] == ["peer"] * 2 and all(p["landed_only"] is None for p in peers)
    assert all(ROW <= set(row) for row in report["rows"])
    for row in (ours, peers[0]):
        assert row["error"] is None and len(row["times"]) == conditions["timed_steps"]
        assert row["s_per_step"] > 0 and row["flops_per_step"] > 0 and 0 <= row["padding"] < 1
    keep, flash = peers
    assert PEER_CONFIG == set(keep["peer_config"]) and keep["peer_config"]["chunks"] == 2
    assert keep["peer_config"]["logits_to_keep"] and not keep["peer_config"]["use_cache"]
    assert keep["flops_per_step"] == ours["flops_per_step"]  # one count for every row
    parts = conditions["flops_by_part"]  # the pool's: each part is checked by hand in the FLOP-count test below
    assert set(parts) == {"decoder_matmuls", "decoder_attention", "vision_matmuls", "vision_attention"}
    assert min(parts.values()) > 0
    assert flash["s_per_step"] is None and flash["times"] is None and "Flash" in flash["error"], flash["error"]
    assert "vs best peer" in result.stdout and "vs peer defaults" in result.stdout
    assert "aten::mm" in (tmp_path / "profile_baseline" / "top_ops.txt").read_text()
    assert "Input Shapes" in (tmp_path / "profile_baseline" / "top_shapes.txt").read_text()
    by_self = (tmp_path / "profile_baseline" / "top_kernels.txt").read_text()
    assert by_self.index("Self CPU") < by_self.index("aten::mm")  # sorted by self time, the matmuls among the top


def test_the_peer_built_on_the_meta_device_has_transformers_own_rope_tables():
    """RoPE's frequency tables are buffers computed at construction: the benchmark's meta-device build computes
    them again on the device."""
    sys.path.insert(0, str(REPO / "bench"))
    from molmo2_peer import transformers_config
    from peer_molmo2 import PEER, peer_trainer
    from transformers.models import molmo2 as tfm

    runner = make_runner(batch=2, backward_chunks=2)
    runner.load_data()
    model, _, steps = peer_trainer(runner, torch.device("cpu"), PEER["keep-c2"])
    reference = tfm.Molmo2ForConditionalGeneration(transformers_config(runner.config, "sdpa", fast_block=True))
    buffers = dict(model.named_buffers())
    assert buffers.keys() == dict(reference.named_buffers()).keys()
    assert all(torch.equal(buffers[name], b) for name, b in reference.named_buffers())
    assert len(steps) == len(runner.pool) and sum(share for _, share in steps[0]) == pytest.approx(1.0)


def test_the_peer_with_bf16_linear_weights_holds_its_trainable_linears_over_fp32_masters():
    """X10 on the peer: its trainable linears' weights become bf16 (autocast's cast of the weights it was built with,
    the fp32 masters kept in MasterAdamW) before any layer compiles; its norms, and every frozen weight, stay fp32."""
    sys.path.insert(0, str(REPO / "bench"))
    from peer_molmo2 import PEER, peer_trainer

    from engine.molmo2.train.master_adamw import shadowed_names

    runner = make_runner(batch=2, backward_chunks=1)
    runner.load_data()
    plain, _, _ = peer_trainer(runner, torch.device("cpu"), PEER["keep-c1"])
    model, _, _ = peer_trainer(runner, torch.device("cpu"), PEER["keep-c1-compiled-bf16-weights"])
    shadowed = shadowed_names(model)
    assert shadowed and all(".layers." in name and "language_model" in name for name in shadowed)
    weights = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == (torch.bfloat16 if name in shadowed else torch.float32), name
        assert torch.equal(p.float(), weights[name].to(p.dtype).float()), name  # autocast's own cast of the same seed


def test_the_flop_count_is_the_hand_count_at_the_tiny_geometry():
    """Two samples, each one single-crop image (3x3 patches, pooled 2x2 into 4 tokens over 9 valid slots) between
    two text tokens and a prompt: sample 1 has 4 prompt tokens and a suffix of 2 aux + 3 FAST + end, sample 2 has
    2 prompt tokens (left-padded by 2) and 1 aux + 2 FAST + end (right-padded by 2). The tiny geometry: hidden 64,
    2 layers, 4 heads and 2 KV heads of 16, MLP 128, vocabulary 320 + FAST 48; ViT 32 wide, MLP 64, 3 stored
    blocks of 2 heads of 16, 14x14x3 patches; pooling 64 -> 2 heads of 16 -> 32, projector 32 -> 96 -> 64."""
    from molmo2_fixtures import Row, make_batch, tiny_config

    sys.path.insert(0, str(REPO / "bench"))
    from peer_molmo2 import attention_pairs, chunk_flop_parts, chunk_flops

    batch = make_batch(tiny_config(), [Row(images=1, text=4, aux=2, fast=3), Row(images=1, text=2, aux=1, fast=2)])
    # real tokens: prefixes 2 + 8 + 4 = 14 and 2 + 8 + 2 = 12 (an image crop is start, 2 x (2 patches + col),
    # end); suffixes 6 and 4, whose last positions carry no label here (molmo2_fixtures): 5 + 3 loss tokens
    prefix_tokens, suffix_tokens, loss_tokens = 14 + 12, 6 + 4, 5 + 3
    # prefix pairs: causal over the real tokens, plus each image token seeing the 7 x 8 / 2 later ones of its crop
    prefix_pairs = (14 * 15 // 2 + 28) + (12 * 13 // 2 + 28)
    # suffix pairs: every real prefix key, then causally
    suffix_pairs = (6 * 14 + 6 * 7 // 2) + (4 * 12 + 4 * 5 // 2)
    assert attention_pairs(batch) == (prefix_pairs, suffix_pairs)

    block = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64  # att_proj (q, k, v), attn_out, ff_proj, ff_out
    last_prefix_block = 64 * 2 * 32  # keys and values only
    decoder = 6 * (suffix_tokens * 2 * block + prefix_tokens * (block + last_prefix_block))
    attention = 12 * 4 * 16 * (prefix_pairs + 2 * suffix_pairs)  # the prefix's pairs skip the last block
    head = 4 * 64 * 320 * loss_tokens + 6 * 64 * 48 * loss_tokens  # frozen lm_head (no weight gradient), FAST head
    crops, patches, pooled, slots = 2, 9, 4 * 2, 9 * 2
    vit = crops * patches * (588 * 32 + 3 * (4 * 32 * 32 + 2 * 32 * 64))  # patch embedding, 3 blocks
    adapter = pooled * (64 * 32 + 32 * 32 + 2 * 32 * 96 + 96 * 64) + slots * 2 * 64 * 32  # q, o, projector; k, v
    vision_attention = 4 * 2 * 16 * 3 * crops * patches**2 + 4 * 2 * 16 * slots  # forward only
    assert chunk_flop_parts(tiny_config(), batch) == {
        "decoder_matmuls": decoder + head,
        "decoder_attention": attention,
        "vision_matmuls": 2 * (vit + adapter),
        "vision_attention": vision_attention,
    }
    assert chunk_flops(tiny_config(), batch) == decoder + attention + head + 2 * (vit + adapter) + vision_attention


def test_attention_pairs_count_the_image_block_and_no_padding():
    """One row: prefix [text, image, image, pad], two real suffix tokens. Prefix: the causal pairs of 3 real
    tokens (6) plus image 1 -> image 2 (1); suffix: 2 x 3 prefix keys + causal 1 + 2 = 9."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "bench"))
    from peer_molmo2 import attention_pairs

    prefix = SimpleNamespace(
        attention_mask=torch.tensor([[1, 1, 1, 0]]), mm_token_type_ids=torch.tensor([[0, 1, 1, 0]])
    )
    suffix = SimpleNamespace(attention_mask=torch.tensor([[1, 1, 0]]))
    assert attention_pairs(SimpleNamespace(prefix=prefix, suffix=suffix, packing=None)) == (7, 9)


def test_a_packed_chunk_counts_the_pairs_and_flops_of_its_padded_self():
    """Packing moves tokens, not work: the same pairs as the padded chunk, none across samples."""
    sys.path.insert(0, str(REPO / "bench"))
    from molmo2_fixtures import make_batch, tiny_config
    from peer_molmo2 import attention_pairs, chunk_flops
    from test_molmo2_execution import MORE_ROWS

    from engine.molmo2.attention.packing import pack

    padded = make_batch(tiny_config(), MORE_ROWS, seed=13)
    assert attention_pairs(pack(padded, (16, 16))) == attention_pairs(padded) and min(attention_pairs(padded)) > 0
    assert chunk_flops(tiny_config(), pack(padded, (16, 16))) == chunk_flops(tiny_config(), padded)


def test_landed_only_arms_use_only_what_the_ledgers_verdicts_landed(tmp_path):
    """Each entry of the benchmark's landed tables is a verdict in the ledger (a copy: tests never write it): the
    registration's outcome, and for a switch its item among the landed ones. X4 (clip_in_adamw) was parked twice."""
    sys.path.insert(0, str(REPO / "bench"))
    from peer_molmo2 import LANDED_CONFIG, LANDED_SWITCHES, OURS, landed_only

    from prereg.audit import audit_show
    from prereg.ledger import Ledger
    from prereg.state import load_state

    shutil.copy(REPO / "ledger.db", tmp_path / "ledger.db")
    ledger = Ledger.open(str(tmp_path / "ledger.db"), create=False)
    try:
        for registration, outcome in set(LANDED_CONFIG.values()) | set(LANDED_SWITCHES.values()):
            assert audit_show(ledger, registration)["verdict"]["outcome"] == outcome, registration
        for switch, (registration, _) in LANDED_SWITCHES.items():
            items = {item["switch"]: item["id"] for item in load_state(ledger, registration).document["items"]}
            assert items[switch] in audit_show(ledger, registration)["verdict"]["land"], switch
        for parked_x4 in ("molmo2-x34-h200", "molmo2-x4-landed-h200"):
            assert "X4" in audit_show(ledger, parked_x4)["verdict"]["park"], parked_x4
    finally:
        ledger.close()
    assert "clip_in_adamw" not in LANDED_SWITCHES
    landed = {name for name, (config, switches) in OURS.items() if landed_only(config, switches)}
    assert {"baseline", "fast-c1", "packed-varlen-cudnn-one-pass-x2"} <= landed
    assert "fast-c2" not in landed  # 2 chunks were never a landed rung


def test_the_flex_benchmark_counts_the_masks_allowed_pairs_and_times_its_sdpa_peers(tmp_path):
    """bench/flex_configs.py: the FLOP count is over allowed pairs (a hand-counted mask), and a CPU run at the
    tiny geometry produces both SDPA peer rows (FlexAttention has no backward on a CPU: its rows say so)."""
    sys.path.insert(0, str(REPO / "bench"))
    from flex_configs import attention_flops

    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]  # 10 allowed pairs
    assert attention_flops(causal, heads=2, head_dim=8) == (4 * 10 * 2 * 8, 10 * 10 * 2 * 8)
    command = [sys.executable, "bench/flex_configs.py", "--profile", "cpu-tiny", "--configs", "default",
               "--warmup", "1", "--repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "flex_configs_cpu-tiny.json").read_text())
    assert {"device", "torch", "dtype", "batch", "seq", "heads", "kv_heads", "head_dim", "warmup", "repeats"} <= set(
        report["conditions"]
    )
    rows = {row["name"]: row for row in report["rows"]}
    assert "backward on CPU" in rows["default"]["error"]
    for peer in ("sdpa-dense-mask", "sdpa-causal-flash"):
        assert rows[peer]["error"] is None and rows[peer]["fwd_bwd_tflops"] > 0


def test_the_packed_attention_benchmarks_rows_are_the_packed_rules(tmp_path):
    """bench/packed_attention.py times the attention paths of the padded and packed rows; each row's mask (a block
    mask, a dense mask, or a varlen plan: segments.py) must allow exactly the pairs of the dense rule it names (the
    pool of the tiny geometry). A CPU run writes every row, with FlexAttention's missing backward as the flex rows'
    reason; an SDPA row and a varlen row run."""
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    sys.path.insert(0, str(REPO / "bench"))
    from packed_attention import steps, variants

    from engine.molmo2.attention.segments import Segments, segments_mask

    packed, _ = steps("cpu-tiny", pack=True)
    padded, _ = steps("cpu-tiny", pack=False)
    for chunk, padded_chunk in zip(packed, padded):
        for name, row in variants(padded_chunk, chunk).items():
            masks = [row.mask()] + ([row.reference()] if row.reference else [])
            rule = row.rule()
            assert rule.shape[-2:] == (row.q_len, row.kv_len) and rule.shape[0] == row.batch, name
            for mask in masks:
                if isinstance(mask, Segments):
                    allowed = segments_mask(mask, row.kv_len)[None, None]
                elif isinstance(mask, BlockMask):
                    allowed = create_mask(mask.mask_mod, row.batch, None, row.q_len, row.kv_len, device="cpu")
                else:
                    allowed = mask
                assert torch.equal(allowed[:, 0], rule[:, 0]), name
    command = [sys.executable, "bench/packed_attention.py", "--profile", "cpu-tiny", "--warmup", "1", "--repeats", "1",
               "--only", "prefix packed,suffix packed sdpa,joined varlen", "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "packed_attention_cpu-tiny.json").read_text())
    assert {"device", "torch", "dtype", "heads", "kv_heads", "head_dim", "warmup", "repeats"} <= set(
        report["conditions"]
    )
    assert [row["name"] for row in report["rows"]] == ["prefix packed", "suffix packed sdpa", "joined varlen"]
    assert "backward on CPU" in report["rows"][0]["error"]
    sdpa = report["rows"][1]
    assert sdpa["error"] is None and sdpa["kind"] == "sdpa" and sdpa["fwd_bwd_ms"] > 0, sdpa
    varlen = report["rows"][2]  # the CPU's varlen kernel has a backward: a timed row, as close to flex as fp32 is
    assert varlen["error"] is None and varlen["fwd_bwd_ms"] > 0 and varlen["max_abs_vs_reference"] < 1e-5, varlen


def test_the_cudnn_kernel_lays_out_each_varlen_call_as_ragged_segments(tmp_path):
    """engine/molmo2/attention/cudnn.py hands cuDNN each call of a varlen plan as B padded segments with their real
    lengths and element offsets into the packed buffers: the lengths are the plan's, the offsets their prefix sums
    times a token's width. On a CPU profile bench/cudnn_varlen_probe.py writes one row saying why it cannot run,
    and exits 0."""
    from molmo2_fixtures import make_batch, tiny_config
    from test_molmo2_execution import MORE_ROWS

    from engine.molmo2.attention.cudnn import ragged_layout
    from engine.molmo2.attention.packing import pack

    plan = pack(make_batch(tiny_config(), MORE_ROWS, seed=13), (16, 16)).packing.segments.joined
    for call in plan.calls:
        layout = ragged_layout(call.cu_q, call.cu_k, heads=4, kv_heads=2, head_dim=16)
        q_lengths, k_lengths = layout.seq_len_q.flatten().tolist(), layout.seq_len_kv.flatten().tolist()
        assert layout.seq_len_q.dtype == torch.int32 and layout.q_offset.dtype == torch.int64
        assert layout.seq_len_q.shape == (len(q_lengths), 1, 1, 1) and layout.k_offset.shape == (
            len(q_lengths) + 1,
            1,
            1,
            1,
        )
        assert sum(q_lengths) == call.queries.shape[0] and max(q_lengths) == call.max_q
        assert sum(k_lengths) == call.keys.shape[0] and max(k_lengths) == call.max_k
        q_starts = [0] + list(itertools.accumulate(q_lengths))
        k_starts = [0] + list(itertools.accumulate(k_lengths))
        assert layout.q_offset.flatten().tolist() == [s * 4 * 16 for s in q_starts]
        assert layout.k_offset.flatten().tolist() == [s * 2 * 16 for s in k_starts]
        assert all(n >= 1 for n in q_lengths)
        if call.causal:  # bottom-right causal needs every segment's queries no more than its keys
            assert all(nq <= nk for nq, nk in zip(q_lengths, k_lengths))
    command = [sys.executable, "bench/cudnn_varlen_probe.py", "--profile", "cpu-tiny", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "cudnn_varlen_probe_cpu-tiny.json").read_text())
    assert [row["name"] for row in report["rows"]] == ["setup"] and "CPU" in report["rows"][0]["error"]
