"""The AR decoder on Molmo2: the prefix (images + prompt + state slot) is encoded once with its K/V kept; the
loss-bearing suffix (aux text, FAST action tokens, end token) attends to prefix + suffix through a dense mask;
losses in mean form and in sum form (for chunked accumulation).

S-bundle sites here: P1, the suffix attention's SDPA backend list, and P3c, the sum-form losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from engine.molmo2.attention.packing import Packing
from engine.molmo2.model.batch import IGNORE_INDEX, ARBatch, PrefixInputs, SuffixInputs
from engine.molmo2.model.model import KVCache, Molmo2Model, greedy_decode
from engine.molmo2.model.text import BASELINE_BACKENDS, backends_context
from engine.molmo2.switches import Switches

# Trainable under the AR recipe: the new FAST rows (embedding and untied head), the decoder blocks, ln_f and the
# state projection. Frozen: both hub embedding tables, the shipped lm_head and the vision tower.
TRAINABLE_PREFIXES = (
    "model.transformer.wte.fast_embed",
    "fast_head.",
    "model.transformer.blocks.",
    "model.transformer.ln_f.",
    "state_proj.",
)


def set_ar_trainable(model: Molmo2Model) -> list[str]:
    """Applies the freezing split; returns the trainable parameter names."""
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(TRAINABLE_PREFIXES))
        if p.requires_grad:
            trainable.append(name)
    return trainable


def suffix_backends(training: bool, switches: Switches) -> tuple[SDPBackend, ...]:
    """P1: cuDNN first, in training mode only. Decode and evaluation keep the baseline's list, so every decode
    byte-anchor stays valid. (Without cuDNN — any CPU — the next entries of the list serve.)"""
    if training and switches.suffix_cudnn:
        return (SDPBackend.CUDNN_ATTENTION, *BASELINE_BACKENDS)
    return BASELINE_BACKENDS


def encode_prefix(model: Molmo2Model, prefix: PrefixInputs, packing: Packing | None = None) -> KVCache:
    """The prefix's K/V per layer, its key mask and each row's next position; its own outputs are never read,
    so the last layer computes only its K/V. Gradients flow back through the kept K/V into the blocks."""
    # A packed prefix without its packing would attend across its samples: pack() sets state_rows, nothing else does.
    assert (packing is None) == (prefix.state_rows is None), "a packed prefix needs its packing (and only it has one)"
    cache, _ = model.prefill(
        prefix.input_ids,
        prefix.attention_mask,
        prefix.mm_token_type_ids,
        pixel_values=prefix.pixel_values,
        image_token_pooling=prefix.image_token_pooling,
        state=prefix.state,
        state_positions=prefix.state_positions,
        state_rows=prefix.state_rows,
        last_logits=False,
        packing=packing,
        image_features=prefix.image_features,
    )
    return cache


def forward_suffix(
    model: Molmo2Model, suffix: SuffixInputs, cache: KVCache, packing: Packing | None = None
) -> torch.Tensor:
    """Suffix logits [B, T, logits_width]: each suffix token attends to the real prefix positions and causally
    to the real suffix positions, through a dense [B, 1, T, P + T] mask — the P1 site."""
    with backends_context(suffix_backends(model.training, model.switches)):
        hidden, _ = model.extend(suffix.input_ids, suffix.attention_mask, cache, packing)
    return model.logits(hidden)


def ar_forward(model: Molmo2Model, batch: ARBatch) -> torch.Tensor:
    if batch.packing is not None and model.execution.pack_one_pass:
        # the suffix's backends (P1) reach its last block; the joined blocks run the prefix's (the baseline's) list
        with backends_context(suffix_backends(model.training, model.switches)):
            hidden = model.joined_suffix_hidden(batch.prefix, batch.suffix.input_ids, batch.packing)
        return model.logits(hidden)
    return forward_suffix(model, batch.suffix, encode_prefix(model, batch.prefix, batch.packing), batch.packing)


@torch.no_grad()
def ar_greedy_decode(
    model: Molmo2Model, prefix: PrefixInputs, start_ids: torch.Tensor, max_new_tokens: int, stop_id: int | None = None
) -> torch.Tensor:
    """Greedy suffix from the encoded prefix, after the teacher-given `start_ids` [B, t0] (the suffix opener
    every row shares, unpadded). Returns [B, n] generated ids."""
    cache = encode_prefix(model, prefix)
    ones = torch.ones_like(start_ids, dtype=torch.bool)
    with backends_context(BASELINE_BACKENDS):
        hidden, layers = model.extend(start_ids, ones, cache)
    return greedy_decode(model, cache.appended(layers, ones), model.logits(hidden[:, -1]), max_new_tokens, stop_id)


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, T] cross-entropy per token; exactly 0.0 where the label is IGNORE_INDEX."""
    B, T, W = logits.shape
    flat = F.cross_entropy(logits.reshape(B * T, W), labels.reshape(B * T), ignore_index=IGNORE_INDEX,
                           reduction="none")  # fmt: skip
    return flat.view(B, T)


def _positions(suffix: SuffixInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    valid = suffix.labels != IGNORE_INDEX
    action = valid & suffix.action_mask
    return valid, action, valid & ~suffix.action_mask


def ar_losses(logits: torch.Tensor, suffix: SuffixInputs) -> dict[str, torch.Tensor]:
    """Mean form (the loss oracles' anchor; no switch touches it): mean CE over the loss-bearing tokens, over
    the action tokens and over the aux-text tokens; an empty group's mean is 0 with its count 0."""
    per_token = _token_losses(logits, suffix.labels)
    valid, action, aux = _positions(suffix)
    n_valid, n_action, n_aux = valid.sum(), action.sum(), aux.sum()
    return {
        "loss": per_token.sum() / n_valid.clamp(min=1),
        "action_loss": (per_token * action).sum() / n_action.clamp(min=1),
        "aux_loss": (per_token * aux).sum() / n_aux.clamp(min=1),
        "n_action": n_action,
        "n_aux": n_aux,
    }


def ar_loss_sums(logits: torch.Tensor, suffix: SuffixInputs, switches: Switches) -> dict[str, torch.Tensor]:
    """Sum form, for accumulation over backward chunks (the caller divides by the step's total counts).

    The baseline (the P3c site) sums through boolean indexing, which syncs with the host (nonzero); P3c sums the
    masked products instead. Cross-entropy is exactly 0.0 at ignored labels, so the two differ only in
    floating-point reduction order."""
    per_token = _token_losses(logits, suffix.labels)
    valid, action, aux = _positions(suffix)
    if switches.masked_loss_sums:
        sums = per_token.sum(), (per_token * action).sum(), (per_token * aux).sum()
    else:
        sums = per_token[valid].sum(), per_token[action].sum(), per_token[aux].sum()
    return {
        "loss_sum": sums[0],
        "action_sum": sums[1],
        "aux_sum": sums[2],
        "n_valid": valid.sum(),
        "n_action": action.sum(),
        "n_aux": aux.sum(),
    }
