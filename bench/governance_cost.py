"""The governance cost on the step: time spent writing window entries as a share of the steps' time.

Every window entry carries `ledger_s`, the seconds its run spent appending the previous window (an fsync'd,
hash-chained append under the writer lock), and its steps' median seconds. Read from a ledger a ladder ran into:

    python bench/governance_cost.py --ledger reports/demo/ledger.db molmo2-perf-pass1-tiny
"""

from __future__ import annotations

import argparse
import platform
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prereg.ledger import Ledger  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("reg_id")
    parser.add_argument("--ledger", default="ledger.db")
    args = parser.parse_args()
    store = Ledger.open(args.ledger, create=False)
    write_s = step_s = 0.0
    windows = 0
    for entry in store.entries(reg_id=args.reg_id, kinds=("window",)):
        data = entry.data
        write_s += data.get("ledger_s", 0.0)
        step_s += data["steps"] * data["s_per_step"]
        windows += 1
    print(
        f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}"
    )
    print(
        f"{windows} windows · writing windows {write_s * 1e3:.1f} ms · steps {step_s:.2f} s · share {write_s / step_s:.3%}"
    )


if __name__ == "__main__":
    main()
