"""Molmo2's vision backbone: a pre-LN ViT over flattened 14x14x3 patches, the concatenated taps, 2x2 attention
pooling with a masked-mean query, and the gated projector into the decoder's width. Module and parameter names
are the hub's (`model.vision_backbone.*`), so the state dict is the checkpoint layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.molmo2.model.config import Molmo2Config, VisionConfig


class DotProductAttention(nn.Module):
    """The hub's ViTMultiHeadDotProductAttention: biased wq/wk/wv/wo, non-causal, scale head_dim^-0.5. Used by
    the ViT blocks (self-attention) and by the pooling (one query against the 4 patches of a 2x2 window)."""

    def __init__(self, input_dim: int, hidden_size: int, num_heads: int, head_dim: int, float32: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.float32 = num_heads, head_dim, float32
        width = num_heads * head_dim
        self.wq = nn.Linear(input_dim, width)
        self.wk = nn.Linear(input_dim, width)
        self.wv = nn.Linear(input_dim, width)
        self.wo = nn.Linear(width, hidden_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self, x_q: torch.Tensor, x_kv: torch.Tensor | None = None, mask: torch.Tensor | None = None, fp16: bool = False
    ) -> torch.Tensor:
        """`fp16` (X2) computes this call's q.k and softmax on fp16 inputs, whatever float32_attention says."""
        x_kv = x_q if x_kv is None else x_kv
        q, k, v = self._heads(self.wq(x_q)), self._heads(self.wk(x_kv)), self._heads(self.wv(x_kv))
        dtype = q.dtype
        if fp16 or self.float32:
            # float32_attention: the hub computes q.k (and softmax) in fp32 whatever the surrounding dtype. X2: the
            # same call on fp16 inputs, which FLASH takes; 10 bits of mantissa against bf16's 7.
            cast = torch.float16 if fp16 else torch.float32
            with torch.autocast(q.device.type, enabled=False):
                attn = F.scaled_dot_product_attention(q.to(cast), k.to(cast), v.to(cast), attn_mask=mask)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.to(dtype).transpose(1, 2)
        return self.wo(attn.reshape(*attn.shape[:2], self.num_heads * self.head_dim))


class ViTMLP(nn.Module):
    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.w2 = nn.Linear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class ViTBlock(nn.Module):
    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.attention = DotProductAttention(v.hidden_size, v.hidden_size, v.num_heads, v.head_dim,
                                             v.float32_attention)  # fmt: skip
        self.feed_forward = ViTMLP(v)
        self.attention_norm = nn.LayerNorm(v.hidden_size, eps=v.norm_eps)
        self.ffn_norm = nn.LayerNorm(v.hidden_size, eps=v.norm_eps)

    def forward(self, x: torch.Tensor, fp16_attention: bool = False) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), fp16=fp16_attention)
        return x + self.feed_forward(self.ffn_norm(x))


class _Blocks(nn.Module):
    """Exists for the key path `transformer.resblocks.{j}`."""

    def __init__(self, v: VisionConfig, depth: int) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(ViTBlock(v) for _ in range(depth))


class VisionTransformer(nn.Module):
    """No class token, no pre/post LayerNorm. Only `stored_layers` blocks exist."""

    def __init__(self, v: VisionConfig, stored_layers: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(v.patch_dim, v.hidden_size)  # on the flattened (row, col, channel) patch
        self.positional_embedding = nn.Parameter(torch.empty(v.num_positions, v.hidden_size))
        self.transformer = _Blocks(v, stored_layers)

    def forward(self, pixels: torch.Tensor, taps: tuple[int, ...], fp16_attention: bool = False) -> torch.Tensor:
        """pixels: [n_crops, n_patches, patch_dim] -> the tapped blocks' outputs concatenated in `taps` order.
        `fp16_attention` (X2) runs every block's attention on fp16 inputs."""
        x = self.patch_embedding(pixels)
        x = x + self.positional_embedding[None].to(x.dtype)
        tapped: dict[int, torch.Tensor] = {}  # only the taps are kept alive (25 block outputs would not be small)
        for index, block in enumerate(self.transformer.resblocks):
            x = block(x, fp16_attention)
            if index in taps:
                tapped[index] = x
        return torch.cat([tapped[i] for i in taps], dim=-1)


class ImageProjector(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the up projection; no biases."""

    def __init__(self, input_dim: int, intermediate: int, output_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(input_dim, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, output_dim, bias=False)
        self.w3 = nn.Linear(input_dim, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class VisionBackbone(nn.Module):
    """The hub's `model.vision_backbone`."""

    def __init__(self, config: Molmo2Config) -> None:
        super().__init__()
        v, a = config.vision, config.adapter
        self.config = config
        self.image_vit = VisionTransformer(v, config.vit_stored_layers)
        self.image_pooling_2d = DotProductAttention(config.pooling_input_dim, a.hidden_size, a.num_heads, a.head_dim,
                                                    a.float32_attention)  # fmt: skip
        self.image_projector = ImageProjector(a.hidden_size, a.intermediate_size, config.text.hidden_size)

    def forward(
        self, pixel_values: torch.Tensor, token_pooling: torch.Tensor, vit_fp16_attention: bool = False
    ) -> torch.Tensor:
        """pixel_values [n_crops, n_patches, patch_dim] (every crop of the batch); token_pooling [n_tokens, k]:
        per output token, k indices into the flattened (n_crops * n_patches) features, -1 = invalid slot.
        Returns [n_tokens, text_hidden], one row per pooled token, in order.

        Every row must hold at least one valid index (a 2x2 window of the bottom/right-padded patch grid always
        contains its top-left patch); the hub drops all-invalid rows, which only its own per-example batching
        padding creates — our flat layout has one row per <im_patch> token, so there is nothing to drop.
        `vit_fp16_attention` (X2) runs the ViT blocks' attention on fp16 inputs; the pooling keeps the config's."""
        expected = self.config.vision.num_patches
        if pixel_values.shape[1] != expected:
            raise ValueError(f"pixel_values has {pixel_values.shape[1]} patches per crop; this geometry has "
                             f"{expected} (the positional table is never interpolated)")  # fmt: skip
        features = self.image_vit(pixel_values, self.config.vit_taps, vit_fp16_attention)
        flat = features.reshape(-1, features.shape[-1])
        valid = token_pooling >= 0
        to_pool = flat[token_pooling.clamp(min=0)] * valid[..., None].to(flat.dtype)  # [n_tokens, k, dim]
        # pooling_attention_mask: the query is the mean over the valid slots only, and attention skips the rest.
        count = valid.float().sum(-1)
        count = torch.where(count == 0, 1, count)
        query = to_pool.sum(-2, keepdim=True) / count[:, None, None].to(to_pool.dtype)
        pooled = self.image_pooling_2d(query, to_pool, mask=valid[:, None, None, :])  # [n_tokens, 1, hidden]
        return self.image_projector(pooled.squeeze(1))
