"""One rung process: `python -m engine.rung …`, started by the ladder.

Sequential: one rung, a fresh process (clean allocator, its own model load — the seeds' protocol).
Interleaved: several rungs in one process and one model load, their switches alternating window by window so
drift hits every rung alike (they share one model and optimizer: their step times and memory are per rung,
their loss is one trajectory).

The process writes its own ledger entries: `run-start` before any work, a `window` per window as it finishes,
`kill` when a kill line fires, and `run-end` with its status. SIGTERM/SIGINT end the rung with status `killed`
and a final window; SIGUSR1 is the ladder's time budget (status `killed`, by the budget, re-run on resume).
A SIGKILL leaves a run without an end, which the next `prereg run` records as `interrupted`.
One JSON line per window goes to stdout for the ladder's progress display.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

PROCESS_START = time.monotonic()  # cost counts from process start: imports and model load included


class Stop:
    """Why the process was asked to stop between steps, if it was."""

    def __init__(self) -> None:
        self.reason: dict[str, Any] | None = None

    def __call__(self) -> bool:
        return self.reason is not None

    def install(self) -> None:
        def on_signal(number, frame):
            name = signal.Signals(number).name
            self.reason = {"budget": True} if number == signal.SIGUSR1 else {"signal": name}

        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(number, on_signal)


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.rung")
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--reg", required=True)
    parser.add_argument("--run", action="append", required=True, help="RUN_ID=LABEL:DECLARED_RUNG:ITEM,ITEM (repeat for interleaved)")
    parser.add_argument("--deadline-s", type=float, default=None, help="device-seconds left under the ceiling (on_ceiling = stop)")
    parser.add_argument("--save-dir", default=None)
    args = parser.parse_args(argv)

    stop = Stop()
    stop.install()

    from engine.environment import run_environment
    from engine.killwatch import KillWatch
    from engine.workload import make_runner
    from prereg.canonical import encode_nonfinite
    from prereg.ledger import Ledger
    from prereg.state import load_state
    from prereg.workload import get_workload

    ledger = Ledger.open(args.ledger, create=False)
    state = load_state(ledger, args.reg, with_windows=False)
    reg = state.registration()
    declaration = get_workload(reg.workload)
    profile = declaration.profiles[reg.profile]
    runs = []
    for spec in args.run:
        run_id, _, rest = spec.partition("=")
        label, declared, items = rest.split(":")
        runs.append({"run": run_id, "label": label, "rung": declared, "items": tuple(i for i in items.split(",") if i)})
    config = reg.rung_config(runs[0]["rung"])
    switches = {i.id: i.switch for i in reg.items}
    environment = run_environment(reg.profile, reg.protocol.seed)
    for run in runs:
        ledger.append("run-start", args.reg, {
            "rung": run["label"], "declared_rung": run["rung"], "primed_from": run["rung"] if run["label"] != run["rung"] else None,
            "items": list(run["items"]), "switches": [switches[i] for i in run["items"]], "config": config,
            "version": state.version, "schedule": reg.protocol.schedule if len(runs) > 1 else "sequential",
            "interleaved_with": [r["run"] for r in runs if r is not run], "env": environment,
        }, ref=run["run"])

    status = {run["run"]: "finished" for run in runs}
    ended_by: dict[str, Any] = {}
    windows: dict[str, list[dict[str, Any]]] = {run["run"]: [] for run in runs}
    watches = {run["run"]: KillWatch(reg, run["rung"], run["items"]) for run in runs}
    load_s = 0.0
    rc = 0
    runner = None
    try:
        runner = make_runner(declaration, profile, config, reg.protocol.seed)
        load_start = time.monotonic()
        runner.load()
        load_s = time.monotonic() - load_start
        emit({"event": "loaded", "load_s": load_s})
        steps_done = {run["run"]: 0 for run in runs}
        protocol = reg.protocol
        active = list(runs)
        ledger_s = 0.0
        while active:
            for run in list(active):
                run_id = run["run"]
                remaining = protocol.steps - steps_done[run_id]
                runner.set_switches(tuple(switches[i] for i in run["items"]))
                window = runner.train_window(min(protocol.log_every, remaining), stop)
                steps_done[run_id] += window["steps"]
                step = steps_done[run_id]
                if protocol.eval_every and step % protocol.eval_every == 0:
                    window.update(runner.evaluate())
                if protocol.save_every and step % protocol.save_every == 0 and args.save_dir:
                    runner.save(os.path.join(args.save_dir, f"{run_id}-step{step}"))
                elapsed = time.monotonic() - PROCESS_START
                window.update({"step": step, "elapsed_s": round(elapsed, 4), "ledger_s": round(ledger_s, 6)})
                windows[run_id].append(window)
                write_start = time.monotonic()
                ledger.append("window", args.reg, {"rung": run["label"], **encode_nonfinite(window)}, ref=run_id)
                ledger_s = time.monotonic() - write_start  # the governance cost of the previous window, carried by the next
                emit({"event": "window", "run": run_id, "rung": run["label"], "step": step, "of": protocol.steps,
                      "loss": window.get("loss"), "s_per_step": window.get("s_per_step")})
                fired = watches[run_id].check(windows[run_id])
                if fired:
                    ledger.append("kill", args.reg, {"rung": run["label"], "declared_rung": run["rung"], **fired}, ref=run_id)
                    status[run_id] = "killed"
                    ended_by[run_id] = {"kill": fired["kill"]}
                    active.remove(run)
                    continue
                if stop():
                    status[run_id] = "killed"
                    ended_by[run_id] = stop.reason
                    active.remove(run)
                    continue
                if args.deadline_s is not None and elapsed * runner.devices >= args.deadline_s:
                    status[run_id] = "over-ceiling"
                    ended_by[run_id] = {"ceiling": True}
                    active.remove(run)
                    continue
                if step >= protocol.steps:
                    active.remove(run)
            if stop():
                for run in active:
                    status[run["run"]] = "killed"
                    ended_by[run["run"]] = stop.reason
                active = []
    except Exception as error:  # the rung failed: recorded with its reason, the process exits non-zero
        rc = 1
        for run in runs:
            if status[run["run"]] == "finished":
                status[run["run"]] = "failed"
                ended_by[run["run"]] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        import traceback

        traceback.print_exc(file=sys.stderr)
    wall = time.monotonic() - PROCESS_START
    devices = runner.devices if runner is not None else 1
    for run in runs:
        share = 1.0 / len(runs)  # interleaved rungs share one process: its time is split evenly
        ledger.append("run-end", args.reg, {
            "rung": run["label"], "status": status[run["run"]], "ended_by": ended_by.get(run["run"]),
            "totals": {"rc": rc, "steps": windows[run["run"]][-1]["step"] if windows[run["run"]] else 0, "load_s": round(load_s, 4),
                       "gpu_s": round(wall * devices * share, 4), "load_gpu_s": round(load_s * devices * share, 4),
                       "wall_s": round(wall, 4), "world_size": 1},
        }, ref=run["run"])
    emit({"event": "end", "status": status})
    return rc


if __name__ == "__main__":
    sys.exit(main())
