"""X10, the trainable linears' weights in bf16 over fp32 masters in the optimizer: moving in and out keeps every
weight, moment and step exactly; checkpoints and decoding read the masters; the CPU, several chunks and a missing
gradient are refused with the fix; on CUDA the fused update is clip_grad_norm_ and torch's AdamW to fp32 rounding,
its bf16 weights are the masters rounded, and the first step of a tiny model is the baseline's."""

from __future__ import annotations

import math

import pytest
import torch
from molmo2_fixtures import data_pool, make_runner, tiny_model, train_config

from engine.molmo2.attention.execution import Execution
from engine.molmo2.switches import Switches
from engine.molmo2.train.master_adamw import ALIGN, BLOCK, MasterAdamW, shadowed_names, shadowed_parameters
from engine.molmo2.train.step import ADAM_BETAS, Trainer

X10 = Switches(bf16_linear_weights=True)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def pool():
    return data_pool(batch=4, backward_chunks=1)


def _trained(pool, steps: int = 2) -> Trainer:
    """A CPU trainer a few steps in: torch AdamW holds moments and a step count."""
    model = tiny_model(seed=5)
    trainer = Trainer(model, train_config(batch=4, backward_chunks=1), torch.device("cpu"))
    for step in pool[:steps]:
        trainer.step(step)
    return trainer


def test_the_shadowed_parameters_are_exactly_the_trainable_linears_weights():
    model = tiny_model()
    Trainer(model, train_config(batch=4, backward_chunks=1), torch.device("cpu"))  # applies the freezing split
    names = shadowed_names(model)
    assert names and all(name.endswith(".weight") for name in names)
    assert "fast_head.weight" in names and "lm_head.weight" not in names  # the base head is frozen
    assert not any("vision_backbone" in name or "norm" in name for name in names)
    assert all(dict(model.named_parameters())[name].ndim == 2 for name in names)


def test_moving_in_keeps_weights_moments_and_step_and_rounds_like_autocast(pool):
    trainer = _trained(pool)
    model, adamw = trainer.model, trainer.optimizer
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    moments = {p: (s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for p, s in adamw.state.items()}
    shadowed = shadowed_parameters(model)
    master = MasterAdamW.from_adamw(adamw, shadowed)
    assert master.steps == 2
    names = {p: name for name, p in model.named_parameters()}
    for bucket in master.buckets:
        for i, p in enumerate(bucket.params):
            name = names[p]
            assert torch.equal(bucket.view(bucket.master, i), before[name])  # the master is the fp32 weight
            assert torch.equal(bucket.view(bucket.exp_avg, i), moments[p][0])
            assert torch.equal(bucket.view(bucket.exp_avg_sq, i), moments[p][1])
            assert bucket.offsets[i] % ALIGN == 0
            if bucket.shadowed:
                assert p.dtype == torch.bfloat16 and torch.equal(p, before[name].to(torch.bfloat16))
                assert p.data_ptr() == bucket.view(bucket.shadow, i).data_ptr()
            else:
                assert p.dtype == torch.float32 and p.data_ptr() == bucket.view(bucket.master, i).data_ptr()
    # every block lies in one tensor and they tile it
    for bucket in master.buckets:
        counts = torch.bincount(bucket.block_tensor.long(), minlength=len(bucket.params)).tolist()
        assert counts == [math.ceil(p.numel() / BLOCK) for p in bucket.params]


def test_moving_out_restores_fp32_parameters_and_adamws_state_exactly(pool):
    trainer = _trained(pool)
    model = trainer.model
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    moments = {id(p): s["exp_avg_sq"].clone() for p, s in trainer.optimizer.state.items()}
    master = MasterAdamW.from_adamw(trainer.optimizer, shadowed_parameters(model))
    states = master.release()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32 and torch.equal(p, before[name])
            assert p.untyped_storage().nbytes() == p.numel() * 4  # its own storage, not a view of a flat buffer
            assert float(states[p]["step"]) == 2.0 and torch.equal(states[p]["exp_avg_sq"], moments[id(p)])


def test_the_state_dict_is_adamws_and_loads_back(pool):
    trainer = _trained(pool)
    reference = trainer.optimizer.state_dict()
    master = MasterAdamW.from_adamw(trainer.optimizer, shadowed_parameters(trainer.model))
    saved = master.state_dict()
    assert saved["state"].keys() == reference["state"].keys()
    for index, entry in reference["state"].items():
        assert set(saved["state"][index]) == set(entry)
        assert float(saved["state"][index]["step"]) == float(entry["step"])
        assert torch.equal(saved["state"][index]["exp_avg"], entry["exp_avg"])
    for bucket in master.buckets:
        bucket.exp_avg.zero_()
    master.steps = 0
    master.load_state_dict(saved)
    assert master.steps == 2
    again = master.state_dict()
    assert all(torch.equal(again["state"][i]["exp_avg"], e["exp_avg"]) for i, e in reference["state"].items())


def test_the_masters_context_gives_fp32_weights_and_writes_reach_the_bf16_copy(pool):
    trainer = _trained(pool, steps=1)
    master = MasterAdamW.from_adamw(trainer.optimizer, shadowed_parameters(trainer.model))
    weight = trainer.model.fast_head.weight
    with master.masters():
        assert weight.dtype == torch.float32
        with torch.no_grad():
            weight.fill_(0.3)
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, torch.full_like(weight, 0.3))


def test_every_change_of_the_weights_dtype_drops_the_compiled_graphs(pool):
    """A graph compiled for fp32 weights must never run on their bf16 copies (nor the reverse): moving in, each
    way through the masters' context, and moving out each make the next compiled call compile again."""
    compiles = []

    def backend(graph, inputs):
        compiles.append(len(inputs))
        return graph.forward

    doubled = torch.compile(lambda x: x * 2, backend=backend)
    x = torch.ones(3)
    doubled(x)
    doubled(x)
    assert len(compiles) == 1  # cached
    trainer = _trained(pool, steps=1)
    master = MasterAdamW.from_adamw(trainer.optimizer, shadowed_parameters(trainer.model))
    doubled(x)
    assert len(compiles) == 2
    with master.masters():
        doubled(x)
        assert len(compiles) == 3
    doubled(x)
    assert len(compiles) == 4
    master.release()
    doubled(x)
    assert len(compiles) == 5


def test_a_checkpoint_and_a_decode_read_the_masters(tmp_path):
    """With the linears in bf16, `runner.save` writes the fp32 masters (not their bf16 copies) and a training state
    plain AdamW resumes from; the fp32 decode runs on the masters too (bf16 weights would not multiply fp32
    activations on the CPU), and the bf16 weights are back after each."""
    from engine.molmo2.model.checkpoint import load_checkpoint
    from engine.molmo2.train.distributed import OPTIMIZER_STATE, load_training_state, resume_unsharded

    runner = make_runner(batch=4, backward_chunks=1)
    runner.load()
    runner.trainer.step(runner.pool[0])
    trainer = runner.trainer
    trainer.optimizer = MasterAdamW.from_adamw(
        trainer.optimizer, shadowed_parameters(trainer.model)
    )  # X10's conversion
    bucket = next(b for b in trainer.optimizer.buckets if b.shadowed and trainer.model.fast_head.weight in b.params)
    master = bucket.view(bucket.master, bucket.params.index(trainer.model.fast_head.weight)).clone()
    assert not torch.equal(master, master.to(torch.bfloat16).float())  # the test tells the two apart
    runner.save(str(tmp_path))
    saved = load_checkpoint(tmp_path, runner.config)
    assert saved.fast_head.weight.dtype == torch.float32 and torch.equal(saved.fast_head.weight, master)
    assert trainer.model.fast_head.weight.dtype == torch.bfloat16
    plain = Trainer(saved, train_config(batch=4, backward_chunks=1), torch.device("cpu"))
    resume_unsharded(plain, load_training_state(str(tmp_path / OPTIMIZER_STATE)))
    assert plain.steps_done == 1 and float(plain.optimizer.state[saved.fast_head.weight]["step"]) == 1.0
    assert runner.decode([runner.eval_data.sample(0)])
    assert trainer.model.fast_head.weight.dtype == torch.bfloat16


def test_x10_refuses_the_cpu_and_several_chunks_with_the_fix(pool):
    model = tiny_model(seed=3)
    model.switches = X10
    trainer = Trainer(model, train_config(batch=4, backward_chunks=1), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"bf16_linear_weights \(X10\) .*Triton.*trains on cpu.*CUDA profile"):
        trainer.step(pool[0])
    runner = make_runner(batch=4, backward_chunks=2)
    runner.load()
    runner.model.switches = X10
    with pytest.raises(ValueError, match="backward_chunks = 2 would sum the chunks' gradients in bf16"):
        runner.trainer.step(runner.pool[0])


def test_the_update_refuses_a_missing_gradient_and_the_cpu(pool):
    trainer = _trained(pool, steps=1)
    master = MasterAdamW.from_adamw(trainer.optimizer, shadowed_parameters(trainer.model))
    trainer.model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="has no gradient this step; X10 updates every trainable"):
        master.clip_and_step(1.0)
    for p in trainer.trainable:
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="CUDA only; these parameters are on cpu"):
        master.clip_and_step(1.0)


def test_x10s_probe_on_the_cpu_says_why_it_switches_nothing():
    runner = make_runner(batch=4, backward_chunks=1)
    runner.load()
    observed = runner.probe("one_step", "bf16_linear_weights", {})
    assert "trains on the CPU in fp32" in observed["error"]


# ---- CUDA ----


def _reference_step(params, grads, lr, max_norm, steps, betas=ADAM_BETAS):
    """clip_grad_norm_ and torch's fused AdamW (weight decay 0.01, its default) on fp32 copies: what X10's kernels
    must reproduce."""
    ref = [p.detach().clone().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW([{"params": ref, "lr": lr}], betas=betas, weight_decay=0.01, fused=True)
    norms = []
    for step_grads in grads[:steps]:
        for r, g in zip(ref, step_grads):
            r.grad = g.float().clone()
        norms.append(torch.nn.utils.clip_grad_norm_(ref, max_norm))
        opt.step()
    return ref, norms


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("max_norm", [1e-3, 1e3], ids=["clipping", "not-clipping"])
def test_the_fused_update_is_clip_and_adamw_and_its_bf16_weights_are_the_masters_rounded(max_norm):
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(3 * BLOCK + 5, 7), (BLOCK,), (17, 3), (1,)]  # several blocks with a tail, exactly one, tiny
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda")) for s in shapes]
    shadowed = {params[0], params[2]}
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn(s, generator=g, device="cuda") for s in shapes] for _ in range(3)]
    grads = [[x.to(torch.bfloat16) if p in shadowed else x for x, p in zip(step, params)] for step in grads]
    adamw = torch.optim.AdamW([{"params": params, "lr": 1e-2}], betas=ADAM_BETAS, weight_decay=0.01, fused=True)
    master = MasterAdamW.from_adamw(adamw, shadowed)
    norms = []
    for step_grads in grads:
        for p, x in zip(params, step_grads):
            p.grad = x.clone()
        # a gradient that is a view into a larger one (as a cat's backward leaves), off the allocator's alignment
        wide = torch.empty(params[2].numel() + 3, dtype=torch.bfloat16, device="cuda")
        params[2].grad = wide[3:].view(params[2].shape).copy_(step_grads[2])
        norms.append(master.clip_and_step(max_norm))
    ref, ref_norms = _reference_step(start, grads, 1e-2, max_norm, 3)
    for a, b in zip(norms, ref_norms):
        assert math.isclose(float(a), float(b), rel_tol=1e-5)
    for bucket in master.buckets:
        for i, p in enumerate(bucket.params):
            r = ref[next(j for j, q in enumerate(params) if q is p)].detach()
            torch.testing.assert_close(bucket.view(bucket.master, i), r, rtol=1e-5, atol=1e-6)  # fp32 rounding
            if bucket.shadowed:
                assert torch.equal(p, bucket.view(bucket.master, i).to(torch.bfloat16))


@pytest.mark.gpu
@cuda
def test_a_planted_fault_in_the_update_is_caught():
    """The comparison above can fail: a beta2 the reference does not use moves the masters past its tolerance."""
    g = torch.Generator(device="cuda").manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(BLOCK + 3, generator=g, device="cuda"))]
    start = [params[0].detach().clone()]
    grads = [[torch.randn(BLOCK + 3, generator=g, device="cuda")] for _ in range(3)]
    adamw = torch.optim.AdamW([{"params": params, "lr": 1e-2}], betas=(0.9, 0.5), weight_decay=0.01, fused=True)
    master = MasterAdamW.from_adamw(adamw, set())
    for (x,) in grads:
        params[0].grad = x.clone()
        master.clip_and_step(1e3)
    ref, _ = _reference_step(start, grads, 1e-2, 1e3, 3)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(master.buckets[0].master, ref[0].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@cuda
def test_compiled_blocks_follow_the_weights_dtype_back_and_forth_on_cuda(pool):
    """The gate's order: a compiled baseline step, then X10's from the same weights, then the baseline's again.
    A graph compiled for one dtype run on the other reads past a bf16 weight's end (an illegal address at 4B)."""
    step = pool[0]
    step = step.__class__(tuple(c.to("cuda") for c in step.chunks), step.loss_tokens, step.useful_tokens)
    model = tiny_model(seed=3).cuda()
    model.set_execution(Execution(compile=True))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    losses, trainer = [], None
    for switches in (Switches(), X10, Switches()):
        if trainer is not None:
            trainer.release_weights()
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        model.switches = switches
        trainer = Trainer(model, train_config(batch=4, backward_chunks=1), torch.device("cuda"))
        losses.append(float(trainer.step(step)[0]))
        trainer.settle()
        torch.cuda.synchronize()
    assert all(math.isfinite(v) for v in losses)
    assert losses[2] == losses[0]  # the baseline's graph again, on fp32 weights again
    assert abs(losses[1] - losses[0]) < 1e-2


@pytest.mark.gpu
@cuda
def test_the_first_step_is_the_baselines_and_the_curves_stay_together_on_cuda(pool):
    steps = [s.__class__(tuple(c.to("cuda") for c in s.chunks), s.loss_tokens, s.useful_tokens) for s in pool]

    def run(switches: Switches):
        model = tiny_model(seed=3).cuda()
        model.switches = switches
        trainer = Trainer(model, train_config(batch=4, backward_chunks=1), torch.device("cuda"))
        losses = []
        for index, step in enumerate(steps * 2):
            loss, _ = trainer.step(step)
            losses.append(float(loss))
            if index == 0:
                grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        trainer.settle()
        return losses, grads

    base_losses, base_grads = run(Switches())
    losses, grads = run(X10)
    assert losses[0] == base_losses[0]  # the same forward: bf16 weights are autocast's own cast
    assert grads.keys() == base_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base_grads[name], rtol=2e-2, atol=1e-5)  # bf16 sums where a weight is reused
    assert max(abs(a - b) for a, b in zip(losses, base_losses)) < 1e-2
