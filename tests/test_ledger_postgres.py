"""What is PostgreSQL's alone: its triggers, its advisory lock, its settings, moving a ledger to SQLite and back.

Everything the two backends share (append, read, verify, tampering, concurrent and killed writers, JSONL) runs
on both from test_ledger.py, test_ledger_adversarial.py and test_ledger_roundtrip.py. These tests need a server:
PREREG_TEST_POSTGRES_URL=postgresql://USER@HOST:PORT/DB (`make test` starts one with tests/postgres_server.sh);
without it they skip, or fail under REQUIRE_POSTGRES=1. Each test gets its own schema (the URL's search_path), so
tests never see each other's ledgers and nothing is left behind.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from conftest import RawLedgerDb, postgres_options
from sqlalchemy import event

from prereg.ledger import Ledger

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.postgres


@pytest.fixture
def schema(postgres_schemas):
    return postgres_schemas.new()


@pytest.fixture
def url(postgres_schemas, schema):
    return postgres_schemas.url_of(schema)


@pytest.fixture
def admin(postgres_schemas):
    return postgres_schemas.admin


@pytest.fixture
def ledger(url):
    with Ledger.open(url) as opened:
        opened.append_many([("window", "reg-a", {"step": i, "loss": 1 / (i + 1)}, f"run-{i % 2}") for i in range(8)])
        yield opened


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE entries SET kind = 'record' WHERE seq = 2",
        "DELETE FROM entries WHERE seq = 8",
        "TRUNCATE entries",
        "UPDATE meta SET name = 'other'",
        "DELETE FROM meta",
        "TRUNCATE meta",
        "INSERT INTO entries SELECT * FROM entries WHERE seq = 3 ON CONFLICT (seq) DO UPDATE SET kind = 'record'",
    ],
)
def test_update_delete_truncate_are_refused(ledger, url, statement):
    import psycopg

    with RawLedgerDb(url) as raw, pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        raw.execute(statement)
    assert ledger.count() == 8 and ledger.verify().ok


def test_url_forms_open_the_same_ledger(ledger, url):
    driver_url = url.replace("postgresql://", "postgresql+psycopg://", 1)
    with Ledger.open(driver_url, create=False) as same:
        assert same.head() == ledger.head()


def test_every_append_takes_the_advisory_lock_before_reading_the_head(ledger):
    statements: list[str] = []
    event.listen(ledger._backend.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    ledger.append("record", "reg-a", {})
    ledger.append_many([("record", "reg-a", {"i": i}, None) for i in range(3)])
    locks = [i for i, s in enumerate(statements) if "pg_advisory_xact_lock" in s]
    reads = [i for i, s in enumerate(statements) if s.lstrip().startswith("SELECT entries.seq")]
    inserts = [i for i, s in enumerate(statements) if s.lstrip().startswith("INSERT INTO entries")]
    assert len(locks) == len(reads) == len(inserts) == 2
    assert all(lock < read < insert for lock, read, insert in zip(locks, reads, inserts))


def test_an_append_waits_for_the_advisory_lock(ledger, admin):
    from prereg.ledger.postgres_backend import ADVISORY_LOCK_KEY

    admin.execute("SELECT pg_advisory_lock(%s)", (ADVISORY_LOCK_KEY,))
    try:
        waiting = threading.Thread(target=ledger.append, args=("record", "reg-a", {"waited": True}))
        waiting.start()
        waiting.join(0.7)
        assert waiting.is_alive()
        assert ledger.count() == 8  # readers are not blocked
    finally:
        admin.execute("SELECT pg_advisory_unlock(%s)", (ADVISORY_LOCK_KEY,))
    waiting.join(10)
    assert not waiting.is_alive()
    assert ledger.count() == 9 and ledger.verify().ok


APPENDER = """
    import os, sys, time
    from prereg.ledger import Ledger
    url, writer, go = sys.argv[1], sys.argv[2], sys.argv[3]
    ledger = Ledger.open(url)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    for i in range(100):
        ledger.append("window", "reg-" + writer, {"writer": writer, "i": i})
    ledger.close()
"""


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_writers_form_one_chain_whatever_the_servers_default_isolation(postgres_schemas, schema, tmp_path, isolation):
    """A server (or role, or database) whose default_transaction_isolation is not READ COMMITTED: under it the
    append's snapshot would be taken by the lock statement before it waits, and the head read after would be stale."""
    url = postgres_schemas.url_of(schema, default_transaction_isolation=isolation)
    Ledger.open(url).close()
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code = textwrap.dedent(APPENDER)
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", code, url, name, str(go)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
        )
        for name in ("a", "b", "c")
    ]
    for writer in writers:
        assert writer.stdout.readline() == "ready\n"
    go.touch()
    for writer in writers:
        assert writer.wait(120) == 0, "an append failed under contention"
    with Ledger.open(url) as ledger:
        report = ledger.verify()
        entries = list(ledger.entries())
    assert report.ok and report.entries == 300
    for name in ("a", "b", "c"):
        assert [e.data["i"] for e in entries if e.data["writer"] == name] == list(range(100))


def test_reg_ids_keep_code_point_order_in_a_database_with_a_linguistic_collation(postgres_url, admin):
    """Team servers are often created with en_US.UTF-8, where ORDER BY would put "a" before "B"; SQLite never does."""
    import psycopg

    name = f"prereg_test_icu_{uuid.uuid4().hex[:12]}"
    try:
        admin.execute(
            f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
        )
    except psycopg.errors.InsufficientPrivilege as error:
        pytest.skip(f"the test role may not create databases: {error}")
    try:
        parts = urlsplit(postgres_url)
        url = urlunsplit(parts._replace(path="/" + name))
        url = url if parts.netloc else url.replace(f"{parts.scheme}:", f"{parts.scheme}://", 1)
        with Ledger.open(url) as ledger:
            names = ["b", "B", "a", "A", "_x", "é", "e"]
            ledger.append_many([("freeze", n, {}, None) for n in names])
            assert ledger.reg_ids() == sorted(names)
    finally:
        admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def test_export_from_postgres_import_into_sqlite_and_back(ledger, tmp_path, postgres_schemas):
    exported = io.StringIO()
    ledger.export_jsonl(exported)
    with Ledger.import_jsonl(io.StringIO(exported.getvalue()), str(tmp_path / "copy.db")) as copy:
        assert copy.head() == ledger.head()
        back = io.StringIO()
        copy.export_jsonl(back)
    assert back.getvalue() == exported.getvalue()
    other = postgres_schemas.url_of(postgres_schemas.new())
    with Ledger.import_jsonl(io.StringIO(back.getvalue()), other) as again:
        assert again.head() == ledger.head() and again.verify().ok
        assert list(again.entries()) == list(ledger.entries())


def test_the_url_helper_keeps_the_socket_form():
    assert postgres_options("postgresql:///db", search_path="s").startswith("postgresql:///db?options=")
    assert "port=5433" in postgres_options("postgresql://h:5433/db?port=5433", search_path="s")
