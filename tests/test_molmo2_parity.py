"""Parity with transformers' own Molmo2 (`transformers.models.molmo2`, 5.23 or newer): same random weights, same
inputs (images, 2x2 pooling with invalid slots, two images in a row, left padding), logits compared in fp32.

Where ports differ, the hub's behaviour is pinned: features are ADDED at <im_patch> (vLLM overwrites), and every
image token of a row sees every other one (a block per contiguous group of image tokens would hide a later image
from an earlier one)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from conftest import REPO
from molmo2_fixtures import Row, make_batch, tiny_config

from engine.molmo2.model.checkpoint import load_checkpoint, write_checkpoint
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import Molmo2Model, positions_from_mask, prefix_attention_mask

sys.path.insert(0, str(REPO / "bench"))
from molmo2_peer import peer_image_token_pooling, transformers_config  # noqa: E402

tfm = pytest.importorskip("transformers.models.molmo2")

# fp32, two decoder layers, three ViT blocks: the two implementations differ only in op order.
LOGITS_ATOL = 1e-5


def tfm_config(config: Molmo2Config) -> "tfm.Molmo2Config":
    return transformers_config(config)


def tfm_model(config: Molmo2Config, seed: int = 0) -> "tfm.Molmo2ForConditionalGeneration":
    """transformers' model with every parameter random (norms around 1, non-zero biases)."""
    model = tfm.Molmo2ForConditionalGeneration(tfm_config(config)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


def hub_state_from_tfm(state: dict[str, torch.Tensor], config: Molmo2Config) -> dict[str, torch.Tensor]:
    """transformers' module names -> the hub's keys: the inverse of its conversion mapping (its
    `conversion_mapping.py` entries "molmo2" and "Molmo2TextModel"), written out by hand."""
    out: dict[str, torch.Tensor] = {}
    lm, blocks = "model.language_model.", "model.transformer.blocks."
    embed = state[lm + "embed_tokens.weight"]
    out["model.transformer.wte.embedding"] = embed[: config.text.vocab_size]
    out["model.transformer.wte.new_embedding"] = embed[config.text.vocab_size :]
    for i in range(config.text.num_layers):
        s, h = f"{lm}layers.{i}.", f"{blocks}{i}."
        out[h + "attn_norm.weight"] = state[s + "input_layernorm.weight"]
        out[h + "ff_norm.weight"] = state[s + "post_attention_layernorm.weight"]
        out[h + "self_attn.att_proj.weight"] = torch.cat([state[f"{s}self_attn.{p}_proj.weight"] for p in "qkv"])
        out[h + "self_attn.attn_out.weight"] = state[s + "self_attn.o_proj.weight"]
        out[h + "self_attn.q_norm.weight"] = state[s + "self_attn.q_norm.weight"]
        out[h + "self_attn.k_norm.weight"] = state[s + "self_attn.k_norm.weight"]
        out[h + "mlp.ff_proj.weight"] = torch.cat([state[s + "mlp.up_proj.weight"], state[s + "mlp.gate_proj.weight"]])
        out[h + "mlp.ff_out.weight"] = state[s + "mlp.down_proj.weight"]
    out["model.transformer.ln_f.weight"] = state[lm + "norm.weight"]
    out["lm_head.weight"] = state["lm_head.weight"]
    vt, vit = "model.vision_tower.", "model.vision_backbone.image_vit."
    for name in ("patch_embedding.weight", "patch_embedding.bias", "positional_embedding"):
        out[vit + name] = state[vt + name]
    renames = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
               "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo", "layer_norm1": "attention_norm",
               "layer_norm2": "ffn_norm", "mlp.fc1": "feed_forward.w1", "mlp.fc2": "feed_forward.w2"}  # fmt: skip
    for j in range(config.vit_stored_layers):
        for src, dst in renames.items():
            for kind in ("weight", "bias"):
                out[f"{vit}transformer.resblocks.{j}.{dst}.{kind}"] = state[f"{vt}layers.{j}.{src}.{kind}"]
    mm, vb = "model.multi_modal_projector.", "model.vision_backbone."
    for src, dst in {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}.items():
        for kind in ("weight", "bias"):
            out[f"{vb}image_pooling_2d.{dst}.{kind}"] = state[f"{mm}image_pooling_2d.{src}.{kind}"]
    for src, dst in {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}.items():
        out[f"{vb}image_projector.{dst}.weight"] = state[f"{mm}image_projector.{src}.weight"]
    return out


def ours_from_tfm(reference, config: Molmo2Config) -> Molmo2Model:
    model = Molmo2Model(config).eval()
    missing, unexpected = model.load_state_dict(hub_state_from_tfm(reference.state_dict(), config), strict=False)
    assert sorted(missing) == sorted(["model.transformer.wte.fast_embed", "fast_head.weight", "state_proj.weight",
                                      "state_proj.bias"]) and not unexpected  # fmt: skip
    return model


def test_transformers_native_dict_reads_as_the_same_geometry():
    native = tfm_config(tiny_config()).to_dict()
    assert "vision_config" in native and "rms_norm_eps" in native["text_config"]
    read = Molmo2Config.from_hf_dict(native, fast_vocab_size=48)
    # A native config declares only the built ViT blocks, with non-negative taps: the same model, written
    # differently (tiny declares 4 blocks and taps [-2, -4] -> blocks 2 and 0, 3 stored).
    tiny = tiny_config()
    vision = dataclasses.replace(tiny.vision, num_layers=tiny.vit_stored_layers)
    adapter = dataclasses.replace(tiny.adapter, vit_layers=tiny.vit_taps)
    assert read == dataclasses.replace(tiny, vision=vision, adapter=adapter)
    assert read.vit_taps == tiny.vit_taps and read.vit_stored_layers == tiny.vit_stored_layers
    # and transformers reads our legacy-layout config.json the way it reads the hub's
    theirs = tfm.Molmo2Config(**tiny.to_hf_dict())
    assert theirs.vision_config.num_hidden_layers == 3 and theirs.adapter_config.vision_feature_layer == [2, 0]


@pytest.fixture(scope="module")
def setup():
    config = tiny_config()
    reference = tfm_model(config)
    batch = make_batch(config, [Row(images=2, text=5), Row(images=1, text=3, two_crops=True)], seed=3)
    return config, reference, ours_from_tfm(reference, config), batch.prefix


def tfm_logits(reference, prefix, **overrides) -> torch.Tensor:
    kwargs = dict(
        input_ids=prefix.input_ids,
        attention_mask=prefix.attention_mask.long(),
        mm_token_type_ids=prefix.mm_token_type_ids,
        pixel_values=prefix.pixel_values,
        image_token_pooling=peer_image_token_pooling(prefix),
        image_grids=prefix.image_grids,
        image_num_crops=prefix.image_num_crops,
        position_ids=positions_from_mask(prefix.attention_mask),
    )
    with torch.no_grad():
        return reference(**(kwargs | overrides)).logits


def our_logits(model: Molmo2Model, prefix) -> torch.Tensor:
    with torch.no_grad():
        return model(prefix.input_ids, prefix.attention_mask, prefix.mm_token_type_ids,
                     pixel_values=prefix.pixel_values, image_token_pooling=prefix.image_token_pooling)  # fmt: skip


def max_diff_at_real(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, vocab: int) -> float:
    return float((a[..., :vocab] - b[..., :vocab])[mask].abs().max())


def test_inputs_exercise_every_mechanism(setup):
    config, _, _, prefix = setup
    pooling = prefix.image_token_pooling
    assert bool((pooling < 0).any()) and bool((pooling >= 0).any(-1).all())  # partial 2x2 windows, none empty
    assert bool((~prefix.attention_mask).any())  # left padding
    assert int((prefix.input_ids[0] == config.token_id("image_end")).sum()) == 2  # two images in row 0


def test_logits_match_transformers(setup):
    config, reference, ours, prefix = setup
    expected = tfm_logits(reference, prefix)
    got = our_logits(ours, prefix)
    assert max_diff_at_real(got, expected, prefix.attention_mask, config.text.vocab_size) <= LOGITS_ATOL


def test_unpadded_default_positions_match_transformers(setup):
    """transformers' plain forward numbers positions 0..S-1; on an unpadded row ours are the same."""
    config, reference, ours, _ = setup
    prefix = make_batch(config, [Row(images=2, text=6)], seed=5).prefix
    expected = tfm_logits(reference, prefix, position_ids=None)
    got = our_logits(ours, prefix)
    assert max_diff_at_real(got, expected, prefix.attention_mask, config.text.vocab_size) <= LOGITS_ATOL


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def per_group_mask(prefix) -> torch.Tensor:
    """The variant the reference describes for transformers' port: each CONTIGUOUS run of image tokens is its
    own bidirectional block, so an image sees earlier images but not later ones."""
    image = prefix.mm_token_type_ids == 1
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
    group = torch.where(image, starts.cumsum(-1), -1)
    S = image.shape[1]
    allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] | (
        (group[:, :, None] == group[:, None, :]) & image[:, :, None]
    )
    allowed = (allowed & prefix.attention_mask[:, None, :]) | torch.eye(S, dtype=torch.bool)[None]
    return allowed[:, None]


def test_image_block_is_the_hubs_all_images_block(setup):
    """Two images in a row: under the hub's mask image 1 attends to image 2; under a per-group mask it does not,
    and the logits differ. transformers itself puts all image tokens in one block (= the hub)."""
    config, reference, ours, prefix = setup
    ours_mask = prefix_attention_mask(prefix.attention_mask, prefix.mm_token_type_ids)
    group_mask = per_group_mask(prefix)
    row = prefix.input_ids[0]
    ends = (row == config.token_id("image_end")).nonzero().flatten().tolist()
    first_image_token, second_image_last = int(prefix.mm_token_type_ids[0].nonzero()[0]), ends[1]
    assert bool(ours_mask[0, 0, first_image_token, second_image_last])  # image 1 sees the end of image 2
    assert not bool(group_mask[0, 0, first_image_token, second_image_last])

    vocab, real = config.text.vocab_size, prefix.attention_mask
    got = our_logits(ours, prefix)
    hub_style = tfm_logits(reference, prefix, attention_mask=_additive(ours_mask), mm_token_type_ids=None)
    grouped = tfm_logits(reference, prefix, attention_mask=_additive(group_mask), mm_token_type_ids=None)
    assert max_diff_at_real(got, hub_style, real, vocab) <= LOGITS_ATOL
    image_1 = slice(first_image_token, ends[0] + 1)
    assert float((got[0, image_1, :vocab] - grouped[0, image_1, :vocab]).abs().max()) > 1e-3
    # The single-image row has one contiguous group, where the two masks agree.
    assert max_diff_at_real(got[1:], grouped[1:], real[1:], vocab) <= LOGITS_ATOL


def test_checkpoint_written_in_hub_layout_loads_in_both(setup, tmp_path):
    """Our writer's directory is the hub layout as transformers itself converts it: its from_pretrained reads
    it back to exactly its own weights (fused q/k/v rows, [up, gate] order, split embedding tables, ViT names);
    our loader reads it back to the same logits."""
    config, reference, ours, prefix = setup
    write_checkpoint(ours, config, tmp_path, shard_max_bytes=200_000, ar_extras=False)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1

    loaded = load_checkpoint(tmp_path).eval()
    expected = tfm_logits(reference, prefix)
    got = our_logits(loaded, prefix)
    assert max_diff_at_real(got, expected, prefix.attention_mask, config.text.vocab_size) <= LOGITS_ATOL
    assert torch.equal(got[..., : config.text.vocab_size], our_logits(ours, prefix)[..., : config.text.vocab_size])

    reread = tfm.Molmo2ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    theirs, original = reread.state_dict(), reference.state_dict()
    assert theirs.keys() == original.keys()
    assert all(torch.equal(theirs[k], original[k]) for k in original)
