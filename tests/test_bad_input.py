"""Bad input: every case exits 2, names the file and the field path, says what to do, and leaves
the ledger byte-for-byte unchanged (the database file and its write-ahead log, compared after the CLI returns)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import MINI, PASSING_ORACLES, Cli, ledger_fingerprint, record_file, rung_record, write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

INVALID = 2


def broken(old: str, new: str) -> str:
    assert MINI.count(old) == 1, f"{old!r} must occur once in MINI"
    return MINI.replace(old, new)


SECONDARY = 'secondary = "(A.s_per_step - B.s_per_step) / A.s_per_step"'

# (case, document text, field path the message must name, what the message must say)
REGISTRATIONS = [
    ("unknown key", broken('question = "', 'colour = "red"\nquestion = "'), "colour", "unknown key 'colour'"),
    ("wrong type", broken("steps = 40", 'steps = "forty"'), "protocol.steps", "valid integer"),
    ("NaN bound", broken("loss_abs = 1e-3", "loss_abs = nan"), "items.P1.oracles.P1a.bounds", "loss_abs = nan"),
    (
        "negative bound",
        broken("loss_abs = 1e-3", "loss_abs = -1e-3"),
        "items.P1.oracles.P1a.bounds",
        "loss_abs = -0.001",
    ),
    ("duplicate item id", broken('id = "P2"\ntitle', 'id = "P1"\ntitle'), "items", "duplicate item id(s) ['P1']"),
    ("duplicate rung id", broken('id = "B"', 'id = "A"'), "protocol.rungs", "duplicate rung id(s) ['A']"),
    ("duplicate oracle id", broken('id = "P2a"', 'id = "P1a"'), "items.*.oracles", "duplicate oracle id(s) ['P1a']"),
    (
        "rung names an unknown item",
        broken('items = ["P1"]\n', 'items = ["P9"]\n'),
        "protocol.rungs.B.items",
        "'P9' is not an item",
    ),
    (
        "rule reads an unknown read",
        broken('when = "primary >= 0.05 and vram_clean"', 'when = "primari >= 0.05 and vram_clean"'),
        "rules.R-land.when",
        "unknown name 'primari'",
    ),
    (
        "read names an unknown rung",
        broken(SECONDARY, 'secondary = "(A.s_per_step - Z.s_per_step) / A.s_per_step"'),
        "reads.secondary",
        "rung 'Z' does not exist",
    ),
    (
        "unknown switch",
        broken('switch = "suffix_cudnn"', 'switch = "flash_attention"'),
        "items.P1.switch",
        "'flash_attention' is not a switch",
    ),
    (
        "unknown probe",
        broken('probe = "one_step"', 'probe = "two_step"'),
        "items.P1.oracles.P1a.probe",
        "'two_step' is not a probe",
    ),
    ("unknown metric", broken("C.vram_peak_gib <=", "C.vram_gib <="), "reads.vram_clean", "no metric 'vram_gib'"),
    ("unknown profile", broken('profile = "cpu-tiny"', 'profile = "tpu-v5"'), "profile", "'tpu-v5' is not a profile"),
    (
        "unknown config key",
        broken("backward_chunks = 2", "backward_chunk = 2"),
        "protocol.config",
        "unknown config key 'backward_chunk'",
    ),
    (
        "config value not allowed",
        broken("backward_chunks = 2", 'backward_chunks = 2, prefix_attention = "flexx"'),
        "protocol.config",
        "prefix_attention = 'flexx'; allowed: ['sdpa', 'flex']",
    ),
    (
        "unsafe expression",
        broken(SECONDARY, "secondary = \"__import__('os').system('true')\""),
        "reads.secondary",
        "__import__",
    ),
    ("unknown name", broken(SECONDARY, 'secondary = "speedup * 2"'), "reads.secondary", "unknown name 'speedup'"),
    (
        "unknown land item",
        broken('land = ["P1", "P2"]', 'land = ["P1", "P7"]'),
        "rules.R-land",
        "'P7' in land/park is not an item",
    ),
    # Amendment paths are dotted: an id with a dot would make `items.P1.x.oracles…` ambiguous.
    ("dotted id", MINI.replace('"P1"', '"P1.x"').replace('id = "P1"', 'id = "P1.x"'), "items", "should match pattern"),
]


def assert_refused(result, *, where: Path, path: str, says: str) -> None:
    assert result.exit_code == INVALID, f"exit {result.exit_code}: {result.stdout}{result.stderr}"
    assert result.stdout == ""
    message = result.stderr
    assert str(where) in message, message
    assert path in message, message
    assert says in message, message
    assert re.search(r"\n\s+fix: \S", message), f"no way forward in {message!r}"


@pytest.mark.parametrize(("case", "text", "path", "says"), REGISTRATIONS, ids=[c[0] for c in REGISTRATIONS])
def test_bad_registration_is_refused_and_writes_nothing(
    cli: Cli, frozen_mini: Path, tmp_path: Path, case: str, text: str, path: str, says: str
) -> None:
    bad = write(tmp_path, "bad.toml", text.replace('id = "mini"', 'id = "mini-bad"'))
    before = ledger_fingerprint(cli.ledger)
    assert_refused(cli.on_ledger("freeze", bad), where=bad, path=path, says=says)
    assert ledger_fingerprint(cli.ledger) == before
    assert_refused(cli("check", bad), where=bad, path=path, says=says)


def test_malformed_toml_names_its_line(cli: Cli, frozen_mini: Path, tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.toml", broken("steps = 40", "steps = 40 40"))
    line = bad.read_text().splitlines().index("steps = 40 40") + 1
    before = ledger_fingerprint(cli.ledger)
    result = cli.on_ledger("freeze", bad)
    assert_refused(result, where=bad, path="malformed TOML", says=f"line {line}")
    assert ledger_fingerprint(cli.ledger) == before


def test_a_field_error_names_the_line_that_assigns_it(cli: Cli, tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.toml", broken("loss_abs = 1e-3", "loss_abs = nan"))
    line = next(n for n, row in enumerate(bad.read_text().splitlines(), start=1) if "loss_abs = nan" in row)
    assert f"{bad}:{line}: items.P1.oracles.P1a.bounds" in cli("check", bad).stderr


def test_bad_registration_does_not_even_create_a_ledger(cli: Cli, tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.toml", broken("steps = 40", "steps = 40 40"))
    fresh = tmp_path / "fresh.db"
    result = cli("freeze", bad, "--ledger", fresh)
    assert result.exit_code == INVALID
    assert not fresh.exists()


# --- records -------------------------------------------------------------------------------------------------

FINISHED_A = rung_record("A", [], s_per_step=2.0)
RECORDS = [
    ("unknown rung", rung_record("Z", [], s_per_step=1.0), "rungs.Z", "not a rung of mini"),
    ("unknown oracle", "[oracles.P9z]\nloss_abs = 1e-4\n", "oracles.P9z", "not an oracle of mini"),
    ("unknown item in a rung", rung_record("B", ["P7"], s_per_step=1.0), "rungs.B.items", "'P7' is not an item"),
    (
        "unknown metric",
        '[rungs.A]\nitems = []\nstatus = "finished"\nmetrics = { speed = 1.0 }\n',
        "rungs.A",
        "unknown metric(s) ['speed']",
    ),
    (
        "unknown key",
        '[rungs.A]\nitems = []\nstatus = "finished"\nmetric = { s_per_step = 1.0 }\n',
        "rungs.A.metric",
        "unknown key 'metric'",
    ),
    (
        "unknown status",
        '[rungs.A]\nitems = []\nstatus = "done"\nmetrics = { s_per_step = 1.0 }\n',
        "rungs.A.status",
        "'finished'",
    ),
    # A typo judged as written would fail the oracle and drop P1 for good: it is refused as bad input instead.
    (
        "misspelt observation",
        "[oracles.P1a]\nloss_ab = 2e-4\ngrad_norm_rel = 3e-3\n",
        "oracles.P1a",
        "unknown ['loss_ab'] and missing ['loss_abs']",
    ),
    ("missing observation", "[oracles.P2a]\nmissing = []\n", "oracles.P2a", "missing ['violations']"),
    # The observer never brings its own verdict: a result is judged from what was observed, by the frozen bounds.
    ("a verdict instead of an observation", "[oracles.P1a]\npassed = true\n", "oracles.P1a", "unknown ['passed']"),
    (
        "window without a step",
        '[rungs.A]\nitems = []\nstatus = "finished"\n[[rungs.A.windows]]\ns_per_step = 2.0\n',
        "rungs.A",
        "needs step",
    ),
    ("no provenance", None, "provenance", "required key 'provenance'"),
]


@pytest.mark.parametrize(("case", "body", "path", "says"), RECORDS, ids=[c[0] for c in RECORDS])
def test_bad_record_is_refused_and_writes_nothing(
    cli: Cli, frozen_mini: Path, tmp_path: Path, case: str, body: str | None, path: str, says: str
) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "good.toml", PASSING_ORACLES, FINISHED_A))
    bad = write(tmp_path, "bad.toml", FINISHED_A) if body is None else record_file(tmp_path, "bad.toml", body)
    before = ledger_fingerprint(cli.ledger)
    assert_refused(cli.on_ledger("record", "mini", bad), where=bad, path=path, says=says)
    assert ledger_fingerprint(cli.ledger) == before


# --- amendments ----------------------------------------------------------------------------------------------

AMENDMENTS = [
    ("changing the id", '[set]\nid = "mini-2"\n', "id", "cannot be amended"),
    ("changing the profile", '[set]\nprofile = "h200-4b"\n', "profile", "cannot be amended"),
    (
        "changing a measured rung's items",
        '[set.protocol.rungs.A]\nitems = ["P2"]\n',
        "protocol.rungs.A.items",
        "edits history",
    ),
    (
        "changing a measured rung's config",
        "[set.protocol.rungs.A]\nconfig = { batch = 8 }\n",
        "protocol.rungs.A.config.batch",
        "edits history",
    ),
    ("changing the measured protocol", "[set.protocol]\nsteps = 80\n", "protocol.steps", "edits history"),
    (
        "changing what a judged item switches",
        '[set.items.P1]\nswitch = "masked_loss_sums"\n',
        "items.P1.switch",
        "edits history",
    ),
    (
        "removing an item with results",
        '[set]\nitems = [{ id = "P2", title = "w", switch = "windowed_vram_peak", bitwise = true, '
        'oracles = [{ id = "P2a", kind = "schema", probe = "window_schema" }] }]\n'
        '[set.protocol]\nrungs = [{ id = "A", items = [] }, { id = "B", items = ["P2"] }, '
        '{ id = "C", items = ["P2"] }]\n'
        "[set.rules.R-land]\nland = []\n[set.rules.R-hygiene]\npark = []\n",
        "items.P1",
        "removing it edits history",
    ),
    (
        "setting a path that does not exist",
        '[set.protocol]\npass_rul = "rc == 0"\n',
        "set.protocol.pass_rul",
        "does not exist",
    ),
    ("selecting an element that does not exist", '[set.items.P9]\ntitle = "t"\n', "items.P9", "no element 'P9'"),
    ("an unsafe expression", "[add.reads]\nevil = \"__import__('os')\"\n", "reads.evil", "__import__"),
    ("an unknown key", 'why = "because"\n[set]\ntitle = "t"\n', "why", "unknown key 'why'"),
    ("no change at all", "", "", "changes nothing"),
    ("a change to the same value", '[set]\ntitle = "mini: two items, three rungs"\n', "", "changes nothing"),
]


@pytest.mark.parametrize(("case", "body", "path", "says"), AMENDMENTS, ids=[c[0] for c in AMENDMENTS])
def test_bad_amendment_is_refused_and_writes_nothing(
    cli: Cli, frozen_mini: Path, tmp_path: Path, case: str, body: str, path: str, says: str
) -> None:
    cli.ok("record", "mini", record_file(tmp_path, "a.toml", PASSING_ORACLES, FINISHED_A))
    bad = write(tmp_path, "amend.toml", f'reason = "{case}"\n{body}')
    before = ledger_fingerprint(cli.ledger)
    assert_refused(cli.on_ledger("amend", "mini", bad), where=bad, path=path, says=says)
    assert ledger_fingerprint(cli.ledger) == before
    assert cli.ok_json("audit", "show", "mini")["versions"][-1]["version"] == 0


# --- refusals of the governance kind (exit 3) also write nothing ----------------------------------------------


@pytest.mark.parametrize("verb", ["record", "amend", "verdict"])
def test_a_verb_on_an_unfrozen_id_is_refused_and_writes_nothing(
    cli: Cli, frozen_mini: Path, tmp_path: Path, verb: str
) -> None:
    files = {
        "record": [record_file(tmp_path, "r.toml", FINISHED_A)],
        "amend": [write(tmp_path, "a.toml", 'reason = "x"\n[set]\ntitle = "y"\n')],
        "verdict": [],
    }
    before = ledger_fingerprint(cli.ledger)
    result = cli.on_ledger(verb, "never-frozen", *files[verb])
    assert result.exit_code == 3, result.stderr
    assert "'never-frozen' is not frozen" in result.stderr
    assert "fix: prereg freeze" in result.stderr
    assert ledger_fingerprint(cli.ledger) == before


def test_a_missing_ledger_is_invalid_input_and_is_not_created(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.db"
    result = cli("audit", "list", "--ledger", missing)
    assert result.exit_code == INVALID
    assert str(missing) in result.stderr
    assert not missing.exists()


def toml_float(value: float) -> str:
    return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan" if math.isnan(value) else repr(value))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bound=st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, -1e-300])
)
def test_a_bound_is_accepted_exactly_when_it_is_a_finite_number_at_least_zero(
    cli: Cli, tmp_path: Path, bound: float
) -> None:
    document = write(tmp_path, "bound.toml", broken("loss_abs = 1e-3", f"loss_abs = {toml_float(bound)}"))
    result = cli("check", document, "--json")
    if math.isfinite(bound) and bound >= 0:
        assert result.exit_code == 0, result.stdout
    else:
        assert result.exit_code == INVALID
        assert result.json()["where"].endswith("items.P1.oracles.P1a.bounds")


@pytest.mark.parametrize("verb", [("audit", "verify"), ("verdict", "mini"), ("freeze", "{mini}")], ids=lambda v: v[0])
def test_a_file_that_is_not_a_database_is_bad_input_and_stays_as_it_was(
    cli: Cli, mini: Path, tmp_path: Path, verb
) -> None:
    """Not an unexpected error with a traceback (exit 1): the file named, what it is not, and what to do."""
    garbage = tmp_path / "ledger.db"
    garbage.write_bytes(bytes(range(256)) * 16)
    result = cli(*[part.format(mini=mini) for part in verb], "--ledger", garbage)
    assert result.exit_code == INVALID, result
    assert (
        f"{garbage}: not a readable database" in result.stderr
        and "not a prereg ledger, or a damaged one" in result.stderr
    )
    assert "fix: " in result.stderr and "Traceback" not in result.stderr
    assert garbage.read_bytes() == bytes(range(256)) * 16
