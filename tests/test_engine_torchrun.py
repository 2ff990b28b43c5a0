"""Multi-process rungs end to end, through the CLI: a `cpu-tiny-x2` ladder (two gloo ranks under torchrun) writes
exactly one set of windows per rung — rank 0 is the only ledger writer — each window the rung's (world_size 2),
the cost counts both processes, and the ladder's signals (the time budget's SIGUSR1 here) stop every rank
cleanly between steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import prereg_process

from engine.ladder import FORWARDED_SIGNALS, rung_command
from engine.molmo2.declaration import PROFILES
from engine.molmo2.run_config import resolve
from engine.molmo2.train.distributed import grad_sync_mode
from prereg.ledger import Ledger
from prereg.state import load_state
from prereg.workload import ConfigError, Profile

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.xdist_group("engine")  # two ranks a rung: one such test at a time on the two cores

TWO_RANKS = """
id = "ranks"
title = "two gloo ranks under torchrun"
question = "Does a rung of two processes write exactly one set of windows, as the rung's?"
workload = "molmo2"
profile = "cpu-tiny-x2"

[cost]
ceiling_gpu_h = 0.5
on_ceiling = "stop"

[protocol]
steps = 4
log_every = 2
discard_first = 0
config = { batch = 2, backward_chunks = 2, camera_counts = [1], max_crops = 1, ddp = true }
  [[protocol.rungs]]
  id = "DDP"
  [[protocol.rungs]]
  id = "NOWRAP"
  config = { zero1 = true, chunk_grad_allreduce = true, ddp_wrapper = false }

[reads]
relative = "NOWRAP.s_per_step / DDP.s_per_step"
loss_gap = "abs(NOWRAP.loss - DDP.loss) / DDP.loss"  # the numerics guard: the two rungs reduce gradients apart

[[rules]]
id = "same-training"
when = "loss_gap <= 0.05"
outcome = "trains-alike"
"""


def prereg(*args: str, ledger: Path, check: bool = True) -> subprocess.CompletedProcess:
    return prereg_process(*args, ledger=ledger, check=check, timeout=300)


def frozen(tmp_path: Path, text: str) -> tuple[Path, Path]:
    path, ledger = tmp_path / "ranks.toml", tmp_path / "ledger.db"
    path.write_text(text)
    prereg("freeze", str(path), ledger=ledger)
    return path, ledger


def entries(ledger: Path, kind: str) -> list:
    store = Ledger.open(str(ledger), create=False)
    try:
        return list(store.entries(reg_id="ranks", kinds=(kind,)))
    finally:
        store.close()


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line names `text` (the test's ledger path: its ladder and ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile
    return found


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.2)


LONG = TWO_RANKS.replace("steps = 4\n", "steps = 4000\n").replace("log_every = 2", "log_every = 5")


def test_a_two_process_ladder_writes_one_set_of_windows_per_rung(tmp_path):
    path, ledger = frozen(tmp_path, TWO_RANKS)
    summary = json.loads(prereg("run", "ranks", "--file", str(path), "--json", ledger=ledger).stdout)
    assert summary["complete"], summary

    store = Ledger.open(str(ledger), create=False)
    try:
        state = load_state(store, "ranks")
    finally:
        store.close()
    assert [(r.rung, r.status) for r in state.runs] == [("DDP", "finished"), ("NOWRAP", "finished")]
    for run in state.runs:
        assert [w["step"] for w in run.windows] == [2, 4], run.windows  # one set: rank 1 wrote nothing
        assert all(w["world_size"] == 2 and w["finite"] and w["steps"] == 2 for w in run.windows)
        assert run.totals["rc"] == 0 and run.totals["world_size"] == 2 and run.totals["steps"] == 4
        assert run.totals["gpu_s"] == pytest.approx(2 * run.totals["wall_s"], rel=1e-3)  # both processes' devices
    assert len(entries(ledger, "run-start")) == 2 and len(entries(ledger, "run-end")) == 2
    parallel = {e.data["rung"]: e.data["parallel"] for e in entries(ledger, "run-end")}
    assert parallel == {
        "DDP": {"world_size": 2, "grad_sync": "ddp", "optimizer": "adamw"},
        "NOWRAP": {"world_size": 2, "grad_sync": "allreduce", "optimizer": "zero1-adamw"},
    }
    # Same init, same data, same global batch: the two sync paths train the same model (fp32, reduction order).
    ddp, nowrap = state.runs
    assert [w["loss"] for w in ddp.windows] == pytest.approx([w["loss"] for w in nowrap.windows], rel=1e-5)

    verified = json.loads(prereg("audit", "verify", "--json", ledger=ledger).stdout)
    assert verified["ok"] and verified["first_bad"] is None


def test_the_time_budget_stops_every_rank_between_steps(tmp_path):
    """The ladder's budget timer sends SIGUSR1 to torchrun, which forwards it to both ranks; the ranks agree on
    the stop, rank 0 writes a final window and the run's end, and the ladder stays resumable."""
    path, ledger = frozen(tmp_path, LONG)
    summary = json.loads(prereg("run", "ranks", "--file", str(path), "--budget-s", "9", "--json", ledger=ledger).stdout)
    assert summary["stopped"] == "budget" and not summary["complete"], summary
    store = Ledger.open(str(ledger), create=False)
    try:
        state, report = load_state(store, "ranks"), store.verify()
    finally:
        store.close()
    assert report.ok
    (run,) = state.runs
    assert run.status == "killed" and run.ended_by == {"budget": True}, (run.status, run.ended_by)
    assert run.windows and run.windows[-1]["step"] < 4000
    steps = [w["step"] for w in run.windows]
    assert steps == sorted(set(steps)), steps  # one writer: no window twice
    assert not processes_naming(str(ledger)), "a rank outlived its ladder"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigkilled_ladder_takes_its_ranks_with_it(tmp_path):
    """torchrun starts its ranks in sessions of their own; a SIGKILL of the ladder's process group (torchrun with
    it) must not leave them running — rank 0 would go on writing a run that the next `prereg run` calls
    interrupted."""
    path, ledger = frozen(tmp_path, LONG)
    ladder = subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), "run", "ranks", "--file", str(path), "--ledger", str(ledger), "--json"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: entries(ledger, "window"), 120, "a first window")
    finally:
        os.killpg(ladder.pid, signal.SIGKILL)
        ladder.wait(timeout=60)
    wait_until(lambda: not processes_naming(str(ledger)), 30, "every rank gone after the ladder's SIGKILL")
    windows = len(entries(ledger, "window"))
    time.sleep(1.0)
    assert len(entries(ledger, "window")) == windows  # nobody writes any more
    store = Ledger.open(str(ledger), create=False)
    try:
        (run,) = load_state(store, "ranks").runs
        assert store.verify().ok
    finally:
        store.close()
    assert run.status == "running"  # without an end: the next `prereg run` records it interrupted, as for one process


def test_a_profile_of_several_processes_launches_its_rungs_under_torchrun():
    one = rung_command(PROFILES["cpu-tiny"], ["--reg", "x"])
    assert one == ["engine.rung", "--reg", "x"]
    two = rung_command(PROFILES["cpu-tiny-x2"], ["--reg", "x"])
    assert two[0] == "torch.distributed.run" and two[two.index("--nproc-per-node") + 1] == "2"
    assert two[two.index("--signals-to-handle") + 1] == FORWARDED_SIGNALS and "SIGUSR1" in FORWARDED_SIGNALS
    assert two[two.index("-m") + 1 :] == ["engine.rung", "--reg", "x", "--device", "cpu"]
    gpus = rung_command(PROFILES["h200x2-4b"], [])
    assert gpus[gpus.index("--nproc-per-node") + 1] == "2" and gpus[-2:] == ["--device", "cuda"]
    assert PROFILES["h200-4b"].world_size == 1 and PROFILES["h200x2-4b"].world_size == 2


def test_profile_processes_are_validated():
    with pytest.raises(ValueError, match="allowed: 0, 1 or 2"):
        Profile("bad", "cuda", 2, "4b", "one process per GPU", processes=3)
    assert Profile("one", "cuda", 2, "script", "its runner starts the ranks", processes=1).world_size == 1
    with pytest.raises(ValueError, match=">= 0"):
        Profile("bad", "cpu", 0, "tiny", "", processes=-1)


def test_gradient_sync_modes_and_their_refusals():
    two = PROFILES["cpu-tiny-x2"]

    def mode(world_size: int, **raw) -> str:
        return grad_sync_mode(resolve(two, raw), world_size)

    assert mode(1, zero1=True) == "none"  # the oracle gate of a two-process profile is one process: nothing to sync
    assert mode(2) == mode(2, ddp=True) == "ddp"  # several processes sync through DDP unless the config says else
    assert mode(2, chunk_grad_allreduce=True) == "ddp+allreduce"
    assert mode(2, ddp=False, chunk_grad_allreduce=True, ddp_wrapper=True) == "ddp+allreduce"
    assert mode(2, chunk_grad_allreduce=True, ddp_wrapper=False) == "allreduce"
    # The refusals belong to the run config, at check and freeze (tests/test_run_config.py has one per rule).
    with pytest.raises(ConfigError, match="need a gradient sync"):
        resolve(two, {"ddp": False})  # the ranks would train apart
    with pytest.raises(ConfigError, match="only with chunk_grad_allreduce"):
        resolve(two, {"ddp_wrapper": False})
    with pytest.raises(ConfigError, match="valid boolean"):
        resolve(two, {"ddp": "yes"})
