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

import dataclasses
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REGISTRATIONS
from molmo2_fixtures import make_runner

from engine.command.declaration import declare
from engine.command.process import CommandRunner
from engine.gate import observe
from engine.memory.meter import MemoryMeter
from engine.molmo2 import probes
from engine.molmo2.model import ar
from engine.molmo2.model.model import Molmo2Model
from engine.molmo2.runner import Molmo2Runner
from engine.molmo2.train import step as train_step
from engine.workload import RunContext
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
    # the sums share one forward, so only the mean-form arms see the leak; the two sum forms still reduce in their own
    # orders, which the CPU's vector width can move by an fp64 ulp: P3c-fp64's frozen sum_rel bound, 1e-12
    assert observed["sum_rel"] <= 1e-12, observed


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


# ---- P1b: the loss curves overlaid, and the steady band new documents can bound ----


def last_columns_hotter(logits: torch.Tensor) -> torch.Tensor:
    """A head kernel that scores the last 16 ids 3 nats too high: every loss-bearing token's loss moves."""
    return torch.cat([logits[..., :-16], logits[..., -16:] + 3.0], dim=-1)


def test_p1b_and_a_steady_band_bound_fail_curves_that_part(tiny, monkeypatch):
    item, p1b = frozen("P1b")
    short = p1b.model_copy(update={"steps": 6})  # P1b's frozen bounds (none: the whole band) on a 6-step curve
    steady = short.model_copy(update={"id": "P1b-steady", "bounds": {"steady_band": 1.0}})
    monkeypatch.setattr(Molmo2Model, "logits", under("no_embed_clone", last_columns_hotter)(Molmo2Model.logits))
    judgement, observed = gate_judgement(tiny, item, short, switch="no_embed_clone")
    assert not judgement.passed and observed["max_abs_diff"] > observed["band"], (judgement.reason, observed)
    assert not judge(steady.kind, observed, steady.bounds).passed
    # The frozen oracle (no bound) is judged as it always was, against the whole band, whatever steady_band says.
    without = {k: v for k, v in observed.items() if k != "steady_band"}
    assert judge("curve_overlay", observed, short.bounds) == judge("curve_overlay", without, short.bounds)


def test_every_curve_overlay_result_in_the_lab_ledger_judges_as_it_was_recorded(tmp_path):
    from conftest import lab_ledger_copy

    from prereg.canonical import decode_nonfinite
    from prereg.ledger import Ledger

    with Ledger.open(str(lab_ledger_copy(tmp_path / "ledger.db")), create=False) as lab:
        recorded = [e.data for e in lab.entries(kinds=("oracle",)) if e.data["kind"] == "curve_overlay"]
    assert recorded
    for data in recorded:
        judgement = judge("curve_overlay", decode_nonfinite(data["observed"]), data["bounds"])
        assert (judgement.passed, judgement.reason) == (data["passed"], data["reason"]), data["oracle"]


@pytest.mark.parametrize(
    ("bounds", "steps", "says"),
    [
        ({"max_abs_diff": 0.04, "steady_band": 1.0}, 20, "at most one of the bounds"),
        ({"band": 1.0}, 20, "at most one of the bounds"),
        ({"steady_band": 1.0}, 3, "at least 4 steps"),
    ],
)
def test_a_curve_overlay_bound_is_one_of_max_abs_diff_and_steady_band(bounds, steps, says):
    with pytest.raises(ValueError, match=says):
        Oracle(id="C", kind="curve_overlay", probe="loss_curve", steps=steps, bounds=bounds)
    assert Oracle(id="C", kind="curve_overlay", probe="loss_curve", steps=4, bounds={"steady_band": 2.0})


# ---- the other probes of the tiny registration ----


def test_p1a_fails_on_a_head_that_scores_differently_under_the_switch(tiny, monkeypatch):
    item, oracle = frozen("P1a")
    monkeypatch.setattr(Molmo2Model, "logits", under("no_embed_clone", last_columns_hotter)(Molmo2Model.logits))
    judgement, observed = gate_judgement(tiny, item, oracle, switch="no_embed_clone")
    assert not judgement.passed and observed["loss_abs"] > oracle.bounds["loss_abs"], (judgement.reason, observed)


def test_p1c_fails_when_the_switch_reaches_decode(tiny, monkeypatch):
    item, oracle = frozen("P1c")
    # The fault moves every greedy token from the first on: 16 of the geometry's 128 show it as well, in an eighth of
    # the decode time.
    monkeypatch.setattr(tiny, "geometry", dataclasses.replace(tiny.geometry, decode_tokens=16))
    monkeypatch.setattr(Molmo2Model, "logits", under("no_embed_clone", last_columns_hotter)(Molmo2Model.logits))
    judgement, observed = gate_judgement(tiny, item, oracle, switch="no_embed_clone")
    assert not judgement.passed and observed["first_difference"] is not None, (judgement.reason, observed)


def test_p2a_fails_when_the_windowed_field_is_dropped(tiny, monkeypatch):
    item, oracle = frozen("P2a")
    original = MemoryMeter.window_end

    def without_window_field(self, windowed):
        fields = original(self, windowed)
        fields.pop("vram_window_peak_gib", None)  # the fault: the switch resets the peak but reports nothing
        return fields

    monkeypatch.setattr(MemoryMeter, "window_end", without_window_field)
    judgement, observed = gate_judgement(tiny, item, oracle)
    assert not judgement.passed and observed["missing"] == ["vram_window_peak_gib"], (judgement.reason, observed)


def test_p3b_fails_when_the_branchless_lookup_rounds(tiny, monkeypatch):
    item, oracle = frozen("P3b-wte")
    monkeypatch.setattr(Molmo2Model, "embed", under("branchless_extension_lookup", in_bf16)(Molmo2Model.embed))
    judgement, observed = gate_judgement(tiny, item, oracle)
    assert not judgement.passed and observed["equal"] < observed["total"], (judgement.reason, observed)


def test_p4a_fails_when_the_in_place_add_changes_the_embedding(tiny, monkeypatch):
    item, oracle = frozen("P4a")
    monkeypatch.setattr(Molmo2Model, "embed", under("no_embed_clone", in_bf16)(Molmo2Model.embed))
    judgement, observed = gate_judgement(tiny, item, oracle)
    assert not judgement.passed and observed["first_mismatch"] is not None, (judgement.reason, observed)


def test_memory_peak_fails_on_a_blow_up_under_the_switch(tiny, monkeypatch):
    """No bundled registration bounds memory_peak: the bound here is the baseline's peak plus 0.25 GiB."""
    item, _ = frozen("P4a")
    MemoryMeter(torch.device("cpu")).window_end(True)  # the process's peak reset: this probe's steps set it
    baseline = observe(tiny, item, Oracle(id="M0", kind="memory", probe="memory_peak", bounds={"peak_gib": 1e3}))
    oracle = Oracle(id="M", kind="memory", probe="memory_peak", bounds={"peak_gib": baseline["peak_gib"] + 0.25})
    held = []

    def blow_up(x):
        if not held:  # the fault: 0.5 GiB allocated in the first forward and kept alive
            held.append(torch.ones(2**27, dtype=torch.float32))
        return x

    monkeypatch.setattr(Molmo2Model, "embed", under("no_embed_clone", blow_up)(Molmo2Model.embed))
    MemoryMeter(torch.device("cpu")).window_end(True)
    judgement, observed = gate_judgement(tiny, item, oracle)
    held.clear()
    assert not judgement.passed and observed["peak_gib"] > oracle.bounds["peak_gib"], (judgement.reason, observed)


# ---- the command workload's probe protocol ----

COMMAND_PROBE = """
import json, math, os
values = [1.0 + 1e-9 * i for i in range(1000)]
def loss(switches):
    if "fp32_sum" in switches:  # the fault under the switch: the sum rounded to fp32 on each add
        import struct
        total = 0.0
        for v in values:
            total = struct.unpack("f", struct.pack("f", total + v))[0]
        return total / len(values)
    return math.fsum(values) / len(values)
base, item = loss(()), loss((os.environ["PREREG_SWITCH"],))
print(json.dumps({"loss_abs": abs(base - item), "equal": int(base == item), "total": 1}))
"""


@pytest.mark.parametrize(("kind", "bounds"), [("tolerance", {"loss_abs": 1e-9}), ("bitwise", {})])
def test_a_command_probe_fails_its_oracle_on_a_fault_under_the_switch(tmp_path: Path, kind: str, bounds: dict):
    (tmp_path / "probe.py").write_text(textwrap.dedent(COMMAND_PROBE))
    table = {"run": "x", "probe": f"{sys.executable} probe.py", "metrics": ["loss"], "switches": ["fp32_sum", "ok"]}
    declaration = declare({**table, "probes": {"parity": ["loss_abs", "equal", "total"]}})
    context = RunContext(declaration, tmp_path, rung=None, steps=4, log_every=2, run_dir=tmp_path)
    profile = declaration.profiles["local"]
    config = declaration.run_config.resolve({}, profile, declaration.run_config.defaults(profile))
    runner = CommandRunner(profile, config, 0, context)
    oracle = Oracle(id="C1", kind=kind, probe="parity", bounds=bounds)
    item = Item(id="C", title="c", switch="ok", bitwise=True, oracles=[oracle])
    assert judge(kind, observe(runner, item, oracle), bounds).passed  # a switch that changes nothing holds
    judgement = judge(kind, observe(runner, item.model_copy(update={"switch": "fp32_sum"}), oracle), bounds)
    assert not judgement.passed, judgement.reason
