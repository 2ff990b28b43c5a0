"""The command workload's runner: the script runs as a process of its own, driven by the rung's loop.

`load()` starts the rung's command (split like a shell line, no shell, in the table's cwd) with its instructions
in the environment — PREREG_SWITCHES, PREREG_CONFIG, PREREG_STEPS, PREREG_LOG_EVERY, PREREG_SEED, PREREG_RUNG,
PREREG_RUN_DIR and PREREG_WINDOWS, the file it appends its windows to. Each `train_window()` blocks until the
script's next window line lands (or the script exits), so kill lines judge every window as it lands. The script's
stdout and stderr go to stdout.log and stderr.log in its run folder; a failed script's stderr tail goes on the
rung's end.

To stop it (a kill line, the ceiling, `--budget-s`, a signal to `prereg run`) the runner sends SIGTERM to the
script's process group, then SIGKILL after STOP_GRACE_S; the exit status is the rung's `rc`. Exit 0 with every
step reported is `finished`; anything else is `failed`. The script dies with the rung process (a SIGKILL of the
engine leaves no orphan training).

Schedules: sequential only. A script runs its rung from start to finish; rungs alternating window by window would
need each process paused between its windows, and a paused process (SIGSTOP) still holds its device memory, so
validation refuses `schedule = "interleaved"` for command documents.

Profiles `cuda-xN`: the command runs under torchrun with N ranks (`python SCRIPT …` as torchrun's script, any
other command with --no-python). Every rank sees the same PREREG_WINDOWS and only rank 0 writes it (RANK = 0;
prereg.script does this for a Python script).

Probes (the oracle gate): the probe command runs once per oracle, as one process, with PREREG_PROBE,
PREREG_SWITCH, PREREG_SEED and PREREG_CONFIG; its last stdout line is one JSON object of observations, or
{"error": why}. Anything else fails the oracle with what was wrong.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Callable

from engine.command.declaration import CommandDeclaration, command_line, script_config
from engine.command.windows import WindowsReader, finite
from engine.workload import RunContext, RunnerFailure
from prereg.workload import Profile, RunConfig

# After SIGTERM, the time a script has to end its step, write its last window and exit before SIGKILL: a step of
# the scripts this governs takes well under a second to a few seconds, and a stop should not wait on one that
# ignores SIGTERM much longer than that.
STOP_GRACE_S = 5.0
# How often a waiting rung looks for a new window line or the script's exit: from POLL_S after each window,
# doubling up to POLL_MAX_S while nothing lands. A window lands at most POLL_MAX_S after its write (kill lines act
# on it that late), and a rung whose windows come a second apart costs a dozen file stats a second.
POLL_S = 0.01
POLL_MAX_S = 0.1
# The end of a failed script's stderr kept on the rung's end: its traceback's last frames and its error.
STDERR_TAIL_CHARS = 1500

PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def visible_devices(profile: Profile, visible: str | None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for the script: none on the CPU profile, the profile's count of GPUs otherwise."""
    if profile.device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    ids = [i for i in visible.split(",") if i] if visible else [str(i) for i in range(profile.gpus)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[: profile.gpus])}


def under_torchrun(words: list[str], ranks: int) -> list[str]:
    """The command as torchrun's: a Python script (or -m module) under its own interpreter; anything else with
    --no-python, under the engine's."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", str(ranks)]
    launcher += ["--max-restarts", "0"]  # a restarted rank would re-run steps already reported
    if PYTHON.match(Path(words[0]).name):
        return [words[0], *launcher, *words[1:]]
    return [sys.executable, *launcher, "--no-python", *words]


def _die_with_engine() -> None:
    """In the script's process, before it runs: SIGKILL it when the rung process dies (Linux; elsewhere a dead
    engine's script runs on until it ends)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))


class CommandRunner:
    def __init__(self, profile: Profile, config: RunConfig, seed: int, context: RunContext):
        declaration = context.declaration
        assert isinstance(declaration, CommandDeclaration) and declaration.command is not None, declaration
        self.command = declaration.command
        self.profile = profile
        self.config = script_config(config)  # the keys the document set, as PREREG_CONFIG carries them
        self.seed = seed
        self.context = context
        self.devices = max(profile.gpus, 1)  # a rung's process holds them all (processes = 1)
        self.parallel = {"launcher": "torchrun", "ranks": profile.gpus} if profile.gpus > 1 else None
        self.process: subprocess.Popen | None = None
        self.reader: WindowsReader | None = None
        self.logs: list[IO[bytes]] = []
        self.queued: list[dict[str, Any]] = []
        self.steps_returned = 0
        self.read_s = 0.0  # the engine's time reading and checking window lines since the last window
        self.delay = POLL_S

    @property
    def cwd(self) -> Path:
        assert self.context.registration_dir is not None, "the ladder names the registration's folder"
        return (self.context.registration_dir / self.command.cwd).resolve()

    def environment(self, instructions: dict[str, str]) -> dict[str, str]:
        return {
            **os.environ,
            **instructions,
            "PREREG_SEED": str(self.seed),
            "PREREG_CONFIG": json.dumps(self.config, sort_keys=True),
            **visible_devices(self.profile, os.environ.get("CUDA_VISIBLE_DEVICES")),
        }

    def start(self, words: list[str], env: dict[str, str], **streams: Any) -> subprocess.Popen:
        if not self.cwd.is_dir():
            raise RunnerFailure(f"command.cwd = {self.command.cwd!r}: {self.cwd} is not a folder")
        try:
            return subprocess.Popen(
                words,
                cwd=self.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: a stop reaches the script and its children
                preexec_fn=_die_with_engine,
                **streams,
            )
        except FileNotFoundError:
            raise RunnerFailure(
                f"command {words[0]!r} not found (run in {self.cwd}; a name without / is looked up on PATH)"
            ) from None
        except PermissionError:
            raise RunnerFailure(f"command {words[0]!r} is not executable (run in {self.cwd})") from None

    # ---- the rung ----
    def load(self) -> None:
        if self.context.rung is None:
            return  # the oracle gate: each probe starts a process of its own
        run_dir = self.context.run_dir
        assert run_dir is not None, "a rung process names its run folder"
        run_dir.mkdir(parents=True, exist_ok=True)
        windows = (run_dir / "windows.jsonl").resolve()
        windows.touch()
        self.reader = WindowsReader(windows, frozenset(self.command.metrics), self.context.steps)
        words = command_line(self.command.run)
        if self.parallel is not None:
            words = under_torchrun(words, self.profile.gpus)
        env = self.environment(
            {
                "PREREG_SWITCHES": ",".join(self.context.switches),
                "PREREG_STEPS": str(self.context.steps),
                "PREREG_LOG_EVERY": str(self.context.log_every),
                "PREREG_RUNG": self.context.rung,
                "PREREG_RUN_DIR": str(run_dir.resolve()),
                "PREREG_WINDOWS": str(windows),
            }
        )
        self.logs = [(run_dir / "stdout.log").open("wb"), (run_dir / "stderr.log").open("wb")]
        self.process = self.start(words, env, stdout=self.logs[0], stderr=self.logs[1])

    def set_switches(self, switches: tuple[str, ...]) -> None:
        assert tuple(switches) == self.context.switches, (switches, self.context.switches)

    def train_window(self, steps: int, should_stop: Callable[[], bool]) -> dict[str, Any]:
        """The script's next window (its own log_every: `steps` is what the loop expects, not a request)."""
        assert self.process is not None, "load() first"
        while not self.queued:
            if should_stop():
                self.stop()
                self.queued += self.read()  # what it wrote before it stopped; a line cut by SIGKILL is dropped
                break
            self.queued += self.read()
            if self.queued:
                break
            status = self.process.poll()
            if status is not None:
                self.queued += self.read(writer_gone=True)
                if not self.queued:
                    raise self.exit_failure(status)
                break
            self.pause()
        if not self.queued:  # stopped before the script wrote another window
            return {"steps": 0, "read_s": round(self.read_s, 6)}
        window = self.queued.pop(0)
        self.delay = POLL_S
        if window["steps"] == self.context.steps:
            self.await_exit(should_stop)
        delta = window["steps"] - self.steps_returned
        self.steps_returned = window["steps"]
        metrics = {k: v for k, v in window.items() if k != "steps"}
        engine_window = {"steps": delta, **metrics, "finite": finite(window), "read_s": round(self.read_s, 6)}
        self.read_s = 0.0
        return engine_window

    def pause(self) -> None:
        """Sleep until the next look (one wake a look: Popen.wait with a timeout wakes several times)."""
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, POLL_MAX_S)

    def read(self, *, writer_gone: bool = False) -> list[dict[str, Any]]:
        assert self.reader is not None
        start = time.perf_counter()
        try:
            return self.reader.read(writer_gone=writer_gone)
        except RunnerFailure:
            self.stop()
            raise
        finally:
            self.read_s += time.perf_counter() - start

    def await_exit(self, should_stop: Callable[[], bool]) -> None:
        """After the last step's window: the script must exit 0, with nothing written after that window."""
        assert self.process is not None
        while self.process.poll() is None:
            if should_stop():
                self.stop()
                return
            self.pause()
        self.read(writer_gone=True)  # a window after the last step fails the rung, naming its line
        if self.process.returncode != 0:
            raise self.exit_failure(self.process.returncode)

    def exit_failure(self, status: int) -> RunnerFailure:
        assert self.reader is not None
        done = f"after reporting {self.reader.last_steps} of {self.context.steps} steps"
        if status == 0:
            return RunnerFailure(
                f"`{self.command.run}` exited with 0 {done}: its last window must report steps = PREREG_STEPS"
            )
        how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with {status}"
        tail = self.stderr_tail()
        return RunnerFailure(
            f"`{self.command.run}` {how} {done}" + (f"; its stderr ends:\n{tail}" if tail else "; its stderr is empty")
        )

    def stderr_tail(self) -> str:
        assert self.context.run_dir is not None
        path = self.context.run_dir / "stderr.log"
        text = path.read_bytes().decode("utf-8", "replace") if path.exists() else ""
        return text[-STDERR_TAIL_CHARS:].strip()

    def stop(self) -> None:
        """SIGTERM to the script's process group; SIGKILL after the grace if it is still running."""
        assert self.process is not None
        if self.process.poll() is not None:
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.process.wait()

    def signal_group(self, number: int) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, number)  # start_new_session: its group's id is its pid
        except ProcessLookupError:
            pass  # it ended on its own meanwhile

    def close(self) -> int | None:
        if self.process is None:
            return None
        self.stop()
        for log in self.logs:
            log.close()
        return self.process.returncode

    def evaluate(self) -> dict[str, float]:
        """A script reports its evaluations in its own windows, as declared metrics: the engine adds none."""
        return {}

    def save(self, directory: str) -> None:
        raise RunnerFailure("a command's script saves its own checkpoints; the engine never saves one for it")

    # ---- the oracle gate ----
    def probe(self, probe: str, switch: str, oracle: dict[str, Any]) -> dict[str, Any]:
        assert self.command.probe is not None  # validated: probes are declared only with a probe command
        words = command_line(self.command.probe)
        env = self.environment({"PREREG_PROBE": probe, "PREREG_SWITCH": switch})
        try:
            process = self.start(words, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except RunnerFailure as error:
            return {"error": str(error)}
        out, err = process.communicate()
        if process.returncode != 0:
            tail = err.decode("utf-8", "replace")[-STDERR_TAIL_CHARS:].strip()
            ends = f"its stderr ends:\n{tail}" if tail else "its stderr is empty"
            return {"error": f"`{self.command.probe}` exited with {process.returncode}; {ends}"}
        lines = [line for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
        if not lines:
            return {"error": f"`{self.command.probe}` printed nothing: its last stdout line must be a JSON object"}
        try:
            observed = json.loads(lines[-1])
        except json.JSONDecodeError:
            observed = None
        if not isinstance(observed, dict):
            return {"error": f"the probe's last stdout line is not a JSON object: {lines[-1][:200]!r}"}
        if "error" in observed:
            return {"error": str(observed["error"])}
        declared = self.command.probes[probe]
        unknown = sorted(set(observed) - set(declared))
        if unknown:
            return {"error": f"the probe reported undeclared observation(s) {unknown}; command.probes.{probe} "
                             f"declares {declared}"}  # fmt: skip
        return observed
