"""One rung process: `python -m engine.rung …`, started by the ladder.

Sequential: one rung, a fresh process (clean allocator, its own model load — the seeds' protocol).
Interleaved: several rungs in one process and one model load, their switches alternating window by window so
drift hits every rung alike (they share one model and optimizer: their step times and memory are per rung,
their loss is one trajectory).

The process writes its own ledger entries: `run-start` before any work (with the process's identity: pid, host,
start time), a `window` per window as it finishes, `kill` when a kill line fires, and `run-end` with its status
(and, for a run that crashed, the crash window its kill lines judged last: engine/crash.py).
SIGTERM/SIGINT end the rung with status `killed` and a final window; SIGUSR1 is the ladder's time budget (status
`killed`, by the budget, re-run on resume). The process dies with its ladder; a SIGKILL leaves a run without an
end, which the next verb that reads the ledger records as `interrupted` (engine/reconcile.py).
One JSON line per window goes to stdout for the ladder's progress display.

Several processes (a profile whose world_size > 1; the ladder starts them under torchrun): every rank runs this
same loop; rank 0 alone reads the ledger (and sends the others what they need) and alone writes it — run-start,
windows, kill, run-end — and alone prints events. Whatever ends a run is decided so that every rank ends it at
the same step: a signal through `Stop` (a collective each step: the ranks agree on the MAX of their reasons),
kill lines and the ceiling on rank 0, broadcast to the others after each window. A window is the rung's: its
step time the slowest rank's, its memory the largest rank's (the workload's window reduction).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

PROCESS_START = time.monotonic()  # cost counts from process start: imports and model load included


class Stop:
    """Why the process was asked to stop between steps, if it was.

    Among several ranks a signal may reach one rank a step before another; a rank that stopped alone would
    leave the others waiting in the next step's collectives. So each call is itself a collective: the ranks
    all-reduce (MAX) the codes of their reasons and all adopt the agreed one — every rank calls it once per
    step and once per window, in the same order."""

    REASONS: list[dict[str, Any] | None] = [None, {"signal": "SIGINT"}, {"signal": "SIGTERM"}, {"budget": True}]

    def __init__(self) -> None:
        self.reason: dict[str, Any] | None = None
        self.ranks = None  # engine.workload.Ranks once joined

    def __call__(self) -> bool:
        if self.ranks is None or self.ranks.world_size == 1:
            return self.reason is not None
        agreed = int(self.ranks.max([float(self.REASONS.index(self.reason))])[0])
        if agreed:
            self.reason = self.REASONS[agreed]
        return agreed != 0

    def install(self) -> None:
        def on_signal(number, frame):
            name = signal.Signals(number).name
            self.reason = {"budget": True} if number == signal.SIGUSR1 else {"signal": name}

        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(number, on_signal)


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def die_with_parent() -> None:
    """Should the ladder (or under torchrun, the launcher) die, a SIGKILL included, this process dies with it —
    never an orphan still training, or still writing the ledger. Linux's PR_SET_PDEATHSIG."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() == 1:  # the launcher was already gone before the line above
        os._exit(1)


def launch_record() -> dict[str, Any]:
    """Where the run runs, as its launcher tells it (engine/launch): the resolved launcher of a registration that
    names one, and a cluster job's id and hosts. Nothing for a local run of a registration that names none."""
    from engine.launch import JOB_VARIABLE, LAUNCHER_VARIABLE

    record = {}
    for key, variable in (("launcher", LAUNCHER_VARIABLE), ("job", JOB_VARIABLE)):
        if os.environ.get(variable):
            record[key] = json.loads(os.environ[variable])
    return record


def read_plan(args: argparse.Namespace, ledger, runs: list[dict[str, Any]]):
    """(what every rank needs from the ledger, the registration): rank 0 reads them, the others receive the
    plan (plain data); the registration (kill lines) stays on rank 0."""
    from prereg.state import load_state

    state = load_state(ledger, args.reg, with_windows=False)
    reg = state.registration()
    protocol = reg.protocol
    return {
        "workload": reg.workload,
        "workload_table": reg.command,
        "profile": reg.profile,
        "seed": protocol.seed,
        "config": reg.rung_config(runs[0]["rung"]),  # what the document sets for the rung
        # every key, defaults included (interleaved rungs share one config: the protocol's)
        "effective_config": reg.effective_config(runs[0]["rung"]).model_dump(mode="json"),
        "switches": {i.id: i.switch for i in reg.items},
        "version": state.version,
        "schedule": protocol.schedule,
        # The ladder decides a rung's steps: the protocol's, or more when on_underpowered = "extend" recorded more.
        "steps": args.steps or protocol.steps,
        "log_every": protocol.log_every,
        "eval_every": protocol.eval_every,
        "save_every": protocol.save_every,
    }, reg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.rung")
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--reg", required=True)
    # No option here may be a prefix of two of torchrun's (argparse would refuse it even after the script name):
    # `--run` matched --run-path and --run_path.
    parser.add_argument(
        "--run-spec",
        dest="run",
        action="append",
        required=True,
        help="RUN_ID=LABEL:DECLARED_RUNG:ITEM,ITEM (repeat for interleaved)",
    )
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="device-seconds left under the ceiling (on_ceiling = stop)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="the rung's steps, as the ladder decided them (default: the protocol's)"
    )
    parser.add_argument("--save-dir", default=None)
    parser.add_argument(
        "--registration-dir", default=None, help="the registration file's folder (the document's paths start there)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="the profile's device, which picks the process group's backend (needed under torchrun)",
    )
    args = parser.parse_args(argv)

    stop = Stop()
    stop.install()

    from engine.workload import join_ranks

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.device is None:
        parser.error("--device is required under torchrun: it picks the process group's backend")
    die_with_parent()
    ranks = join_ranks(args.device or "cpu")
    stop.ranks = ranks
    try:
        with contextlib.ExitStack() as resources:
            return run_rung(args, ranks, stop, resources)
    finally:
        ranks.leave()


def run_rung(args: argparse.Namespace, ranks, stop: Stop, resources: contextlib.ExitStack) -> int:
    """The rung's loop on one rank (the only one, or one of several: see the module docstring)."""
    from engine.workload import (
        MEMORY_DIR_VARIABLE,
        RunContext,
        RunnerFailure,
        make_runner,
        memory_directory,
        run_directory,
        snapshots_in,
    )

    runs = []
    for spec in args.run:
        run_id, _, rest = spec.partition("=")
        label, declared, items = rest.split(":")
        runs.append({"run": run_id, "label": label, "rung": declared, "items": tuple(i for i in items.split(",") if i)})
    memory = memory_directory(args.reg, runs[0]["run"])  # a `memory_snapshot` rung's allocation snapshots

    from prereg.registry import get_workload

    ledger = plan = reg = None
    if ranks.writer:  # the only rank that opens the ledger
        from engine.environment import run_environment
        from prereg.ledger import Ledger

        ledger = resources.enter_context(Ledger.open(args.ledger, create=False))
        plan, reg = read_plan(args, ledger, runs)
        profile = reg.declaration().profiles[plan["profile"]]
        if (profile.world_size, profile.device) != (ranks.world_size, args.device or profile.device):
            raise RuntimeError(
                f"profile {profile.name} runs {profile.world_size} process(es) on {profile.device}; this rung "
                f"was started as {ranks.world_size} on {args.device} — start it through `prereg run`"
            )
        environment = run_environment(plan["profile"], plan["seed"], engine_torch=not reg.declaration().own_process)
        from engine import process_identity

        identity = process_identity.current()  # so that a verb can tell, later, whether this process still runs
        for run in runs:
            ledger.append(
                "run-start",
                args.reg,
                {
                    "rung": run["label"],
                    "declared_rung": run["rung"],
                    "primed_from": run["rung"] if run["label"] != run["rung"] else None,
                    "items": list(run["items"]),
                    "switches": [plan["switches"][i] for i in run["items"]],
                    "config": plan["config"],
                    "effective_config": plan["effective_config"],
                    "steps": plan["steps"],
                    "version": plan["version"],
                    "schedule": plan["schedule"] if len(runs) > 1 else "sequential",
                    "interleaved_with": [r["run"] for r in runs if r is not run],
                    "env": environment,
                    "process": identity,
                    **launch_record(),
                },
                ref=run["run"],
            )
    plan = ranks.broadcast(plan)
    declaration = get_workload(plan["workload"], plan["workload_table"])
    profile = declaration.profiles[plan["profile"]]
    switches = plan["switches"]
    # One rung in the process: its switches are known before the load (a runner may start a process with them).
    only = runs[0] if len(runs) == 1 else None
    run_dir = run_directory(args.reg, runs[0]["run"])
    context = RunContext(
        declaration=declaration,
        registration_dir=Path(args.registration_dir) if args.registration_dir else None,
        rung=only["label"] if only else None,
        switches=tuple(switches[i] for i in only["items"]) if only else (),
        steps=plan["steps"],
        log_every=plan["log_every"],
        run_dir=run_dir,
    )

    from engine.crash import crash_window
    from engine.killwatch import KillWatch
    from prereg.canonical import encode_nonfinite

    status = {run["run"]: "finished" for run in runs}
    ended_by: dict[str, Any] = {}
    windows: dict[str, list[dict[str, Any]]] = {run["run"]: [] for run in runs}
    watches = {run["run"]: KillWatch(reg, run["rung"], run["items"]) for run in runs} if ranks.writer else {}
    load_s = 0.0
    load_start = PROCESS_START
    rc = 0
    runner = None
    ledger_s = 0.0
    last_window_run = None  # the run whose window was appended last: its run-end carries that append's time
    try:
        os.environ[MEMORY_DIR_VARIABLE] = str(memory)
        load_start = time.monotonic()
        config = declaration.run_config.load(plan["effective_config"], profile)
        runner = make_runner(profile, config, plan["seed"], context)
        runner.load()
        load_s = time.monotonic() - load_start
        if ranks.writer:
            emit({"event": "loaded", "load_s": load_s})
        steps_done = {run["run"]: 0 for run in runs}
        active = list(runs)
        while active:
            for run in list(active):
                run_id = run["run"]
                remaining = plan["steps"] - steps_done[run_id]
                runner.set_switches(tuple(switches[i] for i in run["items"]))
                window = runner.train_window(min(plan["log_every"], remaining), stop)
                steps_done[run_id] += window["steps"]
                step = steps_done[run_id]
                if plan["eval_every"] and step % plan["eval_every"] == 0 and ranks.writer:
                    window.update(runner.evaluate())  # the replicas are equal: rank 0's evaluation is the rung's
                if plan["save_every"] and step % plan["save_every"] == 0 and args.save_dir:
                    runner.save(os.path.join(args.save_dir, f"{run_id}-step{step}"))  # every rank: ZeRO consolidates
                stopping = stop()  # agreed by every rank
                decision = None
                if ranks.writer:
                    elapsed = time.monotonic() - PROCESS_START
                    window.update(
                        {
                            "step": step,
                            "elapsed_s": round(elapsed, 4),
                            "ledger_s": round(ledger_s, 6),
                            "world_size": ranks.world_size,
                        }
                    )
                    windows[run_id].append(window)
                    write_start = time.monotonic()
                    ledger.append("window", args.reg, {"rung": run["label"], **encode_nonfinite(window)}, ref=run_id)
                    # The governance cost of this window's append, carried by the next window (the last one's by
                    # its run's run-end entry).
                    ledger_s = time.monotonic() - write_start
                    last_window_run = run_id
                    emit(
                        {
                            "event": "window",
                            "run": run_id,
                            "rung": run["label"],
                            "step": step,
                            "of": plan["steps"],
                            "loss": window.get("loss"),
                            "s_per_step": window.get("s_per_step"),
                        }
                    )
                    fired = watches[run_id].check(windows[run_id])
                    if fired:
                        ledger.append(
                            "kill", args.reg, {"rung": run["label"], "declared_rung": run["rung"], **fired}, ref=run_id
                        )
                        decision = ("killed", {"kill": fired["kill"]})
                    elif stopping:
                        decision = ("killed", stop.reason)
                    elif args.deadline_s is not None and elapsed * runner.devices * ranks.world_size >= args.deadline_s:
                        decision = ("over-ceiling", {"ceiling": True})
                    elif step >= plan["steps"]:
                        decision = ("finished", None)
                decision = ranks.broadcast(decision)  # rank 0's kill lines and ceiling end the run on every rank
                if decision is not None:
                    if decision[0] != "finished":
                        status[run_id], ended_by[run_id] = decision
                    active.remove(run)
            if stop():
                for run in active:
                    status[run["run"]] = "killed"
                    ended_by[run["run"]] = stop.reason
                active = []
    except Exception as error:  # the rung failed: recorded with its reason, the process exits non-zero
        rc = 1
        # A RunnerFailure's message says it all (a script's exit and stderr tail); anything else is a bug's trace.
        reason = str(error) if isinstance(error, RunnerFailure) else f"{type(error).__name__}: {error}"
        for run in runs:
            if status[run["run"]] == "finished":
                status[run["run"]] = "failed"
                ended_by[run["run"]] = {"error": reason[:2000]}
        if isinstance(error, RunnerFailure):
            print(f"rung failed: {reason}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exc(file=sys.stderr)
    # What the runner started ends before the end is recorded: a process it ran gives the rung its exit status.
    exit_status = runner.close() if runner is not None else None
    if not ranks.writer:
        return rc
    crash_windows: dict[str, dict[str, Any]] = {}
    for run in runs:
        if status[run["run"]] != "failed":
            continue
        # A crash is the run's last window: the kill lines judge it like any other (engine/crash.py).
        crash_windows[run["run"]] = crash_window(windows[run["run"]], rc, exit_status, ranks.world_size)
        fired = watches[run["run"]].check([*windows[run["run"]], crash_windows[run["run"]]], final=True)
        if fired:
            ledger.append(
                "kill", args.reg, {"rung": run["label"], "declared_rung": run["rung"], **fired}, ref=run["run"]
            )
            # Killed by its line, the run is final for its items and the contingency re-plans the ladder, as for
            # a line that fired on a measured window; the error stays beside the kill.
            status[run["run"]] = "killed"
            ended_by[run["run"]] = {"kill": fired["kill"], **ended_by[run["run"]]}
    wall = time.monotonic() - PROCESS_START
    devices = (
        runner.devices if runner is not None else 1
    ) * ranks.world_size  # every rank's devices, for the whole wall
    for run in runs:
        share = 1.0 / len(runs)  # interleaved rungs share one process: its time is split evenly
        ledger.append(
            "run-end",
            args.reg,
            {
                "rung": run["label"],
                "status": status[run["run"]],
                "ended_by": ended_by.get(run["run"]),
                "totals": {
                    "rc": rc if exit_status is None else exit_status,
                    "steps": windows[run["run"]][-1]["step"] if windows[run["run"]] else 0,
                    "load_s": round(load_s, 4),
                    "gpu_s": round(wall * devices * share, 4),
                    "load_gpu_s": round(load_s * devices * share, 4),
                    "wall_s": round(wall, 4),
                    "world_size": ranks.world_size,
                    "load_start_s": round(load_start - PROCESS_START, 4),
                },
                "ledger_s": round(ledger_s, 6) if run["run"] == last_window_run else 0.0,
                **({"crash_window": crash_windows[run["run"]]} if run["run"] in crash_windows else {}),
                "parallel": getattr(runner, "parallel", None),
                "memory_snapshots": snapshots_in(memory),  # read once, at the end: an out-of-memory dump included
            },
            ref=run["run"],
        )
    emit({"event": "end", "status": status})
    return rc


if __name__ == "__main__":
    from engine.worker_exit import end_worker

    end_worker(main())
