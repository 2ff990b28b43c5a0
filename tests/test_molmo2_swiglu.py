"""X11, the decoder MLP's SwiGLU as one op each way: its gradient is silu(gate) * up's (fp64 gradcheck), its output
and gradient are the baseline MLP's to fp32 rounding, a swapped [up, gate] layout is caught, a training step with
the switch is the baseline's, and evaluation ignores it; on CUDA the Triton kernels are the reference arithmetic,
eager and inside a compiled block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from molmo2_fixtures import data_pool, tiny_model, train_config
from torch.utils._python_dispatch import TorchDispatchMode

from engine.molmo2.model.swiglu import reference_backward, reference_forward, swiglu_down
from engine.molmo2.model.text import MLP
from engine.molmo2.switches import Switches
from engine.molmo2.train.step import Trainer

X11 = Switches(fused_swiglu=True)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _baseline(u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    up, gate = u.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)


def test_the_ops_gradients_are_the_derivatives_of_the_baseline():
    u = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_down, (u, weight))
    grad = torch.randn(3, 5, 4, dtype=torch.float64)
    ours = torch.autograd.grad(swiglu_down(u, weight), (u, weight), grad)
    baseline = torch.autograd.grad(_baseline(u, weight), (u, weight), grad)
    for a, b in zip(ours, baseline):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_in_fp32_the_op_is_the_baseline_to_rounding_and_a_swapped_layout_is_caught():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(64, 40, generator=g, requires_grad=True)
    weight = torch.randn(24, 20, generator=g, requires_grad=True)
    grad = torch.randn(64, 24, generator=g)
    out = swiglu_down(u, weight)
    ours = torch.autograd.grad(out, (u, weight), grad)
    base = _baseline(u, weight)
    baseline = torch.autograd.grad(base, (u, weight), grad)
    torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-5)
    for a, b in zip(ours, baseline):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the checkpoint's order is [up, gate]: the usual [gate, up] reading is a different function
    swapped = torch.cat(u.detach().chunk(2, dim=-1)[::-1], dim=-1)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(swiglu_down(swapped, weight), base, rtol=1e-3, atol=1e-3)


def _saved_for_backward(mlp: MLP, x: torch.Tensor, fused: bool) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        mlp(x, fused)
    return saved


def test_the_op_keeps_only_the_projection_and_the_weight_for_the_backward():
    """Where the baseline also keeps h = silu(gate) * up (ff_out's input) for ff_out's weight gradient, X11 writes h
    again in its backward."""
    mlp = tiny_model().transformer.blocks[0].mlp
    x = torch.randn(2, 5, mlp.ff_proj.in_features)
    u_shape = (2, 5, mlp.ff_proj.out_features)
    h_shape = (2, 5, mlp.ff_out.in_features)
    fused = _saved_for_backward(mlp, x, True)
    baseline = _saved_for_backward(mlp, x, False)
    assert [tuple(t.shape) for t in fused if t.dim() == 3] == [u_shape]  # the projection, once
    assert any(t.data_ptr() == mlp.ff_out.weight.data_ptr() for t in fused)
    assert h_shape in [tuple(t.shape) for t in baseline]  # the check can fail: the baseline keeps h (and up, gate)


def test_the_halves_round_once_from_fp32():
    u = torch.randn(32, 16, dtype=torch.bfloat16)
    grad = torch.randn(32, 8, dtype=torch.bfloat16)
    up, gate = u.float().chunk(2, dim=-1)
    assert torch.equal(reference_forward(u), (F.silu(gate) * up).to(torch.bfloat16))
    du, h = reference_backward(grad, u)
    assert du.dtype == torch.bfloat16 and du.shape == u.shape and torch.equal(h, reference_forward(u))
    wide = u.float().requires_grad_()
    up, gate = wide.chunk(2, dim=-1)
    (expected,) = torch.autograd.grad(F.silu(gate) * up, wide, grad.float())
    torch.testing.assert_close(du.float(), expected, rtol=2**-8, atol=1e-6)  # one bf16 rounding of the fp32 value


def test_a_projection_that_is_not_the_fused_pair_is_refused_with_what_it_needs():
    with pytest.raises(ValueError, match=r"fused \[up, gate\] projection \(last dimension 2 x 4"):
        swiglu_down(torch.randn(2, 7), torch.randn(3, 4))


class _OpsSeen(TorchDispatchMode):
    """The names of the ops a block of code dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def pool():
    return data_pool(batch=4, backward_chunks=1)


def test_a_training_step_with_x11_is_the_baselines_and_evaluation_ignores_it(pool):
    results = []
    for switches in (Switches(), X11):
        model = tiny_model(seed=2)
        model.switches = switches
        model.eval()
        chunk = pool[1].chunks[0]
        with torch.no_grad():
            logits = model(chunk.prefix.input_ids, chunk.prefix.attention_mask, chunk.prefix.mm_token_type_ids,
                           pixel_values=chunk.prefix.pixel_values,
                           image_token_pooling=chunk.prefix.image_token_pooling)  # fmt: skip
        trainer = Trainer(model, train_config(batch=4, backward_chunks=1), torch.device("cpu"))
        with _OpsSeen() as seen:
            loss, _ = trainer.step(pool[0])
        fused_ops = {"prereg.swiglu_down_forward.default", "prereg.swiglu_down_backward.default"}
        assert (fused_ops <= seen.ops) == (switches == X11)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss), grads, logits))
    (base_loss, base_grads, base_logits), (loss, grads, logits) = results
    assert abs(loss - base_loss) < 1e-5
    assert grads.keys() == base_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base_grads[name], rtol=1e-4, atol=1e-6)
    assert torch.equal(logits, base_logits)  # training mode only: evaluation runs the baseline's SwiGLU


# ---- CUDA ----


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [9728, 1000, 24])  # the 4B width; one that is no multiple of the block; tiny
def test_the_triton_kernels_are_the_reference_arithmetic(dtype, width):
    from engine.molmo2.model import swiglu_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(257, 2 * width, generator=g, device="cuda").to(dtype)
    grad = torch.randn(257, width, generator=g, device="cuda").to(dtype)
    tolerance = {"rtol": 2**-7, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(swiglu_kernels.forward(u), reference_forward(u.cpu()).to("cuda"), **tolerance)
    for ours, reference in zip(swiglu_kernels.backward(grad, u), reference_backward(grad.cpu(), u.cpu())):
        torch.testing.assert_close(ours, reference.to("cuda"), **tolerance)


@pytest.mark.gpu
@cuda
def test_a_planted_fault_in_the_kernel_comparison_is_caught():
    """The comparison above can fail: the up and gate halves of the reference's gradient swapped."""
    from engine.molmo2.model import swiglu_kernels

    u = torch.randn(64, 2 * 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    du, _ = swiglu_kernels.backward(grad, u)
    reference, _ = reference_backward(grad.cpu(), u.cpu())
    wrong = torch.cat(reference.chunk(2, dim=-1)[::-1], dim=-1).to("cuda")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(du, wrong, rtol=2**-7, atol=1e-5)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights-x10"])
def test_a_compiled_block_with_x11_is_the_baselines_under_autocast(weights):
    from engine.molmo2.model.text import Rope

    model = tiny_model(seed=1)
    block = model.transformer.blocks[0].cuda()
    for linear in (block.self_attn.att_proj, block.self_attn.attn_out, block.mlp.ff_proj, block.mlp.ff_out):
        linear.weight.data = linear.weight.data.to(weights)
    compiled = torch.compile(block, dynamic=False)
    x0 = torch.randn(2, 16, block.mlp.ff_proj.in_features, device="cuda")
    rope = Rope(torch.arange(16, device="cuda")[None].expand(2, 16), model.config.text.head_dim,
                model.config.text.rope_theta)  # fmt: skip
    outs = []
    for fused in (False, True):
        x = x0.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _ = compiled(x, rope, None, None, fused)
        out.float().square().sum().backward()
        outs.append((out.float(), x.grad, block.mlp.ff_proj.weight.grad.clone(), block.mlp.ff_out.weight.grad.clone()))
        block.zero_grad(set_to_none=True)
    assert outs[1][3].dtype == weights  # the down projection's gradient in its weight's dtype, as autograd's
    for ours, baseline in zip(outs[1], outs[0]):
        torch.testing.assert_close(ours.float(), baseline.float(), rtol=5e-2, atol=5e-2)  # bf16, another kernel
