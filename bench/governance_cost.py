"""The governance cost on the step: time spent writing window entries as a share of the steps' time.

A rung process times each window's append (an fsync'd, hash-chained append under the writer lock) and writes that
time, `ledger_s`, into the next entry it appends: the next window's, or for the last window its run's run-end.
Every window append is counted once: the windows' `ledger_s` plus the run-ends'. Read from a ledger a ladder ran into:

    python bench/governance_cost.py --ledger reports/demo/ledger.db molmo2-perf-pass1-tiny
"""

from __future__ import annotations

import argparse
import platform
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prereg.ledger import Ledger  # noqa: E402


@dataclass(frozen=True)
class GovernanceCost:
    windows: int
    writes_counted: int  # window appends whose time was carried by a later entry: every one, for complete runs
    write_s: float
    step_s: float

    @property
    def share(self) -> float:
        return self.write_s / self.step_s


def governance_cost(store: Ledger, reg_id: str) -> GovernanceCost:
    write_s = step_s = 0.0
    windows = writes_counted = 0
    for entry in store.entries(reg_id=reg_id, kinds=("window", "run-end")):
        data = entry.data
        if entry.kind == "window":
            windows += 1
            step_s += data["steps"] * data["s_per_step"]
        # A window's ledger_s is 0.0 only for a process's first window: nothing was appended before it. A run-end
        # carries its last window's append, or 0.0 when another run's window was the process's last append.
        if data.get("ledger_s"):
            writes_counted += 1
            write_s += data["ledger_s"]
    return GovernanceCost(windows, writes_counted, write_s, step_s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("reg_id")
    parser.add_argument("--ledger", default="ledger.db")
    args = parser.parse_args()
    store = Ledger.open(args.ledger, create=False)
    cost = governance_cost(store, args.reg_id)
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}")
    print(
        f"{cost.windows} windows ({cost.writes_counted} appends timed) · writing windows {cost.write_s * 1e3:.1f} ms · "
        f"steps {cost.step_s:.2f} s · share {cost.share:.3%}"
    )


if __name__ == "__main__":
    main()
