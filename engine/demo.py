"""`make demo`: the bundled tiny S-bundle, end to end on the CPU, shown as the commands a person would type.

The demo works on a copy of the lab's ledger (ledger.db, where molmo2-perf-pass1-tiny was frozen before any
data) under reports/demo/, so the committed record is never touched: freeze (a no-op: it is already frozen),
the oracle gate and the ladder, the verdict, and the audit. With PREREG_DEMO_COMPARE=1 it then runs the same
question under the other schedule (molmo2-perf-pass1-tiny-interleaved: one process and one model load for the
rungs, instead of seed 000's fresh process per rung) and reports both ladders' costs and verdicts side by side.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGISTRATION = "registrations/molmo2-perf-pass1-tiny.toml"
REG_ID = "molmo2-perf-pass1-tiny"
TWIN = "registrations/molmo2-perf-pass1-tiny-interleaved.toml"
TWIN_ID = "molmo2-perf-pass1-tiny-interleaved"


def prereg(*args: str, ledger: Path) -> None:
    command = ["prereg", *args, "--ledger", str(ledger.relative_to(ROOT))]
    line = f"$ {shlex.join(command)}"
    print("\n" + (f"\033[1m{line}\033[0m" if sys.stdout.isatty() else line), flush=True)
    result = subprocess.run([sys.executable, str(ROOT / "cli.py"), *command[1:]], cwd=ROOT)
    if result.returncode != 0:
        sys.exit(result.returncode)


def main() -> None:
    start = time.monotonic()
    work = ROOT / "reports" / "demo"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ledger = work / "ledger.db"
    shutil.copyfile(ROOT / "ledger.db", ledger)
    print(f"demo ledger: a copy of ledger.db at {ledger.relative_to(ROOT)}")
    prereg("audit", "verify", ledger=ledger)
    prereg("freeze", REGISTRATION, ledger=ledger)
    prereg("run", REG_ID, ledger=ledger)
    prereg("verdict", REG_ID, ledger=ledger)
    prereg("audit", "show", REG_ID, ledger=ledger)
    if os.environ.get("PREREG_DEMO_COMPARE") == "1":
        # The same question, interleaved: its own oracle gate and ladder, then both ladders' costs side by side.
        prereg("freeze", TWIN, ledger=ledger)
        prereg("run", TWIN_ID, ledger=ledger)
        prereg("verdict", TWIN_ID, ledger=ledger)
        prereg("report", REG_ID, "--compare", TWIN_ID, "--out", str((work / "report").relative_to(ROOT)), ledger=ledger)
    else:
        prereg("report", REG_ID, "--out", str((work / "report").relative_to(ROOT)), ledger=ledger)
    print(
        f"\ndemo finished in {time.monotonic() - start:.0f} s · report: "
        f"{(work / 'report' / 'report.html').relative_to(ROOT)}"
    )


if __name__ == "__main__":
    main()
