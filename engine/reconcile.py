"""No run is left "running" once its process is gone: the engine, not the child, owns a run's status.

A rung process records its identity on its run-start (engine/process_identity.py). A run without an end whose
process is gone — killed with its ladder, its machine rebooted — is recorded `interrupted` by the next verb that
reads the ledger, with why; `prereg run` then re-runs its rung from scratch and its partial windows never reach a
read. A run whose ladder still lives is that ladder's to end: the reconciler only acts holding the registration's
run lock, which a living ladder holds.
"""

from __future__ import annotations

from typing import Any

from engine import process_identity
from engine.runlock import RunLock
from prereg.errors import Refused
from prereg.ledger import Entry, Ledger


def running(ledger: Ledger, reg_id: str | None = None) -> list[Entry]:
    """The run-start entries (of one registration, or of all) whose run has no end yet."""
    starts: dict[str, Entry] = {}
    for entry in ledger.entries(reg_id=reg_id, kinds=("run-start", "run-end", "interrupted")):
        if entry.kind == "run-start":
            starts[entry.ref] = entry
        else:
            starts.pop(entry.ref, None)
    return list(starts.values())


def record_interrupted(ledger: Ledger, start: Entry, reason: str) -> None:
    elapsed = 0.0
    for window in ledger.entries(reg_id=start.reg_id, kinds=("window",), ref=start.ref):
        elapsed = window.data.get("elapsed_s", elapsed)
    ledger.append(
        "interrupted",
        start.reg_id,
        {"rung": start.data["rung"], "reason": reason, "totals": {"gpu_s": elapsed, "at_least": True}},
        ref=start.ref,
    )


def gone_reason(start: Entry) -> str | None:
    """Why this run is over without an end, or None while its process may still run. A cluster job's run is its
    job's to settle (engine/launch/slurm.py): the job's state says what its end is, its process alone cannot."""
    if start.data.get("job"):
        return None
    identity: dict[str, Any] | None = start.data.get("process")
    if process_identity.gone(identity) is not True:
        return None
    return f"its {process_identity.describe(identity or {})} is gone without an end; re-run from scratch"


def settle_ended_jobs(ledger: Ledger) -> list[str]:
    """Settle every cluster job that has ended and whose ladder is not running (it settles its own); the job ids.
    Where Slurm's commands are not installed, jobs wait for a verb run where they are."""
    import shutil

    from engine.launch.slurm import job_state, outstanding, settle

    jobs = outstanding(ledger)
    if not jobs or shutil.which("scontrol") is None:
        return []
    settled = []
    for reg_id in sorted({str(job.reg_id) for job in jobs}):
        try:
            with RunLock(ledger.url, reg_id):
                for job in outstanding(ledger, reg_id):  # again, under the lock
                    state = job_state(str(job.ref))
                    if not state.active:
                        settle(ledger, job, state)
                        settled.append(str(job.ref))
        except Refused:
            continue  # its ladder runs: it settles its own jobs
    return settled


def reconcile(ledger: Ledger) -> list[str]:
    """Record `interrupted` for every run whose process is gone and whose ladder is not running; the run ids.
    Ended cluster jobs are settled first."""
    settle_ended_jobs(ledger)
    candidates = {start.reg_id for start in running(ledger) if gone_reason(start)}
    marked = []
    for reg_id in sorted(candidates):
        try:
            with RunLock(ledger.url, reg_id):
                for start in running(ledger, reg_id):  # again, under the lock: nobody else ends them now
                    reason = gone_reason(start)
                    if reason:
                        record_interrupted(ledger, start, reason)
                        marked.append(start.ref)
        except Refused:
            continue  # its ladder runs: it ends its own runs
    return marked
