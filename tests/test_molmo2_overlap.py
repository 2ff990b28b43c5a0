"""X7, the optimizer update on a second CUDA stream under the next step's frozen-ViT forward: the features computed
ahead give the logits the embedding would have computed, bitwise; on CUDA the overlapped run's losses and weights
are the baseline's, bitwise, step after step; the CPU and several ranks refuse it with the fix, and its probe says
why it cannot take effect on the CPU rather than passing vacuously."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from molmo2_fixtures import data_pool, make_runner, tiny_model, train_config

from engine.molmo2.model.ar import ar_forward
from engine.molmo2.switches import BASELINE, Switches
from engine.molmo2.train.step import Step, Trainer

X7 = Switches(optimizer_overlaps_vision=True)


@pytest.fixture(scope="module")
def pool():
    return data_pool(batch=4, backward_chunks=2)


def test_features_computed_ahead_are_the_embeddings_own(pool):
    model = tiny_model(seed=3).train()
    chunk = pool[0].chunks[0]
    features = model.image_features(chunk.prefix.pixel_values, chunk.prefix.image_token_pooling)
    ahead = dataclasses.replace(chunk, prefix=dataclasses.replace(chunk.prefix, image_features=features))
    assert torch.equal(ar_forward(model, ahead), ar_forward(model, chunk))


def test_x7_refuses_the_cpu_with_the_fix(pool):
    model = tiny_model(seed=3)
    model.switches = X7
    trainer = Trainer(model, train_config(batch=4, backward_chunks=2), torch.device("cpu"))
    trainer.accumulate_gradients(pool[0])
    with pytest.raises(ValueError, match="optimizer_overlaps_vision .*second CUDA stream.*CUDA profile with one rank"):
        trainer.update()


def test_x7s_probe_on_the_cpu_says_why_it_switches_nothing():
    runner = make_runner(batch=4, backward_chunks=1)
    runner.load()
    observed = runner.probe("loss_curve", "optimizer_overlaps_vision", {"steps": 2})
    assert "one timeline" in observed["error"]


def _on_cuda(step: Step) -> Step:
    return Step(tuple(c.to("cuda") for c in step.chunks), step.loss_tokens, step.useful_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_overlapped_update_is_the_baselines_bitwise_on_cuda(pool):
    steps = [_on_cuda(s) for s in pool] * 2  # two chunks a step: the second chunk's tower runs after the wait

    def train(switches: Switches):
        model = tiny_model(seed=3).to("cuda")
        model.switches = switches
        trainer = Trainer(model, train_config(batch=4, backward_chunks=2), torch.device("cuda"))
        losses, in_flight = [], []
        for step in steps:
            losses.append(trainer.step(step)[0])
            in_flight.append(trainer.update_in_flight is not None)
        trainer.settle()
        weights = {name: p.detach().cpu() for name, p in model.named_parameters()}
        return [float(v) for v in losses], weights, in_flight

    losses_a, weights_a, in_flight_a = train(BASELINE)
    losses_aa, weights_aa, _ = train(BASELINE)
    # the claim below needs a deterministic baseline at this geometry: two baseline runs agree bitwise
    assert losses_aa == losses_a and all(torch.equal(weights_aa[n], w) for n, w in weights_a.items())
    losses_b, weights_b, in_flight_b = train(X7)
    assert not any(in_flight_a) and all(in_flight_b)  # X7 left every update running past its step
    assert losses_b == losses_a
    assert all(torch.equal(weights_b[n], w) for n, w in weights_a.items())
