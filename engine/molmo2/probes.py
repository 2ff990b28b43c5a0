"""What the oracles of a Molmo2 registration ask the workload to measure (the probes its declaration names).

Every probe runs the baseline and the item on the same micro-batch from the same initial weights and
seed, and returns observed values only; the frozen bounds judge them (oracles/judge.py). A probe that cannot
run on this profile returns {"error": why}: the oracle fails with that reason, it is never skipped.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import torch

from engine.molmo2.model.ar import ar_forward, ar_loss_sums, ar_losses
from engine.molmo2.switches import Switches

if TYPE_CHECKING:
    from engine.molmo2.runner import Molmo2Runner


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def cudnn_unavailable(runner: "Molmo2Runner") -> str | None:
    """Why the P1 switch cannot take effect on this profile, or None when cuDNN attention runs the suffix shape."""
    if runner.device.type != "cuda":
        return (
            f"cuDNN attention is a CUDA backend; profile {runner.profile.name} runs on the CPU, where P1 switches "
            "nothing"
        )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t = runner.config.text
    q = torch.randn(1, t.num_heads, 8, t.head_dim, device=runner.device, dtype=torch.bfloat16)
    kv = torch.randn(1, t.num_kv_heads, 24, t.head_dim, device=runner.device, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 8, 24, device=runner.device, dtype=torch.bool)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
    except RuntimeError as error:
        return f"cuDNN attention refuses the suffix geometry here: {str(error).splitlines()[0]}"
    return None


def switch_inert(runner: "Molmo2Runner", switch: str) -> str | None:
    """Why a switch cannot take effect on this profile (its parity probes then fail with that reason: a probe
    that compares two identical computations would pass vacuously), or None."""
    if switch == "suffix_cudnn":
        return cudnn_unavailable(runner)
    if switch == "optimizer_overlaps_vision" and runner.device.type != "cuda":
        return (
            f"X7 overlaps the optimizer with the next step on a second CUDA stream; profile {runner.profile.name} "
            "trains on the CPU, which has one timeline"
        )
    if switch == "bf16_linear_weights" and runner.device.type != "cuda":
        return (
            f"X10's update is Triton kernels over bf16 weights under bf16 autocast; profile {runner.profile.name} "
            "trains on the CPU in fp32"
        )
    return None


def _switches(runner: "Molmo2Runner", switch: str) -> Switches:
    """The item's arm: the config's baseline switches and the item's."""
    return runner.with_switches([switch])


def _grad_digests(model: torch.nn.Module) -> dict[str, str]:
    return {
        name: hashlib.sha256(p.grad.detach().float().cpu().numpy().tobytes()).hexdigest()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def one_step(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    """One optimizer step, baseline vs item: loss, gradient norm, and a hash of every parameter's gradient."""
    if why := switch_inert(runner, switch):
        return {"error": why}
    results = []
    for switches in (runner.baseline, _switches(runner, switch)):
        trainer = runner.fresh(switches)
        loss, grad_norm = trainer.step(runner.probe_step)
        trainer.settle()
        digests = _grad_digests(runner.model)
        results.append((float(loss), float(grad_norm), digests))
    (la, ga, da), (lb, gb, db) = results
    names = sorted(da)
    mismatched = [n for n in names if da[n] != db.get(n)]
    return {
        "loss_abs": abs(la - lb),
        "loss_rel": _rel(la, lb),
        "grad_norm_abs": abs(ga - gb),
        "grad_norm_rel": _rel(ga, gb),
        "loss_a": la,
        "loss_b": lb,
        "grad_norm_a": ga,
        "grad_norm_b": gb,
        "equal": len(names) - len(mismatched),
        "total": len(names),
        "first_mismatch": mismatched[0] if mismatched else None,
        "finite": all(math.isfinite(v) for v in (la, lb, ga, gb)),
    }


def steady_band(curve: list[float]) -> float | None:
    """The largest step-to-step move of a curve after its warm-up, or None for a curve too short to have one.
    Warm-up: the first half of the steps (n // 2 of n); on a fresh init the loss falls fastest there, so the
    whole curve's largest move (`band`) is the first steps' drop, which at the 4B geometry dwarfs any numerics
    difference. The steady band is the largest |a[i] - a[i-1]| with both steps after the warm-up."""
    moves = [abs(curve[i] - curve[i - 1]) for i in range(len(curve) // 2 + 1, len(curve))]
    return max(moves) if moves else None


def loss_curve(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    """An N-step loss curve from the same init and data, baseline vs item (this runs backward: the crash gate too)."""
    if why := switch_inert(runner, switch):
        return {"error": why}
    steps = int(oracle.get("steps") or 20)
    curves = []
    for switches in (runner.baseline, _switches(runner, switch)):
        trainer = runner.fresh(switches)
        curves.append([float(trainer.step(step)[0]) for step in runner.steps_for(steps)])
        trainer.settle()
    a, b = curves
    finite = all(math.isfinite(v) for v in a + b)
    band = max(abs(a[i] - a[i - 1]) for i in range(1, len(a))) if len(a) > 1 else 0.0
    first_bad = next((i + 1 for i, v in enumerate(b) if not math.isfinite(v)), None)
    return {
        "curve_a": a,
        "curve_b": b,
        "max_abs_diff": max(abs(x - y) for x, y in zip(a, b)) if finite else float("nan"),
        "band": band,
        "steady_band": steady_band(a),
        "finite": finite,
        "first_bad_step": first_bad,
        "steps": steps,
    }


def decode_bytes(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    """Greedy decode of a pinned small eval plan, bytes compared (P1 must not reach decode)."""
    outputs = []
    for switches in (runner.baseline, _switches(runner, switch)):
        runner.fresh(switches)
        outputs.append(runner.decode_plan().cpu().numpy().astype("<i8").tobytes())
    a, b = outputs
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    return {"equal": a == b, "first_difference": first, "bytes": len(a)}


def planted_mismatch(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    """A batch whose <im_patch> count disagrees with its image features must abort at the patch-count guard (an
    abort further on, an index out of range, is not the guard holding). Run in a child process: a CUDA
    device-side assert poisons the process's context, and the gate must go on after it."""
    from engine.molmo2.planted import GUARD_ABORTED

    command = [sys.executable, "-m", "engine.molmo2.planted", "--device", runner.device.type, "--switch", switch]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    tail = (result.stderr or result.stdout).strip().splitlines()
    if result.returncode == 0:
        return {"raised": False, "message": "the forward completed on a mismatched batch"}
    message = next((line for line in tail if line.startswith("aborted ")), tail[-1] if tail else "")
    return {"raised": result.returncode == GUARD_ABORTED, "message": message[:500], "returncode": result.returncode}


def embed_outputs(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    """Embedding outputs on fixed batches with and without FAST (extension) ids, baseline vs item, bitwise."""
    chunk = runner.probe_step.chunks[0]
    batches = {"prefix (no FAST ids)": chunk.prefix.input_ids, "suffix (FAST ids)": chunk.suffix.input_ids}
    equal, names = 0, []
    with torch.no_grad():
        for name, ids in batches.items():
            runner.model.switches = runner.baseline
            a = runner.model.embed(ids)
            runner.model.switches = _switches(runner, switch)
            b = runner.model.embed(ids)
            if torch.equal(a, b):
                equal += 1
            else:
                names.append(name)
    runner.model.switches = runner.baseline
    return {"equal": equal, "total": len(batches), "first_mismatch": names[0] if names else None}


def _mean_form(runner: "Molmo2Runner", switches: Switches) -> dict[str, torch.Tensor]:
    """The mean-form losses of the probe batch as a training forward computes them under `switches`: fresh
    weights, the model in training mode (the suffix backends depend on it), the training precision."""
    from engine.molmo2.train.step import autocast

    chunk = runner.probe_step.chunks[0]
    runner.fresh(switches)
    runner.model.train()
    with torch.no_grad(), autocast(runner.device):
        logits = ar_forward(runner.model, chunk)
    return ar_losses(logits.float(), chunk.suffix)


def loss_sums_fp64(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    """Sum-form losses under the item vs the baseline's boolean-indexed sums, both over the same logits in fp64
    (what the item changes is the reduction, so the logits are held fixed); and the mean-form losses, which no
    switch may touch, each arm's computed end to end under its own switches (forward included) and compared
    bitwise: a switch that leaks into the forward or the mean form shows there."""
    chunk = runner.probe_step.chunks[0]
    runner.fresh(runner.baseline)
    with torch.no_grad():
        logits = ar_forward(runner.model, chunk).double()
    reference = ar_loss_sums(logits, chunk.suffix, runner.baseline)
    item = ar_loss_sums(logits, chunk.suffix, _switches(runner, switch))
    keys = ("loss_sum", "action_sum", "aux_sum")
    sum_rel = max(_rel(float(reference[k]), float(item[k])) for k in keys)
    sum_abs = max(abs(float(reference[k]) - float(item[k])) for k in keys)
    mean_baseline = _mean_form(runner, runner.baseline)
    mean_item = _mean_form(runner, _switches(runner, switch))
    mean_keys = ("loss", "action_loss", "aux_loss")
    mismatched = [k for k in mean_keys if not torch.equal(mean_baseline[k], mean_item[k])]
    return {
        "sum_rel": sum_rel,
        "sum_abs": sum_abs,
        "mean_abs": max(abs(float(mean_baseline[k] - mean_item[k])) for k in mean_keys),
        "equal": len(mean_keys) - len(mismatched),
        "total": len(mean_keys),
        "first_mismatch": mismatched[0] if mismatched else None,
    }


def window_schema(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    """A few logged windows under the item: both memory fields present, lifetime >= window, lifetime monotone."""
    switches = _switches(runner, switch)
    trainer = runner.fresh(switches)
    windows = [trainer.window(runner.steps_for(2), switches.windowed_vram_peak) for _ in range(3)]
    required = ("vram_peak_gib", "vram_window_peak_gib")
    missing = sorted({f for w in windows for f in required if f not in w})
    violations = []
    for index, window in enumerate(windows):
        if all(f in window for f in required) and window["vram_peak_gib"] < window["vram_window_peak_gib"]:
            violations.append(
                f"window {index}: lifetime {window['vram_peak_gib']} < window {window['vram_window_peak_gib']}"
            )
        if index and window.get("vram_peak_gib", 0) < windows[index - 1].get("vram_peak_gib", 0):
            violations.append(f"window {index}: lifetime decreased")
    return {"missing": missing, "violations": violations, "windows": [{f: w.get(f) for f in required} for w in windows]}


def fwd_bwd_outputs(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    """A fixed micro-batch forward + backward, baseline vs item: the logits, the loss and every parameter gradient,
    bitwise. An autograd version-counter error (an in-place add on a tensor backward needs) surfaces here."""
    from engine.molmo2.train.step import autocast

    chunk = runner.probe_step.chunks[0]
    captured = []
    for switches in (runner.baseline, _switches(runner, switch)):
        runner.fresh(switches)
        runner.model.train()
        with autocast(runner.device):
            logits = ar_forward(runner.model, chunk)
        loss = ar_losses(logits.float(), chunk.suffix)["loss"]
        loss.backward()
        tensors = {"logits": logits.detach(), "loss": loss.detach()}
        tensors.update(
            {f"grad:{n}": p.grad.detach().clone() for n, p in runner.model.named_parameters() if p.grad is not None}
        )
        captured.append(tensors)
    a, b = captured
    names = sorted(set(a) | set(b))
    mismatched = [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]
    return {
        "equal": len(names) - len(mismatched),
        "total": len(names),
        "first_mismatch": mismatched[0] if mismatched else None,
    }


def memory_peak(runner: "Molmo2Runner", switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
    trainer = runner.fresh(_switches(runner, switch))
    window = trainer.window(runner.steps_for(3), False)
    return {"peak_gib": window["vram_peak_gib"]}


PROBES = {
    "one_step": one_step,
    "loss_curve": loss_curve,
    "decode_bytes": decode_bytes,
    "planted_mismatch": planted_mismatch,
    "embed_outputs": embed_outputs,
    "loss_sums_fp64": loss_sums_fp64,
    "window_schema": window_schema,
    "fwd_bwd_outputs": fwd_bwd_outputs,
    "memory_peak": memory_peak,
}
