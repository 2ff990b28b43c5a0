"""Sensitivity: bars found in the rules, the read's error from window noise against simulated ladders, the minimum
detectable effect and windows needed, the noise found in the ledger, and the verdict's flip probability."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
from conftest import Cli, record_file, write
from hypothesis import given, settings
from hypothesis import strategies as st

from prereg.documents import document_hash, load_registration
from prereg.errors import InvalidInput
from prereg.ledger import Ledger
from prereg.schema import Registration
from prereg.sensitivity import (
    MDE_Z,
    MetricNoise,
    WindowSeries,
    aa_noise,
    assess,
    find_bars,
    ledger_noise,
    median_inflation,
    planned_windows,
    preferring,
)
from prereg.state import load_state

Z_975 = 1.959963984540054


def document(
    rules: list[dict], reads: dict[str, str], *, steps: int = 64, log_every: int = 2, discard: int = 0
) -> dict:
    """Two rungs of one config: A the baseline, B with item P1."""
    return {
        "id": "power",
        "title": "power",
        "question": "can the ladder see its bar?",
        "workload": "molmo2",
        "profile": "cpu-tiny",
        "cost": {"ceiling_gpu_h": 0.5},
        "items": [
            {
                "id": "P1",
                "title": "suffix cudnn",
                "switch": "suffix_cudnn",
                "bitwise": False,
                "oracles": [{"id": "P1a", "kind": "tolerance", "probe": "one_step", "bounds": {"loss_abs": 1e-3}}],
            }
        ],
        "protocol": {
            "steps": steps,
            "log_every": log_every,
            "discard_first": discard,
            "config": {"batch": 4, "backward_chunks": 2},
            "rungs": [{"id": "A", "items": []}, {"id": "B", "items": ["P1"]}],
        },
        "reads": reads,
        "rules": rules,
    }


GAIN = {"gain": "(A.s_per_step - B.s_per_step) / A.s_per_step", "other": "B.tokens_per_s / A.tokens_per_s"}


def registration(when: str, *, reads: dict[str, str] = GAIN, **protocol: int) -> Registration:
    return Registration.model_validate(document([{"id": "R", "when": when, "outcome": "land"}], reads, **protocol))


def ar1(rng: np.random.Generator, ladders: int, windows: int, rho: float) -> np.ndarray:
    """Stationary AR(1) windows of unit variance: ladders x windows."""
    x = np.empty((ladders, windows))
    x[:, 0] = rng.standard_normal(ladders)
    innovations = rng.standard_normal((ladders, windows)) * math.sqrt(1 - rho**2)
    for t in range(1, windows):
        x[:, t] = rho * x[:, t - 1] + innovations[:, t]
    return x


def simulated_gains(rng, ladders: int, windows: int, *, cv: float, rho: float, effect: float) -> np.ndarray:
    """`gain` over simulated ladders: A at level 1, B at 1 - effect, both with windows of `cv` and `rho`."""
    a = np.median(1.0 + cv * ar1(rng, ladders, windows, rho), axis=1)
    b = np.median((1.0 - effect) * (1.0 + cv * ar1(rng, ladders, windows, rho)), axis=1)
    return (a - b) / a


def known_noise(cv: float, rho: float, level: float = 1.0) -> MetricNoise:
    return MetricNoise(level=level, cv=cv, rho=rho, windows=64, runs=2, source="aa")


# --- the read's error, the MDE and the windows needed, against simulated ladders --------------------------------


def test_the_mde_holds_its_false_positive_rate_and_power_over_simulated_ladders() -> None:
    """32 kept windows per rung, windows of 2% CV with lag-1 autocorrelation 0.3. The estimator is asymptotic and
    errs towards more windows, so the simulated error may sit a few percent under the estimate, never above it by
    more than sampling error (20,000 ladders: about 0.5%)."""
    cv, rho = 0.02, 0.3
    reg = registration("gain >= 0.05")
    noise = {(rung, "s_per_step"): known_noise(cv, rho) for rung in ("A", "B")}
    (row,) = assess(reg, noise).rows
    assert row.windows_per_rung == planned_windows(reg.protocol) == 32
    assert row.mde == pytest.approx(MDE_Z * row.se)
    expected_se = math.sqrt(2 * math.pi / 2 * cv**2 / 32 * median_inflation(rho, 32))  # d gain / dA = -dB = 1 at A = B
    assert row.se == pytest.approx(expected_se, rel=1e-4)

    rng = np.random.default_rng(7)
    null = simulated_gains(rng, 20_000, 32, cv=cv, rho=rho, effect=0.0)
    assert 0.93 <= null.std() / row.se <= 1.02
    # A rule `gain >= bar` with the bar at the MDE fires on no effect only in the far tail (expected 0.26%).
    assert np.mean(null >= row.mde) <= 0.006
    # The test the MDE is defined by: two-sided 5% on no effect, 80% power at an effect of the MDE.
    significant = Z_975 * row.se
    assert 0.035 <= np.mean(np.abs(null) >= significant) <= 0.055
    at_mde = simulated_gains(rng, 20_000, 32, cv=cv, rho=rho, effect=row.mde)
    assert 0.78 <= np.mean(at_mde >= significant) <= 0.86


def test_windows_needed_is_the_fewest_windows_that_power_the_bar() -> None:
    """A 1% bar is out of reach of 32 windows of 2% noise; at the windows it needs, an effect of 1% is detected 80% of
    the time, and at half of them barely half the time."""
    cv, rho = 0.02, 0.3
    noise = {(rung, "s_per_step"): known_noise(cv, rho) for rung in ("A", "B")}
    (row,) = assess(registration("gain >= 0.01"), noise).rows
    assert row.powered is False and row.mde > 0.01
    needed = row.windows_needed
    assert needed > 32

    def se(windows: int) -> float:
        return math.sqrt(2 * math.pi / 2 * cv**2 / windows * median_inflation(rho, windows))

    assert MDE_Z * se(needed) <= 0.01 < MDE_Z * se(needed - 1)
    rng = np.random.default_rng(11)

    def power(windows: int) -> float:
        gains = simulated_gains(rng, 10_000, windows, cv=cv, rho=rho, effect=0.01)
        return float(np.mean(gains >= Z_975 * se(windows)))

    assert 0.78 <= power(needed) <= 0.87
    assert power(needed // 2) <= 0.6
    (enough,) = assess(registration("gain >= 0.01", steps=2 * needed), noise).rows
    assert enough.powered is True and enough.windows_needed == needed


def test_the_delta_method_gives_a_ratios_own_error() -> None:
    """`A.s_per_step / B.s_per_step` with rungs of unequal noise (1% and 4%, B's windows autocorrelated): the
    read's error is the ratio's, checked against 20,000 simulated ladders at level 2 s."""
    reg = registration("speedup >= 1.1", reads={"speedup": "A.s_per_step / B.s_per_step"})
    noise = {
        ("A", "s_per_step"): MetricNoise.from_sd(2.0, 0.02, source="ledger", windows=64, runs=2),  # 1% of 2 s
        ("B", "s_per_step"): known_noise(0.04, 0.5, 2.0),
    }
    (row,) = assess(reg, noise).rows
    variance = math.pi / 2 / 32 * (0.01**2 * median_inflation(0.0, 32) + 0.04**2 * median_inflation(0.5, 32))
    assert row.se == pytest.approx(math.sqrt(variance), rel=1e-4)  # slopes 1/B and A/B^2, both 1/2 s^-1, times 2 s
    rng = np.random.default_rng(3)
    a = np.median(2.0 * (1 + 0.01 * ar1(rng, 20_000, 32, 0.0)), axis=1)
    b = np.median(2.0 * (1 + 0.04 * ar1(rng, 20_000, 32, 0.5)), axis=1)
    assert 0.93 <= (a / b).std() / row.se <= 1.03


def test_a_folded_difference_keeps_its_noise() -> None:
    """abs(B - A) / A has a kink at no effect; its error is the unfolded difference's, not zero."""
    reads = {"gap": "abs(B.s_per_step - A.s_per_step) / A.s_per_step", "gain": GAIN["gain"]}
    noise = {(rung, "s_per_step"): known_noise(0.02, 0.3) for rung in ("A", "B")}
    rows = assess(registration("gap <= 0.01 and gain >= 0.01", reads=reads), noise).rows
    assert rows[0].read == "gap" and rows[0].se == pytest.approx(rows[1].se, rel=1e-6)


@pytest.mark.parametrize("windows, rho, runs", [(16, 0.4, 40), (8, 0.5, 200)])
def test_noise_estimated_from_windows_recovers_cv_and_autocorrelation(windows: int, rho: float, runs: int) -> None:
    """Runs of 3% CV at levels that differ by run (items on and off): the pooled CV is within-run. Uncorrected, the
    lag-1 autocorrelation of 8 windows reads about a third of 0.5, and their deviations from the run's mean about
    89% of the CV."""
    rng = np.random.default_rng(5)
    series = [
        WindowSeries(
            tuple(float(v) for v in level * (1 + 0.03 * ar1(rng, 1, windows, rho)[0])), f"reg/run-{k}", k % 2 == 0
        )
        for k, level in enumerate(rng.uniform(0.5, 3.0, runs))
    ]
    noise = MetricNoise.from_series(series, "ledger")
    assert isinstance(noise, MetricNoise)
    assert noise.cv == pytest.approx(0.03, rel=0.07)
    assert noise.rho == pytest.approx(rho, abs=0.12)
    assert (noise.windows, noise.runs, noise.external_runs) == (windows * runs, runs, runs // 2)
    short = MetricNoise.from_series([WindowSeries((1.0, 1.1, 0.9), "reg/run-1", False)], "ledger")
    assert "4 read windows" in short.reason and "reg/run-1" in short.reason


# --- bars --------------------------------------------------------------------------------------------------------

constants = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


def bars_of(when: str) -> set[tuple[str, str, float]]:
    return {(bar.read, bar.op, bar.bar) for bar in find_bars(registration(when))[0]}


@settings(max_examples=30, deadline=None)
@given(low=constants, high=constants)
def test_bars_are_found_in_chained_negated_and_nested_comparisons(low: float, high: float) -> None:
    assert bars_of(f"{low!r} <= gain < {high!r}") == {("gain", ">=", low), ("gain", "<", high)}
    assert bars_of(f"{low!r} > gain") == {("gain", "<", low)}
    assert bars_of(f"not (gain > {low!r})") == {("gain", "<=", low)}
    assert bars_of(f"not not (gain > {low!r})") == {("gain", ">", low)}
    nested = f"(gain >= {low!r} and not (other < {high!r})) or (defined(gain) and all(B.finite, gain != 3))"
    assert bars_of(nested) == {("gain", ">=", low), ("other", ">=", high)}
    inline = f"(A.s_per_step - B.s_per_step) / A.s_per_step * 100 >= {high!r}"
    assert bars_of(inline) == {("(A.s_per_step - B.s_per_step) / A.s_per_step * 100", ">=", high)}


@settings(max_examples=20, deadline=None)
@given(bar=constants)
def test_a_boolean_read_and_a_conditional_land_entry_give_their_bars(bar: float) -> None:
    doc = document(
        [
            {
                "id": "R",
                "when": "fast and B.finite",
                "outcome": "land",
                "land": [{"item": "P1", "if": f"other > {bar!r}"}],
            }
        ],
        {**GAIN, "fast": f"not (gain < {bar!r})"},
    )
    bars, unresolved = find_bars(Registration.model_validate(doc))
    assert [(b.label, b.read, b.op, b.bar, b.direction) for b in bars] == [
        ("R", "gain", ">=", bar, "above"),
        ("R.land.P1", "other", ">", bar, "above"),
    ]
    assert unresolved == ()


def test_a_comparison_without_a_constant_is_listed_with_its_reason() -> None:
    bars, unresolved = find_bars(registration("B.s_per_step < A.s_per_step * 0.98 or gain == 0.5 or -gain > 1 / 50"))
    assert [(b.read, b.op, b.bar) for b in bars] == [("-gain", ">", 0.02)]
    assert [(u.read, u.reason) for u in unresolved] == [
        (
            "B.s_per_step",
            "`B.s_per_step < A.s_per_step * 0.98` compares it with A.s_per_step * 0.98, which is not a constant",
        ),
        ("gain", "`gain == 0.5` is an equality, not a bar"),
    ]


# --- what cannot be estimated says why --------------------------------------------------------------------------


def test_no_windows_means_powered_null_with_the_reason() -> None:
    reg = registration("gain >= 0.05 and other >= 1.1")
    assessment = assess(reg, ledger_noise(reg, []))
    assert [row.powered for row in assessment.rows] == [None, None]
    for row in assessment.rows:
        assert row.as_json() == {
            "read": row.read,
            "rule": "R",
            "bar": row.bar,
            "noise_cv": None,
            "noise_source": "none",
            "windows_per_rung": 32,
            "se": None,
            "mde": None,
            "windows_needed": None,
            "powered": None,
        }
    notes = [n["note"] for n in assessment.notes_json() if n["read"] == "gain"]
    assert notes == [
        f"{rung}.s_per_step: no earlier finished run of molmo2 on cpu-tiny with log_every = 2 and rung {rung}'s "
        "config has s_per_step windows"
        for rung in ("A", "B")
    ]


def test_a_paired_metric_and_a_peak_are_not_estimated_from_window_noise() -> None:
    reads = {"loss_gap": "(B.loss - A.loss) / A.loss", "vram": "B.vram_peak_gib / A.vram_peak_gib"}
    noise = {(rung, metric): known_noise(0.02, 0.0) for rung in ("A", "B") for metric in ("loss", "vram_peak_gib")}
    rows = assess(registration("loss_gap <= 0.01 and vram <= 1.02", reads=reads), noise).rows
    assert [row.powered for row in rows] == [None, None]
    assert "a paired metric" in rows[0].notes[0] and "summarised by max" in rows[1].notes[0]


# --- the schema ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("windows", ["0", "-4", "true", "2.5"])
def test_a_bad_protocol_noise_is_refused_naming_the_field(tmp_path: Path, windows: str) -> None:
    path = write(tmp_path, "bad.toml", _toml(f"[protocol.noise]\nwindows = {windows}\n"))
    with pytest.raises(InvalidInput) as error:
        load_registration(path)
    assert "protocol.noise.windows" in str(error.value)
    if windows in ("0", "-4"):
        assert f"windows = {windows}: " in str(error.value) and "N must be > 0" in str(error.value)


def test_the_sensitivity_fields_validate_and_leave_other_documents_hashing_alike(tmp_path: Path) -> None:
    plain, _ = load_registration(write(tmp_path, "plain.toml", _toml("")))
    stated, _ = load_registration(write(tmp_path, "warn.toml", _toml("", 'on_underpowered = "warn"\n')))
    calibrated, _ = load_registration(
        write(tmp_path, "aa.toml", _toml("[protocol.noise]\nwindows = 8\n", 'on_underpowered = "extend"\n'))
    )
    assert calibrated.protocol.noise.windows == 8 and calibrated.protocol.on_underpowered == "extend"
    assert document_hash(stated) == document_hash(plain) != document_hash(calibrated)
    with pytest.raises(InvalidInput, match="protocol.on_underpowered"):
        load_registration(write(tmp_path, "bad.toml", _toml("", 'on_underpowered = "ignore"\n')))


def _toml(tables: str, protocol_keys: str = "") -> str:
    return f"""
id = "power"
title = "power"
question = "?"
workload = "molmo2"
profile = "cpu-tiny"
[cost]
ceiling_gpu_h = 0.5
[protocol]
steps = 8
log_every = 2
{protocol_keys}
  [[protocol.rungs]]
  id = "A"
{tables}
"""


# --- noise from the ledger and from an A/A calibration, and the verdict's flip probability ------------------------

RUNG_WINDOWS = 16


def windows(rng: random.Random, level: float) -> list[float]:
    return [level * (1 + 0.02 * rng.gauss(0, 1)) for _ in range(RUNG_WINDOWS)]


def record_windows(series: dict[str, list[float]]) -> list[str]:
    items = {"A": "[]", "B": '["P1"]'}
    return [
        f'[rungs.{rung}]\nitems = {items[rung]}\nstatus = "finished"\n'
        + "".join(f"[[rungs.{rung}.windows]]\nstep = {2 * (k + 1)}\ns_per_step = {v!r}\n" for k, v in enumerate(values))
        for rung, values in series.items()
    ]


def gain_of(series: dict[str, list[float]]) -> float:
    a, b = statistics.median(series["A"]), statistics.median(series["B"])
    return (a - b) / a


def toml_of(doc: dict) -> str:
    rules = "".join(
        f'[[rules]]\nid = "{r["id"]}"\nwhen = "{r["when"]}"\noutcome = "{r["outcome"]}"\n' for r in doc["rules"]
    )
    reads = "".join(f'{name} = "{text}"\n' for name, text in doc["reads"].items())
    return f"""
id = "{doc["id"]}"
title = "t"
question = "q"
workload = "molmo2"
profile = "cpu-tiny"
[cost]
ceiling_gpu_h = 0.5
[[items]]
id = "P1"
title = "suffix cudnn"
switch = "suffix_cudnn"
bitwise = false
  [[items.oracles]]
  id = "P1a"
  kind = "tolerance"
  probe = "one_step"
  bounds = {{ loss_abs = 1e-3 }}
[protocol]
steps = {2 * RUNG_WINDOWS}
log_every = 2
config = {{ batch = 4, backward_chunks = 2 }}
  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "B"
  items = ["P1"]
[reads]
{reads}
{rules}
"""


def test_the_flip_probability_of_a_read_on_its_bar_and_of_one_far_from_it(cli: Cli, tmp_path: Path) -> None:
    """Two reads of the same gain: one with its bar a hair under the value (a coin flip whether a resample lands
    above it), one with its bar far below (no resample crosses it). Both rules are tried: the first does not fire."""
    series = {"A": windows(random.Random(1), 1.0), "B": windows(random.Random(2), 0.97)}
    gain = gain_of(series)
    doc = document(
        [
            {"id": "far", "when": f"far_gain < {gain - 0.2!r}", "outcome": "regressed"},
            {"id": "near", "when": f"gain >= {gain - 1e-9!r}", "outcome": "land"},
        ],
        {"gain": GAIN["gain"], "far_gain": GAIN["gain"]},
    )
    doc["id"] = "flip"
    cli.ok("freeze", write(tmp_path, "flip.toml", toml_of(doc)))
    cli.ok(
        "record", "flip", record_file(tmp_path, "r.toml", "[oracles.P1a]\nloss_abs = 1e-4\n", *record_windows(series))
    )
    verdict = cli.ok_json("verdict", "flip")
    assert verdict["rule"] == "near"
    near, far = verdict["robustness"]["gain"], verdict["robustness"]["far_gain"]
    assert set(near) == {"bar", "flip_probability", "fragile"}
    assert near["bar"] == pytest.approx(gain - 1e-9) and 0.35 <= near["flip_probability"] <= 0.65 and near["fragile"]
    assert far == {"bar": gain - 0.2, "flip_probability": 0.0, "fragile": False}


def test_earlier_windows_of_the_same_config_are_the_noise_and_recorded_ones_are_marked(
    cli: Cli, tmp_path: Path
) -> None:
    series = {"A": windows(random.Random(3), 1.0), "B": windows(random.Random(4), 0.95)}
    earlier = document([{"id": "R", "when": "gain >= 0.05", "outcome": "land"}], {"gain": GAIN["gain"]})
    earlier["id"] = "earlier"
    cli.ok("freeze", write(tmp_path, "earlier.toml", toml_of(earlier)))
    cli.ok("record", "earlier", record_file(tmp_path, "r.toml", *record_windows(series)))
    ledger = Ledger.open(str(cli.ledger), create=False)
    states = [load_state(ledger, reg_id) for reg_id in ledger.reg_ids()]
    ledger.close()

    planned = Registration.model_validate(document([{"id": "R", "when": "gain >= 0.05", "outcome": "x"}], GAIN))
    noise = ledger_noise(planned, states)
    found = noise[("A", "s_per_step")]
    assert found.rho == 0.0  # independent draws: the estimate clamps at 0, so the CV is the plain pooled one
    pooled = math.sqrt(statistics.mean((statistics.stdev(v) / statistics.fmean(v)) ** 2 for v in series.values()))
    assert found.cv == pytest.approx(pooled) and found.source == "ledger"
    assert (found.runs, found.windows, found.external_runs) == (2, 2 * RUNG_WINDOWS, 2)
    assert found.level == pytest.approx(statistics.median(series["A"] + series["B"]))
    (row,) = assess(planned, noise).rows
    assert row.noise_source == "ledger" and row.powered is not None
    assert "A.s_per_step: its noise includes 2 recorded (external) run(s)" in row.notes

    other_config = copy.deepcopy(document([{"id": "R", "when": "gain >= 0.05", "outcome": "x"}], GAIN))
    other_config["protocol"]["config"]["batch"] = 8
    assert all(
        not isinstance(n, MetricNoise) for n in ledger_noise(Registration.model_validate(other_config), states).values()
    )
    assert not isinstance(ledger_noise(Registration.model_validate(earlier), states)[("A", "s_per_step")], MetricNoise)

    calibration = {
        "s_per_step": [WindowSeries(tuple(windows(random.Random(k), 1.0)), f"aa/{k}", False) for k in (5, 6)]
    }
    combined = preferring(aa_noise(planned, calibration), noise)
    assert combined[("B", "s_per_step")].source == "aa" and combined[("A", "tokens_per_s")].reason
    (row,) = assess(planned, combined).rows
    assert row.noise_source == "aa"


def test_earlier_windows_match_by_the_effective_config_not_the_keys_a_document_set(cli: Cli, tmp_path: Path) -> None:
    """Two documents that set the same keys but resolved an unset one with different defaults ran different
    configs: the earlier windows are not this ladder's noise. The same earlier windows under the same defaults are."""
    series = {"A": windows(random.Random(7), 1.0), "B": windows(random.Random(8), 0.95)}
    earlier = document([{"id": "R", "when": "gain >= 0.05", "outcome": "land"}], {"gain": GAIN["gain"]})
    earlier["id"] = "earlier"
    cli.ok("freeze", write(tmp_path, "earlier.toml", toml_of(earlier)))
    cli.ok("record", "earlier", record_file(tmp_path, "r.toml", *record_windows(series)))
    with Ledger.open(str(cli.ledger), create=False) as ledger:
        (state,) = [load_state(ledger, reg_id) for reg_id in ledger.reg_ids()]
    planned = Registration.model_validate(document([{"id": "R", "when": "gain >= 0.05", "outcome": "x"}], GAIN))
    assert "grad_clip" not in planned.rung_config("A")
    assert isinstance(ledger_noise(planned, [state])[("A", "s_per_step")], MetricNoise)

    other_defaults = {**state.config_defaults, "grad_clip": planned.effective_config("A").grad_clip / 2}
    elsewhere = dataclasses.replace(state, config_defaults=other_defaults)
    assert elsewhere.registration().rung_config("A") == planned.rung_config("A")  # the same keys set
    found = ledger_noise(planned, [elsewhere])[("A", "s_per_step")]
    assert not isinstance(found, MetricNoise) and "rung A's config" in found.reason
