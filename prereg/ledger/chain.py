"""The hash chain: pure functions over raw bytes, no storage.

head_i = sha256(0x01 || head_{i-1} || sha256(0x00 || body_i)), over raw 32-byte digests; heads are stored
and shown as lowercase hex. The 0x00/0x01 prefixes separate leaf hashes from link hashes, so a body can never
be passed off as a link (the RFC 6962 domain separation). The genesis head is derived from the ledger's name,
so two ledgers never share a chain prefix.
"""

from __future__ import annotations

import hashlib

GENESIS_PREFIX = b"prereg-genesis\x00"
_LEAF = b"\x00"
_LINK = b"\x01"
HEAD_HEX_LEN = 64


def genesis_head(name: str) -> str:
    return hashlib.sha256(GENESIS_PREFIX + name.encode("utf-8")).hexdigest()


def body_digest(body: bytes) -> bytes:
    return hashlib.sha256(_LEAF + body).digest()


def link_raw(prev_head: bytes, body: bytes) -> bytes:
    """`link` over raw digests, for loops that keep the running head as bytes."""
    return hashlib.sha256(_LINK + prev_head + hashlib.sha256(_LEAF + body).digest()).digest()


def link(prev_head: str, body: bytes) -> str:
    """The head (hex) that follows `prev_head` (hex) once `body` is appended."""
    return link_raw(bytes.fromhex(prev_head), body).hex()


def is_head(value: object) -> bool:
    """Whether `value` has the form of a head: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == HEAD_HEX_LEN and all(c in "0123456789abcdef" for c in value)
