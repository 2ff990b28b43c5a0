"""Trying to break the ledger's guarantees: edits behind its back, forks, concurrent and killed writers.

Every tamper here goes around prereg (a sqlite3 shell, Python's sqlite3 or psycopg with the triggers dropped, the
file's bytes); `verify` must then fail and name the first bad entry. Tests that take `ledger_url` run on both
backends (`[sqlite]`, `[postgresql]`); the ones about SQLite's shell, file bytes and flock are SQLite's alone
(PostgreSQL's triggers and advisory lock are tested in test_ledger_postgres.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import RawLedgerDb

from prereg.ledger import Ledger

REPO = Path(__file__).resolve().parents[1]
SQLITE_CLI = shutil.which("sqlite3")
N = 10  # entries in the ledgers tampered with


def make_ledger(url: str | Path, entries: int = N) -> Ledger:
    ledger = Ledger.open(str(url))
    ledger.append_many(
        [("window", "reg-a", {"step": 100 + i, "loss": 2.5 - i / 10}, f"run-{i // 4}") for i in range(entries)]
    )
    return ledger


def behind_its_back(url: str | Path, *statements: str, params: tuple = ()) -> None:
    """Run SQL straight on the database after taking the triggers away: what a determined editor would do."""
    with RawLedgerDb(str(url)) as raw:
        raw.drop_guards()
        for statement in statements:
            raw.execute(statement, params if "?" in statement else ())


def child(code: str, *args: str, **popen) -> subprocess.Popen:
    """A Python child process that can import prereg from this checkout."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=env, **popen)


# --- the triggers -----------------------------------------------------------------------------------


def sql_refused(path: Path, sql: str, via: str) -> str:
    """Run `sql` through the sqlite3 shell or Python's sqlite3; return the refusal message (fail if accepted)."""
    if via == "cli":
        done = subprocess.run([SQLITE_CLI, str(path), sql], capture_output=True, text=True, timeout=30)
        assert done.returncode != 0, f"the sqlite3 shell accepted {sql!r}"
        return done.stderr
    with sqlite3.connect(path) as conn:
        with pytest.raises(sqlite3.DatabaseError) as caught:
            conn.execute(sql)
        return str(caught.value)


VIAS = [
    pytest.param("cli", marks=pytest.mark.skipif(SQLITE_CLI is None, reason="no sqlite3 binary on this machine")),
    "stdlib",  # the fallback where CI has no sqlite3 binary
]


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE entries SET body = replace(body, '\"step\":103', '\"step\":104') WHERE seq = 4",
        "UPDATE entries SET kind = 'record'",
        "DELETE FROM entries WHERE seq = 10",
        "DELETE FROM entries",
        "UPDATE meta SET name = 'other'",
        "DELETE FROM meta",
        # REPLACE deletes the colliding row without firing DELETE triggers: an UPDATE in disguise.
        "INSERT OR REPLACE INTO entries SELECT seq, 'record', reg_id, ref, ts, body, prev_head, head "
        "FROM entries WHERE seq = 3",
        "REPLACE INTO meta (id, name, format) VALUES (1, 'other', 1)",
        "INSERT INTO meta (id, name, format) VALUES (2, 'other', 1)",
    ],
)
def test_update_and_delete_are_refused(tmp_path, via, sql):
    path = tmp_path / "ledger.db"
    ledger = make_ledger(path)
    before = ledger.head()
    message = sql_refused(path, sql, via)
    assert "append-only" in message
    assert ledger.head() == before and ledger.verify().ok


# --- edits behind its back: verify names the first bad entry ----------------------------------------


@pytest.mark.parametrize(
    "statements, first_bad, why",
    [
        # A measurement edited in place: the body no longer hashes to its head.
        (["UPDATE entries SET body = replace(body, '\"step\":104', '\"step\":105') WHERE seq = 5"], 5, "hash"),
        # A projection column edited: the body is intact but the index now lies.
        (["UPDATE entries SET kind = 'record' WHERE seq = 3"], 3, "kind"),
        (["UPDATE entries SET reg_id = 'reg-b' WHERE seq = 6"], 6, "reg_id"),
        (["UPDATE entries SET reg_id = NULL WHERE seq = 6"], 6, "reg_id"),
        (["UPDATE entries SET ref = 'run-9' WHERE seq = 2"], 2, "ref"),
        (["UPDATE entries SET ts = '2020-01-01T00:00:00.000000Z' WHERE seq = 7"], 7, "ts"),
        # An entry removed from the middle.
        (["DELETE FROM entries WHERE seq = 6"], 6, "missing"),
        # An entry moved: renumbered past the end.
        (["UPDATE entries SET seq = 99 WHERE seq = 4"], 4, "missing"),
        # Two entries swapped (their seq exchanged): the order of events rewritten.
        (
            [
                "UPDATE entries SET seq = -3 WHERE seq = 3",
                "UPDATE entries SET seq = 3 WHERE seq = 4",
                "UPDATE entries SET seq = 4 WHERE seq = -3",
            ],
            3,
            "link",
        ),
        # Two bodies swapped under the same heads.
        (["UPDATE entries SET body = (SELECT body FROM entries e WHERE e.seq = 8) WHERE seq = 9"], 9, "hash"),
        # The chain's own columns edited.
        (["UPDATE entries SET head = prev_head WHERE seq = 10"], 10, "hash"),
        (["UPDATE entries SET prev_head = '" + "ab" * 32 + "' WHERE seq = 2"], 2, "link"),
        # The ledger renamed: the genesis head moves, so the very first link breaks.
        (["UPDATE meta SET name = 'forged'"], 1, "link"),
    ],
)
def test_verify_names_the_first_bad_entry(ledger_url, statements, first_bad, why):
    make_ledger(ledger_url).close()
    behind_its_back(ledger_url, *statements)
    with Ledger.open(ledger_url, create=False) as ledger:
        report = ledger.verify()
    assert not report.ok
    assert report.first_bad == first_bad, report.reason
    assert f"seq {first_bad}:" in report.reason
    assert why in report.reason


def test_a_column_of_the_right_bytes_as_a_blob_is_caught(tmp_path):
    """SQLite's columns take any type: reg_id's very bytes, stored as a BLOB instead of TEXT, are corruption."""
    path = tmp_path / "ledger.db"
    make_ledger(path).close()
    behind_its_back(path, "UPDATE entries SET reg_id = x'7265672d61' WHERE seq = 8")
    with Ledger.open(str(path), create=False) as ledger:
        report = ledger.verify()
    assert (report.ok, report.first_bad) == (False, 8)
    assert "seq 8:" in report.reason and "reg_id" in report.reason


def test_verify_after_an_edit_reports_the_last_good_head(ledger_url):
    ledger = make_ledger(ledger_url)
    written = list(ledger.entries())
    ledger.close()
    behind_its_back(ledger_url, "UPDATE entries SET kind = 'record' WHERE seq = 6")
    with Ledger.open(ledger_url) as ledger:
        report = ledger.verify()
    assert (report.first_bad, report.entries, report.head) == (6, N, written[4].head)


def test_truncation_is_caught_against_a_published_head(ledger_url):
    ledger = make_ledger(ledger_url)
    published = ledger.head()[1]
    ledger.close()
    behind_its_back(ledger_url, "DELETE FROM entries WHERE seq > 7")
    with Ledger.open(ledger_url) as ledger:
        assert ledger.verify().ok  # a clean prefix of a chain is a chain: only a published head can tell
        report = ledger.verify(published_head=published)
    assert (report.ok, report.first_bad, report.entries) == (False, 8, 7)


def test_a_rewritten_history_is_caught_against_a_published_head(ledger_url):
    """An editor who knows the formula rewrites entry 3 and recomputes every head after it."""
    ledger = make_ledger(ledger_url)
    published = ledger.head()[1]
    ledger.close()
    with RawLedgerDb(ledger_url) as raw:
        rows = raw.execute("SELECT seq, body, prev_head FROM entries ORDER BY seq")
    prev = bytes.fromhex(rows[0][2])
    rewritten = []
    for seq, body, _ in rows:
        if seq == 3:
            body = body.replace('"loss":2.3', '"loss":0.3')
        head = hashlib.sha256(b"\x01" + prev + hashlib.sha256(b"\x00" + body.encode()).digest()).digest()
        rewritten.append((body, prev.hex(), head.hex(), seq))
        prev = head
    behind_its_back(ledger_url, "UPDATE entries SET prev_head = 'tmp-' || seq")  # free the UNIQUE prev_heads
    with RawLedgerDb(ledger_url) as raw:
        for row in rewritten:
            raw.execute("UPDATE entries SET body = ?, prev_head = ?, head = ? WHERE seq = ?", row)
    with Ledger.open(ledger_url) as ledger:
        assert json.loads(next(ledger.entries(after_seq=2)).body)["data"]["loss"] == 0.3
        assert ledger.verify().ok  # self-consistent: this is what a published head is for
        report = ledger.verify(published_head=published)
    assert (report.ok, report.first_bad) == (False, N + 1)
    assert "rewritten" in report.reason


def test_bytes_edited_in_the_database_file_are_caught(tmp_path):
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(str(path))
    ledger.append_many([("record", "reg-a", {"needle": f"n-{i:04d}-31337"}, None) for i in range(40)])
    ledger.checkpoint()  # every committed page in the main file, where the editor looks
    ledger.close()
    raw = bytearray(path.read_bytes())
    needle = b'"needle":"n-0027-31337"'
    assert raw.count(needle) == 1  # the body lives in one place: the table's row (no index holds it)
    at = raw.index(needle) + len(b'"needle":"n-0027-3133')
    raw[at : at + 1] = b"8"  # 31337 -> 31338: still valid JSON, same length, the page still parses
    path.write_bytes(bytes(raw))
    with Ledger.open(str(path)) as ledger:
        report = ledger.verify()
        data = next(ledger.entries(after_seq=27)).data
    assert data == {"needle": "n-0027-31338"}  # SQLite itself noticed nothing
    assert (report.ok, report.first_bad) == (False, 28)


def second_successor_of_entry_3(raw: RawLedgerDb) -> tuple:
    [(seq, kind, reg_id, ref, ts, body, prev_head, _)] = raw.execute("SELECT * FROM entries WHERE seq = 4")
    return (N + 1, kind, reg_id, ref, ts, body.replace("103", "104"), prev_head, "cd" * 32)


@pytest.mark.parametrize("triggers", ["kept", "dropped"])
def test_a_fork_fails_on_insert(ledger_url, ledger_backend, triggers):
    ledger = make_ledger(ledger_url)
    if triggers == "dropped":
        behind_its_back(ledger_url)
    refusal = {
        ("sqlite", "kept"): "append-only: INSERT would replace an entry or fork the chain",
        ("sqlite", "dropped"): "UNIQUE constraint failed: entries.prev_head",
        # PostgreSQL has no INSERT trigger: the unique constraint refuses the fork either way.
        ("postgresql", "kept"): "uq_entries_prev_head",
        ("postgresql", "dropped"): "uq_entries_prev_head",
    }[ledger_backend, triggers]
    with RawLedgerDb(ledger_url) as raw:
        integrity_errors: tuple[type[Exception], ...] = (sqlite3.IntegrityError,)
        if raw.postgres:
            import psycopg

            integrity_errors = (psycopg.errors.UniqueViolation,)
        with pytest.raises(integrity_errors, match=refusal):
            raw.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)", second_successor_of_entry_3(raw))
    assert ledger.verify().ok
    assert ledger.append("record", "reg-a", {}).seq == N + 1


def test_sqlite_busy_from_a_foreign_writer_is_waited_out(tmp_path):
    """A sqlite3 shell holding the write lock does not make an append fail: it waits (busy_timeout)."""
    path = tmp_path / "ledger.db"
    ledger = make_ledger(path)
    foreign = sqlite3.connect(path, isolation_level=None)
    foreign.execute("BEGIN IMMEDIATE")
    appended = threading.Thread(target=ledger.append, args=("record", "reg-a", {"after": "foreign"}))
    appended.start()
    appended.join(0.5)
    assert appended.is_alive()
    foreign.execute("ROLLBACK")
    appended.join(10)
    assert not appended.is_alive()
    assert ledger.count() == N + 1 and ledger.verify().ok


# --- the writer lock --------------------------------------------------------------------------------

HOLD_LOCK = """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.readline()  # hold until the test says so
"""


@pytest.mark.parametrize("operation", ["append", "append_many", "checkpoint"])
def test_writers_and_checkpoints_wait_for_the_lock_of_another_process(tmp_path, operation):
    path = tmp_path / "ledger.db"
    ledger = make_ledger(path)
    holder = child(HOLD_LOCK, str(path) + ".lock", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        work = {
            "append": lambda: ledger.append("record", "reg-a", {"waited": True}),
            "append_many": lambda: ledger.append_many([("record", "reg-a", {"i": i}, None) for i in range(3)]),
            "checkpoint": ledger.checkpoint,
        }[operation]
        waiting = threading.Thread(target=work)
        waiting.start()
        waiting.join(0.7)
        assert waiting.is_alive(), f"{operation} did not wait for the lock"
        # Readers never take the lock: the ledger stays readable and verifiable meanwhile.
        assert ledger.count() == N and ledger.verify().ok
        holder.stdin.write("\n")
        holder.stdin.flush()
        waiting.join(10)
        assert not waiting.is_alive()
    finally:
        holder.kill()
        holder.wait()
    assert ledger.count() == {"append": N + 1, "append_many": N + 3, "checkpoint": N}[operation]
    assert ledger.verify().ok


# --- concurrent and killed writers ------------------------------------------------------------------

WRITERS, APPENDS = 4, 250  # the concurrent-writer test: separate processes, each appending one entry at a time
BEFORE = 7  # entries already in the ledger when they start

APPENDER = """
    import os, sys, time
    from prereg.ledger import Ledger
    url, writer, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ledger = Ledger.open(url)  # its own engine and connections, as on another machine
    print("ready", flush=True)
    while not os.path.exists(go):  # start together, after the imports and the connection
        time.sleep(0.001)
    for i in range(count):
        ledger.append("window", "reg-" + writer, {"writer": writer, "i": i}, ref="run-" + writer)
    ledger.close()
"""


def test_concurrent_writer_processes_form_one_chain(ledger_url, ledger_backend, tmp_path):
    with Ledger.open(ledger_url) as ledger:
        ledger.append_many([("freeze", "reg-0", {"before": i}, None) for i in range(BEFORE)])
    go = tmp_path / "go"
    names = [f"w{k}" for k in range(WRITERS)]
    writers = [
        child(APPENDER, ledger_url, name, str(APPENDS), str(go), stdout=subprocess.PIPE, text=True) for name in names
    ]
    try:
        for writer in writers:
            assert writer.stdout.readline() == "ready\n", "a writer died before appending"
        started = time.monotonic()
        go.touch()
        for writer in writers:
            assert writer.wait(300) == 0
        seconds = time.monotonic() - started
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
    with Ledger.open(ledger_url) as ledger:
        report = ledger.verify()
        entries = list(ledger.entries())
    total = BEFORE + WRITERS * APPENDS
    assert report.ok, report.reason
    assert report.entries == len(entries) == total
    assert [e.seq for e in entries] == list(range(1, total + 1))
    assert len({e.prev_head for e in entries}) == total, "two entries claim the same predecessor"
    assert all(after.prev_head == before.head for before, after in zip(entries, entries[1:]))
    assert [e.data for e in entries[:BEFORE]] == [{"before": i} for i in range(BEFORE)]
    for name in names:  # nothing lost, nothing duplicated, each writer's order kept
        assert [e.data["i"] for e in entries if e.data.get("writer") == name] == list(range(APPENDS))
    turns = sum(1 for x, y in zip(entries[BEFORE:], entries[BEFORE + 1 :]) if x.data["writer"] != y.data["writer"])
    print(f"{WRITERS} writers x {APPENDS} appends on {ledger_backend}: {seconds:.2f} s, {turns} changes of writer")
    assert turns >= WRITERS, "the writers barely interleaved: the test did not exercise contention"


KILLED_WRITER = """
    import random, sys
    from prereg.ledger import Ledger
    url, round_ = sys.argv[1], sys.argv[2]
    rng = random.Random(round_)
    ledger = Ledger.open(url)
    batch = 0
    while True:
        size = rng.choice([1, 1, 2, 5, 20, 200])
        pad = "x" * rng.randrange(2000)  # entries of varied size: commits that span WAL pages
        items = [("window", "reg-k", {"batch": f"{round_}-{batch}", "i": i, "n": size, "pad": pad}, f"run-{round_}")
                 for i in range(size)]
        if size == 1:
            ledger.append(*items[0][:3], ref=items[0][3])
        else:
            ledger.append_many(items)
        if batch == 0:
            print("appending", flush=True)
        batch += 1
"""


def test_a_writer_killed_at_random_points_leaves_whole_appends(ledger_url):
    Ledger.open(ledger_url).close()
    rng = random.Random(20260314)
    counts = []
    for round_ in range(5):
        writer = child(KILLED_WRITER, ledger_url, str(round_), stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline() == "appending\n"
        time.sleep(rng.uniform(0.0, 0.25))
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(10) == -signal.SIGKILL
        with Ledger.open(ledger_url) as ledger:  # SQLite: also recovers the WAL the dead writer left
            report = ledger.verify()
            entries = list(ledger.entries())
        assert report.ok, report.reason
        batches: dict[str, list] = {}
        for entry in entries:
            batches.setdefault(entry.data["batch"], []).append(entry)
        for name, members in batches.items():  # every append is all or nothing, and contiguous
            n = members[0].data["n"]
            assert [m.data["i"] for m in members] == list(range(n)), f"batch {name} is partial"
            assert members[-1].seq - members[0].seq == n - 1
        counts.append(len(entries))
    assert counts == sorted(counts) and counts[-1] > counts[0] > 0
