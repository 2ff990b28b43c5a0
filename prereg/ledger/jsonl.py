"""A ledger as JSON lines: to move it between backends, archive it, or read it with jq.

Line 1 is `{"format":1,"ledger":NAME}`. Every further line is one entry: its envelope's fields
(seq, kind, reg, ref, ts, data) plus `prev_head` and `head`, in canonical JSON, so the same ledger always
exports to the same bytes. The body is not carried as a string: it is the canonical form of the envelope,
rebuilt on import, and the chain check proves the rebuilt bytes are the ones that were hashed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import IO, Any

from prereg.canonical import canonical_bytes
from prereg.errors import InvalidInput, LedgerCorrupt
from prereg.ledger.envelope import ENVELOPE_KEYS
from prereg.ledger.tables import FORMAT_VERSION
from prereg.ledger.verify import ChainWalk

IMPORT_BATCH = 5000  # rows per INSERT while importing; the whole import is still one transaction
_LINE_KEYS = ENVELOPE_KEYS | {"prev_head", "head"}


def export_entries(name: str, rows: Iterable[tuple], out: IO[str]) -> int:
    out.write(canonical_bytes({"ledger": name, "format": FORMAT_VERSION}).decode("utf-8") + "\n")
    count = 0
    for _seq, _kind, _reg, _ref, _ts, body, prev_head, head in rows:
        line = json.loads(body)
        line["prev_head"], line["head"] = prev_head, head
        out.write(canonical_bytes(line).decode("utf-8") + "\n")
        count += 1
    return count


def read_header(src: IO[str]) -> str:
    """The ledger name from an export's first line; InvalidInput if it is not a prereg export."""
    first = src.readline()
    try:
        header = json.loads(first)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.keys() != {"ledger", "format"} or not isinstance(header["ledger"], str):
        raise InvalidInput(
            f"line 1 {first[:80]!r} is not a prereg ledger export header",
            fix='an export starts with {"format":1,"ledger":NAME}',
        )
    if header["format"] != FORMAT_VERSION:
        raise InvalidInput(f"export format {header['format']!r} is not {FORMAT_VERSION}", where="line 1")
    return header["ledger"]


def read_rows(name: str, src: IO[str]) -> Iterator[list[dict[str, Any]]]:
    """Table rows from an export's entry lines, in batches, each line re-verified against the chain first.

    Raises LedgerCorrupt naming the first bad seq (and its line); nothing after it is yielded.
    """
    walk = ChainWalk(name)
    batch: list[dict[str, Any]] = []
    for line_number, line in enumerate(src, start=2):  # iterating splits on "\n" only; JSON escapes it
        expected = walk.seq + 1
        try:
            fields = json.loads(line)
            if not isinstance(fields, dict) or fields.keys() != _LINE_KEYS:
                raise ValueError(f"not an entry line with keys {sorted(_LINE_KEYS)}")
            prev_head, head = fields.pop("prev_head"), fields.pop("head")
            if not (isinstance(prev_head, str) and isinstance(head, str)):
                raise ValueError(f"prev_head {prev_head!r} and head {head!r} must be strings")
            body = canonical_bytes(fields).decode("utf-8")
        except (ValueError, TypeError) as error:
            raise LedgerCorrupt(f"line {line_number}: {error}", first_bad=expected) from error
        row = (fields["seq"], fields["kind"], fields["reg"], fields["ref"], fields["ts"], body, prev_head, head)
        reason = walk.step(*row)
        if reason is not None:
            raise LedgerCorrupt(f"line {line_number}: seq {expected}: {reason}", first_bad=expected)
        batch.append(
            {
                "seq": row[0],
                "kind": row[1],
                "reg_id": row[2],
                "ref": row[3],
                "ts": row[4],
                "body": body,
                "prev_head": prev_head,
                "head": head,
            }
        )
        if len(batch) >= IMPORT_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
