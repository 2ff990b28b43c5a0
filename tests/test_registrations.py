"""Every file in registrations/ is a valid document, and each registration's bundled history replays.

The layout these tests hold the directory to:
- `registrations/<id>.toml`: a registration whose id is its file name, whose `source` says where the practice it
  encodes is written down, and whose first line is a comment saying what it asks. A registration that encodes a
  seed's practice names the seed in both (`source = "seed NNN_<hash>: …"`, `# Seed NNN …`), the same seed; any
  other source is the lab's own question, in its own words;
- `registrations/<id>/`: that registration's history after freeze, as step files `amend-<label><N>.toml` and
  `record-<label><N>.toml`, each opening with a comment (naming its registration's seed, if it has one), replayed
  in order of N, a step's amendment before its record (an amendment declares a rung before the rung is measured).
  Nothing else lives there.

The replay goes through the governance verbs themselves (freeze, amend, record) on a temporary ledger, without
`--post-hoc`: a bundled amendment is one that was made before the data it affects.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import NEW_FREEZE_REFUSED, UNGUARDED_BEFORE_THE_NUMERICS_RULE, UNPAIRED_BEFORE_THE_RULE, lab_ledger_copy

from prereg import actions
from prereg.errors import InvalidInput
from prereg.ledger import Ledger

REGISTRATIONS = Path(__file__).resolve().parent.parent / "registrations"
STEP_FILE = re.compile(r"^(?P<verb>amend|record)-(?P<label>[a-z]+)(?P<n>[0-9]+)\.toml$")
VERB_ORDER = {"amend": 0, "record": 1}
SEED_COMMENT = re.compile(r"^#.*\bseed (?P<seed>[0-9]{3})\b", re.IGNORECASE)
SEED_SOURCE = re.compile(r"^seed (?P<seed>[0-9]{3})_[0-9a-f]{16}: ")

REGISTRATION_FILES = sorted(REGISTRATIONS.glob("*.toml"))
HISTORY_DIRS = sorted(p for p in REGISTRATIONS.iterdir() if p.is_dir())


def replay_order(directory: Path) -> list[Path]:
    """The step files of a history directory in replay order; any other file is an error."""
    keyed = []
    for path in directory.iterdir():
        match = STEP_FILE.match(path.name)
        if match is None:
            raise ValueError(
                f"{path}: not a step file; history files are named amend-<label><N>.toml or record-<label><N>.toml"
            )
        keyed.append(((int(match["n"]), VERB_ORDER[match["verb"]], match["label"]), path))
    return [path for _, path in sorted(keyed)]


def header(path: Path) -> str:
    first_line = path.read_text(encoding="utf-8").splitlines()[0]
    assert first_line.startswith("# ") and first_line[2:].strip(), (
        f"{path.name} must open with a comment saying what it is, not {first_line!r}"
    )
    return first_line


def seed_of_header(path: Path) -> str:
    first_line = header(path)
    match = SEED_COMMENT.match(first_line)
    assert match, f"{path.name} must open with a comment naming its seed ('# Seed NNN …'), not {first_line!r}"
    return match["seed"]


def seed_of_source(source: str | None) -> str | None:
    """The seed a registration's source names, or None for the lab's own question."""
    match = SEED_SOURCE.match(source or "")
    return match["seed"] if match else None


def test_the_directory_holds_registrations():
    assert REGISTRATION_FILES, f"no registrations found in {REGISTRATIONS}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Ledger:
    ledger = Ledger.open(str(lab_ledger_copy(tmp_path_factory.mktemp("lab") / "ledger.db")), create=False)
    yield ledger
    ledger.close()


@pytest.mark.parametrize("path", REGISTRATION_FILES, ids=lambda p: p.stem)
def test_registration_validates_and_says_where_it_comes_from(path: Path, lab: Ledger):
    reg, _ = actions.load_against(lab, path)  # as the lab froze it: under the defaults it was frozen with
    assert reg.id == path.stem, (
        f"{path.name} holds registration {reg.id!r}; a registration's file is named after its id"
    )
    assert reg.source and reg.source.strip(), f"{path.name}: source must say where what it encodes is written down"
    header(path)
    seed = seed_of_source(reg.source)
    if seed is not None:
        assert seed_of_header(path) == seed, f"{path.name}: the header comment and source name different seeds"


@pytest.mark.parametrize("directory", HISTORY_DIRS, ids=lambda p: p.name)
def test_history_directory_belongs_to_a_registration_and_holds_only_step_files(directory: Path, lab: Ledger):
    assert (REGISTRATIONS / f"{directory.name}.toml").is_file(), (
        f"{directory.name}/ has no registration {directory.name}.toml"
    )
    steps = replay_order(directory)
    assert steps, f"{directory.name}/ is empty"
    registration, _ = actions.load_against(lab, REGISTRATIONS / f"{directory.name}.toml")
    registration_seed = seed_of_source(registration.source)
    for path in steps:
        if registration_seed is None:
            header(path)
        else:
            assert seed_of_header(path) == registration_seed, (
                f"{directory.name}/{path.name} names a different seed than its registration"
            )


def without_retired_keys(path: Path, directory: Path) -> Path:
    """The registration as a new freeze writes it: without `fps` (retired: read by nothing, so the same meaning)."""
    text = path.read_text(encoding="utf-8")
    assert text.count(" fps = 30,") == 1, "the retired key this helper removes"
    variant = directory / path.name
    variant.write_text(text.replace(" fps = 30,", ""), encoding="utf-8")
    return variant


def test_the_bundled_registrations_a_new_freeze_refuses_are_the_ones_listed(tmp_path: Path):
    refused = set()
    with Ledger.open(str(tmp_path / "ledger.db"), create=True) as ledger:
        for path in REGISTRATION_FILES:
            if path.stem in UNPAIRED_BEFORE_THE_RULE | UNGUARDED_BEFORE_THE_NUMERICS_RULE:
                continue
            try:
                actions.check(ledger, path)
            except InvalidInput as error:
                assert "retired by" in error.message or "already in the baseline; landed by" in error.message, error
                refused.add(path.stem)
        assert ledger.head()[0] == 0
    assert refused == NEW_FREEZE_REFUSED


@pytest.mark.parametrize("path", REGISTRATION_FILES, ids=lambda p: p.stem)
def test_bundled_history_replays_without_post_hoc(path: Path, tmp_path: Path):
    directory = REGISTRATIONS / path.stem
    steps = replay_order(directory) if directory.is_dir() else []
    with Ledger.open(str(tmp_path / "ledger.db"), create=True) as ledger:
        if path.stem in UNPAIRED_BEFORE_THE_RULE:
            with pytest.raises(InvalidInput, match="paired arms must share the flag"):
                actions.freeze(ledger, path)
            assert ledger.head()[0] == 0 and not steps  # nothing written; no history to replay
            return
        if path.stem in UNGUARDED_BEFORE_THE_NUMERICS_RULE:
            with pytest.raises(InvalidInput, match="which changes numerics"):
                actions.freeze(ledger, path)
            assert ledger.head()[0] == 0 and not steps
            return
        if path.stem in NEW_FREEZE_REFUSED:
            with pytest.raises(InvalidInput, match="retired by|already in the baseline"):
                actions.freeze(ledger, path)
            assert ledger.head()[0] == 0  # nothing written
            if not steps:
                return
            path = without_retired_keys(path, tmp_path)  # the history replays on the document a new freeze takes
        frozen = actions.freeze(ledger, path)
        assert not frozen.already
        for step in steps:
            if step.name.startswith("amend-"):
                _, post_hoc = actions.amend(ledger, frozen.reg_id, step, post_hoc=False)
                assert post_hoc == ()
            else:
                entries = actions.record(ledger, frozen.reg_id, step)
                recorded = next(e for e in entries if e.kind == "record").data["rungs"]
                flagged = {rung: data["flagged"] for rung, data in recorded.items() if data["flagged"]}
                assert not flagged, f"{step.name}: recorded rungs kept out of every read: {flagged}"
        report = ledger.verify()
        assert report.ok, report.reason
        assert report.entries == 1 + len(steps)


def test_replay_order_puts_a_steps_amendment_before_its_record_and_orders_numerically(tmp_path: Path):
    for name in (
        "record-rung10.toml",
        "record-rung2.toml",
        "amend-rung2.toml",
        "record-rung1.toml",
        "amend-rung10.toml",
    ):
        (tmp_path / name).write_text("# Seed 003\n", encoding="utf-8")
    assert [p.name for p in replay_order(tmp_path)] == [
        "record-rung1.toml",
        "amend-rung2.toml",
        "record-rung2.toml",
        "amend-rung10.toml",
        "record-rung10.toml",
    ]


@pytest.mark.parametrize("stray", ["notes.md", "amend-rung.toml", "record_rung1.toml", "amend-rung2.toml.bak"])
def test_replay_order_refuses_a_file_that_is_not_a_step(tmp_path: Path, stray: str):
    (tmp_path / "record-rung1.toml").write_text("# Seed 003\n", encoding="utf-8")
    (tmp_path / stray).write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="not a step file"):
        replay_order(tmp_path)
