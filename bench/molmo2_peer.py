"""transformers' own Molmo2 as a peer: its config for one of our geometries, and our batches in its input
layout. Used by the parity tests and by bench/peer_molmo2.py; transformers (>= 5.23) is imported lazily, it is
a test/benchmark dependency only."""

from __future__ import annotations

from typing import Any

import torch

from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import positions_from_mask


def transformers_config(config: Molmo2Config, attention: str = "eager"):
    from transformers.models import molmo2 as tfm

    t, v, a = config.text, config.vision, config.adapter
    tc = tfm.Molmo2Config(
        text_config=dict(
            hidden_size=t.hidden_size, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
            head_dim=t.head_dim, vocab_size=t.vocab_size, additional_vocab_size=t.additional_vocab_size,
            num_hidden_layers=t.num_layers, intermediate_size=t.intermediate_size, rms_norm_eps=t.norm_eps,
            rope_parameters=dict(rope_type="default", rope_theta=t.rope_theta),
            max_position_embeddings=t.max_position_embeddings,
        ),
        vision_config=dict(
            hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
            num_hidden_layers=config.vit_stored_layers, num_attention_heads=v.num_heads,
            num_key_value_heads=v.num_heads, head_dim=v.head_dim, image_size=list(v.image_size),
            patch_size=v.patch_size, layer_norm_eps=v.norm_eps,
        ),
        adapter_config=dict(
            vision_feature_layer=list(config.vit_taps), hidden_size=a.hidden_size, num_attention_heads=a.num_heads,
            num_key_value_heads=a.num_heads, head_dim=a.head_dim, intermediate_size=a.intermediate_size,
            text_hidden_size=t.hidden_size,
        ),
        image_start_token_id=config.token_id("image_start"),
        low_res_image_start_token_id=config.token_id("low_res_image_start"),
        image_end_token_id=config.token_id("image_end"),
        image_patch_id=config.image_patch_id,
        frame_start_token_id=config.token_id("frame_start"),
        frame_end_token_id=config.token_id("frame_end"),
    )  # fmt: skip
    tc._attn_implementation = attention
    return tc


def transformers_inputs(batch: ARBatch, config: Molmo2Config) -> dict[str, Any]:
    """One sequence per row, [left-padded prefix | right-padded suffix], with labels on the suffix only.

    transformers' Molmo2 has no FAST block: the FAST ids are remapped into the base vocabulary (id - base),
    which changes nothing in what it computes; its logits span the whole base vocabulary at every position."""
    p, s = batch.prefix, batch.suffix
    fast = s.input_ids >= config.fast_block_base
    suffix_ids = torch.where(fast, s.input_ids - config.fast_block_base, s.input_ids)
    labels = torch.where(s.labels >= config.fast_block_base, s.labels - config.fast_block_base, s.labels)
    input_ids = torch.cat([p.input_ids, suffix_ids], dim=1)
    attention_mask = torch.cat([p.attention_mask, s.attention_mask], dim=1)
    # transformers shifts labels by one inside its loss: the label of position j is the token at j + 1.
    shifted = torch.full_like(input_ids, IGNORE_INDEX)
    shifted[:, p.input_ids.shape[1] : p.input_ids.shape[1] + s.labels.shape[1]] = labels
    shifted = torch.roll(shifted, 1, dims=1)
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        mm_token_type_ids=torch.cat([p.mm_token_type_ids, torch.zeros_like(s.input_ids)], dim=1),
        pixel_values=p.pixel_values,
        image_token_pooling=p.image_token_pooling,
        image_grids=p.image_grids,
        image_num_crops=p.image_num_crops,
        position_ids=positions_from_mask(attention_mask),
        labels=shifted,
    )
