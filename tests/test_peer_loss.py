"""Ours and the benchmark's peer optimise the same loss: transformers' Molmo2 with our text vocabulary
(bench/molmo2_peer.py, fast_block=True) and our model on the same weights, the same collated samples (the runner's
own pool at the tiny geometry, where every real suffix position carries a label) and the same labels. The peer's
step loss is its per-chunk mean weighted by the chunk's share of the step's loss-bearing tokens, as
bench/peer_molmo2.py steps it; ours is the trainer's (the chunks' loss sums over the step's count). Compared with
and without `logits_to_keep`, against our padded step and our fastest landed execution (packed, one pass, varlen
segments: the CPU runs their per-segment reference), losses and the decoder's gradients, in fp32."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO
from molmo2_fixtures import make_runner, train_config
from test_molmo2_parity import hub_state_from_tfm

from engine.molmo2.attention.execution import Execution
from engine.molmo2.attention.packing import pack
from engine.molmo2.model.config import Molmo2Config
from engine.molmo2.model.model import Molmo2Model
from engine.molmo2.train.step import Trainer, prepare_step

sys.path.insert(0, str(REPO / "bench"))
from molmo2_peer import transformers_config, transformers_inputs  # noqa: E402

tfm = pytest.importorskip("transformers.models.molmo2")

# fp32 on the CPU, two decoder layers: the two implementations differ only in op order (measured: 5e-7 on the
# loss, 8e-7 of the largest gradient entry). Wrapping the longest row's last label away (one label a chunk) moves
# the loss by 4e-3.
LOSS_ATOL = 5e-6
GRAD_RTOL = 1e-5


def peer_model(config: Molmo2Config) -> "tfm.Molmo2ForConditionalGeneration":
    """The peer with every parameter random (norms around 1, non-zero biases), trained as the benchmark trains it:
    the decoder layers and the final norm."""
    model = tfm.Molmo2ForConditionalGeneration(transformers_config(config, "sdpa", fast_block=True)).train()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
            p.requires_grad_(
                ".layers." in name and "language_model" in name or name.endswith("language_model.norm.weight")
            )
    return model


def ours_state(tfm_state: dict[str, torch.Tensor], config: Molmo2Config) -> dict[str, torch.Tensor]:
    """The peer's tensors under our names: the hub's mapping, with the embedding table and the head cut where
    the FAST block sits in the peer's vocabulary (base rows, FAST block, specials)."""
    V, F = config.text.vocab_size, config.fast_vocab_size
    out = hub_state_from_tfm(tfm_state, config)
    embed, head = tfm_state["model.language_model.embed_tokens.weight"], tfm_state["lm_head.weight"]
    out["model.transformer.wte.embedding"] = embed[:V]
    out["model.transformer.wte.fast_embed"] = embed[V : V + F]
    out["model.transformer.wte.new_embedding"] = embed[V + F :]
    out["lm_head.weight"], out["fast_head.weight"] = head[:V], head[V:]
    return out


def our_model(peer, config: Molmo2Config, execution: Execution) -> Molmo2Model:
    model = Molmo2Model(config)
    missing, unexpected = model.load_state_dict(ours_state(peer.state_dict(), config), strict=False)
    assert sorted(missing) == ["state_proj.bias", "state_proj.weight"] and not unexpected
    with torch.no_grad():  # the peer has no state slot; ours starts with a zero projection (init_weights)
        model.state_proj.weight.zero_()
        model.state_proj.bias.zero_()
    model.set_execution(execution)
    return model


def our_step(model: Molmo2Model, step) -> tuple[float, dict[str, torch.Tensor]]:
    trainer = Trainer(model, train_config(batch=4, backward_chunks=len(step.chunks)), torch.device("cpu"))
    loss = float(trainer.accumulate_gradients(step))
    return loss, {name: p.grad for name, p in model.named_parameters() if name.startswith("model.transformer.")}


def peer_step(peer, chunks, config: Molmo2Config, logits_to_keep: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """bench/peer_molmo2.py's step: each chunk's mean loss times its share of the step's loss-bearing tokens."""
    peer.zero_grad(set_to_none=True)
    total = sum(int((c.suffix.labels >= 0).sum()) for c in chunks)
    loss = 0.0
    for chunk in chunks:
        out = peer(**transformers_inputs(chunk, config, logits_to_keep=logits_to_keep), use_cache=False)
        share = out.loss * (int((chunk.suffix.labels >= 0).sum()) / total)
        share.backward()
        loss += float(share.detach())
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in peer.named_parameters()}
    return loss, hub_state_from_tfm(grads, config)


@pytest.fixture(scope="module")
def setup():
    runner = make_runner(batch=4, backward_chunks=2)
    runner.load_data()
    step = runner.pool[0]  # two chunks of two samples, padded
    samples = [runner.train_data.sample(i) for i in range(4)]  # the same four samples, as one packed chunk
    packed = prepare_step([pack(runner.collator(samples))], torch.device("cpu"))
    assert packed.loss_tokens == step.loss_tokens
    # every real suffix position carries a label, the longest row's last column included
    assert all(bool((c.suffix.labels >= 0).eq(c.suffix.attention_mask).all()) for c in step.chunks)
    return runner.config, step, packed, peer_model(runner.config)


@pytest.mark.parametrize("logits_to_keep", [True, False], ids=["logits_to_keep", "all-logits"])
def test_the_peer_and_our_padded_step_optimise_the_same_loss(setup, logits_to_keep):
    config, step, _, peer = setup
    theirs, their_grads = peer_step(peer, step.chunks, config, logits_to_keep)
    ours, our_grads = our_step(our_model(peer, config, Execution()), step)
    assert abs(theirs - ours) <= LOSS_ATOL, (theirs, ours)
    assert_same_decoder_gradients(our_grads, their_grads, config)


def test_the_peer_and_our_fastest_landed_execution_optimise_the_same_loss(setup):
    config, step, packed, peer = setup
    theirs, their_grads = peer_step(peer, step.chunks, config, logits_to_keep=True)
    execution = Execution(pack_attention="varlen-cudnn", pack_one_pass=True)
    ours, our_grads = our_step(our_model(peer, config, execution), packed)
    assert abs(theirs - ours) <= LOSS_ATOL, (theirs, ours)
    assert_same_decoder_gradients(our_grads, their_grads, config)


def assert_same_decoder_gradients(ours: dict, theirs: dict, config: Molmo2Config) -> None:
    names = [n for n in ours if n.startswith(("model.transformer.blocks.", "model.transformer.ln_f."))]
    assert len(names) == 8 * config.text.num_layers + 1  # every block's weights and norms, and ln_f
    for name in names:
        scale = float(theirs[name].abs().max())
        assert scale > 0, name
        assert float((ours[name] - theirs[name]).abs().max()) <= GRAD_RTOL * scale, name
