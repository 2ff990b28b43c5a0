"""Ledger benchmark (CPU): append rates, verify over a large ledger, and the `audit show` query path.

    python bench/ledger_bench.py [--entries 1000000] [--dir DIR]

Prints its conditions first; builds its ledgers in a temporary directory (never ./ledger.db).
"""

from __future__ import annotations

import argparse
import os
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prereg.ledger import Ledger, sqlite_wal_reset_affected  # noqa: E402

BUILD_BATCH = 50_000  # append_many batch while building the big ledger
SHOW_WINDOWS = 100_000  # windows of the one registration `audit show` is timed on
SHOW_RUNS = 20  # its runs (refs); windows spread evenly over them
NON_WINDOW_KINDS = ["freeze", "amend", "oracle", "run-start", "run-end", "verdict"]


def window(step: int, rung: str) -> dict:
    """A window entry's data, sized like the engine's (about 350 bytes of body)."""
    return {
        "rung": rung,
        "step": step,
        "steps": 20,
        "s_per_step": 2.2518 + step * 1e-6,
        "tokens_per_s": 14123.75,
        "loss": 1.0 / (1 + step),
        "finite": True,
        "vram_peak_gib": 66.6,
        "vram_window_peak_gib": 60.125,
        "vram_reserved_peak_gib": 70.25,
        "smi_peak_mib": 81234,
        "doc": "3f0c2a9e5b7d4c1f8a6e0d2b9c7a5e3f1d8b6a4c2e0f9d7b5a3c1e8f6d4b2a0c",
    }


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def conditions(ledger: Ledger) -> None:
    engine = ledger._backend.engine  # the ledger's own connection settings, not a fresh connection's defaults
    with engine.connect() as conn:
        journal = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
        level = conn.exec_driver_sql("PRAGMA synchronous").scalar()
        synchronous = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[level]
    print(f"machine: {cpu_model()} x {os.cpu_count()} CPUs, {platform.system()} {platform.release()}")
    print(
        f"python {platform.python_version()}, sqlite {sqlite3.sqlite_version} "
        f"(WAL-reset race affected: {sqlite_wal_reset_affected(sqlite3.sqlite_version_info)}; "
        "writers and checkpoints serialized by flock)"
    )
    print(f"journal_mode={journal}, synchronous={synchronous}")


def timed(label: str, count: int, seconds: float) -> None:
    print(f"{label:<52} {count:>9,} in {seconds:8.3f} s = {count / seconds:>10,.0f} /s")


def bench_appends(directory: Path) -> None:
    ledger = Ledger.open(str(directory / "appends.db"))
    conditions(ledger)
    single = 2000
    start = time.perf_counter()
    for step in range(single):
        ledger.append("window", "bench-single", window(step, "A"), ref="run-1")
    timed("append (one transaction + fsync each)", single, time.perf_counter() - start)
    for batch in (100, 1000):
        total = 20 * batch
        start = time.perf_counter()
        for first in range(0, total, batch):
            ledger.append_many([("window", "bench-many", window(s, "A"), "run-1") for s in range(first, first + batch)])
        timed(f"append_many (batches of {batch})", total, time.perf_counter() - start)
    ledger.close()


def build_big(ledger: Ledger, entries: int) -> None:
    """`entries` entries: one registration with SHOW_WINDOWS windows and its lifecycle, the rest other registrations."""
    windows_per_run = SHOW_WINDOWS // SHOW_RUNS
    items: list = [("freeze", "show-me", {"doc_hash": "ab" * 32}, None)]
    items += [("oracle", "show-me", {"oracle": f"P{i}a", "observed": {"loss_abs": 1e-4}}, None) for i in range(4)]
    for run in range(SHOW_RUNS):
        ref = f"run-{run}"
        items.append(("run-start", "show-me", {"rung": "A", "env": {"gpu": "H200"}}, ref))
        items += [("window", "show-me", window(step, "A"), ref) for step in range(windows_per_run)]
        items.append(("run-end", "show-me", {"status": "finished"}, ref))
    items.append(("verdict", "show-me", {"outcome": "land-bundle"}, None))
    other = 0
    while len(items) < entries:
        items.append(("window", f"other-{other % 50}", window(other, "B"), f"other-run-{other // 5000}"))
        other += 1
    for first in range(0, len(items), BUILD_BATCH):
        ledger.append_many(items[first : first + BUILD_BATCH])


def bench_big(directory: Path, entries: int) -> None:
    ledger = Ledger.open(str(directory / "big.db"))
    start = time.perf_counter()
    build_big(ledger, entries)
    timed(f"build with append_many (batches of {BUILD_BATCH})", entries, time.perf_counter() - start)
    ledger.checkpoint()
    size_mb = (directory / "big.db").stat().st_size / 2**20
    print(f"database file: {size_mb:,.0f} MiB")

    start = time.perf_counter()
    report = ledger.verify()
    seconds = time.perf_counter() - start
    assert report.ok and report.entries == entries, report
    timed("verify (recompute chain + envelopes)", entries, seconds)

    start = time.perf_counter()
    per_run = ledger.count_by("show-me", "window")
    lifecycle = list(ledger.entries(reg_id="show-me", kinds=NON_WINDOW_KINDS))
    seconds = time.perf_counter() - start
    assert sum(per_run.values()) == SHOW_WINDOWS and len(lifecycle) == 2 * SHOW_RUNS + 6, (per_run, len(lifecycle))
    print(
        f"{'audit show proxy: count_by + non-window entries':<52} {seconds * 1000:8.1f} ms "
        f"({SHOW_WINDOWS:,} windows in {len(per_run)} runs, {len(lifecycle)} other entries; target < 200 ms)"
    )
    ledger.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000, help="size of the ledger verify is timed on")
    parser.add_argument("--dir", type=Path, default=None, help="where to build the ledgers (default: a temp dir)")
    args = parser.parse_args()
    if args.entries < SHOW_WINDOWS + 2 * SHOW_RUNS + 6:
        parser.error(f"--entries must be at least {SHOW_WINDOWS + 2 * SHOW_RUNS + 6} (the audit-show registration)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        bench_appends(Path(tmp))
        bench_big(Path(tmp), args.entries)


if __name__ == "__main__":
    main()
