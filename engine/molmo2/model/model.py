"""The composed Molmo2 model: image features added at <im_patch> positions, the causal-OR-image-block mask,
the decoder, and the heads (the hub's untied lm_head over the base vocabulary + our FAST rows).

State-dict names: the hub's exact keys (`model.transformer.*`, `model.vision_backbone.*`, `lm_head.weight`) plus
the AR extras in `AR_EXTRA_KEYS`. Three S-bundle sites live here and in text.py, each switched by `self.switches`
(P3a the patch-count check, P3b the extension lookup, P4 the embedding clone); P1 is in ar.py.

Attention runs one of a few paths per site, chosen by `self.execution` (execution.py): a padded prefix under its
dense mask (SDPA) or its block mask (FlexAttention); a packed prefix the same on its packed row, or as varlen
segments; a suffix, padded or packed, under its dense mask (SDPA), or as varlen segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from engine.molmo2.attention.execution import EAGER, VARLEN_KERNELS, Execution
from engine.molmo2.attention.packing import Packing, packed_prefix_block_mask, packed_prefix_mask, packed_suffix_mask
from engine.molmo2.model.batch import PrefixInputs, positions_from_mask
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.text import BASELINE_BACKENDS, KV, DecoderBlock, Mask, RMSNorm, TextModel, backends_context
from engine.molmo2.model.vision import VisionBackbone
from engine.molmo2.switches import BASELINE, Switches

# Parameters that are not in the hub checkpoint: the FAST block (embedding rows + head rows) and the state slot's
# projection, which the AR decoder adds. A hub checkpoint lacks them by design; our AR checkpoints carry them.
AR_EXTRA_KEYS = ("model.transformer.wte.fast_embed", "fast_head.weight", "state_proj.weight", "state_proj.bias")


def prefix_attention_mask(attention_mask: torch.Tensor, mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, True = may attend: (causal OR both q and k are image tokens) AND k is not padding.

    The image block is the hub's (`token_type_ids_mask_function`): every image token of a row sees every other
    image token of that row, later images included. A padding query sees only itself, so no row is empty."""
    B, S = attention_mask.shape
    device = attention_mask.device
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    image = mm_token_type_ids == 1
    allowed = causal[None] | (image[:, :, None] & image[:, None, :])
    allowed = allowed & attention_mask.bool()[:, None, :]
    allowed = allowed | torch.eye(S, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


def prefix_block_mask(attention_mask: torch.Tensor, mm_token_type_ids: torch.Tensor) -> BlockMask:
    """The same rule as `prefix_attention_mask`, as FlexAttention's block mask (execution.py, "flex")."""
    B, S = attention_mask.shape
    image = mm_token_type_ids == 1
    real = attention_mask.bool()

    def allowed(b, h, q, kv):
        return (((q >= kv) | (image[b, q] & image[b, kv])) & real[b, kv]) | (q == kv)

    return create_block_mask(allowed, B, None, S, S, device=attention_mask.device)


def continuation_mask(cache_key_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, P + T] bool for T new tokens after P cached ones: cached keys where they are real, new keys
    causally where they are real. The new tokens are text (no image block), RIGHT-padded, and each row has at
    least one real cached token, so no query row is empty."""
    B, T = attention_mask.shape
    P = cache_key_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    cached = cache_key_mask.bool()[:, None, :].expand(B, T, P)
    new = causal[None] & attention_mask.bool()[:, None, :]
    return torch.cat([cached, new], dim=-1)[:, None]


@dataclass(frozen=True)
class KVCache:
    """The K/V of every decoder layer over the positions seen so far (a prefix, then appended tokens)."""

    layers: tuple[KV, ...]  # per layer: keys, values [B, kv_heads, L, head_dim]
    key_mask: torch.Tensor  # [B, L] bool: False at padding
    next_position: torch.Tensor  # [B] long: RoPE position of each row's next real token

    @property
    def length(self) -> int:
        return int(self.key_mask.shape[1])

    def appended(self, layers: list[KV], attention_mask: torch.Tensor) -> "KVCache":
        return KVCache(
            layers=tuple(
                (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                for (k0, v0), (k1, v1) in zip(self.layers, layers, strict=True)
            ),  # fmt: skip
            key_mask=torch.cat([self.key_mask, attention_mask.bool()], dim=1),
            next_position=self.next_position + attention_mask.long().sum(-1),
        )


class Molmo2Trunk(nn.Module):
    """The hub's `model.` namespace."""

    def __init__(self, config: Molmo2Config) -> None:
        super().__init__()
        self.transformer = TextModel(config)
        self.vision_backbone = VisionBackbone(config)


class Molmo2Model(nn.Module):
    def __init__(self, config: Molmo2Config, switches: Switches = BASELINE) -> None:
        super().__init__()
        self.config = config
        self.execution = EAGER  # set with `set_execution`
        # Plain attributes (a list, a wrapper set through __dict__): not submodules, so no extra state-dict keys.
        self._compiled_blocks: list[nn.Module] | None = None
        self.__dict__["_compiled_vision"] = None
        t = config.text
        self.model = Molmo2Trunk(config)
        self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)  # untied; base vocabulary only
        self.fast_head = nn.Linear(t.hidden_size, config.fast_vocab_size, bias=False)
        self.state_proj = nn.Linear(config.state_dim, t.hidden_size)  # zero-initialised: the prompt starts undisturbed
        self.switches = switches  # reassign to change rungs without reloading

    @property
    def transformer(self) -> TextModel:
        return self.model.transformer

    def set_execution(self, execution: Execution) -> None:
        """The compiled wrappers share the blocks' parameters; they are built once, on the first compiled run."""
        self.execution = execution
        if execution.compile and self._compiled_blocks is None:
            # Specialised shapes (dynamic=False) with room for every (chunk, prefix/suffix) shape of a pool: past
            # the default limit of 8 Dynamo would silently run the block eagerly.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            options = execution.compile_options()
            self._compiled_blocks = [
                torch.compile(block, dynamic=False, options=options) for block in self.transformer.blocks
            ]
            self.__dict__["_compiled_vision"] = torch.compile(self.model.vision_backbone, dynamic=False,
                                                              options=options)  # fmt: skip

    def image_features(self, pixel_values: torch.Tensor, image_token_pooling: torch.Tensor) -> torch.Tensor:
        vision = self._compiled_vision if self.execution.compile else self.model.vision_backbone
        # X2 (vit_fp16_attention), training mode only: the frozen ViT's attention on fp16 inputs instead of the
        # hub's fp32; evaluation and decode keep the hub's numerics, so decode byte-anchors stay valid.
        return vision(pixel_values, image_token_pooling, self.training and self.switches.vit_fp16_attention)

    def _fused_swiglu(self) -> bool:
        """X11 (fused_swiglu), training mode only: evaluation and decode keep the baseline's SwiGLU, so decode
        byte-anchors stay valid."""
        return self.training and self.switches.fused_swiglu

    def _blocks(self, extending: bool) -> list[DecoderBlock]:
        """Compiled blocks for training and for prefixes; decode runs eager. Greedy decode extends its cache by one
        position a call, so compiled blocks would meet a new key length every token: a compilation each (seconds at
        4B), until Dynamo's recompile limit ran the rest eagerly anyway."""
        compiled = self.execution.compile and (self.training or not extending)
        return self._compiled_blocks if compiled else list(self.transformer.blocks)

    # ---- inputs -> embeddings ----

    def embed(
        self,
        input_ids: torch.Tensor,
        image_features: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        state_positions: torch.Tensor | None = None,
        state_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.transformer.wte(input_ids, branchless=self.switches.branchless_extension_lookup)
        if image_features is not None:
            x = self._add_image_features(input_ids, x, image_features)
        if state is not None:
            # x is ours here (a fresh lookup or its clone), so the slot add can be in place.
            rows = torch.arange(x.shape[0], device=x.device) if state_rows is None else state_rows
            x.index_put_((rows, state_positions), self.state_proj(state).to(x.dtype), accumulate=True)
        return x

    def _add_image_features(self, input_ids: torch.Tensor, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """x[input_ids == <im_patch>] += features, in <im_patch> order — ADDED to the learned <im_patch> row, as
        the hub and transformers do (vLLM's overwrite differs unless that row is ~0)."""
        B, S, H = x.shape
        is_patch = (input_ids == self.config.image_patch_id).reshape(-1)
        n = features.shape[0]
        if self.switches.device_assert_patch_count:
            # P3a: the same guard on the device; a mismatch aborts (on CPU it raises RuntimeError at once).
            torch._assert_async(is_patch.sum() == n, "<im_patch> count != number of image features")
        else:
            found = int(is_patch.sum())  # the baseline (the P3a site): a host sync per encode
            if found != n:
                raise ValueError(f"input_ids hold {found} <im_patch> tokens (id {self.config.image_patch_id}) "
                                 f"but the images give {n} features; prompt and pooling indices disagree")  # fmt: skip
        rows = torch.nonzero_static(is_patch, size=n).squeeze(1)  # size known on the host: no sync
        flat = x.view(B * S, H)
        if not self.switches.no_embed_clone:
            flat = flat.clone()  # the baseline (the P4 site); P4 adds in place into the fresh lookup
        flat.index_add_(0, rows, features.to(flat.dtype))
        return flat.view(B, S, H)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Column j scores token id j over [0, fast_block_base + fast_vocab). The extension ids (image specials)
        have no head row and can never be produced: their columns are -inf."""
        base = self.lm_head(hidden)
        fast = self.fast_head(hidden)
        gap = base.new_full((*hidden.shape[:-1], self.config.text.additional_vocab_size), float("-inf"))
        return torch.cat([base, gap, fast], dim=-1)

    # ---- decoder ----
    def decoder(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: Mask,
        past: KVCache | None = None,
        last_layer_kv_only: bool = False,
    ) -> tuple[torch.Tensor | None, list[KV]]:
        """Runs the blocks (attention backends are the caller's `backends_context`). Returns the hidden states
        before ln_f and each layer's K/V of x. With `last_layer_kv_only`, the last block only contributes its
        K/V (a prefix's outputs are never read) and no hidden states are returned."""
        rope = self.transformer.rope(positions)
        blocks = self._blocks(extending=past is not None)
        layers: list[KV] = []
        for index, block in enumerate(blocks):
            if last_layer_kv_only and index == len(blocks) - 1:
                layers.append(self.transformer.blocks[index].keys_values(x, rope))
                return None, layers
            x, kv = block(x, rope, mask, None if past is None else past.layers[index], self._fused_swiglu())
            layers.append(kv)
        return x, layers

    def embed_multimodal(
        self,
        input_ids: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_token_pooling: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        state_positions: torch.Tensor | None = None,
        state_rows: torch.Tensor | None = None,
        image_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """With `image_features` (the tower's output for `pixel_values`, computed ahead), the tower does not run."""
        features = image_features
        if features is None and pixel_values is not None:
            features = self.image_features(pixel_values, image_token_pooling)
        return self.embed(input_ids, features, state, state_positions, state_rows)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_token_pooling: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        state_positions: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence per row, all at once: logits [B, S, logits_width]."""
        x = self.embed_multimodal(input_ids, pixel_values=pixel_values, image_token_pooling=image_token_pooling,
                                  state=state, state_positions=state_positions)  # fmt: skip
        positions = positions_from_mask(attention_mask) if position_ids is None else position_ids
        with backends_context(BASELINE_BACKENDS):
            hidden, _ = self.decoder(x, positions, prefix_attention_mask(attention_mask, mm_token_type_ids))
        return self.logits(self.transformer.ln_f(hidden))

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_token_pooling: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        state_positions: torch.Tensor | None = None,
        state_rows: torch.Tensor | None = None,
        last_logits: bool = True,
        packing: Packing | None = None,
        image_features: torch.Tensor | None = None,
    ) -> tuple[KVCache, torch.Tensor | None]:
        """Encodes a LEFT-padded prompt once and keeps its K/V. With `last_logits`, also returns the logits at
        the last column ([B, logits_width]), the next-token scores of every row; without, the last layer only
        computes its K/V. With `packing` (packing.py: a packed training chunk, one row of every sample's prompt),
        positions and attention keep to each sample; its cache serves `extend` with the same packing only."""
        x = self.embed_multimodal(input_ids, pixel_values=pixel_values, image_token_pooling=image_token_pooling,
                                  state=state, state_positions=state_positions, state_rows=state_rows,
                                  image_features=image_features)  # fmt: skip
        positions, mask = self._prefix_attention(attention_mask, mm_token_type_ids, packing)
        with backends_context(BASELINE_BACKENDS):
            hidden, layers = self.decoder(x, positions, mask, last_layer_kv_only=not last_logits)
        cache = KVCache(tuple(layers), attention_mask.bool(), attention_mask.long().sum(-1))
        if not last_logits:
            return cache, None
        return cache, self.logits(self.transformer.ln_f(hidden[:, -1]))

    def extend(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: KVCache, packing: Packing | None = None
    ) -> tuple[torch.Tensor, list[KV]]:
        """T new text tokens (RIGHT-padded) after the cached positions: their hidden states after ln_f
        [B, T, hidden] and each layer's K/V of them. Attention backends are the caller's `backends_context`.
        With `packing`, the packed suffix row after the packed prefix that filled `cache`."""
        x = self.embed(input_ids)
        positions, mask = self._suffix_attention(attention_mask, cache, packing)
        hidden, layers = self.decoder(x, positions, mask, past=cache)
        return self.transformer.ln_f(hidden), layers

    def joined_suffix_hidden(self, prefix: PrefixInputs, suffix_ids: torch.Tensor, packing: Packing) -> torch.Tensor:
        """A packed training chunk in one pass (pack_one_pass): the suffix's hidden states after ln_f [1, Ns,
        hidden], what prefill then extend give, with the prefix row and the suffix row joined into one
        (Packing.joined) through every block but the last. Each weight then serves one matmul a layer instead of
        two (prefix, then suffix): one cast to bf16 and one gradient, none to accumulate. The last block stays
        split as in prefill (the prefix's outputs are never read: only its K/V) and extend (the suffix on them)."""
        x = torch.cat([self.embed_multimodal(prefix.input_ids, pixel_values=prefix.pixel_values,
                                             image_token_pooling=prefix.image_token_pooling, state=prefix.state,
                                             state_positions=prefix.state_positions, state_rows=prefix.state_rows,
                                             image_features=prefix.image_features),
                       self.embed(suffix_ids)], dim=1)  # fmt: skip
        joined, types = packing.joined(prefix.mm_token_type_ids)
        positions, mask = self._prefix_attention(None, types, joined)
        Np = packing.prefix_doc.shape[1]
        blocks = self._blocks(extending=False)
        rope = self.transformer.rope(positions)
        with backends_context(BASELINE_BACKENDS):
            for block in blocks[:-1]:
                x, _ = block(x, rope, mask, None, self._fused_swiglu())
        last = len(blocks) - 1
        past = self.transformer.blocks[last].keys_values(x[:, :Np], self.transformer.rope(packing.prefix_pos))
        positions, mask = self._suffix_attention(None, None, packing)
        x, _ = self._blocks(extending=True)[last](
            x[:, Np:], self.transformer.rope(positions), mask, past, self._fused_swiglu()
        )
        return self.transformer.ln_f(x)

    def _packed_path(self) -> str:
        """Where a packed chunk attends: "masks" (its packed row under per-sample masks, pack_attention = "packed")
        or the CUDA kernel of its varlen segments ("flash" or "cudnn")."""
        return VARLEN_KERNELS.get(self.execution.pack_attention, "masks")

    def _prefix_attention(self, attention_mask: torch.Tensor | None, mm_token_type_ids: torch.Tensor,
                          packing: Packing | None) -> tuple[torch.Tensor, Mask]:  # fmt: skip
        """(RoPE positions, attention mask) of a prefix: padded or packed, under the dense rule (SDPA) or its block
        mask (prefix_attention = "flex"); or packed as varlen segments."""
        flex = self.execution.prefix_attention == "flex"
        if packing is None:
            mask = (prefix_block_mask if flex else prefix_attention_mask)(attention_mask, mm_token_type_ids)
            return positions_from_mask(attention_mask), mask
        path = self._packed_path()
        if path == "masks":
            mask = (packed_prefix_block_mask if flex else packed_prefix_mask)(packing, mm_token_type_ids)
            return packing.prefix_pos, mask
        return packing.prefix_pos, packing.segments.prefix.on(path)

    def _suffix_attention(self, attention_mask: torch.Tensor | None, cache: KVCache | None,
                          packing: Packing | None) -> tuple[torch.Tensor, Mask]:  # fmt: skip
        """(RoPE positions, attention mask) of a suffix after `cache`: padded or packed under its dense rule (SDPA,
        whose backends are the P1 site), or packed as varlen segments."""
        if packing is None:
            mask = continuation_mask(cache.key_mask, attention_mask)
            return cache.next_position[:, None] + positions_from_mask(attention_mask), mask
        path = self._packed_path()
        if path == "masks":
            return packing.suffix_pos, packed_suffix_mask(packing)
        return packing.suffix_pos, packing.segments.suffix.on(path)


@torch.no_grad()
def generate(
    model: Molmo2Model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    *,
    pixel_values: torch.Tensor | None = None,
    image_token_pooling: torch.Tensor | None = None,
    max_new_tokens: int,
    stop_id: int | None = None,
) -> torch.Tensor:
    """Greedy continuation of LEFT-padded multimodal prompts: the prompt is encoded once, then one token per step
    against its kept K/V. Returns [B, n] new token ids."""
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("generate needs LEFT-padded prompts: every row's last column must be a real token")
    cache, first = model.prefill(input_ids, attention_mask, mm_token_type_ids, pixel_values=pixel_values,
                                 image_token_pooling=image_token_pooling)  # fmt: skip
    return greedy_decode(model, cache, first, max_new_tokens, stop_id)


@torch.no_grad()
def greedy_decode(model: Molmo2Model, cache: KVCache, first_logits: torch.Tensor, max_new_tokens: int,
                  stop_id: int | None = None) -> torch.Tensor:  # fmt: skip
    """Greedy continuation from a cache whose next-token scores are `first_logits` [B, logits_width]. Decode
    always uses the baseline's backend list (P1 reaches training only, so decode numerics stay fixed). Returns
    [B, n] token ids, n <= max_new_tokens; a row that emitted `stop_id` keeps emitting it, and decoding ends once
    every row has."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens} is invalid; allowed: >= 1")
    token = first_logits.argmax(-1)
    out = [token]
    done = token == stop_id if stop_id is not None else None
    ones = torch.ones_like(token, dtype=torch.bool)[:, None]
    with backends_context(BASELINE_BACKENDS):
        for _ in range(max_new_tokens - 1):
            if done is not None and bool(done.all()):
                break
            hidden, layers = model.extend(token[:, None], ones, cache)
            cache = cache.appended(layers, ones)
            token = model.logits(hidden[:, -1]).argmax(-1)
            if done is not None:
                token = torch.where(done, stop_id, token)
                done = done | (token == stop_id)
            out.append(token)
    return torch.stack(out, dim=1)


@torch.no_grad()
def init_weights(model: Molmo2Model, seed: int, only: tuple[str, ...] | None = None, std: float = 0.02) -> None:
    """The hub's initialisation (normal(0, std) weights and embeddings, zero biases, unit norms), seeded and
    device-agnostic; `state_proj` starts at zero. `only` restricts it to those parameter names (the AR extras
    of a model loaded from a hub checkpoint)."""
    generators: dict[torch.device, torch.Generator] = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if only is not None and full not in only:
                continue
            if isinstance(module, (RMSNorm, nn.LayerNorm)):
                p.fill_(1.0) if name == "weight" else p.zero_()
            elif module is model.state_proj or name == "bias":
                p.zero_()
            else:
                if p.device not in generators:
                    generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
                p.normal_(0.0, std, generator=generators[p.device])
