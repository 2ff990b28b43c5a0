"""Canonical JSON: the one byte form of a body that every hash is taken over.

Sorted keys, no insignificant whitespace, UTF-8, integers as integers, floats by Python's shortest
round-trip repr. NaN and infinities have no JSON form and are refused: a measurement that is not finite
is recorded as the string "nan"/"inf"/"-inf" by the caller, deliberately.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


def _check_finite(value: Any, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path}: {value!r} has no canonical JSON form; encode it as a string")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path}: key {key!r} is not a string")
            _check_finite(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_finite(item, f"{path}[{index}]")


def canonical_bytes(value: Any) -> bytes:
    _check_finite(value, "$")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def canonical_hash(value: Any) -> str:
    return hashlib.sha256(canonical_bytes(value)).hexdigest()


def file_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_nonfinite(window: dict[str, Any]) -> dict[str, Any]:
    """A measurement that is not finite is kept, as the string "nan"/"inf"/"-inf" (JSON has no such numbers)."""
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in window.items()}


def decode_nonfinite(window: dict[str, Any]) -> dict[str, Any]:
    return {k: (NONFINITE[v] if isinstance(v, str) and v in NONFINITE else v) for k, v in window.items()}
