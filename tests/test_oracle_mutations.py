"""Every oracle can fail: for each probe, a real fault planted in what it guards (perturbed numerics under the
item's switch, a dropped field, a NaN, a removed guard, a memory blow-up) makes its oracle fail through the gate's
own observation (engine.gate.observe) and judgement (oracles.judge), with the bounds a bundled registration froze.

Each fault is switched on by the item's switch only, so the baseline arm computes what it always did: a probe that
compared two identical computations, or measured the item alone where it should compare, would pass the fault.
The tiny geometry on the CPU, one model load for the module. P1's cuDNN takes no effect on a CPU (its probes fail
there with that reason), so a fault for P1's oracles is planted under a switch that acts on the CPU; the bounds
judged are still P1's frozen ones.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REGISTRATIONS
from molmo2_fixtures import make_runner

from engine.gate import observe
from engine.molmo2 import probes
from engine.molmo2.model import ar
from engine.molmo2.model.model import Molmo2Model
from engine.molmo2.runner import Molmo2Runner
from engine.molmo2.train import step as train_step
from oracles.judge import judge
from prereg.documents import load_registration
from prereg.schema import Item, Oracle

TINY = REGISTRATIONS / "molmo2-perf-pass1-tiny.toml"


@pytest.fixture(scope="module")
def tiny() -> Molmo2Runner:
    """The tiny registration's gate config (batch 4 in 2 chunks) with one model load for every test here."""
    reg, _ = load_registration(TINY, None)
    runner = make_runner(**reg.protocol.config)
    runner.load()
    return runner


def frozen(oracle_id: str) -> tuple[Item, Oracle]:
    reg, _ = load_registration(TINY, None)
    return next((item, oracle) for item in reg.items for oracle in item.oracles if oracle.id == oracle_id)


def gate_judgement(runner: Molmo2Runner, item: Item, oracle: Oracle, switch: str | None = None):
    """The gate's observation and judgement of `oracle`, its item switched by `switch` (default: the item's own)."""
    if switch is not None:
        item = item.model_copy(update={"switch": switch})
    observed = observe(runner, item, oracle)
    return judge(oracle.kind, observed, oracle.bounds), observed


def under(switch: str, perturb):
    """A Molmo2Model method wrapper: the method's output through `perturb` when `switch` is on, else unchanged."""

    def wrap(method):
        def wrapped(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            return perturb(out) if getattr(self.switches, switch) else out

        return wrapped

    return wrap


def in_bf16(tensor: torch.Tensor) -> torch.Tensor:
    """The values rounded through bfloat16: a kernel that computes in lower precision than the baseline's."""
    return tensor.to(torch.bfloat16).to(tensor.dtype)


# ---- P3c: the sum-form losses, and the mean-form anchors no switch may touch ----


def test_p3c_mean_fails_when_the_switch_leaks_into_the_forward(tiny, monkeypatch):
    item, oracle = frozen("P3c-mean")
    judgement, _ = gate_judgement(tiny, item, oracle)
    assert judgement.passed, judgement.reason  # the real P3c leaves the mean form alone
    monkeypatch.setattr(Molmo2Model, "logits", under("masked_loss_sums", in_bf16)(Molmo2Model.logits))
    judgement, observed = gate_judgement(tiny, item, oracle)
    assert not judgement.passed and observed["equal"] < observed["total"], (judgement.reason, observed)
    assert observed["sum_rel"] == 0.0  # the sums share one forward: only the mean-form arms see the leak


def test_p3c_sums_fail_when_the_masked_sums_lose_precision(tiny, monkeypatch):
    item, oracle = frozen("P3c-fp64")
    original = ar.ar_loss_sums

    def fp32_masked_sums(logits, suffix, switches):
        sums = original(logits, suffix, switches)
        if switches.masked_loss_sums:  # the fault: the masked products summed in fp32, not the logits' fp64
            return {k: v.float().double() if k.endswith("_sum") else v for k, v in sums.items()}
        return sums

    for module in (ar, probes, train_step):
        monkeypatch.setattr(module, "ar_loss_sums", fp32_masked_sums)
    judgement, observed = gate_judgement(tiny, item, oracle)
    assert not judgement.passed and observed["sum_rel"] > oracle.bounds["sum_rel"], (judgement.reason, observed)


# ---- P3a: a mismatched batch must abort at the patch-count guard ----


def test_p3a_fails_when_the_guard_is_gone_although_the_forward_still_aborts(tiny, tmp_path, monkeypatch):
    item, oracle = frozen("P3a-abort")
    # The fault, in the probe's child process: the device-side assert compiled out (a no-op). The mismatched batch
    # then dies of an index out of range further on; that abort is not the guard holding.
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch._assert_async = lambda *args, **kwargs: None\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    judgement, observed = gate_judgement(tiny, item, oracle)
    assert not judgement.passed, (judgement.reason, observed)
    assert "elsewhere than the patch-count guard" in observed["message"], observed
