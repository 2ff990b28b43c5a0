"""The oracle gate process: `python -m engine.gate …`, started by the ladder before any rung.

For every oracle without a result, the workload's probe runs baseline and item on the same micro-batch and
seed; the comparator judges the observed values against the frozen bounds; the result goes to the ledger.
A probe that cannot run on this profile fails with that reason: it is not skipped.

Then, with `[protocol.noise]`, the A/A calibration (prereg.calibration): the baseline rung, after the oracles' drops,
run twice from a fresh runner each (its effective config, its items' switches) for the steps that leave N read
windows; each finished run is a `calibration` entry. It runs here, before any rung of the ladder has data, so the
noise it measures cannot know the effect. The gate entry, written last, holds the whole process's device-seconds:
oracles and calibration alike. A calibration run whose runner fails (a command's script that exits non-zero) ends
the gate with exit 1, its reason on stderr and on the gate entry.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prereg.ledger import Ledger

PROCESS_START = time.monotonic()


def observe(runner, item, oracle) -> dict:
    """What the item's oracle observes: its probe's values, or the probe's crash as the reason it failed."""
    try:
        return runner.probe(oracle.probe, item.switch, oracle.model_dump(mode="json"))
    except Exception as error:  # a probe that crashes is an oracle failure with the crash as its reason
        return {"error": f"{type(error).__name__}: {error}"[:2000]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.gate")
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--reg", required=True)
    parser.add_argument(
        "--registration-dir", default=None, help="the registration file's folder (the document's paths start there)"
    )
    args = parser.parse_args(argv)

    stop: list[str] = []
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        # Between probes and steps: the oracle being judged finishes and is recorded, a calibration run stops
        # unrecorded; the rest wait for the next run.
        signal.signal(number, lambda n, f: stop.append(signal.Signals(n).name))

    from prereg.ledger import Ledger

    with Ledger.open(args.ledger, create=False) as ledger:
        return gate(ledger, args, stop)


def gate(ledger: Ledger, args: argparse.Namespace, stop: list[str]) -> int:
    """The registration's pending oracles, then its A/A calibration where it asks for one; the gate's entry."""
    from engine.workload import RunnerFailure
    from prereg.calibration import CALIBRATION_RUNS, baseline_items, calibration_runs
    from prereg.state import load_state

    state = load_state(ledger, args.reg, with_windows=False)
    reg = state.registration()
    registration_dir = Path(args.registration_dir) if args.registration_dir else None
    pending = [(item, oracle) for item in reg.items for oracle in item.oracles if oracle.id not in state.oracles]
    have = calibration_runs(ledger, args.reg, reg, baseline_items(reg, set(state.dropped())))
    if not pending and (reg.protocol.noise is None or len(have) == CALIBRATION_RUNS):
        return 0
    done, load_s, devices = run_oracles(ledger, args.reg, pending, stop, registration_dir) if pending else ([], 0.0, 1)
    calibrated: list[str] = []
    failure = None
    if reg.protocol.noise is not None and not stop:
        try:
            calibrated, devices = calibrate(ledger, args.reg, stop, registration_dir)
        except RunnerFailure as error:
            failure = str(error)
            print(f"A/A calibration failed: {failure}", file=sys.stderr)
    wall = time.monotonic() - PROCESS_START
    ledger.append(
        "gate",
        args.reg,
        {
            "load_s": round(load_s, 4),
            "wall_s": round(wall, 4),
            "gpu_s": round(wall * devices, 4),
            "oracles": done,
            "calibration": calibrated,
            **({"calibration_failed": failure[:2000]} if failure else {}),
            "stopped": stop[0] if stop else None,
            "version": state.version,
        },
    )
    return 1 if failure else 0


def run_oracles(
    ledger, reg_id: str, pending: list, stop: list[str], registration_dir: Path | None
) -> tuple[list[str], float, int]:
    """Every pending oracle's probe, judged and recorded: (the oracles done, the model load's seconds, devices)."""
    from engine.workload import RunContext, make_runner
    from oracles.judge import judge
    from prereg.canonical import encode_nonfinite
    from prereg.state import load_state

    state = load_state(ledger, reg_id, with_windows=False)
    reg = state.registration()
    declaration = reg.declaration()
    profile = declaration.profiles[reg.profile]
    assert reg.gate_config is not None, "a document with items resolves the oracle gate's config"
    context = RunContext(declaration, registration_dir)
    runner = make_runner(profile, reg.gate_config, reg.protocol.seed, context)
    load_start = time.monotonic()
    runner.load()
    load_s = time.monotonic() - load_start
    done = []
    for item, oracle in pending:
        if stop:
            break
        start = time.monotonic()
        observed = observe(runner, item, oracle)
        seconds = time.monotonic() - start
        judgement = judge(oracle.kind, observed, oracle.bounds)
        ledger.append(
            "oracle",
            reg_id,
            {
                "oracle": oracle.id,
                "item": item.id,
                "kind": oracle.kind,
                "probe": oracle.probe,
                "observed": encode_nonfinite(observed),  # a NaN observation is kept, as the string "nan"
                "bounds": oracle.bounds,
                "passed": judgement.passed,
                "reason": judgement.reason,
                "version": state.version,
                "external": False,
                "gpu_s": round(seconds * runner.devices, 4),
            },
        )
        done.append(oracle.id)
        emit(
            {
                "event": "oracle",
                "oracle": oracle.id,
                "item": item.id,
                "passed": judgement.passed,
                "reason": judgement.reason,
            }
        )
    runner.close()
    return done, load_s, runner.devices


def calibrate(ledger, reg_id: str, stop: list[str], registration_dir: Path | None) -> tuple[list[str], int]:
    """The A/A calibration's missing runs, each recorded once finished: (their entries' refs, devices)."""
    from engine.workload import RunContext, make_runner, run_directory
    from prereg.calibration import CALIBRATION_KIND, CALIBRATION_RUNS, baseline_items, calibration_key, calibration_runs
    from prereg.canonical import encode_nonfinite
    from prereg.sensitivity import baseline_rung
    from prereg.state import load_state

    gc.collect()  # the oracles' model is gone before the first calibration model loads
    state = load_state(ledger, reg_id, with_windows=False)  # after the oracles: their drops are in the plan
    reg = state.registration()
    declaration = reg.declaration()
    profile = declaration.profiles[reg.profile]
    items = baseline_items(reg, set(state.dropped()))
    key = calibration_key(reg, items)
    config = reg.effective_config(baseline_rung(reg))
    switches = tuple(reg.item(i).switch for i in items)
    # What a rung process spends before its load (interpreter, imports), measured on this process: the calibration
    # entry carries it so that a rung's projected cost includes it.
    start_s = time.monotonic() - PROCESS_START
    recorded: list[str] = []
    devices = 1
    for number in range(len(calibration_runs(ledger, reg_id, reg, items)) + 1, CALIBRATION_RUNS + 1):
        if stop:
            break
        ref = f"aa-{uuid.uuid4().hex[:12]}"
        label = f"A/A {number} ({key['rung']})"
        context = RunContext(
            declaration=declaration,
            registration_dir=registration_dir,
            rung=label,
            switches=switches,
            steps=key["steps"],
            log_every=reg.protocol.log_every,
            run_dir=run_directory(reg_id, ref),
        )
        load_start = time.monotonic()
        runner = make_runner(profile, config, reg.protocol.seed, context)
        windows: list[dict[str, Any]] = []
        done = 0
        try:
            runner.load()
            load_s = time.monotonic() - load_start
            runner.set_switches(switches)
            while done < key["steps"] and not stop:
                window = runner.train_window(min(reg.protocol.log_every, key["steps"] - done), lambda: bool(stop))
                if window["steps"] == 0:
                    break  # stopped before another step
                done += window["steps"]
                window["step"] = done
                windows.append(window)
                emit(
                    {
                        "event": "window",
                        "run": ref,
                        "rung": label,
                        "step": done,
                        "of": key["steps"],
                        "loss": window.get("loss"),
                        "s_per_step": window.get("s_per_step"),
                    }
                )
        finally:
            runner.close()
        steps_s = time.monotonic() - load_start - load_s
        devices = runner.devices
        del runner
        gc.collect()
        if done < key["steps"]:
            break  # stopped between steps: not a calibration run (its time is in the gate entry's)
        ledger.append(
            CALIBRATION_KIND,
            reg_id,
            {
                **key,
                "run": number,
                "windows": [encode_nonfinite(w) for w in windows],
                "start_gpu_s": round(start_s * devices, 4),
                "load_gpu_s": round(load_s * devices, 4),
                "steps_gpu_s": round(steps_s * devices, 4),
                "gpu_s": round((load_s + steps_s) * devices, 4),
                "version": state.version,
            },
            ref=ref,
        )
        recorded.append(ref)
    return recorded, devices


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


if __name__ == "__main__":
    from engine.worker_exit import end_worker

    end_worker(main())
