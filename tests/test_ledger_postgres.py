"""The PostgreSQL backend against a real server: PREREG_TEST_POSTGRES_URL=postgresql://USER@HOST:PORT/DB.

Each test gets its own schema (through the connection's search_path), so tests never see each other's
ledgers and nothing is left behind.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from prereg.ledger import Ledger

PG_URL = os.environ.get("PREREG_TEST_POSTGRES_URL")
REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not PG_URL, reason="PREREG_TEST_POSTGRES_URL is not set"),
]


def libpq_url(url: str) -> str:
    return "postgresql://" + url.split("://", 1)[1]


def with_search_path(url: str, schema: str) -> str:
    parts = urlsplit(url)
    query = parse_qsl(parts.query) + [("options", f"-csearch_path={schema}")]
    url = urlunsplit(parts._replace(query=urlencode(query)))
    # urlunsplit drops the "//" of a URL with no host (postgresql:///db, the local socket): put it back.
    return url if parts.netloc else url.replace(f"{parts.scheme}:", f"{parts.scheme}://", 1)


@pytest.fixture
def admin():
    import psycopg

    with psycopg.connect(libpq_url(PG_URL), autocommit=True) as conn:
        yield conn


@pytest.fixture
def schema(admin):
    name = f"prereg_test_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE SCHEMA {name}")
    yield name
    admin.execute(f"DROP SCHEMA {name} CASCADE")


@pytest.fixture
def url(schema):
    return with_search_path(PG_URL, schema)


@pytest.fixture
def ledger(url):
    with Ledger.open(url) as opened:
        opened.append_many([("window", "reg-a", {"step": i, "loss": 1 / (i + 1)}, f"run-{i % 2}") for i in range(8)])
        yield opened


def sql(admin, schema: str, statement: str, params: tuple = ()):
    admin.execute(f"SET search_path TO {schema}")
    try:
        return admin.execute(statement, params)
    finally:
        admin.execute("RESET search_path")


def test_append_query_verify(ledger):
    assert ledger.head()[0] == 8
    assert ledger.count_by("reg-a", "window") == {"run-0": 4, "run-1": 4}
    assert [e.seq for e in ledger.entries(ref="run-1", after_seq=2)] == [4, 6, 8]
    assert ledger.reg_ids() == ["reg-a"]
    report = ledger.verify(published_head=ledger.head()[1])
    assert report.ok and report.entries == 8


def test_create_false_without_a_ledger_is_invalid_input(url):
    from prereg.errors import InvalidInput

    with pytest.raises(InvalidInput, match="no prereg ledger"):
        Ledger.open(url, create=False)


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
def test_update_delete_truncate_are_refused(ledger, admin, schema, statement):
    import psycopg

    with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        sql(admin, schema, statement)
    assert ledger.verify().ok


def test_a_fork_fails_on_insert(ledger, admin, schema):
    import psycopg

    with pytest.raises(psycopg.errors.UniqueViolation, match="prev_head"):
        sql(admin, schema, "INSERT INTO entries SELECT 99, kind, reg_id, ref, ts, body, prev_head, head "
                           "FROM entries WHERE seq = 4")
    assert ledger.verify().ok


def test_an_edit_behind_the_triggers_is_caught(ledger, admin, schema):
    sql(admin, schema, "ALTER TABLE entries DISABLE TRIGGER USER")
    sql(admin, schema, "UPDATE entries SET body = replace(body, '\"step\":5', '\"step\":6') WHERE seq = 6")
    report = ledger.verify()
    assert (report.ok, report.first_bad) == (False, 6)


def test_truncation_is_caught_against_a_published_head(ledger, admin, schema):
    published = ledger.head()[1]
    sql(admin, schema, "ALTER TABLE entries DISABLE TRIGGER USER")
    sql(admin, schema, "DELETE FROM entries WHERE seq > 5")
    assert ledger.verify().ok
    report = ledger.verify(published_head=published)
    assert (report.ok, report.first_bad) == (False, 6)


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
    while not os.path.exists(go):
        time.sleep(0.001)
    for i in range(300):
        ledger.append("window", "reg-" + writer, {"writer": writer, "i": i})
    ledger.close()
"""


def test_two_processes_appending_form_one_chain(url, tmp_path):
    Ledger.open(url).close()
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    writers = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(APPENDER), url, name, str(go)], cwd=REPO, env=env)
        for name in ("a", "b")
    ]
    time.sleep(0.5)
    go.touch()
    for writer in writers:
        assert writer.wait(60) == 0
    with Ledger.open(url) as ledger:
        report = ledger.verify()
        entries = list(ledger.entries())
    assert report.ok and report.entries == 600
    for name in ("a", "b"):
        assert [e.data["i"] for e in entries if e.data["writer"] == name] == list(range(300))


def test_export_from_postgres_import_into_sqlite_and_back(ledger, tmp_path, admin):
    exported = io.StringIO()
    ledger.export_jsonl(exported)
    with Ledger.import_jsonl(io.StringIO(exported.getvalue()), str(tmp_path / "copy.db")) as copy:
        assert copy.head() == ledger.head()
        back = io.StringIO()
        copy.export_jsonl(back)
    other = f"prereg_test_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE SCHEMA {other}")
    try:
        with Ledger.import_jsonl(io.StringIO(back.getvalue()), with_search_path(PG_URL, other)) as again:
            assert again.head() == ledger.head() and again.verify().ok
    finally:
        admin.execute(f"DROP SCHEMA {other} CASCADE")
