"""The ledger's interface: opening, appending, querying, the chain's exact form, verify on a sound ledger.

Every test that takes `ledger` or `ledger_url` runs on both backends (`[sqlite]`, `[postgresql]`; see conftest);
the ones about SQLite's file, WAL and locking take `sqlite_ledger` or a path.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sqlite3

import pytest
from conftest import RawLedgerDb
from sqlalchemy import event

from prereg.canonical import canonical_bytes
from prereg.errors import InvalidInput, LedgerCorrupt
from prereg.ledger import Entry, Ledger, VerifyReport, genesis_head, sqlite_wal_reset_affected

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\Z")


@pytest.fixture
def ledger(ledger_url):
    with Ledger.open(ledger_url) as opened:
        yield opened


@pytest.fixture
def sqlite_ledger(tmp_path):
    with Ledger.open(str(tmp_path / "ledger.db")) as opened:
        yield opened


def fill(ledger: Ledger) -> list[Entry]:
    """Two registrations, two runs of windows, lifecycle entries around them."""
    items = [("freeze", "reg-a", {"doc": "a1"}, None), ("freeze", "reg-b", {"doc": "b1"}, None)]
    items += [("run-start", "reg-a", {"rung": "A"}, "run-1")]
    items += [("window", "reg-a", {"step": s}, "run-1") for s in range(3)]
    items += [("run-end", "reg-a", {"status": "finished"}, "run-1"), ("run-start", "reg-a", {"rung": "C"}, "run-2")]
    items += [("window", "reg-a", {"step": s}, "run-2") for s in range(2)]
    items += [("window", "reg-b", {"step": 0}, "run-3"), ("verdict", "reg-a", {"outcome": "land"}, None)]
    return ledger.append_many(items)


# --- the chain's exact bytes: computed here by hand, independently of prereg.ledger.chain ---------------


def test_genesis_head_is_derived_from_the_name(ledger_url):
    expected = hashlib.sha256(b"prereg-genesis\x00lab").hexdigest()
    assert genesis_head("lab") == expected
    with Ledger.open(ledger_url, name="lab") as ledger:
        assert ledger.head() == (0, expected)
    assert genesis_head("lab") != genesis_head("prereg")


def test_first_entry_matches_the_documented_chain_formula(ledger):
    data = {"doc_hash": "ff", "n": 3}
    entry = ledger.append("freeze", "reg-a", data, ref=None)
    envelope = {"seq": 1, "kind": "freeze", "reg": "reg-a", "ref": None, "ts": entry.ts, "data": data}
    body = json.dumps(envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    genesis = hashlib.sha256(b"prereg-genesis\x00prereg").digest()
    head = hashlib.sha256(b"\x01" + genesis + hashlib.sha256(b"\x00" + body).digest()).hexdigest()
    assert entry.body == body
    assert entry.prev_head == genesis.hex()
    assert entry.head == head
    assert ledger.head() == (1, head)
    assert TS.match(entry.ts)


def test_each_entry_links_to_the_one_before(ledger):
    entries = fill(ledger)
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    for before, after in zip(entries, entries[1:]):
        assert after.prev_head == before.head
    assert ledger.head() == (entries[-1].seq, entries[-1].head)


# --- opening ----------------------------------------------------------------------------------------


def test_url_forms_open_the_same_file(tmp_path):
    path = tmp_path / "same.db"
    with Ledger.open(str(path)) as by_path:
        by_path.append("freeze", "r", {})
    with Ledger.open(f"sqlite:///{path}", create=False) as by_url:
        assert by_url.count() == 1
        assert by_url.url == f"sqlite:///{path}"


def test_create_false_on_an_empty_place_is_invalid_input(ledger_url):
    with pytest.raises(InvalidInput, match="no (prereg )?ledger") as caught:
        Ledger.open(ledger_url, create=False)
    assert caught.value.exit_code == 2
    assert caught.value.where and caught.value.fix


def test_create_false_on_a_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.db"
    with pytest.raises(InvalidInput, match=re.escape(str(missing))) as caught:
        Ledger.open(str(missing), create=False)
    assert caught.value.exit_code == 2
    assert not missing.exists()


@pytest.mark.parametrize("url", ["mysql://host/db", "sqlite:///:memory:", "sqlite:///", ""])
def test_unsupported_urls_are_refused(url):
    with pytest.raises(InvalidInput):
        Ledger.open(url)


def test_a_missing_directory_is_invalid_input(tmp_path):
    with pytest.raises(InvalidInput, match="directory"):
        Ledger.open(str(tmp_path / "no" / "such" / "ledger.db"))


def test_a_foreign_database_is_not_taken_for_a_ledger(ledger_url):
    with RawLedgerDb(ledger_url) as raw:
        raw.execute("CREATE TABLE entries (x INTEGER)")
    with pytest.raises(InvalidInput, match="not a prereg ledger"):
        Ledger.open(ledger_url)


def test_the_name_is_chosen_at_creation_and_kept(ledger_url):
    path = ledger_url
    with Ledger.open(path, name="lab-ledger") as created:
        created.append("freeze", "r", {})
        head = created.head()
    with Ledger.open(path, name="something-else") as reopened:
        assert reopened.name == "lab-ledger"
        assert reopened.head() == head
        assert reopened.verify().ok


def test_a_ledger_of_another_format_is_refused(ledger_url):
    Ledger.open(ledger_url).close()
    with RawLedgerDb(ledger_url) as raw:  # only possible behind the triggers' back
        raw.drop_guards()
        raw.execute("UPDATE meta SET format = 2")
    with pytest.raises(InvalidInput, match="format 2"):
        Ledger.open(ledger_url)


@pytest.mark.parametrize("name", ["", "a\x00b"])
def test_a_name_no_backend_can_store_is_refused(ledger_url, name):
    with pytest.raises(ValueError, match="ledger name"):
        Ledger.open(ledger_url, name=name)


def test_wal_and_full_sync_are_in_force(sqlite_ledger, tmp_path):
    sqlite_ledger.append("freeze", "r", {})
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_every_append_takes_the_write_lock_before_reading_the_head(sqlite_ledger):
    """BEGIN IMMEDIATE: a deferred BEGIN would read the head under a read lock and could lose the race."""
    ledger = sqlite_ledger
    statements: list[str] = []
    event.listen(ledger._backend.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    ledger.append("freeze", "r", {})
    ledger.append_many([("window", "r", {}, None)] * 3)
    ledger.head()
    begins = [s for s in statements if s.startswith("BEGIN")]
    assert begins == ["BEGIN IMMEDIATE", "BEGIN IMMEDIATE", "BEGIN"]  # the read stays deferred
    first_read = next(i for i, s in enumerate(statements) if s.startswith("SELECT"))
    assert statements.index("BEGIN IMMEDIATE") < first_read


# --- appending --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, reg_id, data, ref, message",
    [
        ("", "r", {}, None, "kind"),
        ("Window", "r", {}, None, "kind"),
        ("run start", "r", {}, None, "kind"),
        (3, "r", {}, None, "kind"),
        ("window", "", {}, None, "reg_id"),
        ("window", 5, {}, None, "reg_id"),
        ("window", "r", {}, "", "ref"),
        ("window", "r", [1, 2], None, "data"),
        ("window", "r", {"loss": float("nan")}, None, "canonical"),
        ("window", "r", {"loss": [1.0, float("inf")]}, None, "canonical"),
        # PostgreSQL's text cannot hold NUL: refused on every backend, so a SQLite ledger always moves to PostgreSQL.
        ("window", "reg\x00a", {}, None, "NUL"),
        ("window", "r", {}, "run\x00", "NUL"),
    ],
)
def test_bad_items_are_refused_and_nothing_is_written(ledger, kind, reg_id, data, ref, message):
    ledger.append("freeze", "r", {})
    good = ("window", "r", {"step": 1}, "run-1")
    with pytest.raises(ValueError, match=message):
        ledger.append_many([good, (kind, reg_id, data, ref), good])
    assert ledger.count() == 1
    assert ledger.verify().ok


def test_append_many_of_nothing_writes_nothing(ledger):
    assert ledger.append_many([]) == []
    assert ledger.head() == (0, genesis_head("prereg"))


def test_entries_read_back_exactly_as_appended(ledger):
    written = fill(ledger)
    assert list(ledger.entries()) == written
    for entry in written:
        assert entry.body == canonical_bytes(
            {
                "seq": entry.seq,
                "kind": entry.kind,
                "reg": entry.reg_id,
                "ref": entry.ref,
                "ts": entry.ts,
                "data": entry.data,
            }
        )


def test_data_survives_unicode_and_nesting(ledger):
    data = {
        "title": "mesure — ß ∑ 🚀",
        "nested": {"list": [1, 2.5, None, True, "x"], "empty": {}},
        "big": 2**70,
        "nul": "a\x00b",
    }  # inside the body NUL is escaped (\u0000), so every backend stores it
    ledger.append("record", "r", data)
    (entry,) = ledger.entries()
    assert entry.data == data
    assert ledger.verify().ok


# --- querying ---------------------------------------------------------------------------------------


def test_filters_combine_and_keep_seq_order(ledger):
    fill(ledger)
    windows_a = [(e.ref, e.data["step"]) for e in ledger.entries(reg_id="reg-a", kinds=["window"])]
    assert windows_a == [("run-1", 0), ("run-1", 1), ("run-1", 2), ("run-2", 0), ("run-2", 1)]
    lifecycle = [e.kind for e in ledger.entries(reg_id="reg-a", kinds={"freeze", "run-start", "run-end", "verdict"})]
    assert lifecycle == ["freeze", "run-start", "run-end", "run-start", "verdict"]
    assert [e.seq for e in ledger.entries(ref="run-2")] == [8, 9, 10]
    assert [e.seq for e in ledger.entries(after_seq=10)] == [11, 12]
    assert [e.seq for e in ledger.entries(reg_id="reg-a", ref="run-1", kinds=["window"], after_seq=4)] == [5, 6]
    assert list(ledger.entries(kinds=[])) == []
    assert list(ledger.entries(reg_id="nobody")) == []


def test_counts(ledger):
    fill(ledger)
    assert ledger.count() == 12
    assert ledger.count(reg_id="reg-a") == 10
    assert ledger.count(kinds=["window"]) == 6
    assert ledger.count(reg_id="reg-a", kinds=["window"], ref="run-2") == 2
    assert ledger.count_by("reg-a", "window") == {"run-1": 3, "run-2": 2}
    assert ledger.count_by("reg-a", "freeze") == {None: 1}
    assert ledger.count_by("reg-a", "oracle") == {}
    assert ledger.reg_ids() == ["reg-a", "reg-b"]


def test_reg_ids_are_in_code_point_order_on_every_backend(ledger):
    names = ["reg-b", "Reg-c", "reg-a", "_x", "Zed", "été", "ete", "10", "9"]
    ledger.append_many([("freeze", name, {}, None) for name in names])
    assert ledger.reg_ids() == sorted(names)  # whatever the database's collation


def test_an_abandoned_iteration_does_not_block_appends(ledger):
    fill(ledger)
    reading = ledger.entries()
    next(reading)
    ledger.append("record", "reg-c", {})  # a reader's open snapshot never holds the write lock
    assert [e.seq for e in reading][-1] == 12  # the snapshot taken before the append
    assert ledger.count() == 13


# --- verify on a sound ledger -----------------------------------------------------------------------


def test_verify_of_a_sound_ledger(ledger):
    assert ledger.verify() == VerifyReport(True, 0, genesis_head("prereg"), None, None)
    entries = fill(ledger)
    assert ledger.verify() == VerifyReport(True, 12, entries[-1].head, None, None)


def test_any_head_that_was_ever_current_passes_as_published(ledger):
    published = [ledger.head()[1]]
    for entry in fill(ledger):
        published.append(entry.head)
    for head in published:
        assert ledger.verify(published_head=head).ok


def test_a_published_head_from_elsewhere_fails_after_the_last_entry(ledger):
    fill(ledger)
    report = ledger.verify(published_head=hashlib.sha256(b"elsewhere").hexdigest())
    assert (report.ok, report.first_bad, report.entries) == (False, 13, 12)
    assert "published head" in report.reason


@pytest.mark.parametrize("bad", ["abc", "G" * 64, "A" * 64, 64 * "0" + "1"])
def test_a_malformed_published_head_is_invalid_input(ledger, bad):
    with pytest.raises(InvalidInput):
        ledger.verify(published_head=bad)


def test_checkpoint_folds_the_wal_into_the_file(sqlite_ledger, tmp_path):
    fill(sqlite_ledger)
    sqlite_ledger.checkpoint()
    wal = tmp_path / "ledger.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    with sqlite3.connect(f"file:{tmp_path / 'ledger.db'}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT count(*) FROM entries").fetchone()[0] == 12


# --- JSON lines -------------------------------------------------------------------------------------


def export(ledger: Ledger) -> str:
    out = io.StringIO()
    ledger.export_jsonl(out)
    return out.getvalue()


def test_export_format(ledger):
    entries = fill(ledger)
    text = export(ledger)
    lines = text.splitlines()
    assert json.loads(lines[0]) == {"ledger": "prereg", "format": 1}
    assert len(lines) == 1 + len(entries)
    third = json.loads(lines[3])
    assert third == {
        "seq": 3,
        "kind": "run-start",
        "reg": "reg-a",
        "ref": "run-1",
        "ts": entries[2].ts,
        "data": {"rung": "A"},
        "prev_head": entries[2].prev_head,
        "head": entries[2].head,
    }


def test_checkpoint_keeps_the_ledger_whole(ledger):
    fill(ledger)
    ledger.checkpoint()  # SQLite: folds the WAL into the file; PostgreSQL: nothing to do
    assert ledger.count() == 12 and ledger.verify().ok


def test_import_rebuilds_the_same_ledger(ledger, new_ledger_url):
    fill(ledger)
    text = export(ledger)
    with Ledger.import_jsonl(io.StringIO(text), new_ledger_url()) as copy:
        assert copy.head() == ledger.head()
        assert list(copy.entries()) == list(ledger.entries())
        assert copy.verify().ok
        assert export(copy) == text


def test_import_keeps_the_ledger_name(new_ledger_url):
    with Ledger.open(new_ledger_url(), name="lab") as source:
        source.append("freeze", "r", {})
        text = export(source)
    with Ledger.import_jsonl(io.StringIO(text), new_ledger_url()) as copy:
        assert copy.name == "lab" and copy.head() == source.head()


def lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def edit_line(text: str, number: int, edit) -> str:
    """Line `number` (0 is the header, n is seq n) re-encoded after `edit` changed its fields."""
    edited = lines(text)
    fields = json.loads(edited[number])
    edit(fields)
    edited[number] = json.dumps(fields) + "\n"
    return "".join(edited)


@pytest.mark.parametrize(
    "damage, first_bad",
    [
        (lambda text: edit_line(text, 4, lambda f: f["data"].update(step=7)), 4),  # a measurement changed
        (lambda text: edit_line(text, 6, lambda f: f.update(kind="record")), 6),  # a kind changed
        (lambda text: edit_line(text, 2, lambda f: f.update(ts="2020-01-01T00:00:00.000000Z")), 2),
        (lambda text: edit_line(text, 9, lambda f: f.update(head="0" * 64)), 9),
        (lambda text: edit_line(text, 3, lambda f: f.pop("ref")), 3),
        (lambda text: "".join(lines(text)[:5] + lines(text)[6:]), 5),  # a line dropped
        (lambda text: "".join(lines(text)[:3] + lines(text)[4:5] + lines(text)[3:4] + lines(text)[5:]), 3),
        (lambda text: "".join(lines(text)[:8] + ["not json\n"] + lines(text)[8:]), 8),
        (lambda text: "".join(lines(text)[:8] + ['{"seq":8}\n'] + lines(text)[8:]), 8),
    ],
)
def test_import_refuses_a_damaged_export_and_commits_nothing(ledger, new_ledger_url, damage, first_bad):
    fill(ledger)
    target = new_ledger_url()
    with pytest.raises(LedgerCorrupt) as caught:
        Ledger.import_jsonl(io.StringIO(damage(export(ledger))), target)
    assert caught.value.first_bad == first_bad
    assert caught.value.exit_code == 4
    with Ledger.open(target, create=False) as left:
        assert left.count() == 0  # the import was one transaction


def test_import_refuses_a_non_empty_target(ledger, new_ledger_url):
    fill(ledger)
    busy_url = new_ledger_url()
    with Ledger.open(busy_url) as busy:
        busy.append("freeze", "x", {})
    with pytest.raises(InvalidInput, match="empty"):
        Ledger.import_jsonl(io.StringIO(export(ledger)), busy_url)
    with Ledger.open(busy_url) as busy:
        assert busy.count() == 1 and busy.verify().ok


@pytest.mark.parametrize("header", ["", "{}", '{"ledger":"x","format":2}', '{"ledger":1,"format":1}', "[1]"])
def test_import_refuses_a_bad_header(ledger_url, header):
    with pytest.raises(InvalidInput):
        Ledger.import_jsonl(io.StringIO(header + "\n"), ledger_url)


# --- the SQLite version check -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, affected",
    [
        ((3, 40, 1), True),
        ((3, 51, 2), True),
        ((3, 50, 6), True),
        ((3, 44, 5), True),
        ((3, 7, 0), True),
        ((3, 6, 23), False),  # before WAL existed
        ((3, 51, 3), False),
        ((3, 50, 7), False),
        ((3, 44, 6), False),
        ((3, 52, 0), False),
        ((3, 52, 1), False),
        ((4, 0, 0), False),
        ((3, 51, 3, 1), False),
    ],
)
def test_sqlite_wal_reset_affected(version, affected):
    assert sqlite_wal_reset_affected(version) is affected


@pytest.mark.parametrize("bad", [(3, 40), ("3", "40", "1"), (3, -1, 0)])
def test_sqlite_wal_reset_affected_refuses_non_versions(bad):
    with pytest.raises(ValueError):
        sqlite_wal_reset_affected(bad)
