"""Molmo2 config and model mechanics: config validation and both config.json dialects, the embedding tables,
additive image injection, the fused-MLP order, the heads, the mask, left-padding invariance, greedy decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from molmo2_fixtures import PAD_ID, Row, make_batch, prefix_kwargs, tiny_config, tiny_model

from engine.molmo2.model.config import AdapterConfig, Molmo2Config, TextConfig, VisionConfig
from engine.molmo2.model.model import generate, positions_from_mask, prefix_attention_mask
from engine.molmo2.switches import BASELINE, Switches

# allenai/Molmo2-4B config.json as shipped, verbatim.
HUB_4B_CONFIG = {
    "adapter_config": {"attention_dropout": 0.0, "attn_implementation": "sdpa", "float32_attention": True,
                       "head_dim": 72, "hidden_act": "silu", "hidden_size": 1152, "image_feature_dropout": 0.0,
                       "initializer_range": 0.02, "intermediate_size": 9728, "model_type": "molmo2",
                       "num_attention_heads": 16, "num_key_value_heads": 16, "pooling_attention_mask": True,
                       "residual_dropout": 0.0, "text_hidden_size": 2560, "vit_layers": [-3, -9]},
    "architectures": ["Molmo2ForConditionalGeneration"],
    "auto_map": {"AutoConfig": "configuration_molmo2.Molmo2Config",
                 "AutoModelForImageTextToText": "modeling_molmo2.Molmo2ForConditionalGeneration"},
    "dtype": "float32", "frame_end_token_id": 151944, "frame_start_token_id": 151943, "image_col_id": 151939,
    "image_end_token_id": 151937, "image_high_res_id": 151938, "image_low_res_id": 151942,
    "image_patch_id": 151938, "image_start_token_id": 151936, "initializer_range": 0.02,
    "low_res_image_start_token_id": 151940, "model_type": "molmo2",
    "text_config": {"additional_vocab_size": 128, "attention_dropout": 0.0, "attn_implementation": "sdpa",
                    "embedding_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
                    "initializer_range": 0.02, "intermediate_size": 9728, "layer_norm_eps": 1e-06,
                    "max_position_embeddings": 36864, "model_type": "molmo2_text", "norm_after": False,
                    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
                    "qk_norm_type": "qwen3", "qkv_bias": False, "residual_dropout": 0.0, "rope_scaling": None,
                    "rope_scaling_layers": None, "rope_theta": 5000000.0, "use_cache": True, "use_qk_norm": True,
                    "vocab_size": 151936},
    "tie_word_embeddings": False, "transformers_version": "4.57.1", "use_cache": True,
    "use_frame_special_tokens": False,
    "vit_config": {"attention_dropout": 0.0, "attn_implementation": "sdpa", "float32_attention": True,
                   "head_dim": 72, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
                   "image_default_input_size": [378, 378], "image_num_pos": 729, "image_patch_size": 14,
                   "initializer_range": 0.02, "intermediate_size": 4304, "layer_norm_eps": 1e-06,
                   "model_type": "molmo2", "num_attention_heads": 16, "num_hidden_layers": 27,
                   "num_key_value_heads": 16, "residual_dropout": 0.0},
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------


def test_hub_config_reads_as_the_4b_geometry():
    config = Molmo2Config.from_hf_dict(HUB_4B_CONFIG)
    assert config == Molmo2Config.named("4b")
    assert config.vit_taps == (24, 18) and config.vit_stored_layers == 25  # [-3, -9] on 27 declared
    assert config.fast_block_base == 152_064
    assert config.image_patch_id == 151_938 and config.token_id("video") == 151_945
    assert config.pooling_input_dim == 2304


def test_tiny_has_every_mechanism():
    c = tiny_config()
    assert c.text.num_heads != c.text.num_kv_heads  # GQA
    assert len(c.vit_taps) == 2 and c.vit_stored_layers < c.vision.num_layers  # taps resolved vs declared depth
    assert c.vision.grid == (3, 3)  # odd grid: 2x2 pooling has partial windows
    assert c.fast_block_base == c.text.vocab_size + c.text.additional_vocab_size


@pytest.mark.parametrize(
    ("section", "key", "value", "needle"),
    [
        ("text_config", "norm_after", True, "norm_after"),
        ("text_config", "qk_norm_type", "olmo", "qk_norm_type"),
        ("text_config", "rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling"),
        ("text_config", "qkv_bias", True, "qkv_bias"),
        ("text_config", "residual_dropout", 0.1, "residual_dropout"),
        ("adapter_config", "pooling_attention_mask", False, "pooling_attention_mask"),
        ("adapter_config", "text_hidden_size", 4096, "text_hidden_size"),
        ("vit_config", "hidden_act", "gelu", "hidden_act"),
        (None, "image_patch_id", 151_939, "image_patch_id"),
    ],
)
def test_hub_settings_this_port_lacks_are_refused(section, key, value, needle):
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in HUB_4B_CONFIG.items()}
    (d if section is None else d[section])[key] = value
    with pytest.raises(ValueError, match=needle) as info:
        Molmo2Config.from_hf_dict(d)
    assert "allowed" in str(info.value)


def test_dialect_must_be_unambiguous():
    with pytest.raises(ValueError, match="exactly one of"):
        Molmo2Config.from_hf_dict(HUB_4B_CONFIG | {"vision_config": {}})
    with pytest.raises(ValueError, match="exactly one of"):
        Molmo2Config.from_hf_dict({k: v for k, v in HUB_4B_CONFIG.items() if k != "vit_config"})


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda t: dataclasses.replace(t, num_kv_heads=3), "num_kv_heads = 3"),
        (lambda t: dataclasses.replace(t, head_dim=15), "head_dim = 15"),
        (lambda t: dataclasses.replace(t, additional_vocab_size=4), "additional_vocab_size = 4"),
        (lambda t: dataclasses.replace(t, hidden_size=0), "hidden_size = 0"),
    ],
)
def test_text_config_validation_names_field_value_allowed(build, needle):
    with pytest.raises(ValueError, match=needle) as info:
        build(tiny_config().text)
    assert "allowed" in str(info.value)


def test_vision_and_adapter_validation():
    v = tiny_config().vision
    with pytest.raises(ValueError, match="image_size"):
        dataclasses.replace(v, image_size=(40, 42))
    with pytest.raises(ValueError, match="num_positions = 10"):
        dataclasses.replace(v, num_positions=10)
    with pytest.raises(ValueError, match=r"vit_layers.*\[-4, 4\)"):
        dataclasses.replace(tiny_config(), adapter=dataclasses.replace(tiny_config().adapter, vit_layers=(-5,)))
    with pytest.raises(ValueError, match="unknown Molmo2 geometry 'huge'"):
        Molmo2Config.named("huge")


@settings(max_examples=60, deadline=None)
@given(
    heads=st.sampled_from([(4, 2), (4, 4), (8, 2), (6, 3)]),
    head_dim=st.sampled_from([8, 16, 128]),
    layers=st.integers(1, 40),
    vocab=st.integers(16, 200_000),
    extra=st.integers(10, 300),
    theta=st.floats(1.0, 1e7),
    grid=st.tuples(st.integers(1, 30), st.integers(1, 30)),
    patch=st.sampled_from([7, 14, 16]),
    vit_depth=st.integers(1, 30),
    taps=st.lists(st.integers(-30, 29), min_size=1, max_size=3),
    fast=st.integers(1, 4096),
    state=st.integers(1, 32),
)
def test_config_json_round_trip(heads, head_dim, layers, vocab, extra, theta, grid, patch, vit_depth, taps, fast,
                                state):  # fmt: skip
    taps = tuple(t for t in taps if -vit_depth <= t < vit_depth) or (-1,)
    text = TextConfig(64, layers, heads[0], heads[1], head_dim, 96, vocab, extra, theta, 1e-5, 4096)
    vision = VisionConfig(32, 48, vit_depth, 2, 16, (grid[0] * patch, grid[1] * patch), patch, grid[0] * grid[1], 1e-6)
    adapter = AdapterConfig(taps, 32, 2, 16, 40, float32_attention=False)
    config = Molmo2Config(text, vision, adapter, fast_vocab_size=fast, state_dim=state)
    assert Molmo2Config.from_hf_dict(config.to_hf_dict()) == config


# ---------------------------------------------------------------------------------------------------------------
# embeddings, injection, heads
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("branchless", [False, True])
def test_embedding_reads_the_three_tables_as_one_id_range(branchless):
    """The hub's formula, F.embedding over cat(embedding, new_embedding), extended by the FAST block."""
    model = tiny_model()
    c = model.config
    wte = model.transformer.wte
    ids = torch.tensor([[0, 5, c.text.vocab_size - 1, c.text.vocab_size, c.image_patch_id, c.fast_block_base - 1,
                         c.fast_block_base, c.logits_width - 1]])  # fmt: skip
    table = torch.cat([wte.embedding, wte.new_embedding, wte.fast_embed])
    assert torch.equal(wte(ids, branchless=branchless), F.embedding(ids, table))


def test_image_features_are_added_at_im_patch_positions():
    model = tiny_model()
    prefix = make_batch(model.config, [Row(images=2), Row(images=1, two_crops=True)]).prefix
    with torch.no_grad():
        features = model.image_features(prefix.pixel_values, prefix.image_token_pooling)
        plain = model.embed(prefix.input_ids)
        injected = model.embed(prefix.input_ids, features)
    is_patch = prefix.input_ids == model.config.image_patch_id
    assert features.shape == (int(is_patch.sum()), model.config.text.hidden_size)
    # Added onto the learned <im_patch> row (hub, transformers), in order — not written over it (vLLM).
    assert torch.equal(injected[is_patch], plain[is_patch] + features)
    assert not torch.equal(injected[is_patch], features)
    assert torch.equal(injected[~is_patch], plain[~is_patch])


def test_pooling_masks_invalid_slots():
    """An invalid (-1) slot contributes nothing: pointing it at another patch changes no feature."""
    model = tiny_model()
    prefix = make_batch(model.config, [Row(images=1)]).prefix
    pooling = prefix.image_token_pooling
    rerouted = torch.where(pooling < 0, 0, pooling)  # now "valid" slots reading patch 0
    with torch.no_grad():
        masked = model.image_features(prefix.pixel_values, pooling)
        leaked = model.image_features(prefix.pixel_values, rerouted)
    partial = (pooling < 0).any(-1)
    assert torch.equal(masked[~partial], leaked[~partial])
    assert (masked[partial] - leaked[partial]).abs().max() > 1e-2 * masked.abs().max()


def test_fused_mlp_is_up_then_gate():
    model = tiny_model()
    mlp = model.transformer.blocks[0].mlp
    inter = model.config.text.intermediate_size
    x = torch.randn(3, model.config.text.hidden_size)
    up, gate = mlp.ff_proj.weight[:inter], mlp.ff_proj.weight[inter:]
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.ff_out.weight.T
    torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-6)


def test_logit_columns_are_token_ids():
    model = tiny_model()
    c = model.config
    h = torch.randn(2, c.text.hidden_size)
    logits = model.logits(h)
    assert logits.shape == (2, c.logits_width)
    assert torch.equal(logits[:, : c.text.vocab_size], model.lm_head(h))
    assert torch.equal(logits[:, c.fast_block_base :], model.fast_head(h))
    assert bool(torch.isneginf(logits[:, c.text.vocab_size : c.fast_block_base]).all())


# ---------------------------------------------------------------------------------------------------------------
# mask, positions, padding
# ---------------------------------------------------------------------------------------------------------------


def test_prefix_mask_semantics():
    attention = torch.tensor([[False, True, True, True, True, True]])
    types = torch.tensor([[0, 0, 1, 0, 1, 0]])
    m = prefix_attention_mask(attention, types)[0, 0]
    assert bool(m[2, 4]) and bool(m[4, 2])  # image tokens see each other, also forwards past text
    assert not bool(m[3, 4]) and not bool(m[1, 2])  # text stays causal
    assert not bool(m[1:, 0].any())  # no real token sees padding
    assert m[0].tolist() == [True, False, False, False, False, False]  # a pad query sees only itself
    assert positions_from_mask(attention).tolist() == [[0, 0, 1, 2, 3, 4]]


def test_left_padding_does_not_change_real_logits():
    """A row alone vs the same row left-padded next to a longer one (left padding must not change a real token's
    logits), state slot included."""
    model = tiny_model().eval()
    batch = make_batch(model.config, [Row(images=1, text=3), Row(images=2, text=8)], seed=4).prefix
    real = batch.attention_mask[0]
    pad = int((~real).sum())
    assert pad > 0
    alone = dict(
        input_ids=batch.input_ids[:1, pad:],
        attention_mask=batch.attention_mask[:1, pad:],
        mm_token_type_ids=batch.mm_token_type_ids[:1, pad:],
        pixel_values=batch.pixel_values[:1],  # row 0 has one single-crop image, the batch's first crop
        image_token_pooling=batch.image_token_pooling[:4],
        state=batch.state[:1],
        state_positions=batch.state_positions[:1] - pad,
    )
    with torch.no_grad():
        padded = model(**prefix_kwargs(batch))[0][real]
        single = model(**alone)[0]
    finite = torch.isfinite(single)
    assert float((padded - single)[finite].abs().max()) <= 1e-5


# ---------------------------------------------------------------------------------------------------------------
# greedy decode
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_decode_equals_argmax_of_repeated_full_forwards():
    model = tiny_model(seed=2).double().eval()
    c = model.config
    prefix = make_batch(c, [Row(images=2, text=4), Row(images=1, text=2, two_crops=True)], seed=6).prefix
    images = dict(pixel_values=prefix.pixel_values.double(), image_token_pooling=prefix.image_token_pooling)
    steps = 6
    got = generate(model, prefix.input_ids, prefix.attention_mask, prefix.mm_token_type_ids, **images,
                   max_new_tokens=steps)  # fmt: skip

    ids, mask, types = prefix.input_ids, prefix.attention_mask, prefix.mm_token_type_ids
    expected = []
    with torch.no_grad():
        for _ in range(steps):
            token = model(ids, mask, types, **images)[:, -1].argmax(-1)
            expected.append(token)
            ids = torch.cat([ids, token[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(token, dtype=torch.bool)[:, None]], 1)
            types = torch.cat([types, torch.zeros_like(token)[:, None]], 1)
    assert torch.equal(got, torch.stack(expected, 1))
    assert len(set(got.flatten().tolist())) > 2  # a real sequence, not one repeated token


def test_generate_stops_and_holds_the_stop_token():
    model = tiny_model(seed=2).eval()
    prefix = make_batch(model.config, [Row(images=1), Row(images=1)], seed=6).prefix
    kwargs = prefix_kwargs(prefix)
    del kwargs["state"], kwargs["state_positions"]
    free = generate(model, **kwargs, max_new_tokens=5)
    stop = int(free[0, 1])
    stopped = generate(model, **kwargs, max_new_tokens=5, stop_id=stop)
    assert torch.equal(stopped[0, :2], free[0, :2]) and bool((stopped[0, 1:] == stop).all())


def test_generate_refuses_right_padding():
    model = tiny_model()
    prefix = make_batch(model.config, [Row(images=1, text=2), Row(images=1, text=6)]).prefix
    flipped = torch.flip(prefix.attention_mask, [1])
    with pytest.raises(ValueError, match="LEFT-padded"):
        generate(model, prefix.input_ids, flipped, prefix.mm_token_type_ids, max_new_tokens=2)


# ---------------------------------------------------------------------------------------------------------------
# P3a: the <im_patch> count guard
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plant", ["one_missing", "one_extra"])
@pytest.mark.parametrize(("switches", "error", "needle"), [
    (BASELINE, ValueError, "<im_patch> tokens"),
    (Switches(device_assert_patch_count=True), RuntimeError, "<im_patch> count"),
])  # fmt: skip
def test_planted_patch_count_mismatch_aborts(plant, switches, error, needle):
    model = tiny_model(switches=switches)
    c = model.config
    prefix = make_batch(c, [Row(images=1, text=4)]).prefix
    ids = prefix.input_ids.clone()
    if plant == "one_missing":
        ids[0, int((ids[0] == c.image_patch_id).nonzero()[0])] = PAD_ID + 10
    else:
        ids[0, -1] = c.image_patch_id
    with pytest.raises(error, match=needle):
        model(ids, prefix.attention_mask, prefix.mm_token_type_ids, pixel_values=prefix.pixel_values,
              image_token_pooling=prefix.image_token_pooling)  # fmt: skip
