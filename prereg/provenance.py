"""Where a document or a run came from: the git commit, whether the tree was dirty, and a hash of the diff."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

from prereg import __version__


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.decode("utf-8", "replace") if result.returncode == 0 else None


def git_state(cwd: Path) -> dict[str, Any]:
    commit = _git(["rev-parse", "HEAD"], cwd)
    if commit is None:
        # A copy of the tree without its .git (a lent GPU machine): the launcher states the commit it copied.
        stated = os.environ.get("PREREG_GIT_COMMIT")
        if stated:
            return {
                "commit": stated,
                "dirty": os.environ.get("PREREG_GIT_DIRTY") == "1",
                "diff_hash": os.environ.get("PREREG_GIT_DIFF_HASH"),
                "stated_by": "PREREG_GIT_COMMIT",
            }
        return {"commit": None, "dirty": None, "diff_hash": None}
    diff = _git(["diff", "HEAD", "--no-color", "--no-ext-diff"], cwd) or ""
    untracked = _git(["ls-files", "--others", "--exclude-standard"], cwd) or ""
    dirty = bool(diff.strip() or untracked.strip())
    digest = hashlib.sha256((diff + "\0" + untracked).encode()).hexdigest() if dirty else None
    return {"commit": commit.strip(), "dirty": dirty, "diff_hash": digest}


def tool_version() -> str:
    return f"prereg {__version__}"
