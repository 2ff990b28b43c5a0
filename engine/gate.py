"""The oracle gate process: `python -m engine.gate …`, started by the ladder before any rung.

For every oracle without a result, the workload's probe runs baseline and item on the same micro-batch and
seed; the comparator judges the observed values against the frozen bounds; the result goes to the ledger.
A probe that cannot run on this profile fails with that reason: it is not skipped.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

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
        # Between probes: the oracle being judged finishes and is recorded; the rest wait for the next run.
        signal.signal(number, lambda n, f: stop.append(signal.Signals(n).name))

    from pathlib import Path

    from engine.workload import RunContext, make_runner
    from oracles.judge import judge
    from prereg.canonical import encode_nonfinite
    from prereg.ledger import Ledger
    from prereg.state import load_state

    ledger = Ledger.open(args.ledger, create=False)
    state = load_state(ledger, args.reg, with_windows=False)
    reg = state.registration()
    declaration = reg.declaration()
    profile = declaration.profiles[reg.profile]
    pending = [(item, oracle) for item in reg.items for oracle in item.oracles if oracle.id not in state.oracles]
    if not pending:
        return 0
    assert reg.gate_config is not None, "a document with items resolves the oracle gate's config"
    context = RunContext(declaration, Path(args.registration_dir) if args.registration_dir else None)
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
            args.reg,
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
        print(
            json.dumps(
                {
                    "event": "oracle",
                    "oracle": oracle.id,
                    "item": item.id,
                    "passed": judgement.passed,
                    "reason": judgement.reason,
                }
            ),
            flush=True,
        )
    runner.close()
    wall = time.monotonic() - PROCESS_START
    ledger.append(
        "gate",
        args.reg,
        {
            "load_s": round(load_s, 4),
            "wall_s": round(wall, 4),
            "gpu_s": round(wall * runner.devices, 4),
            "oracles": done,
            "stopped": stop[0] if stop else None,
            "version": state.version,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
