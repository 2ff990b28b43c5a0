"""What a freeze records (docs/design.md "The ledger"): the document's canonical hash, the source file's hash, the git
commit and whether the tree was dirty with a hash of the diff, and the tool version. A tree copied without its
.git (a lent GPU machine) records the commit its launcher states, marked as stated."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
from conftest import MINI, write

from prereg import actions
from prereg.ledger import Ledger
from prereg.provenance import git_state, tool_version


def git(repo: Path, *args: str) -> str:
    identity = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    env = {**identity, "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True, env=env).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "lab"
    root.mkdir()
    git(root, "init", "-q")
    write(root, "mini.toml", MINI)
    write(root, "notes.txt", "one\n")
    git(root, "add", ".")
    git(root, "commit", "-qm", "registration")
    return root


def freeze_entry(repo: Path, ledger_path: Path):
    with Ledger.open(str(ledger_path), create=True) as ledger:
        result = actions.freeze(ledger, repo / "mini.toml")
        return next(e for e in ledger.entries(reg_id=result.reg_id) if e.kind == "freeze"), result


def test_a_freeze_in_a_clean_tree_records_the_commit_the_hashes_and_the_tool(repo: Path, tmp_path: Path) -> None:
    entry, result = freeze_entry(repo, tmp_path / "ledger.db")
    data = entry.data
    assert data["git"] == {"commit": git(repo, "rev-parse", "HEAD"), "dirty": False, "diff_hash": None}
    assert data["source_hash"] == hashlib.sha256((repo / "mini.toml").read_bytes()).hexdigest()
    assert data["doc_hash"] == result.doc_hash and data["source_file"] == "mini.toml"
    assert data["tool"] == tool_version()


def test_a_dirty_tree_is_recorded_dirty_with_a_hash_that_changes_with_the_diff(repo: Path, tmp_path: Path) -> None:
    (repo / "notes.txt").write_text("two\n")
    first = git_state(repo)
    (repo / "notes.txt").write_text("three\n")
    second = git_state(repo)
    assert first["dirty"] and second["dirty"] and first["diff_hash"] != second["diff_hash"]
    write(repo, "scratch.py", "x = 1\n")  # an untracked file dirties the tree too
    assert git_state(repo)["diff_hash"] not in (None, second["diff_hash"])
    entry, _ = freeze_entry(repo, tmp_path / "ledger.db")
    assert entry.data["git"]["dirty"] is True and entry.data["git"]["diff_hash"] == git_state(repo)["diff_hash"]


def test_a_tree_without_git_records_the_stated_commit_or_none(tmp_path: Path, monkeypatch) -> None:
    bare = tmp_path / "copy"
    bare.mkdir()
    monkeypatch.delenv("PREREG_GIT_COMMIT", raising=False)
    assert git_state(bare) == {"commit": None, "dirty": None, "diff_hash": None}  # unknown, never guessed
    monkeypatch.setenv("PREREG_GIT_COMMIT", "4f23a01631495ec5d6a6575b33c9db17dfb50c47")
    assert git_state(bare) == {"commit": "4f23a01631495ec5d6a6575b33c9db17dfb50c47", "dirty": False, "diff_hash": None,
                               "stated_by": "PREREG_GIT_COMMIT"}  # fmt: skip
