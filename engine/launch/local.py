"""The local launcher: the gate or rung is a child process of the ladder, on this machine.

A profile of several processes runs each rung (and only the rungs: the oracle gate is one process) under
torchrun, which forwards the ladder's signals — SIGTERM, SIGINT and the budget's SIGUSR1 — to every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.launch import LAUNCHER_VARIABLE, Purpose
from prereg.workload import Profile

REPO_ROOT = Path(__file__).resolve().parent.parent.parent

# torchrun handles (and forwards to every rank) only the signals it is told to; SIGUSR1 (the time budget) would
# otherwise kill the launcher outright and orphan its ranks.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGUSR1"


def rung_command(profile: Profile, rung_args: list[str]) -> list[str]:
    """The `python -m ...` arguments of a rung process: `engine.rung` itself, or torchrun starting world_size of
    them on this host (one per GPU on CUDA; never restarted: a restarted rank would re-run the rung)."""
    if profile.world_size == 1:
        return ["engine.rung", *rung_args]
    return [
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(profile.world_size),
        "--max-restarts",
        "0",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
        "-m",
        "engine.rung",
        *rung_args,
        "--device",
        profile.device,
    ]


class Child:
    """A gate or rung process; SIGTERM/SIGINT to the ladder are forwarded to it."""

    def __init__(self, args: list[str], extra_env: dict[str, str] | None = None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        self.process = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, env=env, text=True
        )
        self.returncode: int | None = None

    def events(self):
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.strip()
            if line.startswith("{"):
                yield json.loads(line)
        self.returncode = self.process.wait()

    def signal(self, number: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(number)


class LocalLaunch:
    detached_jobs = False

    def __init__(self, record: dict | None = None):
        # The registration's launcher as its runs record it (PREREG_LAUNCHER); None when it names none.
        self.env = {LAUNCHER_VARIABLE: json.dumps(record, sort_keys=True)} if record is not None else {}

    def start(self, purpose: Purpose, args: list[str], profile: Profile, runs: dict[str, str]) -> Child:
        if purpose == "gate":
            return Child(["engine.gate", *args], self.env)
        return Child(rung_command(profile, args), self.env)
