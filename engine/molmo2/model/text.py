"""The Qwen3-style decoder of Molmo2: embeddings (base + 128-row extension + the FAST block), pre-norm blocks with
a fused qkv projection, per-head q/k RMSNorm before RoPE, GQA attention, the fused [up, gate] MLP, and the final
norm. Module and parameter names are the hub's, so the state dict IS the checkpoint layout; the FAST table
(`wte.fast_embed`) is ours: the AR decoder's action tokens, which the hub has no rows for."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from engine.molmo2.attention.segments import Segments, attend_segments
from engine.molmo2.model.config import Molmo2Config, TextConfig
from engine.molmo2.model.swiglu import swiglu_down

# The dispatcher list the baseline pins for decoder attention (the P1 site), in this priority order. A dense mask
# rules out FLASH, so on CUDA this runs EFFICIENT or MATH.
BASELINE_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values), each [B, kv_heads, L, head_dim]


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back to the input dtype, THEN multiply by the weight (hub and Qwen3 order)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rope:
    """cos/sin tables for the given positions, computed in fp32 once per forward and shared by every layer."""

    def __init__(self, positions: torch.Tensor, head_dim: int, theta: float) -> None:
        with torch.autocast(positions.device.type, enabled=False):
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
            inv_freq = 1.0 / (theta**exponent)
            freqs = positions[..., None].float() * inv_freq  # [B, S, head_dim/2]
            angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, S, head_dim]: broadcast over heads
            self.cos, self.sin = angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, heads, S, head_dim]; rotate_half pairs dimension i with i + head_dim/2 (not interleaved)."""
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# A dense bool mask (SDPA), a BlockMask (FlexAttention: prefix_attention = "flex"), varlen Segments (a packed row
# under the varlen choices of pack_attention), or None (no mask).
Mask = torch.Tensor | BlockMask | Segments | None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    """GQA attention, scale 1/sqrt(head_dim), dispatched on the mask's kind: Segments to the varlen calls
    (segments.py), a BlockMask to FlexAttention, a dense bool mask to SDPA, whose backends the caller picks with
    `sdpa_kernel`."""
    if isinstance(mask, Segments):
        return attend_segments(q, k, v, mask)
    if isinstance(mask, BlockMask):
        return _flex(q.device.type)(q, k, v, block_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


_compiled_flex_attention = None  # built on first use: torch.compile imports Dynamo


def _flex(device_type: str):
    """FlexAttention runs fused only when compiled; called eagerly it materialises the scores (fine on a CPU at the
    tiny geometry, ruinous at 4B). Inside a compiled decoder block it is traced as it is."""
    global _compiled_flex_attention
    if device_type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


def backends_context(backends: tuple[SDPBackend, ...]):
    """The list's order is the priority order (so "prepend cuDNN" means cuDNN is tried first)."""
    return sdpa_kernel(list(backends), set_priority=True)


class Molmo2Embedding(nn.Module):
    """ids in [0, vocab) read `embedding`; ids from vocab on read the extension rows: the 128 specials
    (`new_embedding`, hub) then the FAST block (`fast_embed`, ours) — one contiguous id range, so the
    FAST block starts at vocab + additional_vocab (Molmo2Config.fast_block_base).

    The hub concatenates the two hub tables and calls F.embedding on the whole [152064, hidden] table; reading
    the two ranges separately and selecting with torch.where gives bitwise the same rows without that copy."""

    def __init__(self, config: Molmo2Config) -> None:
        super().__init__()
        t = config.text
        self.embedding = nn.Parameter(torch.empty(t.vocab_size, t.hidden_size))
        self.new_embedding = nn.Parameter(torch.empty(t.additional_vocab_size, t.hidden_size))
        self.fast_embed = nn.Parameter(torch.empty(config.fast_vocab_size, t.hidden_size))

    def forward(self, ids: torch.Tensor, *, branchless: bool) -> torch.Tensor:
        vocab = self.embedding.shape[0]
        is_extension = ids >= vocab
        # The baseline (the P3b site): a host sync on every call to skip the extension lookup when it is not needed.
        # `branchless` (P3b) always takes the second path; torch.where with an all-False mask returns the base
        # rows exactly, so the outputs are bitwise equal either way.
        if not branchless and not bool(is_extension.any()):
            return F.embedding(ids, self.embedding)
        extension = torch.cat([self.new_embedding, self.fast_embed])
        base_rows = F.embedding(torch.where(is_extension, 0, ids), self.embedding)
        extension_rows = F.embedding((ids - vocab).clamp(min=0), extension)
        return torch.where(is_extension[..., None], extension_rows, base_rows)


class Attention(nn.Module):
    def __init__(self, t: TextConfig) -> None:
        super().__init__()
        self.t = t
        # Fused rows, as the checkpoint stores them: q [0, q_width), k [q_width, q_width + kv_width), v [the rest];
        # no bias.
        self.att_proj = nn.Linear(t.hidden_size, t.q_width + 2 * t.kv_width, bias=False)
        self.q_norm = RMSNorm(t.head_dim, t.norm_eps)  # per head ("qwen3"), over head_dim
        self.k_norm = RMSNorm(t.head_dim, t.norm_eps)
        self.attn_out = nn.Linear(t.q_width, t.hidden_size, bias=False)

    def project(self, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [B, S, hidden] -> q [B, heads, S, d], k and v [B, kv_heads, S, d]; q/k normed BEFORE RoPE."""
        t = self.t
        B, S, _ = h.shape
        q, k, v = self.att_proj(h).split([t.q_width, t.kv_width, t.kv_width], dim=-1)
        q = self.q_norm(q.view(B, S, t.num_heads, t.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, S, t.num_kv_heads, t.head_dim)).transpose(1, 2)
        v = v.view(B, S, t.num_kv_heads, t.head_dim).transpose(1, 2)
        return rope.apply(q), rope.apply(k), v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        B, _, S, _ = attn.shape
        return self.attn_out(attn.transpose(1, 2).reshape(B, S, self.t.q_width))


class MLP(nn.Module):
    def __init__(self, t: TextConfig) -> None:
        super().__init__()
        # Fused rows [up, gate]: up FIRST, as the checkpoint stores them (the usual convention is [gate, up]).
        self.ff_proj = nn.Linear(t.hidden_size, 2 * t.intermediate_size, bias=False)
        self.ff_out = nn.Linear(t.intermediate_size, t.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """`fused` (X11): ff_out(silu(gate) * up) as swiglu.py's ops, whose backward reads each (up, gate) pair
        once."""
        u = self.ff_proj(x)
        if fused:
            return swiglu_down(u, self.ff_out.weight)
        up, gate = u.chunk(2, dim=-1)
        return self.ff_out(F.silu(gate) * up)


class DecoderBlock(nn.Module):
    def __init__(self, t: TextConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(t.hidden_size, t.norm_eps)
        self.self_attn = Attention(t)
        self.ff_norm = RMSNorm(t.hidden_size, t.norm_eps)
        self.mlp = MLP(t)

    def keys_values(self, x: torch.Tensor, rope: Rope) -> KV:
        """Only this layer's K/V of x (what a prefix's last layer must contribute; its outputs are unused)."""
        _, k, v = self.self_attn.project(self.attn_norm(x), rope)
        return k, v

    def forward(
        self, x: torch.Tensor, rope: Rope, mask: Mask, past: KV | None = None, fused_swiglu: bool = False
    ) -> tuple[torch.Tensor, KV]:
        """x: [B, S, hidden]; `past` holds earlier positions' K/V, which x's queries also see through `mask`
        ([B, 1, S, past_len + S], True = may attend). Returns the new x and this layer's K/V of x alone.
        `fused_swiglu` (X11) runs the MLP's SwiGLU as swiglu.py's ops."""
        q, k, v = self.self_attn.project(self.attn_norm(x), rope)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        x = x + self.self_attn.output(attend(q, keys, values, mask))
        x = x + self.mlp(self.ff_norm(x), fused_swiglu)
        return x, (k, v)


class TextModel(nn.Module):
    """The hub's `model.transformer`: wte, blocks, ln_f."""

    def __init__(self, config: Molmo2Config) -> None:
        super().__init__()
        self.t = config.text
        self.wte = Molmo2Embedding(config)
        self.blocks = nn.ModuleList(DecoderBlock(self.t) for _ in range(self.t.num_layers))
        self.ln_f = RMSNorm(self.t.hidden_size, self.t.norm_eps)

    def rope(self, positions: torch.Tensor) -> Rope:
        return Rope(positions, self.t.head_dim, self.t.rope_theta)
