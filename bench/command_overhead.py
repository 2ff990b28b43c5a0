"""What governing a script costs: the engine's reading of a command rung's windows file and its ledger writes, as a
share of the rung's wall time (target: under 1%).

Two measurements, on a script that spends a fixed time per step on the CPU (a busy loop, as training is) and
appends a window every `--log-every` steps:

1. A real ladder: `prereg freeze` and `prereg run` on a temporary ledger. Each window entry carries the engine's
   own accounting, `read_s` (reading and checking the window's lines) and `ledger_s` (appending the previous
   window); their sum over the rung against its run-end `wall_s`.
2. The runner in this process, against the same script, with one ledger append per window on a temporary ledger:
   the CPU time this process spends (the poll loop, reading and checking, appending) against the wall time — what
   the engine takes from the machine the script trains on. The appends' waits on the disk (fsync) are idle time
   there: the script writes its windows on, whatever the engine is doing.

    PYTHONPATH=. python bench/command_overhead.py [--steps 1000] [--log-every 100] [--step-ms 20]

Prints its conditions and results, and writes them to bench/results/command_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.command.declaration import declare  # noqa: E402
from engine.command.process import POLL_MAX_S, POLL_S, STOP_GRACE_S, CommandRunner  # noqa: E402
from engine.workload import RunContext  # noqa: E402
from prereg.ledger import Ledger  # noqa: E402

SCRIPT = """
import json, os, time

steps, every = int(os.environ["PREREG_STEPS"]), int(os.environ["PREREG_LOG_EVERY"])
step_s = json.loads(os.environ["PREREG_CONFIG"])["step_ms"] / 1000
with open(os.environ["PREREG_WINDOWS"], "a") as out:
    for step in range(1, steps + 1):
        end = time.perf_counter() + step_s
        while time.perf_counter() < end:  # a step's work: the CPU busy, as in training
            pass
        if step % every == 0:
            out.write(json.dumps({"steps": step, "s_per_step": step_s, "loss": 1.0 / step}) + "\\n")
            out.flush()
"""

REGISTRATION = """
id = "bench-command-overhead"
title = "the engine's share of a command rung"
question = "How much of a command rung's wall time is the engine's?"
workload = "command"
profile = "local"

[command]
run = "{python} train.py"
sources = ["train.py"]
config = ["step_ms"]
metrics = ["s_per_step", "loss"]

[cost]
ceiling_gpu_h = 1.0

[protocol]
steps = {steps}
log_every = {log_every}
config = {{ step_ms = {step_ms} }}
  [[protocol.rungs]]
  id = "A"
"""


def through_the_cli(work: Path, args: argparse.Namespace) -> dict:
    (work / "train.py").write_text(textwrap.dedent(SCRIPT))
    registration = work / "bench.toml"
    registration.write_text(
        REGISTRATION.format(python=sys.executable, steps=args.steps, log_every=args.log_every, step_ms=args.step_ms)
    )
    ledger = work / "ledger.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for verb in (["freeze", str(registration)], ["run", "bench-command-overhead", "--file", str(registration)]):
        subprocess.run([sys.executable, str(ROOT / "cli.py"), *verb, "--ledger", str(ledger), "--json"], cwd=ROOT,
                       env=env, check=True, capture_output=True)  # fmt: skip
    store = Ledger.open(str(ledger), create=False)
    try:
        windows = [e.data for e in store.entries(reg_id="bench-command-overhead", kinds=("window",))]
        [end] = [e.data for e in store.entries(reg_id="bench-command-overhead", kinds=("run-end",))]
    finally:
        store.close()
    read_s = sum(w["read_s"] for w in windows)
    # Each window carries the append of the one before it; the last append is timed by nobody: count the mean once more.
    ledger_s = sum(w["ledger_s"] for w in windows) * len(windows) / max(len(windows) - 1, 1)
    wall_s = end["totals"]["wall_s"]
    return {
        "windows": len(windows),
        "wall_s": wall_s,
        "read_s": round(read_s, 6),
        "ledger_s": round(ledger_s, 6),
        "share": (read_s + ledger_s) / wall_s,
    }


def in_this_process(work: Path, args: argparse.Namespace) -> dict:
    declaration = declare(
        {"run": f"{sys.executable} train.py", "config": ["step_ms"], "metrics": ["s_per_step", "loss"]}
    )
    run_dir = work / "in-process"
    run_dir.mkdir()
    context = RunContext(declaration, work, rung="A", steps=args.steps, log_every=args.log_every, run_dir=run_dir)
    runner = CommandRunner(declaration.profiles["local"], {"step_ms": args.step_ms}, 0, context)
    ledger = Ledger.open(str(work / "appends.db"), create=True)
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    runner.load()
    done, append_s, append_cpu_s, windows = 0, 0.0, 0.0, 0
    while done < args.steps:
        window = runner.train_window(args.log_every, lambda: False)
        done += window["steps"]
        start, start_cpu = time.perf_counter(), time.process_time()
        ledger.append("window", "bench", {"rung": "A", "step": done, **window}, ref="run")
        append_s += time.perf_counter() - start
        append_cpu_s += time.process_time() - start_cpu
        windows += 1
    assert runner.close() == 0
    wall_s, cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
    ledger.close()
    return {
        "windows": windows,
        "wall_s": round(wall_s, 4),
        "cpu_s": round(cpu_s, 6),
        "reading_cpu_s": round(cpu_s - append_cpu_s, 6),
        "append_cpu_s": round(append_cpu_s, 6),
        "append_wall_s": round(append_s, 6),
        "share": cpu_s / wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    conditions = {
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "steps": args.steps,
        "log_every": args.log_every,
        "step_ms": args.step_ms,
        "window_s": args.log_every * args.step_ms / 1000,
        "poll_s": [POLL_S, POLL_MAX_S],
        "stop_grace_s": STOP_GRACE_S,
        "ledger": "SQLite, WAL, synchronous=FULL (a temporary file)",
    }
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        results = {
            "conditions": conditions,
            "ladder": through_the_cli(work, args),
            "runner": in_this_process(work, args),
        }
    shutil.rmtree(ROOT / "reports" / "bench-command-overhead", ignore_errors=True)  # the rung's scratch folder
    for name, value in conditions.items():
        print(f"{name:>16}: {value}")
    ladder, runner = results["ladder"], results["runner"]
    print(
        f"\nprereg run: {ladder['windows']} windows in a {ladder['wall_s']:.2f} s rung; reading "
        f"{ladder['read_s']:.4f} s + ledger writes {ladder['ledger_s']:.4f} s = {100 * ladder['share']:.3f}% of it"
    )
    print(
        f"runner here: {runner['windows']} windows in {runner['wall_s']:.2f} s; engine CPU {runner['cpu_s']:.4f} s "
        f"(waiting and reading {runner['reading_cpu_s']:.4f}, appends {runner['append_cpu_s']:.4f}) = "
        f"{100 * runner['share']:.3f}%; the appends' wall {runner['append_wall_s']:.4f} s"
    )
    per_window_ms = 1000 * (ladder["read_s"] + ladder["ledger_s"]) / ladder["windows"]
    results["ladder"]["per_window_ms"] = round(per_window_ms, 3)
    print(
        f"per window: {per_window_ms:.2f} ms of reading and writing (the ledger's fsync most of it): "
        + ", ".join(f"{100 * per_window_ms / 1000 / w:.2f}% at windows {w:g} s apart" for w in (0.5, 2, 10))
    )
    print(f"target < 1% of the rung's wall time: {'met' if ladder['share'] < 0.01 else 'NOT met'} here")
    out = ROOT / "bench" / "results" / "command_overhead.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"→ {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
