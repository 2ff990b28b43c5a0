"""Ledger benchmark (CPU): append rates, and `prereg audit verify` and `prereg audit show` as a user runs them.

    python bench/ledger_bench.py [--entries 1000000] [--repeats 3] [--dir DIR] [--out bench/results/ledger_bench.json]

Builds its ledgers in a temporary directory (never ./ledger.db): a registration frozen, its oracles recorded and
SHOW_RUNS runs of SHOW_WINDOWS windows in all written as the engine writes them, its verdict, and window entries
of other runs up to `--entries`. Then it times the CLI, each command its own process on the built ledger, from
the interpreter's start to its exit, `--repeats` times; and the same CLI on a one-entry ledger, the floor that
interpreter start and imports set. Writes the figures with their conditions as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prereg.actions import freeze, record  # noqa: E402
from prereg.ledger import Ledger, sqlite_wal_reset_affected  # noqa: E402
from prereg.verdict import record_verdict  # noqa: E402

BUILD_BATCH = 50_000  # append_many batch while building the big ledger
SHOW_WINDOWS = 100_000  # windows of the one registration `audit show` is timed on
SHOW_RUNS = 20  # its runs (refs); windows spread evenly over them
VERDICT_WINDOWS = 5  # windows per run of the small ledger the verdict is computed on (see verdict_data)
OTHER_RUN_WINDOWS = 5000  # windows per run of the filler registrations
REG_ID = "ledger-bench"

REGISTRATION = """
id = "ledger-bench"
title = "ledger benchmark: one registration with many windows"
question = "How long do audit show and audit verify take on a large ledger?"
workload = "molmo2"
profile = "cpu-tiny"

[cost]
ceiling_gpu_h = 1.0

[[items]]
id = "P2"
title = "windowed vram peak"
switch = "windowed_vram_peak"
bitwise = true
  [[items.oracles]]
  id = "P2a"
  kind = "schema"
  probe = "window_schema"

[protocol]
steps = 100000
log_every = 20
  [[protocol.rungs]]
  id = "A"
  [[protocol.rungs]]
  id = "C"
  items = ["P2"]

[reads]
gain = "(A.s_per_step - C.s_per_step) / A.s_per_step"

[[rules]]
id = "faster"
when = "gain >= 0.01"
outcome = "land"
land = ["P2"]
[[rules]]
id = "not-faster"
when = "gain < 0.01"
outcome = "park"
park = ["P2"]

[[expectations]]
n = 1
claim = "the oracle passes"
confidence = "high"
check = "all_oracles_passed()"
"""

ORACLES = """
provenance = "ledger benchmark"
[oracles.P2a]
missing = []
violations = []
"""


def window(step: int, rung: str) -> dict:
    """A window entry's data, sized like the engine's (about 350 bytes of body)."""
    return {
        "rung": rung,
        "step": step,
        "steps": 20,
        "s_per_step": 2.2518 + step * 1e-6 - (0.1 if rung == "C" else 0.0),
        "tokens_per_s": 14123.75,
        "loss": 1.0 / (1 + step),
        "finite": True,
        "vram_peak_gib": 66.6,
        "vram_window_peak_gib": 60.125,
        "vram_reserved_peak_gib": 70.25,
        "smi_peak_mib": 81234,
        "elapsed_s": 2.2518 * step,
        "ledger_s": 0.0012,
        "world_size": 1,
    }


def run_entries(run: int, windows: int) -> list[tuple[str, str, dict, str]]:
    """One run of the bench registration, in the entries the engine writes (run-start, windows, run-end)."""
    rung, items = ("A", []) if run % 2 == 0 else ("C", ["P2"])
    ref = f"run-{run}"
    start = {
        "rung": rung,
        "declared_rung": rung,
        "primed_from": None,
        "items": items,
        "switches": ["windowed_vram_peak"] if items else [],
        "config": {},
        "version": 0,
        "schedule": "sequential",
        "interleaved_with": [],
        "env": {"python": platform.python_version(), "gpu": None, "host": "bench", "profile": "cpu-tiny"},
    }
    end = {
        "rung": rung,
        "status": "finished",
        "ended_by": None,
        "totals": {"rc": 0, "steps": windows * 20, "load_s": 1.0, "gpu_s": 2.25 * windows * 20, "world_size": 1},
        "ledger_s": 0.0012,
        "parallel": None,
        "memory_snapshots": [],
    }
    return (
        [("run-start", REG_ID, start, ref)]
        + [("window", REG_ID, window(20 * (k + 1), rung), ref) for k in range(windows)]
        + [("run-end", REG_ID, end, ref)]
    )


def lifecycle(ledger: Ledger, directory: Path) -> None:
    """The bench registration frozen and its oracle recorded, through the verbs a user runs."""
    registration = directory / f"{REG_ID}.toml"
    registration.write_text(textwrap.dedent(REGISTRATION).lstrip())
    observed = directory / "oracles.toml"
    observed.write_text(textwrap.dedent(ORACLES).lstrip())
    freeze(ledger, registration)
    record(ledger, REG_ID, observed)


def verdict_data(directory: Path) -> dict[str, Any]:
    """The bench registration's verdict entry, computed by `prereg verdict` on the same lifecycle with a few windows
    a run: its bootstrap over 5,000 windows a rung would take longer than everything timed here, and `audit show`
    reads only its outcome, rule, land, park and expectations."""
    ledger = Ledger.open(str(directory / "verdict.db"))
    lifecycle(ledger, directory)
    for run in range(SHOW_RUNS):
        ledger.append_many(run_entries(run, VERDICT_WINDOWS))
    verdict, _ = record_verdict(ledger, REG_ID)
    data = next(ledger.entries(reg_id=REG_ID, kinds=("verdict",))).data
    ledger.close()
    assert data["verdict"] == verdict and verdict["outcome"] == "land", verdict
    return data


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def conditions(ledger: Ledger) -> dict[str, Any]:
    engine = ledger._backend.engine  # the ledger's own connection settings, not a fresh connection's defaults
    with engine.connect() as conn:
        journal = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
        level = conn.exec_driver_sql("PRAGMA synchronous").scalar()
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),  # the machine is shared: how busy it was at the start
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "sqlite_wal_reset_affected": sqlite_wal_reset_affected(sqlite3.sqlite_version_info),
        "journal_mode": journal,
        "synchronous": {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[level],
    }


def rate(count: int, seconds: float) -> dict[str, Any]:
    return {"count": count, "seconds": round(seconds, 4), "per_s": round(count / seconds, 1)}


def bench_appends(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    ledger = Ledger.open(str(directory / "appends.db"))
    found = conditions(ledger)
    results = {}
    single = 2000
    start = time.perf_counter()
    for step in range(single):
        ledger.append("window", "bench-single", window(step, "A"), ref="run-1")
    results["single"] = rate(single, time.perf_counter() - start)
    for batch in (100, 1000):
        total = 20 * batch
        start = time.perf_counter()
        for first in range(0, total, batch):
            ledger.append_many([("window", "bench-many", window(s, "A"), "run-1") for s in range(first, first + batch)])
        results[f"batch_{batch}"] = rate(total, time.perf_counter() - start)
    ledger.close()
    return found, results


def build_big(ledger: Ledger, directory: Path, entries: int, verdict: dict[str, Any]) -> None:
    lifecycle(ledger, directory)
    items: list = []
    for run in range(SHOW_RUNS):
        items += run_entries(run, SHOW_WINDOWS // SHOW_RUNS)
    items.append(("verdict", REG_ID, verdict, None))
    other = 0
    already = ledger.count()
    while already + len(items) < entries:
        items.append(("window", f"other-{other % 50}", window(other, "B"), f"other-run-{other // OTHER_RUN_WINDOWS}"))
        other += 1
    for first in range(0, len(items), BUILD_BATCH):
        ledger.append_many(items[first : first + BUILD_BATCH])


def timed_cli(args: list[str], repeats: int) -> tuple[list[float], dict[str, Any]]:
    """Wall seconds of `prereg ARGS` as its own process, each repeat, and the JSON it printed last."""
    seconds = []
    payload: dict[str, Any] = {}
    for _ in range(repeats):
        start = time.perf_counter()
        result = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=ROOT, capture_output=True, text=True)
        seconds.append(round(time.perf_counter() - start, 4))
        assert result.returncode == 0, result.stderr
        payload = json.loads(result.stdout)
    return seconds, payload


def summary(command: list[str], seconds: list[float]) -> dict[str, Any]:
    return {
        "command": "prereg " + " ".join(command),
        "seconds": seconds,
        "median_s": round(statistics.median(seconds), 4),
        "min_s": min(seconds),
        "max_s": max(seconds),
    }


def bench_cli(directory: Path, entries: int, repeats: int) -> dict[str, Any]:
    verdict = verdict_data(directory)
    db = directory / "big.db"
    ledger = Ledger.open(str(db))
    start = time.perf_counter()
    build_big(ledger, directory, entries, verdict)
    built = rate(entries, time.perf_counter() - start)
    ledger.checkpoint()
    assert ledger.count() == entries
    ledger.close()
    built["db_mib"] = round(db.stat().st_size / 2**20, 1)

    verify = ["audit", "verify", "--json", "--ledger", str(db)]
    seconds, report = timed_cli(verify, repeats)
    assert report["ok"] and report["entries"] == entries, report
    results = {"build": built, "verify": summary(verify[:3] + ["--ledger", "big.db"], seconds)}

    show = ["audit", "show", REG_ID, "--json", "--ledger", str(db)]
    seconds, shown = timed_cli(show, repeats)
    windows = sum(run["windows"] for run in shown["runs"])
    assert windows == SHOW_WINDOWS and len(shown["runs"]) == SHOW_RUNS, (windows, len(shown["runs"]))
    results["audit_show"] = {
        **summary(show[:4] + ["--ledger", "big.db"], seconds),
        "windows": windows,
        "runs": len(shown["runs"]),
    }

    floor_db = directory / "floor.db"
    floor = Ledger.open(str(floor_db))
    freeze(floor, directory / f"{REG_ID}.toml")
    floor.close()
    floor_verify = ["audit", "verify", "--json", "--ledger", str(floor_db)]
    seconds, _ = timed_cli(floor_verify, repeats)
    results["cli_floor"] = summary(floor_verify[:3] + ["--ledger", "one-entry.db"], seconds)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000, help="size of the ledger verify and show run on")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each timed command")
    parser.add_argument("--dir", type=Path, default=None, help="where to build the ledgers (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ledger_bench.json")
    args = parser.parse_args()
    smallest = SHOW_WINDOWS + 2 * SHOW_RUNS + 4
    if args.entries < smallest:
        parser.error(f"--entries must be at least {smallest} (the audit-show registration)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        found, appends = bench_appends(Path(tmp))
        print(json.dumps({"conditions": found}, indent=1), flush=True)
        cli = bench_cli(Path(tmp), args.entries, args.repeats)
    results = {
        "conditions": found,
        "entries": args.entries,
        "build_batch": BUILD_BATCH,
        "repeats": args.repeats,
        "appends": appends,
        **cli,
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, figures in appends.items():
        print(
            f"append {name:<10} {figures['count']:>9,} in {figures['seconds']:8.3f} s = {figures['per_s']:>10,.0f} /s"
        )
    build = cli["build"]
    print(f"build      {build['count']:>9,} in {build['seconds']:8.3f} s = {build['per_s']:>10,.0f} /s")
    print(f"database   {build['db_mib']} MiB")
    for name in ("verify", "audit_show", "cli_floor"):
        print(f"{cli[name]['command']:<40} median {cli[name]['median_s']:.3f} s of {cli[name]['seconds']}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
