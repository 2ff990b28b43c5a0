"""Paired per-row differences: a measurement recorded row by row (one value per frame id, `prereg record`'s
`[rungs.R.rows.METRIC]`) against an anchor's rows of the same ids.

The difference of row k is this rung's value minus the anchor's; the mean of the differences has a two-sided 95%
interval from Student's t over the rows' standard error. Rows pair by id, never by position: when the two sets of
ids differ, the result is undefined and its reason names the rows that did not pair (seed 003: "a pairing failure
is reported, not silently pooled").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from statistics import NormalDist

from prereg.rules.values import Undefined, Value

Rows = Mapping[str, float]
SHOWN_IDS = 3  # row ids a pairing failure names before it counts the rest


def t_quantile_975(df: int) -> float:
    """Student's t 0.975 quantile: exact for 1 and 2 degrees of freedom, else the Cornish-Fisher expansion
    (Abramowitz & Stegun 26.7.5), within 0.004 of the exact value from 3 degrees of freedom on."""
    assert df >= 1, df
    if df == 1:
        return math.tan(math.pi * 0.475)
    if df == 2:
        return 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))
    z = NormalDist().inv_cdf(0.975)
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4)
    )


def _ids(ids: list[str]) -> str:
    shown = ", ".join(repr(i) for i in sorted(ids)[:SHOWN_IDS])
    return shown + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


def differences(rows: Rows, anchor: Rows, names: tuple[str, str]) -> list[float] | Undefined:
    """rows[k] - anchor[k] for every id, or why the rows do not pair."""
    name, anchor_name = names
    unpaired = []
    only_here = [k for k in rows if k not in anchor]
    only_there = [k for k in anchor if k not in rows]
    if only_here:
        unpaired.append(f"{len(only_here)} row(s) of {name} have no row in {anchor_name} ({_ids(only_here)})")
    if only_there:
        unpaired.append(f"{len(only_there)} row(s) of {anchor_name} have no row in {name} ({_ids(only_there)})")
    if unpaired:
        return Undefined(f"the rows do not pair: {'; '.join(unpaired)}")
    broken = [k for k in rows if not (math.isfinite(rows[k]) and math.isfinite(anchor[k]))]
    if broken:
        return Undefined(f"{len(broken)} paired row(s) are not finite ({_ids(broken)})")
    if len(rows) < 2:
        return Undefined(f"{len(rows)} paired row(s): an interval needs at least 2")
    return [rows[k] - anchor[k] for k in sorted(rows)]


def _interval(deltas: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(deltas)
    half = t_quantile_975(len(deltas) - 1) * statistics.stdev(deltas) / math.sqrt(len(deltas))
    return mean, mean - half, mean + half


def paired_delta(deltas: list[float]) -> Value:
    return _interval(deltas)[0]


def paired_delta_low(deltas: list[float]) -> Value:
    return _interval(deltas)[1]


def paired_delta_high(deltas: list[float]) -> Value:
    return _interval(deltas)[2]
