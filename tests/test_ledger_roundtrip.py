"""Hypothesis round-trips: canonical JSON (what every head hashes), the envelope's tail, export -> import.

The export -> import round-trip runs on both backends (`[sqlite]`, `[postgresql]`; see conftest).
"""

from __future__ import annotations

import io
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prereg.canonical import canonical_bytes, canonical_hash
from prereg.ledger import Ledger
from prereg.ledger.envelope import ENVELOPE_HEAD, envelope_bytes, envelope_tail

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=24,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=5)


def reordered(value, rng):
    """The same value with every dict's keys inserted in another order."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {key: reordered(value[key], rng) for key in keys}
    if isinstance(value, list):
        return [reordered(item, rng) for item in value]
    return value


@given(json_values, st.randoms(use_true_random=False))
def test_canonical_bytes_ignore_key_order(value, rng):
    assert canonical_bytes(reordered(value, rng)) == canonical_bytes(value)
    assert canonical_hash(reordered(value, rng)) == canonical_hash(value)


@given(json_values)
def test_canonical_bytes_round_trip_through_json(value):
    encoded = canonical_bytes(value)
    assert json.loads(encoded) == value
    assert canonical_bytes(json.loads(encoded)) == encoded  # a fixed point: re-encoding changes nothing
    assert b"\n" not in encoded  # one entry, one JSONL line


non_finite = st.sampled_from([math.nan, math.inf, -math.inf])


@given(
    st.recursive(
        non_finite,
        lambda inner: st.tuples(inner, st.lists(json_values, max_size=2), st.text(max_size=4)).flatmap(
            lambda parts: st.sampled_from([[*parts[1], parts[0]], {parts[2]: parts[0], "_": parts[1]}])
        ),
        max_leaves=6,
    )
)
def test_non_finite_floats_are_refused_at_any_depth(value):
    with pytest.raises(ValueError, match="canonical"):
        canonical_bytes(value)


@pytest.mark.parametrize("value", [{1: "a"}, {"a": {None: 1}}, [{(1, 2): 3}]])
def test_non_string_keys_are_refused(value):
    with pytest.raises(ValueError, match="not a string"):
        canonical_bytes(value)


kinds = st.sampled_from(["freeze", "amend", "oracle", "run-start", "window", "run-end", "record", "verdict"])
# Column values: any text but NUL, which no backend stores (PostgreSQL's text cannot hold it; append refuses it).
no_nul = st.characters(codec="utf-8", exclude_characters="\x00")
column_text = st.text(no_nul, min_size=1, max_size=10)
reg_ids = st.none() | column_text
refs = st.none() | column_text


@given(st.integers(1, 2**40), kinds, reg_ids, refs, json_objects)
def test_the_tail_check_agrees_with_the_envelope(seq, kind, reg_id, ref, data):
    ts = "2026-03-14T02:26:00.123456Z"
    body = envelope_bytes(seq, kind, reg_id, ref, ts, data).decode()
    assert body.startswith(ENVELOPE_HEAD) and body.endswith(envelope_tail(seq, kind, reg_id, ref, ts))
    # and any other column value breaks it
    assert not body.endswith(envelope_tail(seq + 1, kind, reg_id, ref, ts))
    assert not body.endswith(envelope_tail(seq, kind, reg_id, ref, ts.replace("2026", "2025")))
    assert not body.endswith(envelope_tail(seq, kind, reg_id, (ref or "") + "x", ts))
    assert not body.endswith(envelope_tail(seq, kind, None if reg_id else "r", ref, ts))


items = st.lists(st.tuples(kinds, reg_ids, json_objects, refs), max_size=12)


# new_ledger_url is a factory: every example asks it for two fresh places, so sharing it across examples is safe.
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(st.lists(items, min_size=1, max_size=3), st.text(no_nul, min_size=1, max_size=12))
def test_export_then_import_gives_the_same_ledger(new_ledger_url, batches, name):
    with Ledger.open(new_ledger_url(), name=name) as source:
        for batch in batches:
            source.append_many(batch)
        exported = io.StringIO()
        count = source.export_jsonl(exported)
        assert count == sum(len(batch) for batch in batches)
        with Ledger.import_jsonl(io.StringIO(exported.getvalue()), new_ledger_url()) as copy:
            assert copy.name == name
            assert copy.head() == source.head()
            assert list(copy.entries()) == list(source.entries())
            assert copy.verify().ok
            again = io.StringIO()
            copy.export_jsonl(again)
            assert again.getvalue() == exported.getvalue()
