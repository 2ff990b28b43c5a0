"""What running a rung as a Slurm job costs over running it here: submission, queueing, the job's start, and the
ladder's polling for its end.

The same tiny rung (the command workload: a script that writes a few windows and exits) runs as a one-rung ladder
`--repeats` times on this machine and `--repeats` times as a job on `--partition`, each on a fresh temporary
ledger: `prereg run`'s wall time, freeze excluded. The difference of the medians is the overhead per rung. From
the ledger's own timestamps, for each job: submission (`job`) to the rung's run-start (queue and job start: sbatch,
the controller's scheduling, srun, submitit's unpickling, the rung process's imports), and the rung's run-end to
the `job-end` (the job's teardown and the ladder's polling, POLL_S).

    PYTHONPATH=. python bench/slurm_overhead.py [--partition prereg] [--repeats 5]

Needs a Slurm partition (tests/slurm_cluster.sh starts a one-node one here). Prints its conditions and results,
and writes them to bench/results/slurm_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.launch.slurm import POLL_S  # noqa: E402
from prereg.ledger import Ledger  # noqa: E402

SCRIPT = """
import json, os
steps, every = int(os.environ["PREREG_STEPS"]), int(os.environ["PREREG_LOG_EVERY"])
with open(os.environ["PREREG_WINDOWS"], "a") as out:
    for step in range(every, steps + 1, every):
        out.write(json.dumps({"steps": step, "s_per_step": 0.01}) + "\\n")
"""

REGISTRATION = """
id = "bench-slurm-{where}"
title = "a tiny rung, {where}"
question = "What does a rung cost as a Slurm job over a local one?"
workload = "command"
profile = "local"
{launcher}
[command]
run = "python train.py"
sources = ["train.py"]
metrics = ["s_per_step"]

[cost]
ceiling_gpu_h = 0.5

[protocol]
steps = 4
log_every = 2
  [[protocol.rungs]]
  id = "A"
"""


def cli(*args: str, cwd: Path) -> float:
    """Wall seconds of one `prereg ARGS` process (which must succeed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def seconds_between(earlier: str, later: str) -> float:
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


def one_ladder(where: str, partition: str, folder: Path) -> dict:
    folder.mkdir()
    (folder / "train.py").write_text(textwrap.dedent(SCRIPT))
    (folder / "prereg.toml").write_text(f'[launchers.cluster]\nkind = "slurm"\npartition = "{partition}"\n')
    launcher = 'launcher = "cluster"\n' if where == "job" else ""
    path = folder / "rung.toml"
    path.write_text(REGISTRATION.format(where=where, launcher=launcher))
    ledger = str(folder / "ledger.db")
    cli("freeze", str(path), "--ledger", ledger, cwd=folder)
    wall = cli("run", f"bench-slurm-{where}", "--file", str(path), "--ledger", ledger, "--json", cwd=folder)
    result = {"run_wall_s": round(wall, 3)}
    if where == "job":
        store = Ledger.open(ledger, create=False)
        try:
            times = {e.kind: e.ts for e in store.entries(kinds=("job", "run-start", "run-end", "job-end"))}
        finally:
            store.close()
        result["submit_to_start_s"] = round(seconds_between(times["job"], times["run-start"]), 3)
        result["end_to_settled_s"] = round(seconds_between(times["run-end"], times["job-end"]), 3)
    return result


def spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "stdev": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partition", default="prereg")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    slurm = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, check=True).stdout.strip()
    nodes = subprocess.run(
        ["sinfo", "-h", "-p", args.partition, "-o", "%N %c %t"], capture_output=True, text=True, check=True
    ).stdout.split()
    conditions = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "slurm": slurm,
        "partition": args.partition,
        "partition_nodes": nodes,
        "poll_s": POLL_S,
        "repeats": args.repeats,
        "rung": "command workload, 4 steps, 2 windows, no work per step",
    }
    print("conditions:", json.dumps(conditions))
    runs: dict[str, list[dict]] = {"local": [], "job": []}
    with tempfile.TemporaryDirectory(prefix="slurm-overhead-") as scratch:
        for repeat in range(args.repeats):
            for where in ("local", "job"):  # alternating, so drift in the machine's load hits both alike
                result = one_ladder(where, args.partition, Path(scratch) / f"{where}-{repeat}")
                runs[where].append(result)
                print(f"  {where} #{repeat + 1}: {json.dumps(result)}")
    local = spread([r["run_wall_s"] for r in runs["local"]])
    job = spread([r["run_wall_s"] for r in runs["job"]])
    results = {
        "local_run_wall_s": local,
        "job_run_wall_s": job,
        "overhead_per_rung_s": round(job["median"] - local["median"], 3),
        "submit_to_start_s": spread([r["submit_to_start_s"] for r in runs["job"]]),
        "end_to_settled_s": spread([r["end_to_settled_s"] for r in runs["job"]]),
    }
    print("results:", json.dumps(results, indent=1))
    out = ROOT / "bench" / "results" / "slurm_overhead.json"
    out.write_text(json.dumps({"conditions": conditions, "results": results, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
