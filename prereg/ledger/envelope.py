"""The envelope: what one entry's body is, and the checks that tie its columns to it.

An entry's body is the canonical JSON of {"seq", "kind", "reg", "ref", "ts", "data"}. The table's
kind/reg_id/ref/ts columns are projections of it kept for indexing; the body is what the chain hashes, so
the body is the truth and a column that disagrees with it is corruption.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from json.encoder import encode_basestring as _json_string  # the string encoder of json.dumps(ensure_ascii=False)
from typing import Any

from prereg.canonical import canonical_bytes

ENVELOPE_KEYS = frozenset({"seq", "kind", "reg", "ref", "ts", "data"})
# Kinds are short lowercase words (freeze, amend, run-start, ...): a typo'd or free-text kind would split a
# registration's history across names that no query asks for.
KIND_PATTERN = re.compile(r"[a-z][a-z0-9-]{0,63}\Z")
TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def utc_timestamp() -> str:
    """Now in UTC, ISO-8601, always with microseconds and `Z`: fixed width, so text order is time order."""
    return datetime.now(timezone.utc).strftime(TS_FORMAT)


def check_item(kind: object, reg_id: object, data: object, ref: object) -> None:
    """Refuse an entry that could not be stored faithfully, naming the bad value (ValueError)."""
    if not isinstance(kind, str) or not KIND_PATTERN.match(kind):
        raise ValueError(f"entry kind {kind!r} is not a lowercase word matching {KIND_PATTERN.pattern}")
    for field, value in (("reg_id", reg_id), ("ref", ref)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"entry {field} {value!r} must be a non-empty string or None")
        if value is not None and "\x00" in value:
            # PostgreSQL's text cannot hold NUL: refused on every backend, so any ledger can move to PostgreSQL.
            raise ValueError(f"entry {field} {value!r} contains a NUL character, which no ledger backend stores")
    if not isinstance(data, dict):
        raise ValueError(f"entry data must be a dict, got {type(data).__name__}")


def envelope_bytes(seq: int, kind: str, reg_id: str | None, ref: str | None, ts: str, data: dict) -> bytes:
    envelope = {"seq": seq, "kind": kind, "reg": reg_id, "ref": ref, "ts": ts, "data": data}
    return canonical_bytes(envelope)


ENVELOPE_HEAD = '{"data":{'  # canonical key order: data, kind, ref, reg, seq, ts


def envelope_tail(seq: int, kind: str, reg_id: str | None, ref: str | None, ts: str) -> str:
    """The canonical text that follows the data in the envelope of these column values.

    For a canonical envelope, `body.endswith(envelope_tail(columns))` holds exactly when the columns equal
    the envelope's fields: a `,"kind":` preceded by a comma can only be the top-level key (inside a JSON
    string every quote is escaped), so the two tails align, and JSON's string encoding is injective. It lets
    verify check a million bodies without parsing them; a body that fails is parsed to say why.
    """
    reg = "null" if reg_id is None else _json_string(reg_id)
    ref_text = "null" if ref is None else _json_string(ref)
    return f',"kind":{_json_string(kind)},"ref":{ref_text},"reg":{reg},"seq":{seq},"ts":{_json_string(ts)}}}'


def explain_disagreement(body: str, seq: int, kind: str, reg_id: str | None, ref: str | None, ts: str) -> str:
    """Why a body whose hash is right is not the canonical envelope of its columns."""
    try:
        envelope = json.loads(body)
    except ValueError as error:
        return f"the body is not JSON: {error}"
    mismatch = projection_mismatch(envelope, seq, kind, reg_id, ref, ts)
    if mismatch is not None:
        return mismatch
    return "the body is not the canonical JSON of its envelope"


def projection_mismatch(envelope: Any, seq: int, kind: str, reg_id: str | None, ref: str | None, ts: str) -> str | None:
    """Why the stored columns disagree with the parsed body, or None when they agree."""
    if not isinstance(envelope, dict) or envelope.keys() != ENVELOPE_KEYS:
        keys = sorted(envelope) if isinstance(envelope, dict) else type(envelope).__name__
        return f"body is not an envelope with keys {sorted(ENVELOPE_KEYS)}: {keys}"
    if not isinstance(envelope["data"], dict):
        return "body's data is not an object"
    for column, stored, enveloped in (
        ("seq", seq, envelope["seq"]),
        ("kind", kind, envelope["kind"]),
        ("reg_id", reg_id, envelope["reg"]),
        ("ref", ref, envelope["ref"]),
        ("ts", ts, envelope["ts"]),
    ):
        # type() as well: True == 1, and a bool seq in a body is not the int seq of the column.
        if stored != enveloped or type(stored) is not type(enveloped):
            return f"column {column}={stored!r} disagrees with the body's {enveloped!r}"
    return None
