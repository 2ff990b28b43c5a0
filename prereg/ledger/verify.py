"""Recomputing the chain: the check behind `Ledger.verify` and `Ledger.import_jsonl`.

Per entry, in seq order: the seq is the next one, prev_head is the head before it, the body hashes to its
head, and the kind/reg_id/ref/ts columns are exactly the envelope's (compared as canonical text, so a
sound body is never parsed: a million entries verify in seconds).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prereg.ledger.chain import genesis_head, link_raw
from prereg.ledger.envelope import ENVELOPE_HEAD, envelope_tail, explain_disagreement


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    entries: int  # rows in the ledger
    head: str  # the head after the last entry that verified (the current head when ok)
    first_bad: int | None  # the first seq that failed, or that is missing
    reason: str | None


class ChainWalk:
    """Walks entries in seq order from genesis, recomputing every link; `step` says what is wrong, if anything.

    A walk stops trusting at the first bad entry: its state is then the last good head.
    """

    def __init__(self, name: str):
        self.seq = 0
        self.head = genesis_head(name)
        self._head_raw = bytes.fromhex(self.head)

    def step(
        self, seq: int, kind: str, reg_id: str | None, ref: str | None, ts: str, body: str, prev_head: str, head: str
    ) -> str | None:
        """Check the next entry (body as text, its UTF-8 bytes are what was hashed); None when it is good."""
        expected = self.seq + 1
        if seq != expected:
            return f"seq {expected} is missing: the entry after seq {self.seq} is seq {seq}"
        if prev_head != self.head:
            return (
                f"prev_head {prev_head[:16]}… does not link to the head of seq {self.seq} ({self.head[:16]}…): "
                f"seq {self.seq} or this entry was rewritten"
            )
        raw = link_raw(self._head_raw, body.encode("utf-8"))
        if raw.hex() != head:
            return "the body does not hash to the stored head: its bytes were edited"
        try:
            agrees = body.startswith(ENVELOPE_HEAD) and body.endswith(envelope_tail(seq, kind, reg_id, ref, ts))
        except TypeError:  # a column of the wrong type, stored behind our back
            agrees = False
        if not agrees:
            return explain_disagreement(body, seq, kind, reg_id, ref, ts)
        self.seq, self.head, self._head_raw = seq, head, raw
        return None


def verify_rows(name: str, rows: Iterable[tuple], published_head: str | None) -> VerifyReport:
    """Verify rows (seq, kind, reg_id, ref, ts, body text, prev_head, head) given in seq order."""
    walk = ChainWalk(name)
    published_seen = published_head is None or published_head == walk.head
    rows = iter(rows)
    count = 0
    for seq, kind, reg_id, ref, ts, body, prev_head, head in rows:
        count += 1
        reason = walk.step(seq, kind, reg_id, ref, ts, body, prev_head, head)
        if reason is not None:
            count += sum(1 for _ in rows)  # the rest is untrusted, but still counted
            first_bad = walk.seq + 1
            return VerifyReport(False, count, walk.head, first_bad, f"seq {first_bad}: {reason}")
        if head == published_head:
            published_seen = True
    if not published_seen:
        first_bad = walk.seq + 1
        reason = (
            f"the published head {published_head} is no entry's head: the ledger was truncated or rewritten "
            f"after it was published (it ends at seq {walk.seq})"
        )
        return VerifyReport(False, count, walk.head, first_bad, reason)
    return VerifyReport(True, count, walk.head, None, None)
