"""Checkpoints in the hub layout: the 4B key set and parameter count from the config alone, write -> load round
trips, strictness (missing / unexpected / partial / misshapen keys are listed), truncated mounts, dtype casts,
fresh AR extras on hub checkpoints, and the checkpoint's own tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from molmo2_fixtures import Row, make_batch, prefix_kwargs, tiny_config, tiny_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from engine.molmo2.model.checkpoint import (
    INDEX_NAME,
    CheckpointKeyError,
    ar_extra_shapes,
    hub_key_shapes,
    load_checkpoint,
    load_tokenizer,
    parameter_count,
    write_checkpoint,
)
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import AR_EXTRA_KEYS, Molmo2Model
from engine.molmo2.switches import Switches


def test_4b_parameter_count_from_the_config():
    """The hub index's total_parameters: LLM + ViT + pooling + projector."""
    config = Molmo2Config.named("4b")
    assert parameter_count(config) == 4_850_869_200
    shapes = hub_key_shapes(config)
    assert len([k for k in shapes if k.startswith("model.transformer.blocks.")]) == 36 * 8
    assert len([k for k in shapes if ".resblocks." in k]) == 25 * 16  # 25 of 27 declared ViT blocks stored
    assert shapes["model.transformer.blocks.0.self_attn.att_proj.weight"] == (6144, 2560)
    assert shapes["model.transformer.blocks.0.mlp.ff_proj.weight"] == (19456, 2560)
    assert shapes["model.vision_backbone.image_pooling_2d.wq.weight"] == (1152, 2304)
    assert parameter_count(config, ar_extras=True) == 4_850_869_200 + 2 * 1024 * 2560 + 2560 * 6 + 2560


@pytest.mark.parametrize("name", ["tiny", "4b"])
def test_module_tree_is_the_hub_layout(name):
    """The model's own state dict (built on the meta device: nothing allocated) IS the layout."""
    config = Molmo2Config.named(name)
    with torch.device("meta"):
        model = Molmo2Model(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == hub_key_shapes(config) | ar_extra_shapes(config)


@pytest.fixture(scope="module")
def model() -> Molmo2Model:
    return tiny_model(seed=12)


@pytest.fixture
def written(model, tmp_path):
    write_checkpoint(model, model.config, tmp_path, shard_max_bytes=150_000)
    return tmp_path


def test_round_trip_is_exact_and_sharded(model, written):
    index = json.loads((written / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((written / s).is_file() for s in shards)
    n = sum(p.numel() for p in model.parameters())
    assert index["metadata"]["total_size"] == 4 * n and index["metadata"]["total_parameters"] == n
    assert all(t.dtype == torch.float32 for s in shards for t in load_file(written / s).values())  # fp32 on disk
    config_json = json.loads((written / "config.json").read_text())
    assert "vit_config" in config_json and config_json["text_config"]["layer_norm_eps"] == 1e-6  # hub legacy keys

    loaded = load_checkpoint(written)
    assert loaded.config == model.config
    original = model.state_dict()
    assert loaded.state_dict().keys() == original.keys()
    assert all(torch.equal(v, original[k]) for k, v in loaded.state_dict().items())
    assert all(p.requires_grad for p in loaded.parameters())


def test_hub_checkpoint_gets_fresh_seeded_ar_extras(model, tmp_path):
    write_checkpoint(model, model.config, tmp_path, ar_extras=False)
    assert not set(AR_EXTRA_KEYS) & set(json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"])
    a, b, c = (load_checkpoint(tmp_path, seed=s) for s in (0, 0, 1))
    fast = "model.transformer.wte.fast_embed"
    assert torch.equal(a.state_dict()[fast], b.state_dict()[fast])
    assert not torch.equal(a.state_dict()[fast], c.state_dict()[fast])
    assert not bool(a.state_proj.weight.any()) and not bool(a.state_proj.bias.any())  # zero: prompt undisturbed
    assert 0.01 < float(a.fast_head.weight.detach().std()) < 0.03
    assert torch.equal(a.lm_head.weight, model.lm_head.weight)


def _rewrite(directory, shard_edit, index_edit=None):
    index = json.loads((directory / INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(directory / shard)
    shard_edit(tensors, index["weight_map"], shard)
    save_file(tensors, str(directory / shard))
    (directory / INDEX_NAME).write_text(json.dumps(index))


def test_missing_keys_are_listed(written):
    victims = []

    def drop(tensors, weight_map, shard):
        victims.extend(k for k in list(tensors)[:2])
        for k in victims:
            del tensors[k]
            del weight_map[k]

    _rewrite(written, drop)
    with pytest.raises(CheckpointKeyError, match="missing 2 key") as info:
        load_checkpoint(written)
    assert all(v in str(info.value) for v in victims)


def test_unexpected_keys_are_listed(written):
    def add(tensors, weight_map, shard):
        for i in range(10):
            tensors[f"model.transformer.blocks.{90 + i}.attn_norm.weight"] = torch.ones(64)
            weight_map[f"model.transformer.blocks.{90 + i}.attn_norm.weight"] = shard

    _rewrite(written, add)
    with pytest.raises(CheckpointKeyError, match=r"unexpected 10 key\(s\): model.transformer.blocks.90") as info:
        load_checkpoint(written)
    assert str(info.value).endswith(", ...")  # first few, then the count says the rest


def test_partial_ar_extras_are_refused(written):
    def drop_state_proj(tensors, weight_map, shard):
        index_shard = weight_map.pop("state_proj.bias")
        assert index_shard  # the key exists in the index; its tensor may live in another shard

    _rewrite(written, drop_state_proj)
    with pytest.raises(CheckpointKeyError, match="partial AR extras.*state_proj.bias"):
        load_checkpoint(written)


def test_wrong_shape_is_refused(written):
    def widen(tensors, weight_map, shard):
        key = next(k for k in tensors if k.endswith("attn_norm.weight"))
        tensors[key] = torch.ones(65)

    _rewrite(written, widen)
    with pytest.raises(CheckpointKeyError, match=r"attn_norm.weight \(65,\) != \(64,\)"):
        load_checkpoint(written)


def test_index_pointing_at_the_wrong_shard_is_refused(written):
    index = json.loads((written / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][key] = shards[1]
    (written / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointKeyError, match="does not hold"):
        load_checkpoint(written)


def test_truncated_mount_keeps_the_first_layers(model, written):
    mounted = load_checkpoint(written, truncate_layers=1)
    assert mounted.config.text.num_layers == 1 and len(mounted.transformer.blocks) == 1
    assert torch.equal(mounted.transformer.blocks[0].mlp.ff_proj.weight, model.transformer.blocks[0].mlp.ff_proj.weight)
    assert mounted.config.vision == model.config.vision  # only the decoder is truncated
    # The mount's layer-0 prefix K/V are the full model's, bitwise.
    prefix = make_batch(model.config, [Row(images=1), Row(images=2)]).prefix
    with torch.no_grad():
        short, _ = mounted.prefill(**prefix_kwargs(prefix))
        full, _ = model.prefill(**prefix_kwargs(prefix))
    assert torch.equal(short.layers[0][0], full.layers[0][0]) and torch.equal(short.layers[0][1], full.layers[0][1])
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"truncate_layers = {bad} is invalid; allowed: 1..2"):
            load_checkpoint(written, truncate_layers=bad)


def test_dtype_and_switches_on_load(model, written):
    loaded = load_checkpoint(written, dtype=torch.bfloat16, switches=Switches(no_embed_clone=True))
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    assert loaded.switches == Switches(no_embed_clone=True)


def test_config_override_must_match_the_tensors(written):
    smaller = Molmo2Config.named("tiny", fast_vocab_size=16)
    with pytest.raises(CheckpointKeyError, match="wrong shapes.*fast_embed"):
        load_checkpoint(written, smaller)


def test_tokenizer_comes_from_the_directory(written):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_tokenizer(written)
    Tokenizer(WordLevel({"<pad>": 0, "robot": 1}, unk_token="<pad>")).save(str(written / "tokenizer.json"))
    assert load_tokenizer(written).token_to_id("robot") == 1


def test_writer_refuses_a_state_that_is_not_the_layout(model, tmp_path):
    state = dict(model.state_dict())
    del state["lm_head.weight"]
    with pytest.raises(CheckpointKeyError, match="missing 1 key.*lm_head.weight"):
        write_checkpoint(state, tiny_config(), tmp_path)
