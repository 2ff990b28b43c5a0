"""FAST: the action tokenizer of pi0-FAST / MolmoAct (its `UniversalActionProcessor`), written for this workload.

A chunk of actions [T, D] becomes a variable-length list of BPE ids:

    DCT-II (orthonormal, along time) -> * scale -> round -> frequency-major flatten (coefficient 0 of every
    dimension, then coefficient 1, ...) -> - min_token -> one character per integer -> BPE

and back. Rounding is the only lossy step: each coefficient moves by at most 0.5 / scale, and the orthonormal
inverse DCT preserves the L2 norm, so the RMS error of a decoded chunk is at most 0.5 / scale.

Departures from the reference implementation, each deliberate:
- Integers map to characters of the Unicode Private Use Area (U+E000 + v), so no value becomes whitespace, a
  control character or a surrogate (openpi #333 fed surrogates to the BPE and got garbage).
- A coefficient outside the fitted range is a ValueError naming it, never clamped.
- A token string that does not reshape to (T, D) raises `FastDecodeError` (openpi returns zeros silently,
  which an MAE metric then scores as a plausible "stand still" action). Callers that expect malformed output —
  greedy decode early in training — catch it and count it.
- The BPE is character-level (no byte-level remapping): every alphabet character is one initial token, and
  `vocab_size` counts the alphabet plus the merges.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, models, trainers

FORMAT = "prereg.fast/1"
# First code point of the Private Use Area (U+E000..U+F8FF, 6,400 code points: room for any vocabulary we fit).
CHAR_BASE = 0xE000
_PUA_SIZE = 6400


class FastDecodeError(ValueError):
    """A token sequence that is not a FAST encoding of a (T, D) chunk."""


@lru_cache(maxsize=16)
def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II matrix M [n, n]: coefficients = M @ signal, signal = M.T @ coefficients.

    M[k, t] = sqrt(2 / n) * cos(pi * (2t + 1) * k / (2n)), with row 0 scaled by 1/sqrt(2) (scipy's
    `dct(type=2, norm="ortho")`)."""
    k = np.arange(n, dtype=np.float64)[:, None]
    t = np.arange(n, dtype=np.float64)[None, :]
    m = np.sqrt(2.0 / n) * np.cos(np.pi * (2.0 * t + 1.0) * k / (2.0 * n))
    m[0] /= np.sqrt(2.0)
    m.setflags(write=False)
    return m


def quantized_coefficients(chunks: np.ndarray, scale: float) -> np.ndarray:
    """[..., T, D] actions -> [..., T, D] integer DCT coefficients (round half to even, as np.around)."""
    chunks = np.asarray(chunks, dtype=np.float64)
    return np.rint(np.einsum("kt,...td->...kd", dct_matrix(chunks.shape[-2]), chunks) * scale).astype(np.int64)


class FastTokenizer:
    """A fitted FAST tokenizer. Build with `fit` or `load`; immutable afterwards."""

    def __init__(self, bpe: Tokenizer, *, scale: float, min_token: int, max_token: int, chunk_len: int,
                 action_dim: int, fitted_on: str = "") -> None:  # fmt: skip
        if not scale > 0:
            raise ValueError(f"FAST scale = {scale!r} is invalid; allowed: > 0")
        if chunk_len < 1 or action_dim < 1:
            raise ValueError(f"FAST chunk shape ({chunk_len}, {action_dim}) is invalid; allowed: both >= 1")
        if max_token < min_token:
            raise ValueError(f"FAST range [{min_token}, {max_token}] is empty")
        alphabet = max_token - min_token + 1
        if bpe.get_vocab_size() < alphabet:
            raise ValueError(f"the BPE vocabulary ({bpe.get_vocab_size()}) is smaller than the alphabet ({alphabet})")
        self._bpe = bpe
        self.scale = float(scale)
        self.min_token = int(min_token)
        self.max_token = int(max_token)
        self.chunk_len = int(chunk_len)
        self.action_dim = int(action_dim)
        self.fitted_on = fitted_on  # free-form provenance of the fit data, saved with the tokenizer

    # ---- construction ----
    @classmethod
    def fit(cls, chunks: np.ndarray, scale: float = 10.0, vocab_size: int = 1024, *,
            fitted_on: str = "") -> "FastTokenizer":  # fmt: skip
        """Fit on chunks [N, T, D]: the integer range of their rounded coefficients becomes the alphabet, and
        a BPE of `vocab_size` tokens (alphabet included) is trained on their character strings."""
        if not scale > 0:
            raise ValueError(f"FAST scale = {scale!r} is invalid; allowed: > 0")
        if not 1 <= vocab_size <= _PUA_SIZE:
            raise ValueError(f"FAST vocab_size = {vocab_size}; allowed: 1..{_PUA_SIZE} (the Private Use Area's size)")
        chunks = np.asarray(chunks, dtype=np.float64)
        if chunks.ndim != 3 or chunks.shape[0] == 0:
            raise ValueError(f"FAST fit needs chunks of shape [N >= 1, T, D]; got {chunks.shape}")
        if not np.isfinite(chunks).all():
            raise ValueError("FAST fit got non-finite actions")
        q = quantized_coefficients(chunks, scale)
        lo, hi = int(q.min()), int(q.max())
        alphabet = hi - lo + 1
        if alphabet > vocab_size:
            raise ValueError(
                f"FAST fit: the rounded coefficients span [{lo}, {hi}] ({alphabet} values) at scale {scale}, more "
                f"than the vocabulary of {vocab_size}; lower the scale or raise vocab_size"
            )
        bpe = Tokenizer(models.BPE())  # no pre-tokenizer: a chunk's string is one word
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,  # a merge must occur twice, as in the reference
            initial_alphabet=[chr(CHAR_BASE + v) for v in range(alphabet)],
            special_tokens=[],
            show_progress=False,
        )
        bpe.train_from_iterator(_strings(q - lo), trainer=trainer)
        return cls(bpe, scale=scale, min_token=lo, max_token=hi, chunk_len=chunks.shape[1],
                   action_dim=chunks.shape[2], fitted_on=fitted_on)  # fmt: skip

    # ---- properties ----
    @property
    def vocab_size(self) -> int:
        """Number of BPE ids: every id this tokenizer emits is in [0, vocab_size)."""
        return self._bpe.get_vocab_size()

    @property
    def rms_error_bound(self) -> float:
        """The guaranteed bound on a decoded chunk's RMS error (see the module docstring)."""
        return 0.5 / self.scale

    # ---- encode / decode ----
    def encode(self, chunk: Any) -> list[int]:
        """One chunk [T, D] -> BPE ids. ValueError if the shape or a coefficient is outside the fit."""
        return self.encode_batch(np.asarray(chunk, dtype=np.float64)[None])[0]

    def encode_batch(self, chunks: Any) -> list[list[int]]:
        chunks = np.asarray(chunks, dtype=np.float64)
        shape = (self.chunk_len, self.action_dim)
        if chunks.ndim != 3 or chunks.shape[1:] != shape:
            raise ValueError(f"FAST encode expects chunks of shape [N, {shape[0]}, {shape[1]}]; got {chunks.shape}")
        if not np.isfinite(chunks).all():
            raise ValueError("FAST encode got non-finite actions")
        q = quantized_coefficients(chunks, self.scale)
        bad = np.argwhere((q < self.min_token) | (q > self.max_token))
        if len(bad):
            n, k, d = (int(i) for i in bad[0])
            raise ValueError(
                f"FAST encode: chunk {n} has rounded coefficient {int(q[n, k, d])} (frequency {k}, dim {d}) outside "
                f"the fitted range [{self.min_token}, {self.max_token}] at scale {self.scale}; {len(bad)} "
                "coefficient(s) out of range in total — refit on data covering these actions or lower the scale"
            )
        return [e.ids for e in self._bpe.encode_batch(_strings(q - self.min_token))]

    def decode(self, ids: list[int] | tuple[int, ...], *, partial: bool = False) -> np.ndarray:
        """BPE ids -> the chunk [T, D] (float64). FastDecodeError if the ids do not spell a (T, D) chunk.

        With `partial`, a wrong coefficient count is completed instead: coefficients are frequency-major, so a
        short sequence lacks the highest frequencies (taken as 0) and a long one's excess is dropped. Callers
        that use it (the evaluation probe) count such decodes; nothing is completed silently."""
        text = []
        for position, i in enumerate(ids):
            token = self._bpe.id_to_token(int(i)) if 0 <= int(i) < self.vocab_size else None
            if token is None:
                raise FastDecodeError(f"FAST decode: id {i} at position {position} is not in [0, {self.vocab_size})")
            text.append(token)
        values = np.fromiter((ord(c) - CHAR_BASE for c in "".join(text)), dtype=np.int64)
        expected = self.chunk_len * self.action_dim
        if partial and values.size != expected:
            values = np.concatenate([values, np.full(max(0, expected - values.size), -self.min_token)])[:expected]
        if values.size != expected:
            raise FastDecodeError(
                f"FAST decode: {len(ids)} ids spell {values.size} coefficients; a ({self.chunk_len}, "
                f"{self.action_dim}) chunk needs {expected}"
            )
        coefficients = (values + self.min_token).reshape(self.chunk_len, self.action_dim) / self.scale
        return dct_matrix(self.chunk_len).T @ coefficients

    # ---- serialisation ----
    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "scale": self.scale,
            "min_token": self.min_token,
            "max_token": self.max_token,
            "chunk_len": self.chunk_len,
            "action_dim": self.action_dim,
            "char_base": CHAR_BASE,
            "fitted_on": self.fitted_on,
            "bpe": json.loads(self._bpe.to_str()),
        }
        return json.dumps(body, sort_keys=True, ensure_ascii=True)

    @classmethod
    def from_json(cls, text: str) -> "FastTokenizer":
        body = json.loads(text)
        if body.get("format") != FORMAT:
            raise ValueError(f"not a FAST tokenizer file: format {body.get('format')!r}; expected {FORMAT!r}")
        if body["char_base"] != CHAR_BASE:
            raise ValueError(f"FAST file char_base {body['char_base']:#x} differs from this code's {CHAR_BASE:#x}")
        bpe = Tokenizer.from_str(json.dumps(body["bpe"]))
        return cls(bpe, scale=body["scale"], min_token=body["min_token"], max_token=body["max_token"],
                   chunk_len=body["chunk_len"], action_dim=body["action_dim"],
                   fitted_on=body["fitted_on"])  # fmt: skip

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="ascii")

    @classmethod
    def load(cls, path: str | Path) -> "FastTokenizer":
        return cls.from_json(Path(path).read_text(encoding="ascii"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FastTokenizer) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __repr__(self) -> str:
        return (f"FastTokenizer(vocab_size={self.vocab_size}, scale={self.scale}, range=[{self.min_token}, "
                f"{self.max_token}], chunk=({self.chunk_len}, {self.action_dim}))")  # fmt: skip


def _strings(shifted: np.ndarray) -> list[str]:
    """[N, T, D] non-negative ints -> one string per chunk, frequency-major (row-major over [T, D])."""
    flat = shifted.reshape(shifted.shape[0], -1) + CHAR_BASE
    return ["".join(map(chr, row)) for row in flat.tolist()]
