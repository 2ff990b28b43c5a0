"""FAST: the DCT, the round-trip error bound, range errors, decode errors, serialisation.

The bound under test: encoding rounds each of the T*D scaled DCT coefficients to an integer, moving each by at
most 0.5, i.e. at most 0.5 / scale after unscaling; the orthonormal inverse DCT preserves the L2 norm, so
||decoded - chunk||_F <= sqrt(T * D) * 0.5 / scale, i.e. the per-chunk RMS error is <= 0.5 / scale. The only
slack allowed is float64 rounding in the two matrix products (relative 1e-12).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from tokenizers import Tokenizer

from engine.molmo2.data.fast import CHAR_BASE, FastDecodeError, FastTokenizer, dct_matrix, quantized_coefficients

T, D = 30, 6
FLOAT_SLACK = 1 + 1e-12


def smooth_chunks(rng: np.random.Generator, n: int) -> np.ndarray:
    """Minimum-jerk moves between random poses in [-1, 1], with random durations (some arrive mid-chunk)."""
    start, goal = rng.uniform(-1, 1, (2, n, 1, D))
    duration = rng.uniform(0.5, 2.0, (n, 1, 1))
    tau = np.clip(np.arange(1, T + 1)[None, :, None] / (T * duration), 0, 1)
    return start + (goal - start) * tau**3 * (10 - 15 * tau + 6 * tau**2)


def rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)))


@pytest.fixture(scope="module")
def fitted() -> FastTokenizer:
    rng = np.random.default_rng(0)
    # The constant -1 / +1 chunks reach the largest coefficient any chunk in [-1, 1] can have (sqrt(T)), so
    # every chunk in [-1, 1] is inside this fit's range.
    bounds = np.stack([np.full((T, D), -1.0), np.full((T, D), 1.0)])
    return FastTokenizer.fit(np.concatenate([smooth_chunks(rng, 1500), bounds]), scale=10.0, vocab_size=1024)


def test_dct_matrix_is_the_orthonormal_dct_ii():
    n = 7
    m = dct_matrix(n)
    np.testing.assert_allclose(m @ m.T, np.eye(n), atol=1e-14)
    x = np.random.default_rng(1).normal(size=n)
    # The textbook sum, term by term, with the ortho normalisation.
    direct = [
        math.sqrt((1 if k == 0 else 2) / n)
        * sum(x[t] * math.cos(math.pi * (2 * t + 1) * k / (2 * n)) for t in range(n))
        for k in range(n)
    ]
    np.testing.assert_allclose(m @ x, direct, atol=1e-13)


def test_fit_range_and_vocabulary(fitted: FastTokenizer):
    bound = round(math.sqrt(T) * 10.0)  # the constant +-1 chunks' coefficient 0
    assert (fitted.min_token, fitted.max_token) == (-bound, bound)
    assert fitted.vocab_size == 1024
    assert (fitted.chunk_len, fitted.action_dim) == (T, D)


def test_round_trip_error_bound_on_smooth_chunks(fitted: FastTokenizer):
    chunks = smooth_chunks(np.random.default_rng(2), 400)  # fresh chunks, not the fit's
    worst = 0.0
    for chunk, ids in zip(chunks, fitted.encode_batch(chunks)):
        assert all(0 <= i < fitted.vocab_size for i in ids)
        decoded = fitted.decode(ids)
        worst = max(worst, rms(decoded, chunk))
    assert fitted.rms_error_bound == 0.5 / 10.0
    assert worst <= fitted.rms_error_bound * FLOAT_SLACK
    assert worst > 0  # the bound is not vacuous: rounding did move something


@settings(max_examples=60, deadline=None)
@given(chunk=arrays(np.float64, (T, D), elements=st.floats(-1.0, 1.0, allow_nan=False)))
def test_round_trip_error_bound_on_any_chunk_in_range(fitted: FastTokenizer, chunk: np.ndarray):
    ids = fitted.encode(chunk)
    decoded = fitted.decode(ids)
    assert rms(decoded, chunk) <= 0.5 / fitted.scale * FLOAT_SLACK
    # The quantised chunk is a fixed point: re-encoding the decoded chunk gives the same ids.
    assert fitted.encode(decoded) == ids


def test_encoding_is_frequency_major(fitted: FastTokenizer):
    chunk = np.zeros((T, D))
    chunk[:, 2] = 0.5  # a constant in dim 2: only coefficient (0, 2) is nonzero
    q = quantized_coefficients(chunk, fitted.scale)
    assert q[0, 2] != 0 and np.count_nonzero(q) == 1
    bpe = Tokenizer.from_str(json.dumps(json.loads(fitted.to_json())["bpe"]))
    text = "".join(bpe.id_to_token(i) for i in fitted.encode(chunk))
    values = [ord(c) - CHAR_BASE + fitted.min_token for c in text]
    # Frequency-major: the first D characters are coefficient 0 of dims 0..D-1.
    assert values[:D] == [0, 0, int(q[0, 2]), 0, 0, 0]
    assert values[D:] == [0] * (T * D - D)


def test_out_of_range_coefficient_is_a_clear_error(fitted: FastTokenizer):
    chunk = np.zeros((T, D))
    chunk[:, 4] = 1.5  # coefficient 0 of dim 4 = sqrt(30) * 1.5 * 10 -> 82 > 55
    with pytest.raises(ValueError, match=r"coefficient 82 \(frequency 0, dim 4\) outside the fitted range \[-55, 55\]"):
        fitted.encode(chunk)


def test_encode_refuses_wrong_shape_and_non_finite(fitted: FastTokenizer):
    with pytest.raises(ValueError, match=r"shape \[N, 30, 6\]"):
        fitted.encode(np.zeros((T, D + 1)))
    bad = np.zeros((T, D))
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        fitted.encode(bad)


def test_fit_refuses_a_range_larger_than_the_vocabulary():
    chunks = smooth_chunks(np.random.default_rng(3), 50)
    with pytest.raises(ValueError, match=r"values\) at scale 100.0, more than the vocabulary of 1024"):
        FastTokenizer.fit(np.concatenate([chunks, np.ones((1, T, D))]), scale=100.0, vocab_size=1024)


def test_small_vocabulary_fit_for_tiny_profiles():
    chunks = np.concatenate([smooth_chunks(np.random.default_rng(4), 300), np.ones((1, T, D)), -np.ones((1, T, D))])
    tiny = FastTokenizer.fit(chunks, scale=2.0, vocab_size=48)
    assert tiny.vocab_size <= 48
    decoded = tiny.decode(tiny.encode(chunks[0]))
    assert rms(decoded, chunks[0]) <= 0.25 * FLOAT_SLACK


def test_decode_of_a_malformed_sequence_raises(fitted: FastTokenizer):
    ids = fitted.encode(smooth_chunks(np.random.default_rng(5), 1)[0])
    with pytest.raises(FastDecodeError, match=r"a \(30, 6\) chunk needs 180"):
        fitted.decode(ids[:-1] if len(ids) > 1 else ids + ids)
    with pytest.raises(FastDecodeError, match="needs 180"):
        fitted.decode([])
    with pytest.raises(FastDecodeError, match=r"id 1024 at position 1 is not in \[0, 1024\)"):
        fitted.decode([ids[0], 1024])
    assert issubclass(FastDecodeError, ValueError)


def test_save_load_round_trip(fitted: FastTokenizer, tmp_path):
    path = tmp_path / "fast.json"
    fitted.save(path)
    loaded = FastTokenizer.load(path)
    assert loaded == fitted
    assert loaded.to_json() == fitted.to_json()
    chunks = smooth_chunks(np.random.default_rng(6), 20)
    assert loaded.encode_batch(chunks) == fitted.encode_batch(chunks)
    body = json.loads(path.read_text())
    assert {"scale", "min_token", "max_token", "chunk_len", "action_dim", "bpe"} <= set(body)


def test_load_refuses_another_format(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a FAST tokenizer file"):
        FastTokenizer.load(path)


def test_fit_is_deterministic():
    chunks = smooth_chunks(np.random.default_rng(7), 200)
    assert FastTokenizer.fit(chunks).to_json() == FastTokenizer.fit(chunks).to_json()
