"""What runs in each task of a Slurm job: the gate or rung process, as the ladder would start it locally.

submitit pickles a `Task` and runs it in every task srun starts (one per rank: nodes x tasks per node). Each
starts `python -m engine.gate|engine.rung ARGS` in the repository root with the ladder's environment (Slurm
exports it), told its rank the way torchrun tells one (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, from the job's own), and the job's id and hosts (PREREG_JOB), which rank 0 records on
its run-start. Rank 0 alone writes the ledger, as under torchrun.

Signals: Slurm delivers scancel's SIGTERM, a --signal and a preemption to every process of the step, the rung
included; this wrapper survives them (its death would SIGKILL the rung, which dies with its parent) and passes
them on, so the rung ends its run as a local one would. A non-zero exit of the rung fails the task.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.launch import JOB_VARIABLE

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@dataclass(frozen=True)
class Task:
    module_args: tuple[str, ...]  # `python -m` arguments: engine.gate … or engine.rung …
    cwd: str
    env: tuple[tuple[str, str], ...]  # added to the job's environment (the launcher's record)

    def __call__(self) -> int:
        import submitit

        job = submitit.JobEnvironment()
        env = {**os.environ, **dict(self.env), "PYTHONUNBUFFERED": "1"}
        env[JOB_VARIABLE] = json.dumps({"id": str(job.job_id), "hosts": list(job.hostnames)}, sort_keys=True)
        if job.num_tasks > 1:
            distributed = submitit.helpers.TorchDistributedEnvironment()
            env.update(
                RANK=str(distributed.rank),
                LOCAL_RANK=str(distributed.local_rank),
                WORLD_SIZE=str(distributed.world_size),
                LOCAL_WORLD_SIZE=str(distributed.local_world_size),
                MASTER_ADDR=distributed.master_addr,
                MASTER_PORT=str(distributed.master_port),
            )
        started: list[subprocess.Popen] = []

        def pass_on(number, frame):
            for process in started:
                if process.poll() is None:
                    process.send_signal(number)

        for number in PASSED_ON:  # before the rung starts: a signal in between must not end this wrapper
            signal.signal(number, pass_on)
        started.append(subprocess.Popen([sys.executable, "-m", *self.module_args], cwd=Path(self.cwd), env=env))
        rc = started[0].wait()
        if rc != 0:
            # submitit records an exception as the task's failure: the job ends FAILED with the rung's status.
            raise RuntimeError(f"python -m {' '.join(self.module_args[:1])} exited with {rc}")
        return rc
