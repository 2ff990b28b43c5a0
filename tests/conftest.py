"""Shared fixtures: a ledger in a temporary directory, the CLI run in-process, small registrations to break.

Every CLI call goes through `Cli`, which passes `--ledger` explicitly where a test asks for it and otherwise
points PREREG_LEDGER into the test's tmp directory, so no test can ever write the repository's ledger.db.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

# Two xdist workers share two cores, and most tests start torch processes of their own: one thread each, so no
# process's OpenMP threads spin-wait against another's. Set before torch is imported here; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent
REGISTRATIONS = REPO / "registrations"
PERF_PASS1 = REGISTRATIONS / "molmo2-perf-pass1.toml"
# Frozen (and run) before prereg/pairing.py existed; its unpaired loss expectation is what taught the rule. A fresh
# freeze of it is refused; the frozen one never changes.
UNPAIRED_BEFORE_THE_RULE = frozenset({"molmo2-fast-h200"})
# Frozen before prereg/numerics_guard.py existed: compared rungs differ in a key that changes numerics and no rule
# bounds their paired loss difference. A fresh freeze is refused; `check` shows them as frozen before the rule.
UNGUARDED_BEFORE_THE_NUMERICS_RULE = frozenset({"molmo2-fast-h200", "throughput-compile-2b"})
REPO_LEDGER = REPO / "ledger.db"
# Bundled registrations a new freeze refuses today: they use options a later verdict retired, or test as items the
# switches the verdicts have since landed into the CUDA baseline. The lab's ledger holds each frozen as it was: a
# test that needs one frozen works on a copy of it (`lab_ledger_copy`).
NEW_FREEZE_REFUSED = frozenset(
    {
        *("molmo2-ar-40k-f1", "molmo2-ar-40k", "molmo2-ar-f1-h200x2"),  # fps
        *("molmo2-pack-h200", "molmo2-pack-one-pass-h200", "molmo2-pack-varlen-h200"),  # suffix flex
        *("molmo2-pack-rows-h200", "molmo2-sflex-h200", "molmo2-x1-h200", "molmo2-x34-h200"),  # rows, X1, X3
        "molmo2-pack-fa4-h200",  # varlen-fa4
        *("molmo2-fp8-h200", "molmo2-fp8-rowwise-h200", "molmo2-fp8-normed-h200"),  # X5, X6, X8
        "molmo2-staged-update-h200",  # X9
        *("molmo2-x4-h200", "molmo2-x4-landed-h200"),  # X4
        "molmo2-x12-h200",  # X12
        *(
            "molmo2-perf-pass1",
            "molmo2-perf-pass1-h200",
            "molmo2-perf-pass1-h200-interleaved",
            "molmo2-x2-h200",
            "molmo2-overlap-h200",
            "molmo2-x10-h200",
            "molmo2-x10-recompiled-h200",
            "molmo2-x11-h200",
        ),  # landed
    }
)
# Rich wraps tables to the terminal width; a fixed width makes output (and the golden files) stable.
CLI_COLUMNS = "120"
# The folders the suite's rungs and jobs leave under reports/<id>/ in the checkout: the command workload's run
# folders (its scripts' windows and logs) and the Slurm jobs' logs. Removed once, after the whole session, by the
# process that ran it (under xdist the controller, after every worker): a worker that removed them when its share
# of a module ended would pull a folder from under a rung the other worker is still running.
REPORT_FOLDERS = ("cmd-*", "example-mlp-matmul", "slurm-*")
REPORTS_BEFORE = pytest.StashKey[set[Path]]()
# The suite's Molmo2 processes (rungs, gates, in-process runners: a hundred and more) fit the same few FAST
# tokenizers: one directory of fits for the whole run, made here by the first process to load this file (under
# xdist the controller, before it starts the workers, which inherit it with every process they start) and removed
# by it at the end. Its keys cover everything a fit depends on (engine/molmo2/data/fast_cache.py).
FAST_CACHE_VARIABLE = "PREREG_FAST_CACHE"
FAST_CACHE_MADE_HERE = FAST_CACHE_VARIABLE not in os.environ
if FAST_CACHE_MADE_HERE:
    os.environ[FAST_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="prereg-fast-fits-")


def report_folders() -> set[Path]:
    return {folder for pattern in REPORT_FOLDERS for folder in (REPO / "reports").glob(pattern)}


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # an xdist worker leaves the folders to the controller
        session.config.stash[REPORTS_BEFORE] = report_folders()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--dist loadgroup` groups by a `@group` suffix that xdist 3.8 writes to `item._nodeid`, a field pytest 9 no
    longer reads: without this every group's tests are spread over the workers as if ungrouped."""
    if not config.getoption("loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    from _pytest.nodeid import NodeId

    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if FAST_CACHE_MADE_HERE:
        shutil.rmtree(os.environ[FAST_CACHE_VARIABLE], ignore_errors=True)
    before = session.config.stash.get(REPORTS_BEFORE, None)
    if before is None:
        return
    for folder in report_folders() - before:
        shutil.rmtree(folder, ignore_errors=True)


class CliResult(NamedTuple):
    """(exit_code, stdout, stderr) of one in-process `prereg` call."""

    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> dict[str, Any]:
        """The whole of stdout as ONE JSON object (fails the test if stdout holds anything else)."""
        payload = json.loads(self.stdout)
        assert isinstance(payload, dict), f"--json printed a {type(payload).__name__}, not an object: {self.stdout!r}"
        return payload


class Cli:
    """`prereg` in-process. Click >= 8.2 keeps stderr apart from stdout (it has no mix_stderr switch)."""

    def __init__(self, ledger: Path, tmp: Path):
        self.ledger = ledger
        self._runner = CliRunner()
        # A forgotten --ledger lands here, in the test's tmp directory, never in the repository's ledger.db.
        self._env = {
            "COLUMNS": CLI_COLUMNS,
            "NO_COLOR": "1",
            "PREREG_LEDGER": str(tmp / "unintended-default-ledger.db"),
        }

    def __call__(self, *args: str | Path) -> CliResult:
        from cli import app  # here, not at the top: test files that never call the CLI do not import it

        words = [str(a) for a in args]
        assert all(Path(w).resolve() != REPO_LEDGER for w in words), "tests never touch the repository's ledger"
        result = self._runner.invoke(app, words, env=self._env, catch_exceptions=False)
        return CliResult(result.exit_code, result.stdout, result.stderr)

    def on_ledger(self, *args: str | Path) -> CliResult:
        """A verb run against this test's ledger (`--ledger` appended)."""
        return self(*args, "--ledger", self.ledger)

    def ok(self, *args: str | Path) -> CliResult:
        """A verb on this test's ledger that must succeed; its output is shown when it does not."""
        result = self.on_ledger(*args)
        assert result.exit_code == 0, (
            f"prereg {' '.join(map(str, args))} exited {result.exit_code}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}"
        )
        return result

    def ok_json(self, *args: str | Path) -> dict[str, Any]:
        return self.ok(*args, "--json").json()


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@pytest.fixture
def cli(ledger_path: Path, tmp_path: Path) -> Cli:
    return Cli(ledger_path, tmp_path)


def prereg_process(*args: str, ledger: Path, check: bool, timeout: float = 600) -> subprocess.CompletedProcess:
    """`prereg ARGS --ledger LEDGER` as its own process, from the repository root: for what the in-process CLI
    runner cannot do (the engine starts torch processes and handles signals)."""
    result = subprocess.run(
        [sys.executable, str(REPO / "cli.py"), *args, "--ledger", str(ledger)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120", "NO_COLOR": "1"},
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"prereg {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def ledger_fingerprint(db: Path) -> dict[str, str | None]:
    """sha256 of the ledger file and its write-ahead log (None when absent): compared before and after a verb.

    Taken after the CLI has returned (and closed the ledger), so a close-time checkpoint has already happened.
    The -shm index is SQLite's shared memory, rewritten by readers, and carries no content of its own.
    """
    files = {"db": db, "wal": db.with_name(db.name + "-wal")}
    return {
        name: hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None for name, path in files.items()
    }


def lab_ledger_copy(destination: Path) -> Path:
    """A copy of the lab's ledger.db at `destination` (tests never open the committed file itself)."""
    shutil.copyfile(REPO_LEDGER, destination)
    return destination


def lab_ledger_before(entry: int, destination: Path) -> Path:
    """The lab's ledger as it was before `entry`, at `destination`: its earlier entries exported and imported again
    (the same chain, so the same head there). A script that appended entries from `entry` on replays on it."""
    from prereg.ledger import Ledger

    buffer = io.StringIO()
    with Ledger.open(str(lab_ledger_copy(destination.with_name("lab.db"))), create=False) as lab:
        lab.export_jsonl(buffer)
    lines = buffer.getvalue().splitlines(keepends=True)[:entry]  # the export's header, then entries
    Ledger.import_jsonl(io.StringIO("".join(lines)), str(destination)).close()
    return destination


# Run-config keys added after the lab's correction scripts ran: a replay today records them in the configs it writes,
# the entries the lab appended then do not, and a table without a key resolves it as the code ran before the key
# existed (the workload's unrecorded defaults), so the two mean the same.
KEYS_ADDED_SINCE_THE_CORRECTIONS = frozenset({"compile_tuning"})


def _without_keys_added_since(value):
    if isinstance(value, dict):
        return {k: _without_keys_added_since(v) for k, v in value.items() if k not in KEYS_ADDED_SINCE_THE_CORRECTIONS}
    if isinstance(value, list):
        return [_without_keys_added_since(v) for v in value]
    return value


def without_times(entry) -> tuple:
    """An entry but for its time (hence its hash), and the run-config keys added since it was appended: what a
    replay of the script that appended it appends again."""
    data = _without_keys_added_since(entry.data)
    return (entry.kind, entry.reg_id, entry.ref, json.dumps(data, sort_keys=True, default=str))


def apply_script(script: Path, ledger: Path) -> Path:
    """A correction script of bench/results/ run on `ledger`, with this interpreter and this checkout."""
    subprocess.run(
        ["bash", str(script), str(ledger)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "COLUMNS": "120"},
        timeout=600,
    )
    return ledger


def assert_the_lab_holds_what_the_script_appended(applied: Path, entry: int, scratch: Path) -> None:
    """Entry for entry, but for their times (hence their hashes), the lab's ledger holds from `entry` on what the
    script appended to the ledger before it (`applied`)."""
    from prereg.ledger import Ledger

    with (
        Ledger.open(str(applied), create=False) as ours,
        Ledger.open(str(lab_ledger_copy(scratch / "lab.db")), create=False) as lab,
    ):
        appended = [without_times(e) for e in ours.entries() if e.seq >= entry]
        recorded = [without_times(e) for e in lab.entries() if entry <= e.seq < entry + len(appended)]
    assert appended and appended == recorded


def freeze_as_the_lab_did(ledger: Path, path: Path) -> None:
    """Freeze a bundled registration into `ledger` (a fresh one) as the lab froze it before freezes recorded their
    defaults: its run configs under the workload's unrecorded defaults (what a new freeze of it would refuse)."""
    from prereg.actions import freeze_registration
    from prereg.documents import load_registration
    from prereg.ledger import Ledger
    from prereg.registry import get_workload

    reg, raw = load_registration(path, dict(get_workload("molmo2").run_config.unrecorded_defaults))
    with Ledger.open(str(ledger), create=True) as store:
        freeze_registration(store, reg, raw, path)


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


# --- small registrations over the molmo2 workload's declared names ---------------------------------------------

# Three rungs: a baseline, the baseline + P1, and P1 + P2. Dropping P2 makes C equal to B; dropping P1 empties B.
MINI = """
id = "mini"
title = "mini: two items, three rungs"
question = "does P1 (and P2) make a step faster?"
workload = "molmo2"
profile = "cpu-tiny"

[cost]
ceiling_gpu_h = 0.5
on_ceiling = "stop"

[[items]]
id = "P1"
title = "suffix cudnn"
switch = "suffix_cudnn"
bitwise = false

  [[items.oracles]]
  id = "P1a"
  kind = "tolerance"
  probe = "one_step"
  bounds = { loss_abs = 1e-3, grad_norm_rel = 1e-2 }

[[items]]
id = "P2"
title = "windowed vram peak"
switch = "windowed_vram_peak"
bitwise = true

  [[items.oracles]]
  id = "P2a"
  kind = "schema"
  probe = "window_schema"

[protocol]
kind = "compare"
steps = 40
log_every = 10
discard_first = 10
config = { batch = 4, backward_chunks = 2 }

  [[protocol.rungs]]
  id = "A"
  items = []
  [[protocol.rungs]]
  id = "B"
  items = ["P1"]
  [[protocol.rungs]]
  id = "C"
  items = ["P1", "P2"]

[reads]
primary = "(A.s_per_step - C.s_per_step) / A.s_per_step"
secondary = "(A.s_per_step - B.s_per_step) / A.s_per_step"
vram_clean = "C.vram_peak_gib <= A.vram_peak_gib * 1.02"

[[rules]]
id = "R-land"
when = "primary >= 0.05 and vram_clean"
outcome = "land-both"
land = ["P1", "P2"]

[[rules]]
id = "R-hygiene"
when = "primary < 0.05 or not vram_clean"
outcome = "land-hygiene"
land = [{ item = "P2", if = "vram_clean" }]
park = ["P1"]

[[expectations]]
n = 1
claim = "every oracle passes"
confidence = "high"
check = "all_oracles_passed()"

[[expectations]]
n = 2
claim = "P1 alone buys 4%"
confidence = "medium"
check = "secondary >= 0.04"

[[expectations]]
n = 3
claim = "the bundle buys 5%"
confidence = "low"
check = "primary >= 0.05"
"""

# Oracle observations that pass MINI's bounds / pass conditions.
PASSING_ORACLES = """
[oracles.P1a]
loss_abs = 2e-4
grad_norm_rel = 3e-3
[oracles.P2a]
missing = []
violations = []
"""


def rung_record(rung: str, items: list[str], *, s_per_step: float, vram: float = 10.0, status: str = "finished") -> str:
    """One `[rungs.X]` table of a record file, with summary metrics."""
    listed = ", ".join(f'"{i}"' for i in items)
    return f"""
[rungs.{rung}]
items = [{listed}]
status = "{status}"
metrics = {{ s_per_step = {s_per_step!r}, vram_peak_gib = {vram!r} }}
"""


def record_file(directory: Path, name: str, *parts: str, provenance: str = "test bench, hand-entered") -> Path:
    return write(directory, name, f'provenance = "{provenance}"\n' + "".join(textwrap.dedent(p) for p in parts))


@pytest.fixture
def mini(tmp_path: Path) -> Path:
    return write(tmp_path, "mini.toml", MINI)


@pytest.fixture
def frozen_mini(cli: Cli, mini: Path) -> Path:
    cli.ok("freeze", mini)
    return mini


# --- the ledger on each backend: SQLite, and PostgreSQL when PREREG_TEST_POSTGRES_URL names a server ----------------
#
# `ledger_url` is a fresh, empty place for a ledger, once per backend: tests that take it run as `test_x[sqlite]` and
# `test_x[postgresql]`. On PostgreSQL each place is its own schema (the URL's search_path), named after the xdist
# worker and a random suffix, so tests and workers never see each other's ledgers; the schemas are dropped after.
# `make test` starts a server for these (tests/postgres_server.sh). Without one the postgresql half is skipped,
# unless REQUIRE_POSTGRES=1 (CI), where it fails.

POSTGRES_URL_VAR = "PREREG_TEST_POSTGRES_URL"
LEDGER_BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def postgres_options(url: str, **settings: str) -> str:
    """`url` with server settings added to its libpq `options` (search_path, default_transaction_isolation, ...)."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    flags = " ".join(f"-c{key}={value.replace(' ', chr(92) + ' ')}" for key, value in settings.items())
    previous = [value for key, value in query if key == "options"]
    query = [(key, value) for key, value in query if key != "options"] + [("options", " ".join([*previous, flags]))]
    joined = urlunsplit(parts._replace(query=urlencode(query)))
    # urlunsplit drops the "//" of a URL with no host (postgresql:///db, the local socket): put it back.
    return joined if parts.netloc else joined.replace(f"{parts.scheme}:", f"{parts.scheme}://", 1)


def libpq_url(url: str) -> str:
    """A prereg PostgreSQL URL (postgresql:// or postgresql+psycopg://) as libpq spells it."""
    return "postgresql://" + url.split("://", 1)[1]


@pytest.fixture
def postgres_url() -> str:
    """The test server's URL; skips without one, fails without one under REQUIRE_POSTGRES=1."""
    url = os.environ.get(POSTGRES_URL_VAR)
    if not url:
        why = f"{POSTGRES_URL_VAR} is not set (`make test` starts a server with tests/postgres_server.sh)"
        if os.environ.get("REQUIRE_POSTGRES") == "1":
            pytest.fail(f"REQUIRE_POSTGRES=1 but {why}")
        pytest.skip(why)
    return url


class PostgresSchemas:
    """Fresh schemas on the test server, each a place for one ledger; `drop_all` removes them."""

    def __init__(self, url: str):
        import psycopg

        self.url = url
        self.admin = psycopg.connect(libpq_url(url), autocommit=True)
        # A test that left a transaction open on a schema must not hang the teardown: fail it instead.
        self.admin.execute("SET lock_timeout = '30s'")
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.names: list[str] = []

    def new(self) -> str:
        name = f"prereg_test_{self.worker}_{uuid.uuid4().hex[:12]}"
        self.admin.execute(f"CREATE SCHEMA {name}")
        self.names.append(name)
        return name

    def url_of(self, schema: str, **settings: str) -> str:
        return postgres_options(self.url, search_path=schema, **settings)

    def drop_all(self) -> None:
        try:
            for name in self.names:
                self.admin.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        finally:
            self.admin.close()


@pytest.fixture
def postgres_schemas(postgres_url):
    schemas = PostgresSchemas(postgres_url)
    yield schemas
    schemas.drop_all()


@pytest.fixture(params=LEDGER_BACKENDS)
def ledger_backend(request) -> str:
    """ "sqlite" or "postgresql": the backend the test runs against (the postgresql one needs a server)."""
    return request.param


@pytest.fixture
def new_ledger_url(request, ledger_backend, tmp_path):
    """A factory: every call gives the URL of another fresh, empty place for a ledger on the backend under test."""
    if ledger_backend == "sqlite":
        counter = iter(range(1, 1_000_000))
        return lambda: str(tmp_path / f"ledger-{next(counter)}.db")
    schemas = request.getfixturevalue("postgres_schemas")
    return lambda: schemas.url_of(schemas.new())


@pytest.fixture
def ledger_url(new_ledger_url) -> str:
    """A fresh, empty place for one ledger, on each backend in turn."""
    return new_ledger_url()


class RawLedgerDb:
    """The database under a ledger, opened behind prereg's back: Python's sqlite3, or psycopg.

    What a determined editor (or a foreign tool) does. Autocommit; `?` placeholders on both backends.
    """

    def __init__(self, url: str):
        self.postgres = url.startswith(("postgresql://", "postgresql+psycopg://"))
        if self.postgres:
            import psycopg

            self.conn = psycopg.connect(libpq_url(url), autocommit=True)
        else:
            import sqlite3

            path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else url
            self.conn = sqlite3.connect(path, isolation_level=None)

    def execute(self, sql: str, params: tuple = ()) -> list[tuple]:
        if self.postgres:
            cursor = self.conn.execute(sql.replace("?", "%s"), params or None)
        else:
            cursor = self.conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []

    def drop_guards(self) -> None:
        """Take away the triggers that refuse UPDATE and DELETE (SQLite: drop them; PostgreSQL: disable them)."""
        if self.postgres:
            for table in ("entries", "meta"):
                self.execute(f"ALTER TABLE {table} DISABLE TRIGGER USER")
        else:
            for (trigger,) in self.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'"):
                self.execute(f"DROP TRIGGER {trigger}")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> RawLedgerDb:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def every_workload_declaration():
    """name -> the declaration of every installed workload: a workload its document declares (the command
    workload) is declared by the bundled example's table."""
    import tomllib

    from prereg.registry import TableError, get_workload, installed_workloads

    example = tomllib.loads((REPO / "examples" / "command" / "mlp-matmul.toml").read_text())["command"]
    found = {}
    for name in installed_workloads():
        try:
            found[name] = get_workload(name)
        except TableError:
            found[name] = get_workload(name, example)
    return found


# --- a Slurm partition: `make test` starts a one-node cluster (tests/slurm_cluster.sh) and names its partition -----

SLURM_PARTITION_VAR = "PREREG_TEST_SLURM_PARTITION"


@pytest.fixture
def slurm_partition() -> str:
    """The test cluster's partition; skips without one, fails without one under REQUIRE_SLURM=1."""
    partition = os.environ.get(SLURM_PARTITION_VAR)
    if not partition:
        why = f"{SLURM_PARTITION_VAR} is not set (`make test` starts a cluster with tests/slurm_cluster.sh)"
        if os.environ.get("REQUIRE_SLURM") == "1":
            pytest.fail(f"REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    return partition
