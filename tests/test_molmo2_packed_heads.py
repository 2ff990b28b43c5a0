"""X12, a packed row's full varlen calls with each key head's query heads packed into one head of group x the rows
(attention/segments.py packed_heads_call): the packing is a permutation with an exact inverse; a packed call is the
grouped call to fp64 rounding, output and gradients, and a packing that mixes the groups is caught; a training step
with the switch is the baseline's to fp32 rounding and evaluation ignores it; the switch is refused where no varlen
call runs. On CUDA the cuDNN call packed is the grouped one to bf16 rounding, and a compiled bf16 step with X12 is
as close to the fp32 padded step as the one without."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from molmo2_fixtures import make_batch, make_runner, tiny_config, tiny_model
from test_molmo2_execution import MORE_ROWS, _max_logit_diff, _worst_grad

from engine.molmo2.attention.execution import Execution
from engine.molmo2.attention.packing import pack
from engine.molmo2.attention.segments import (
    pack_query_heads,
    packed_heads_call,
    unpack_query_heads,
    varlen_call,
)
from engine.molmo2.model.ar import ar_forward, ar_loss_sums
from engine.molmo2.switches import BASELINE, Switches

X12 = Switches(packed_query_heads=True)


@pytest.fixture(scope="module")
def packed():
    return pack(make_batch(tiny_config(), MORE_ROWS, seed=13), (16, 16))


@given(
    nq=st.integers(1, 9),
    kv_heads=st.integers(1, 4),
    group=st.integers(1, 4),
    d=st.integers(1, 5),
)
def test_packing_is_a_permutation_whose_rows_are_each_key_heads_query_heads(nq, kv_heads, group, d):
    q = torch.randn(nq, kv_heads * group, d)
    rows = pack_query_heads(q, kv_heads)
    assert rows.shape == (nq * group, kv_heads, d)
    for t in range(nq):
        for j in range(kv_heads):
            for g in range(group):
                assert torch.equal(rows[t * group + g, j], q[t, j * group + g])
    assert torch.equal(unpack_query_heads(rows, kv_heads * group), q)


def _full_call_inputs(plan, heads: int, kv_heads: int, d: int):
    call = next(c for c in plan.calls if not c.causal)
    g = torch.Generator().manual_seed(0)
    nq, nk = call.queries.shape[0], call.keys.shape[0]
    leaves = [torch.randn(n, h, d, generator=g, dtype=torch.float64) for n, h in
              ((nq, heads), (nk, kv_heads), (nk, kv_heads))]  # fmt: skip
    return call, leaves, torch.randn(nq, heads, d, generator=g, dtype=torch.float64)


def test_a_packed_full_call_is_the_grouped_call_and_a_packing_across_groups_is_caught(packed):
    """On the CPU's per-segment reference in fp64: output and the three gradients to 1e-12. The planted fault packs
    query head h under key head h % kv_heads (the groups interleaved, not contiguous): each query then reads
    another key head, and the output moves by far more than rounding."""
    call, leaves, do = _full_call_inputs(packed.packing.segments.joined, heads=8, kv_heads=2, d=4)
    inputs = [t.clone().requires_grad_() for t in leaves]
    grouped = varlen_call(*inputs, call)
    grouped_grads = torch.autograd.grad(grouped, inputs, do)
    inputs = [t.clone().requires_grad_() for t in leaves]
    out = packed_heads_call(*inputs, call, "flash")  # the CPU runs its reference whatever the CUDA kernel
    grads = torch.autograd.grad(out, inputs, do)
    torch.testing.assert_close(out, grouped, rtol=0, atol=1e-12)
    for grad, reference in zip(grads, grouped_grads):
        torch.testing.assert_close(grad, reference, rtol=0, atol=1e-12)

    q, k, v = leaves
    nq, heads, d = q.shape
    interleaved = q.view(nq, 4, 2, d).reshape(nq * 4, 2, d)  # row t * 4 + g holds heads 2g and 2g + 1: h % 2 = j
    wrong = varlen_call(interleaved, k, v, _packed(call, 4)).view(nq, 4, 2, d).reshape(nq, heads, d)
    assert float((wrong - grouped.detach()).abs().max()) > 1e-2


def _packed(call, group: int):
    from dataclasses import replace

    return replace(call, cu_q=call.cu_q * group, max_q=call.max_q * group)


def test_a_causal_call_is_never_packed(packed):
    call = next(c for c in packed.packing.segments.joined.calls if c.causal)
    q, k, v = torch.zeros(call.queries.shape[0], 4, 2), *(torch.zeros(call.keys.shape[0], 2, 2) for _ in range(2))
    with pytest.raises(AssertionError, match="causal band"):
        packed_heads_call(q, k, v, call, "flash")


def _step(batch, switches: Switches, execution: Execution, device: str = "cpu"):
    model = tiny_model(seed=5, switches=switches).to(device).train()
    model.set_execution(execution)
    b = batch.to(device)
    logits = ar_forward(model, b)
    loss = ar_loss_sums(logits, b.suffix, BASELINE)["loss_sum"]
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        evaluated = ar_forward(model, b)
    return logits.detach().float().cpu(), float(loss.detach()), grads, evaluated.float().cpu()


@pytest.mark.parametrize("one_pass", [False, True], ids=["two-pass", "one-pass"])
def test_a_training_step_with_x12_is_the_baselines_and_evaluation_ignores_it(packed, one_pass, monkeypatch):
    """The varlen segments on the CPU's reference, the tiny model's GQA 4:2: logits, loss and every gradient to fp32
    rounding, with the full calls of every block packed (and only in training); in evaluation the output is the
    baseline's, bitwise."""
    from engine.molmo2.attention import segments

    calls = []

    def counted(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return packed_heads_call(*args, **kwargs)

    monkeypatch.setattr(segments, "packed_heads_call", counted)
    execution = Execution(pack_attention="varlen", pack_one_pass=one_pass)
    base_logits, base_loss, base_grads, base_eval = _step(packed, BASELINE, execution)
    assert calls == []
    logits, loss, grads, evaluated = _step(packed, X12, execution)
    blocks = tiny_config().text.num_layers
    # A full call in every block but the last, whose prefix computes only keys and values (the suffix has no image
    # runs); none in evaluation.
    assert calls == [True] * (blocks - 1)
    assert _max_logit_diff(base_logits, logits) <= 1e-5
    assert abs(loss - base_loss) <= 1e-6 * abs(base_loss)
    name, diff = _worst_grad(base_grads, grads)
    assert diff <= 1e-5, name
    assert torch.equal(evaluated, base_eval)


@pytest.mark.parametrize("probe", ["one_step", "loss_curve"])
def test_x12s_probes_where_no_varlen_call_runs_say_why_they_switch_nothing(probe):
    runner = make_runner(batch=4, backward_chunks=1, pack=True, pack_attention="packed")
    runner.load()
    assert "runs none" in runner.probe(probe, "packed_query_heads", {"steps": 2})["error"]


def test_x12_is_refused_on_a_rung_where_no_varlen_call_runs():
    """As a rung's item (a baseline switch is the run config's rule, tests/test_run_config.py)."""
    runner = make_runner(pack=True, pack_attention="packed")
    runner.load()
    with pytest.raises(ValueError, match="packed_query_heads .*pack_attention = 'varlen-cudnn'"):
        runner.set_switches(("packed_query_heads",))


# ---- CUDA ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_packed_cudnn_call_is_the_grouped_one_to_bf16_rounding(packed):
    """The full call of a joined plan at 32:8 heads of 128 (the 4B's), bf16 on cuDNN, packed against grouped:
    output and gradients within 2**-6 of values of order 1 (another order of the key gradients' fp32 sums, then one
    bf16 rounding: at most a step or two of bf16), and each no further from the fp64 reference than grouped is,
    twice over."""
    pytest.importorskip("cudnn", reason="varlen-cudnn needs nvidia-cudnn-frontend (bench/device_env.sh installs it)")
    call, leaves, do = _full_call_inputs(packed.packing.segments.joined, heads=32, kv_heads=8, d=128)
    exact_inputs = [t.clone().requires_grad_() for t in leaves]
    exact = varlen_call(*exact_inputs, call)
    runs = {"exact": [exact, *torch.autograd.grad(exact, exact_inputs, do)]}
    cuda_call = call.to("cuda")
    for name, run in (("grouped", lambda *t: varlen_call(*t, cuda_call, "cudnn")),
                      ("packed", lambda *t: packed_heads_call(*t, cuda_call, "cudnn"))):  # fmt: skip
        inputs = [t.to("cuda", torch.bfloat16).requires_grad_() for t in leaves]
        out = run(*inputs)
        runs[name] = [t.double().cpu() for t in (out, *torch.autograd.grad(out, inputs, do.to("cuda", torch.bfloat16)))]
    for index, name in enumerate(("o", "dq", "dk", "dv")):
        exact, grouped, packed_ = runs["exact"][index], runs["grouped"][index], runs["packed"][index]
        scale = max(1.0, float(exact.abs().max()))
        assert float((packed_ - grouped).abs().max()) <= 2**-6 * scale, name
        assert float((packed_ - exact).abs().max()) <= 2 * float((grouped - exact).abs().max()) + 1e-3, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_compiled_bf16_step_with_x12_is_as_close_to_fp32_as_without(packed):
    """One-pass varlen on cuDNN, compiled, under bf16 autocast, with and without X12, each against the fp32 padded
    reference (eager SDPA on the CPU's rule, on CUDA): X12's logit and gradient errors at most twice the landed
    path's, plus 1e-3."""
    pytest.importorskip("cudnn", reason="varlen-cudnn needs nvidia-cudnn-frontend (bench/device_env.sh installs it)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    padded = make_batch(tiny_config(), MORE_ROWS, seed=13)
    reference = _step(padded, BASELINE, Execution(), "cuda")
    execution = Execution(compile=True, pack_attention="varlen-cudnn", pack_one_pass=True)
    runs = {}
    for name, switches in (("landed", BASELINE), ("x12", X12)):
        with torch.autocast("cuda", torch.bfloat16):
            runs[name] = _step(packed, switches, execution, "cuda")
    real = padded.suffix.attention_mask.bool()
    n = int(real.sum())
    logit_error = {name: _max_logit_diff(reference[0][real], run[0][0, :n]) for name, run in runs.items()}
    assert logit_error["x12"] <= 2 * logit_error["landed"] + 1e-3, logit_error
    grad_error = {name: _worst_grad(reference[2], run[2])[1] for name, run in runs.items()}
    assert grad_error["x12"] <= 2 * grad_error["landed"] + 1e-3, grad_error
