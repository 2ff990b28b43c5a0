"""transformers' own Molmo2 as a peer: its config for one of our geometries, and our batches in its input
layout. Used by the parity tests and by bench/peer_molmo2.py; transformers (>= 5.23) is imported lazily, it is
a test/benchmark dependency only.

Two vocabularies. The hub's (`fast_block=False`, the parity tests'): the base rows, then the 128 extension rows
(the image specials); its head spans the base rows. Ours for AR training (`fast_block=True`, the benchmark's):
the base rows, then our FAST block, then the image specials, so its head spans the base rows and the FAST block,
as ours does. Our logits are the same columns with the extension between them held at -inf, so the two softmaxes
and the two losses are the same (tests/test_peer_loss.py)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import positions_from_mask


def transformers_config(config: Molmo2Config, attention: str = "eager", *, fast_block: bool = False):
    from transformers.models import molmo2 as tfm

    t, v, a = config.text, config.vision, config.adapter
    # With the FAST block the specials move up by its size (peer_ids): they follow it in the embedding table.
    shift = config.fast_vocab_size if fast_block else 0

    def special(name: str) -> int:
        return config.token_id(name) + shift

    tc = tfm.Molmo2Config(
        text_config=dict(
            hidden_size=t.hidden_size, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
            head_dim=t.head_dim, vocab_size=t.vocab_size + shift, additional_vocab_size=t.additional_vocab_size,
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
        image_start_token_id=special("image_start"),
        low_res_image_start_token_id=special("low_res_image_start"),
        image_end_token_id=special("image_end"),
        image_patch_id=config.image_patch_id + shift,
        frame_start_token_id=special("frame_start"),
        frame_end_token_id=special("frame_end"),
    )  # fmt: skip
    tc._attn_implementation = attention
    return tc


def peer_ids(ids: torch.Tensor, config: Molmo2Config) -> torch.Tensor:
    """Our token ids in the vocabulary of `transformers_config(..., fast_block=True)`: base ids unchanged, the
    FAST block right after the base rows, the image specials after it. IGNORE_INDEX stays."""
    base, special_end = config.text.vocab_size, config.fast_block_base
    special = (ids >= base) & (ids < special_end)
    fast = ids >= special_end
    return torch.where(
        special, ids + config.fast_vocab_size, torch.where(fast, ids - config.text.additional_vocab_size, ids)
    )


@functools.cache
def peer_indexes_each_images_own_patches() -> bool:
    """Whether the installed transformers reads `image_token_pooling` image by image. Up to 5.24 its processor and
    model index the batch's patches, as ours do; from 5.25 each image's rows index that image's own patches and
    its model adds the offsets from `image_num_crops`. Read off the model's signature, which says which it is."""
    from transformers.models.molmo2 import modeling_molmo2

    return "image_num_crops" in inspect.signature(modeling_molmo2.Molmo2Model.get_image_features).parameters


def peer_image_token_pooling(images: Any) -> torch.Tensor:
    """`images.image_token_pooling` (ours: indices into the batch's patches) in the layout the installed
    transformers takes. `images` is a `PrefixInputs` or an `ImageBatch`: pixel values, pooling, grids, crops."""
    pooling = images.image_token_pooling
    if not peer_indexes_each_images_own_patches():
        return pooling
    grids, crops = images.image_grids, images.image_num_crops
    tokens_per_image = grids[:, 0] * grids[:, 1] + grids[:, 2] * grids[:, 3]
    patches_per_image = crops * images.pixel_values.shape[-2]
    first_patch = (patches_per_image.cumsum(0) - patches_per_image).repeat_interleave(tokens_per_image)
    assert first_patch.shape[0] == pooling.shape[0], (first_patch.shape, pooling.shape)
    return torch.where(pooling >= 0, pooling - first_patch[:, None], pooling)


def transformers_inputs(batch: ARBatch, config: Molmo2Config, *, logits_to_keep: bool = False) -> dict[str, Any]:
    """Forward kwargs for `transformers_config(..., fast_block=True)`: one sequence per row, [left-padded prefix |
    right-padded suffix | one pad column], labels on the suffix only.

    transformers' loss shifts its labels (position j scores the token at j + 1), so our label of suffix position t
    sits at t + 1; the pad column holds the label of the longest row's last real position. With `logits_to_keep`
    only the suffix's positions and the pad column reach the head (`logits_to_keep` = suffix + 1 columns), their
    labels beside them; without, every position does, as transformers trains by default."""
    p, s = batch.prefix, batch.suffix
    B, P = p.input_ids.shape
    pad = torch.zeros((B, 1), dtype=s.input_ids.dtype, device=s.input_ids.device)
    suffix_ids = torch.cat([peer_ids(s.input_ids, config), pad], dim=1)
    suffix_mask = torch.cat([s.attention_mask, pad.bool()], dim=1)
    suffix_labels = torch.full_like(suffix_ids, IGNORE_INDEX)
    suffix_labels[:, 1:] = peer_ids(s.labels, config)
    attention_mask = torch.cat([p.attention_mask, suffix_mask], dim=1)
    inputs = dict(
        input_ids=torch.cat([peer_ids(p.input_ids, config), suffix_ids], dim=1),
        attention_mask=attention_mask.long(),
        mm_token_type_ids=torch.cat([p.mm_token_type_ids, torch.zeros_like(suffix_ids)], dim=1),
        pixel_values=p.pixel_values,
        image_token_pooling=peer_image_token_pooling(p),
        image_grids=p.image_grids,
        image_num_crops=p.image_num_crops,
        position_ids=positions_from_mask(attention_mask),
    )
    if logits_to_keep:
        return inputs | dict(labels=suffix_labels, logits_to_keep=suffix_ids.shape[1])
    return inputs | dict(labels=torch.cat([torch.full_like(p.input_ids, IGNORE_INDEX), suffix_labels], dim=1))
