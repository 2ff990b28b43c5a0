"""Where a gate or rung process runs: a launcher starts it and hands the ladder a job to follow.

Two launchers, one module each: `local` (engine/launch/local.py: a child process of the ladder, torchrun's ranks
on this host for a profile of several) and `slurm` (engine/launch/slurm.py: one cluster job per gate or rung,
submitted through submitit, followed through the ledger). The ladder sees only the protocol below: it starts a
job, reads its events (the progress display), signals it (budget, Ctrl-C), and takes its exit status.
"""

from __future__ import annotations

from typing import Any, Iterator, Literal, Protocol

from prereg.workload import Profile

Purpose = Literal["gate", "rung"]
# The resolved launcher (name and settings, JSON) a rung records on its run-start; a cluster job adds its id and
# hosts under JOB_VARIABLE.
LAUNCHER_VARIABLE = "PREREG_LAUNCHER"
JOB_VARIABLE = "PREREG_JOB"


class Job(Protocol):
    returncode: int | None

    def events(self) -> Iterator[dict[str, Any]]:
        """The job's events (`oracle`, `window`, …) as they happen, until it ends; then `returncode` is set."""
        ...

    def signal(self, number: int) -> None: ...


class Launch(Protocol):
    # True when the job outlives the ladder (a cluster job): a signal to the ladder stops following it, not the job.
    detached_jobs: bool

    def start(self, purpose: Purpose, args: list[str], profile: Profile, runs: dict[str, str]) -> Job:
        """Start the gate (`engine.gate ARGS`) or a rung (`engine.rung ARGS`, its runs: run id -> rung label)."""
        ...
