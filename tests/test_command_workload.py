"""The command workload through the CLI, as processes on temporary ledgers: a script of its own governed end to
end (gate, rungs, verdict), the ways a script breaks the contract or is stopped, the engine owning every run's
status, and the documents that declare it. The scripts here are a few lines of plain Python, so each rung costs
its processes' start and little more."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import MINI, Cli

from engine import process_identity
from engine.command.declaration import CommandDeclaration, declare
from engine.command.process import STOP_GRACE_S, CommandRunner, under_torchrun
from engine.command.windows import WindowError, WindowsReader
from engine.ladder import mark_interrupted
from engine.reconcile import reconcile, running
from engine.workload import RunContext, RunnerFailure
from prereg.documents import document_dict
from prereg.errors import Refused
from prereg.ledger import Ledger
from prereg.schema import Registration
from prereg.state import load_state
from prereg.template import BLANK_MARK, COMMAND, blanks

REPO = Path(__file__).resolve().parent.parent
# One worker for the module: its ladder of broken scripts (a module fixture, 10 s) runs once, not once on each.
pytestmark = pytest.mark.xdist_group("command-workload")
REFUSED, INVALID = 3, 2
# The scripts' `python` is this interpreter, and they import prereg from this checkout.
ENV = {
    **os.environ,
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    "PYTHONPATH": str(REPO),
    "COLUMNS": "120",
    "NO_COLOR": "1",
}

# One script for every behaviour, chosen by protocol.config `mode`; its windows report fixed step times (the
# switch `fast` halves them), so the verdict is known in advance.
TRAIN = """
import json, os, signal, sys, time

steps, every = int(os.environ["PREREG_STEPS"]), int(os.environ["PREREG_LOG_EVERY"])
config = json.loads(os.environ["PREREG_CONFIG"])
mode, pause = config.get("mode", "ok"), config.get("pause", 0.0)
fast = "fast" in os.environ["PREREG_SWITCHES"].split(",")
if mode == "ignore-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(os.environ["PREREG_RUN_DIR"], "seen.json"), "w") as seen:
    instructions = {k: v for k, v in os.environ.items() if k.startswith("PREREG_")}
    json.dump(instructions | {"cwd": os.getcwd(), "pid": os.getpid()}, seen)
with open(os.environ["PREREG_WINDOWS"], "a") as out:
    for step in range(1, steps + 1):
        time.sleep(pause)
        if step % every:
            continue
        window = {"steps": step, "s_per_step": 0.01 if fast else 0.02, "loss": 1.0 / step}
        if mode == "nan" and step >= 2 * every:
            window["loss"] = float("nan")
        if mode == "undeclared" and step >= 2 * every:
            window["accuracy"] = 0.5
        out.write(json.dumps(window) + "\\n")
        out.flush()
        if mode == "crash" and step >= every:
            sys.exit("boom: the script failed on purpose")
        while mode == "ignore-sigterm":  # deaf to SIGTERM after its first window: only SIGKILL ends it
            time.sleep(1)
"""

# The probe keeps the contract by hand: one JSON line last, or an error, or (switch nojson) no JSON at all.
PROBE = """
import json, os

switch = os.environ["PREREG_SWITCH"]
assert os.environ["PREREG_PROBE"] == "parity" and "PREREG_SEED" in os.environ
assert isinstance(json.loads(os.environ["PREREG_CONFIG"]), dict)
print("probing", switch)
if switch == "nojson":
    print("loss_abs is small, trust me")
elif switch == "errs":
    print(json.dumps({"error": "this probe needs a GPU"}))
else:
    print(json.dumps({"loss_abs": 1e-7 if switch == "fast" else 0.5}))
"""

REGISTRATION = """
id = "{reg_id}"
title = "a script governed"
question = "Does the fast switch halve a step?"
workload = "command"
profile = "local"

[command]
run = "python train.py"
probe = "python probe.py"
cwd = "scripts"
sources = ["train.py", "probe.py"]
switches = ["fast"]
config = ["mode", "pause"]
metrics = ["s_per_step", "loss"]
probes = {{ parity = ["loss_abs"] }}

[cost]
ceiling_gpu_h = 0.5
on_ceiling = "stop"
{items}
[protocol]{protocol}
steps = {steps}
log_every = {log_every}
discard_first = {log_every}
config = {{ mode = "{mode}", pause = {pause} }}
{rungs}{decide}{kill}"""

# With a rung B: how much faster it is than A, and the rule that lands it.
DECIDE = """
[reads]
speedup = "(A.s_per_step - B.s_per_step) / A.s_per_step"

[[rules]]
id = "land"
when = "speedup >= 0.4"
outcome = "land-fast"
land = ["fast-item"]

[[expectations]]
n = 1
claim = "fast halves a step"
confidence = "high"
check = "speedup >= 0.4"
"""

ITEM = """
[[items]]
id = "{item}"
title = "switch {switch}"
switch = "{switch}"
bitwise = false
  [[items.oracles]]
  id = "{item}-parity"
  kind = "tolerance"
  probe = "parity"
  bounds = {{ loss_abs = 1e-4 }}
"""


def rungs_text(rungs: dict[str, list[str]], config: dict[str, dict]) -> str:
    return "".join(
        f'\n  [[protocol.rungs]]\n  id = "{r}"\n  items = {json.dumps(items)}\n'
        + (f"  config = {{ {', '.join(f'{k} = {v!r}' for k, v in config[r].items())} }}\n" if r in config else "")
        for r, items in rungs.items()
    )


def write_lab(
    tmp_path: Path,
    reg_id: str,
    *,
    mode: str = "ok",
    pause: float = 0.0,
    steps: int = 4,
    log_every: int = 2,
    items: tuple[str, ...] = ("fast",),
    rungs: dict[str, list[str]] | None = None,
    rung_config: dict[str, dict] | None = None,
    kill: str = "",
    protocol: str = "",
) -> Path:
    """A registration and its scripts in a folder of their own; the path of the registration."""
    rungs = rungs or {"A": [], "B": ["fast-item"]}
    lab = tmp_path / "lab"
    (lab / "scripts").mkdir(parents=True, exist_ok=True)
    (lab / "scripts" / "train.py").write_text(textwrap.dedent(TRAIN))
    (lab / "scripts" / "probe.py").write_text(textwrap.dedent(PROBE))
    text = REGISTRATION.format(
        reg_id=reg_id,
        items="".join(ITEM.format(item=f"{s}-item", switch=s) for s in items),
        steps=steps,
        log_every=log_every,
        mode=mode,
        pause=pause,
        rungs=rungs_text(rungs, rung_config or {}),
        decide=DECIDE if rungs.get("B") == ["fast-item"] else "",
        kill=kill,
        protocol=protocol,
    )
    path = lab / f"{reg_id}.toml"
    path.write_text(text)
    return path


def prereg(*args: str | Path, ledger: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`prereg ARGS` as a process of its own: for `run`, whose ladder handles signals and starts processes."""
    return subprocess.run([sys.executable, str(REPO / "cli.py"), *map(str, args), "--ledger", str(ledger)], cwd=REPO,
                          capture_output=True, text=True, env=ENV, timeout=timeout)  # fmt: skip


def run_json(reg_id: str, path: Path, ledger: Path, *options: str) -> dict:
    result = prereg("run", reg_id, "--file", path, *options, "--json", ledger=ledger)
    assert result.returncode == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def frozen_lab(cli: Cli, tmp_path: Path, reg_id: str, **options) -> tuple[Path, Path]:
    path = write_lab(tmp_path, reg_id, **options)
    cli.ok("freeze", path)
    return path, cli.ledger


def state_of(ledger: Path, reg_id: str):
    store = Ledger.open(str(ledger), create=False)
    try:
        return load_state(store, reg_id), store.verify()
    finally:
        store.close()


def entries(ledger: Path, reg_id: str, kind: str) -> list[dict]:
    store = Ledger.open(str(ledger), create=False)
    try:
        return [e.data for e in store.entries(reg_id=reg_id, kinds=(kind,))]
    finally:
        store.close()


# --- a ladder end to end -------------------------------------------------------------------------------------


def test_the_example_ladder_lands_the_faster_kernel_and_drops_the_planted_numerics_change(cli: Cli, tmp_path):
    """examples/command end to end: the gate drops the float16 item at its oracle, rung C (left equal to B) is not
    run, A and B run their script with their switches, and the frozen rules land the BLAS kernel."""
    example = tmp_path / "command"
    shutil.copytree(REPO / "examples" / "command", example)
    path = example / "mlp-matmul.toml"
    # Fewer steps than the example's own (a test, not a measurement); the scripts and the ladder are the same.
    path.write_text(
        path.read_text().replace("steps = 300", "steps = 60").replace("discard_first = 60", "discard_first = 30")
    )
    cli.ok("freeze", path)
    ledger = cli.ledger
    [freeze] = entries(ledger, "example-mlp-matmul", "freeze")
    assert set(freeze["sources"]) == {"train.py", "probe.py", "mlp.py"}  # hashed at freeze
    assert freeze["document"]["command"]["run"] == "python train.py"  # the declaration is frozen with the document

    summary = run_json("example-mlp-matmul", path, ledger)
    assert summary["complete"] and set(summary["dropped"]) == {"X2"}, summary
    assert "> bound 1e-05" in summary["dropped"]["X2"]["reason"]
    assert sorted((r["rung"], r["status"], r["windows"]) for r in summary["runs"]) == [
        ("A", "finished", 2),
        ("B", "finished", 2),
    ]
    state, report = state_of(ledger, "example-mlp-matmul")
    assert report.ok and state.oracles["X1a"].passed
    b = next(r for r in state.runs if r.rung == "B")
    assert [w["step"] for w in b.windows] == [30, 60] and [w["steps"] for w in b.windows] == [30, 30]
    assert b.totals["rc"] == 0 and all(w["finite"] for w in b.windows)
    start = entries(ledger, "example-mlp-matmul", "run-start")[1]
    assert start["switches"] == ["blas_matmul"] and {"pid", "host", "started"} <= set(start["process"])
    assert start["env"]["torch"] is None  # the engine's torch is not the script's: the script ran in its own process
    assert (REPO / "reports" / "example-mlp-matmul" / "runs" / b.run_id / "stderr.log").exists()

    verdict = cli.ok_json("verdict", "example-mlp-matmul")
    assert verdict["outcome"] == "land-blas", verdict["reads"]
    results = [e["result"] for e in verdict["expectations"]]
    # The oracle claims are the engine's to get right; the third is a speed claim about this machine (BLAS at least
    # twice the naive loop), which a core shared with the other worker's torch processes can miss: scored either way.
    assert results[:2] == ["hit", "hit"] and results[2] in ("hit", "miss"), results


def test_an_edited_source_refuses_the_run_naming_the_file(cli: Cli, tmp_path):
    path, ledger = frozen_lab(cli, tmp_path, "cmd-edited")
    train = path.parent / "scripts" / "train.py"
    train.write_text(train.read_text() + "\n# tuned after freezing\n")
    before = ledger.read_bytes()
    result = prereg("run", "cmd-edited", "--file", path, ledger=ledger)
    assert result.returncode == REFUSED, result.stderr
    assert f"{train} changed since cmd-edited was frozen" in result.stderr.replace("\n", "")
    assert ledger.read_bytes() == before


# --- a script that breaks the contract, or is stopped -----------------------------------------------------------


# One until-pass ladder whose every rung breaks the contract or is stopped in its own way: no rung passes, so each
# runs in turn, in one `prereg run`.
BROKEN_RUNGS = {
    "CRASH": {"mode": "crash"},
    "UNDECLARED": {"mode": "undeclared"},
    "NAN": {"mode": "nan"},
    "STUBBORN": {"mode": "ignore-sigterm"},
}
BROKEN_KILLS = """
[[kill]]
id = "K-nan"
when = "not finite(loss)"
rungs = ["NAN"]
[[kill]]
id = "K-first"
when = "step >= 2"
rungs = ["STUBBORN"]
"""


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict:
    """rung -> its run, from one ladder of broken scripts."""
    tmp_path = tmp_path_factory.mktemp("broken")
    cli = Cli(tmp_path / "ledger.db", tmp_path)
    path, ledger = frozen_lab(cli, tmp_path, "cmd-broken", steps=8, items=(), rungs={r: [] for r in BROKEN_RUNGS},
                              rung_config=BROKEN_RUNGS, kill=BROKEN_KILLS,
                              protocol='\nkind = "until_pass"\npass_rule = "rc == 0 and steps >= 8"')  # fmt: skip
    summary = run_json("cmd-broken", path, ledger)
    assert summary["complete"], summary  # until-pass: a failed or killed rung is final, and the next one runs
    state, report = state_of(ledger, "cmd-broken")
    assert report.ok and [r.rung for r in state.runs] == list(BROKEN_RUNGS)
    return {run.rung: run for run in state.runs}


def test_a_rung_gets_its_instructions_in_its_environment_and_runs_in_cwd(broken):
    run = broken["CRASH"]
    seen = json.loads((REPO / "reports" / "cmd-broken" / "runs" / run.run_id / "seen.json").read_text())
    assert (seen["PREREG_RUNG"], seen["PREREG_STEPS"], seen["PREREG_LOG_EVERY"]) == ("CRASH", "8", "2")
    assert seen["PREREG_SWITCHES"] == "" and seen["PREREG_SEED"] == "0"
    assert json.loads(seen["PREREG_CONFIG"]) == {"mode": "crash", "pause": 0.0}
    assert Path(seen["PREREG_RUN_DIR"]).name == run.run_id and Path(seen["PREREG_WINDOWS"]).name == "windows.jsonl"
    assert Path(seen["cwd"]).name == "scripts"  # command.cwd, relative to the registration's folder


def test_a_script_that_exits_nonzero_fails_with_its_stderr_tail(broken):
    run = broken["CRASH"]
    assert run.status == "failed" and run.totals["rc"] == 1
    assert "exited with 1 after reporting 2 of 8 steps" in run.ended_by["error"]
    assert "boom: the script failed on purpose" in run.ended_by["error"]
    assert "Traceback" not in run.ended_by["error"]


def test_an_undeclared_metric_fails_the_rung_naming_line_and_key(broken):
    run = broken["UNDECLARED"]
    assert run.status == "failed"
    assert run.ended_by["error"].startswith("windows.jsonl line 2: undeclared key 'accuracy'"), run.ended_by
    assert run.n_windows == 1  # the window before it stands; nothing of the bad line reached the ledger


def test_nan_is_recorded_not_finite_and_the_kill_line_fires(broken):
    run = broken["NAN"]
    assert run.status == "killed" and run.ended_by == {"kill": "K-nan"}
    assert [w["finite"] for w in run.windows] == [True, False] and run.windows[-1]["step"] == 4


def test_a_script_that_ignores_sigterm_is_sigkilled_after_the_grace(broken):
    run = broken["STUBBORN"]
    assert run.status == "killed" and run.ended_by == {"kill": "K-first"}
    assert run.totals["rc"] == -signal.SIGKILL
    assert run.totals["wall_s"] - run.windows[0]["elapsed_s"] >= STOP_GRACE_S  # SIGTERM, the grace, then SIGKILL


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids_in_session(leader: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == leader and _alive(int(entry.name)):
                    found.add(int(entry.name))
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes die with their parent on Linux")
def test_a_ladder_stopped_by_its_budget_then_sigkilled_resumes_from_scratch_each_time(cli: Cli, tmp_path):
    # No items: no oracle gate before the rung, so the budget is the rung's.
    path, ledger = frozen_lab(
        cli, tmp_path, "cmd-resume", items=(), pause=0.05, steps=40, log_every=10, rungs={"A": []}
    )
    stopped = run_json("cmd-resume", path, ledger, "--budget-s", "1.5")
    assert stopped["stopped"] == "budget" and not stopped["complete"], stopped
    [budgeted] = state_of(ledger, "cmd-resume")[0].runs
    assert budgeted.status == "killed" and budgeted.ended_by == {"budget": True}

    ladder = subprocess.Popen([sys.executable, str(REPO / "cli.py"), "run", "cmd-resume", "--file", str(path),
                               "--ledger", str(ledger), "--json"], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(state_of(ledger, "cmd-resume")[0].runs) < 2 or not state_of(ledger, "cmd-resume")[0].runs[1].windows:
            assert time.monotonic() < deadline, "no window of the second run within a minute"
            time.sleep(0.05)
        ladder.kill()  # prereg run alone: its rung process and the script die with it
        ladder.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _pids_in_session(ladder.pid):
            assert time.monotonic() < deadline, "the rung process outlived prereg run"
            time.sleep(0.05)
    finally:
        if ladder.poll() is None:
            os.killpg(ladder.pid, signal.SIGKILL)
    killed = state_of(ledger, "cmd-resume")[0].runs[1]
    assert killed.status == "running"  # as the ledger was left: nobody wrote its end
    seen = json.loads((REPO / "reports" / "cmd-resume" / "runs" / killed.run_id / "seen.json").read_text())
    assert not _alive(seen["pid"]), "the script outlived its rung process"
    shown = cli.ok_json("audit", "show", "cmd-resume")  # a verb that only reads: it reconciles first
    assert [r["status"] for r in shown["runs"]] == ["killed", "interrupted"]
    [interrupted] = entries(ledger, "cmd-resume", "interrupted")
    assert "is gone without an end" in interrupted["reason"]

    resumed = run_json("cmd-resume", path, ledger)
    assert resumed["complete"], resumed
    state, report = state_of(ledger, "cmd-resume")
    assert report.ok and [r.status for r in state.runs] == ["killed", "interrupted", "finished"]
    assert [w["step"] for w in state.runs[2].windows] == [10, 20, 30, 40]  # one whole set of windows
    rung = next(r for r in cli.ok_json("verdict", "cmd-resume")["rungs"] if r["rung"] == "A")
    assert rung["run"] == state.runs[2].run_id and rung["windows"] == 3  # nothing partial merged into the read


# --- documents: what a [command] table may say ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (('cwd = "scripts"', 'cwd = "scripts"\nshell = true'), "command.shell: unknown key 'shell'"),
        (('metrics = ["s_per_step", "loss"]', 'metrics = ["loss"]'), "reads.speedup"),
        (('switches = ["fast"]', 'switches = ["quick"]'), "'fast' is not a switch"),
        (('probes = { parity = ["loss_abs"] }', 'probes = { parity = ["loss_rel"] }'), "does not observe ['loss_abs']"),
        (('probes = { parity = ["loss_abs"] }', 'probes = { other = ["loss_abs"] }'), "'parity' is not a probe"),
        (('config = ["mode", "pause"]', 'config = ["mode"]'), "unknown config key 'pause'"),
        (
            ('sources = ["train.py", "probe.py"]', 'sources = ["train.py", "gone.py"]'),
            "'scripts/gone.py' is not a file",
        ),
        (('cwd = "scripts"', 'cwd = "/opt/lab"'), "command.cwd: "),
        (('run = "python train.py"', 'run = "python \'train.py"'), "command.run: "),
        (('metrics = ["s_per_step", "loss"]', 'metrics = ["s_per_step", "loss", "steps"]'), "command.metrics: 'steps'"),
        (('probe = "python probe.py"\n', ""), "command.probe: probes ['parity'] are declared"),
        (("[protocol]\n", '[protocol]\nschedule = "interleaved"\n'), "protocol.schedule: workload command runs each"),
        (('workload = "command"', 'workload = "molmo2"'), "command: workload 'molmo2' is declared by its code"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_bad_command_table_is_refused_at_check_and_freeze_naming_it(cli: Cli, tmp_path, change, says):
    path = write_lab(tmp_path, "cmd-bad")
    old, new = change
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    for result in (cli("check", path), cli.on_ledger("freeze", path)):
        assert result.exit_code == INVALID, result.stdout
        assert str(path) in result.stderr and says in result.stderr.replace("\n", ""), result.stderr
    assert not cli.ledger.exists()


def test_the_declaration_a_table_builds_and_a_document_without_one():
    declaration = declare({"run": "python train.py", "cwd": "..", "sources": ["a/train.py"], "metrics": ["loss"]})
    assert isinstance(declaration, CommandDeclaration) and declaration.own_process
    assert declaration.sources == ("../a/train.py",)  # relative to the registration's folder
    assert set(declaration.profiles) >= {"local", "cuda", "cuda-x2", "cuda-x8"}
    assert declaration.profiles["cuda-x4"].world_size == 1  # one engine process; the script's torchrun has 4 ranks
    assert {"rc", "steps", "gpu_s", "finite", "loss"} <= set(declaration.metrics)
    # A document without the optional table hashes as before: the field is left out, not written as null.
    reg = Registration.model_validate(tomllib.loads(MINI))
    assert "command" not in document_dict(reg)


def test_prereg_new_writes_a_template_that_checks_once_its_blanks_are_filled(cli: Cli, tmp_path):
    path = tmp_path / "mine.toml"
    written = cli("new", path, "--json")
    assert written.exit_code == 0 and written.json()["blanks"] == blanks(COMMAND)
    unfilled = cli("check", path)
    assert unfilled.exit_code == INVALID and "id: '<FILL: a unique id" in unfilled.stderr
    assert cli("new", path).exit_code == INVALID  # never overwrites

    (tmp_path / "train.py").write_text("")
    fills = {
        "a unique id": "mine",
        "one line saying": "a title",
        "the question": "a question",
        "the command that trains": "python train.py",
        "the command that measures": "python train.py",
        "the files the commands run": "train.py",
        "the switch your script reads": "fast_kernel",
        "what the switch changes": "a faster kernel",
        "the switch named in": "fast_kernel",
    }
    text = path.read_text()
    for blank in blanks(text):
        [value] = [v for k, v in fills.items() if blank.startswith(f"{BLANK_MARK} {k}")]
        text = text.replace(f'"{blank}"', json.dumps(value), 1)
    path.write_text(text)
    checked = cli("check", path, "--json")
    assert checked.exit_code == 0, checked.stderr
    assert checked.json()["rungs"] == ["A", "B"]


# --- the parts, in this process ---------------------------------------------------------------------------------


def test_the_windows_reader_returns_whole_lines_and_names_what_is_wrong(tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_text("")
    reader = WindowsReader(path, frozenset({"loss", "s_per_step"}), total_steps=60)
    with path.open("a") as out:
        out.write('{"steps": 20, "loss": NaN, "s_per_step": 0.5}\n\n{"steps": 40, "lo')
        out.flush()
        assert reader.read() == [{"steps": 20, "loss": pytest.approx(float("nan"), nan_ok=True), "s_per_step": 0.5}]
        assert reader.read() == []  # the line still being written waits for its newline
        out.write('ss": Infinity}\n')
    assert reader.read() == [{"steps": 40, "loss": float("inf")}]
    for line, says in [
        ("not json", "windows.jsonl line 4: not JSON"),
        ("[1, 2]", "a JSON list, not an object"),
        ('{"loss": 1.0}', "no 'steps' key"),
        ('{"steps": 40, "loss": 1.0}', "must grow past the previous window's 40"),
        ('{"steps": 80}', "within PREREG_STEPS = 60"),
        ('{"steps": 60, "loss": "low"}', "key 'loss' = 'low' is not a number"),
        ('{"steps": 60, "loss": true}', "key 'loss' = True is not a number"),
        ('{"steps": 60, "acc": 1}', "undeclared key 'acc'; command.metrics declares ['loss', 's_per_step']"),
    ]:
        with pytest.raises(WindowError, match=says.replace("[", r"\[").replace("]", r"\]")):
            reader.parse(line.encode(), 4)
    with path.open("a") as out:
        out.write('{"steps": 50, "loss": 1.0}\n{"steps": 60, "loss": "low"}\n')
    assert reader.read() == [{"steps": 50, "loss": 1.0}]  # a good window stands, though a bad line came with it
    with pytest.raises(WindowError, match="line 5: key 'loss' = 'low'"):
        reader.read()
    shrunk = WindowsReader(path, frozenset({"loss"}), total_steps=60, offset=10_000)
    with pytest.raises(WindowError, match="shrank"):
        shrunk.read()


def test_prereg_script_round_trip(tmp_path):
    """A script using prereg.script: its instructions read back, windows appended (NaN kept), SIGTERM a request."""
    script = tmp_path / "helper.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, signal
        from prereg import script
        print(json.dumps([sorted(script.switches()), script.switch("fast"), script.config(), script.steps(),
                          script.log_every(), script.seed(), script.rung(), str(script.run_dir())]))
        script.window(steps=10, loss=float("nan"), s_per_step=0.25)
        os.kill(os.getpid(), signal.SIGTERM)
        assert script.should_stop()
        script.window(steps=20, loss=1.5, s_per_step=0.25)
        os.environ["RANK"] = "1"
        script.window(steps=30, loss=1.0, s_per_step=0.25)  # only rank 0 writes
        """)
    )
    windows = tmp_path / "windows.jsonl"
    env = {**ENV, "PREREG_SWITCHES": "fast,other", "PREREG_CONFIG": '{"batch": 4}', "PREREG_STEPS": "20",
           "PREREG_LOG_EVERY": "10", "PREREG_SEED": "7", "PREREG_RUNG": "B", "PREREG_RUN_DIR": str(tmp_path),
           "PREREG_WINDOWS": str(windows)}  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [["fast", "other"], True, {"batch": 4}, 20, 10, 7, "B", str(tmp_path)]
    read = WindowsReader(windows, frozenset({"loss", "s_per_step"}), total_steps=20).read(writer_gone=True)
    assert [w["steps"] for w in read] == [10, 20] and read[0]["loss"] != read[0]["loss"]  # NaN survives the trip
    missing = subprocess.run([sys.executable, "-c", "from prereg import script; script.steps()"], env=ENV,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode != 0 and "PREREG_STEPS is not set" in missing.stderr


def _runner(tmp_path: Path, table: dict, rung: str | None = "A") -> CommandRunner:
    declaration = declare(table)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    context = RunContext(declaration, tmp_path, rung=rung, steps=4, log_every=2, run_dir=run_dir)
    profile = declaration.profiles["local"]
    config = declaration.run_config.resolve({}, profile, declaration.run_config.defaults(profile))
    return CommandRunner(profile, config, 0, context)


def test_a_command_that_is_not_found_fails_naming_it(tmp_path):
    runner = _runner(tmp_path, {"run": "no-such-trainer --fast", "metrics": ["loss"]})
    with pytest.raises(RunnerFailure, match="command 'no-such-trainer' not found"):
        runner.load()
    assert runner.close() is None
    prober = _runner(tmp_path, {"run": "x", "probe": "no-such-probe", "metrics": ["loss"], "probes": {"p": ["a"]}})
    [(key, why)] = prober.probe("p", "fast", {}).items()
    assert key == "error" and "command 'no-such-probe' not found" in why


def test_the_probe_protocol(tmp_path):
    """The last stdout line is one JSON object of observations, or {"error": why}; anything else fails the oracle
    with what was wrong. The probe gets PREREG_PROBE, PREREG_SWITCH, PREREG_SEED and PREREG_CONFIG."""
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE))
    table = {"run": "x", "probe": f"{sys.executable} probe.py", "metrics": ["loss"], "probes": {"parity": ["loss_abs"]}}
    probe = _runner(tmp_path, table, rung=None).probe
    assert probe("parity", "fast", {}) == {"loss_abs": 1e-7}
    assert probe("parity", "errs", {}) == {"error": "this probe needs a GPU"}
    assert probe("parity", "nojson", {}) == {
        "error": "the probe's last stdout line is not a JSON object: 'loss_abs is small, trust me'"
    }
    (tmp_path / "exits.py").write_text('import sys\nprint(\'{"a": 1, "b": 2}\')\nsys.exit(int(sys.argv[1]))\n')
    table = {"run": "x", "metrics": ["loss"], "probes": {"p": ["a"]}}
    failing = _runner(tmp_path, {**table, "probe": f"{sys.executable} exits.py 4"}, rung=None)
    assert failing.probe("p", "fast", {})["error"].endswith("exits.py 4` exited with 4; its stderr is empty")
    extra = _runner(tmp_path, {**table, "probe": f"{sys.executable} exits.py 0"}, rung=None)
    assert "undeclared observation(s) ['b']" in extra.probe("p", "fast", {})["error"]


def test_a_multi_gpu_profile_runs_the_command_under_torchrun():
    assert under_torchrun(["python3", "train.py", "--lr", "1e-3"], 4)[:3] == ["python3", "-m", "torch.distributed.run"]
    assert under_torchrun(["python3", "train.py"], 4)[-1] == "train.py"
    assert "--nproc-per-node" in under_torchrun(["python", "-m", "lab.train"], 2)
    other = under_torchrun(["./train.sh", "--x"], 2)
    assert other[0] == sys.executable and other[other.index("--no-python") + 1 :] == ["./train.sh", "--x"]


def test_a_cuda_xn_rung_runs_its_script_under_torchrun_and_reads_rank_0s_windows(tmp_path, monkeypatch):
    """The cuda-x2 profile's path on the CPU (torchrun needs no GPU to start ranks): every rank gets the same
    PREREG_WINDOWS, prereg.script writes only on rank 0, and the runner reads one window per window."""
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""
        import os
        from prereg import script
        for step in range(2, script.steps() + 1, 2):
            script.window(steps=step, loss=1.0 / step, rank=float(os.environ["RANK"]))
        """)
    )
    declaration = declare({"run": "python train.py", "metrics": ["loss", "rank"]})
    context = RunContext(declaration, tmp_path, rung="A", steps=4, log_every=2, run_dir=tmp_path / "run")
    profile = declaration.profiles["cuda-x2"]
    config = declaration.run_config.resolve({}, profile, declaration.run_config.defaults(profile))
    runner = CommandRunner(profile, config, 0, context)
    assert runner.devices == 2 and runner.parallel == {"launcher": "torchrun", "ranks": 2}
    monkeypatch.setenv("PATH", ENV["PATH"])  # the script's `python` is this interpreter, with this checkout
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    try:
        runner.load()
        windows = [runner.train_window(2, lambda: False) for _ in range(2)]
    finally:
        status = runner.close()
    assert status == 0, (tmp_path / "run" / "stderr.log").read_text()
    assert [(w["steps"], w["rank"]) for w in windows] == [(2, 0.0), (2, 0.0)]  # rank 0's, once each


def test_only_a_run_whose_process_is_gone_is_recorded_interrupted(tmp_path):
    ledger = Ledger.open(str(tmp_path / "ledger.db"), create=True)
    alive = process_identity.current()
    report = "import json; from engine import process_identity as p; print(json.dumps(p.current()))"
    ended = subprocess.run([sys.executable, "-c", report], env=ENV, capture_output=True, text=True, check=True)
    identities = {
        "alive": alive,
        "gone": json.loads(ended.stdout),
        "reused-pid": {**alive, "start_ticks": alive["start_ticks"] + 1},  # another process under this pid
        "elsewhere": {**alive, "host": "another-host"},  # this machine cannot tell: left to its own host
        "unnamed": None,  # recorded before runs carried their process: left to `prereg run`
    }
    for ref, identity in identities.items():
        ledger.append("run-start", "r", {"rung": "A", "process": identity}, ref=ref)
    assert reconcile(ledger) == ["gone", "reused-pid"]
    assert [e.ref for e in running(ledger)] == ["alive", "elsewhere", "unnamed"]
    assert reconcile(ledger) == []  # recorded once
    with pytest.raises(Refused, match="rung A of r is still running: process"):
        mark_interrupted(ledger, SimpleNamespace(reg_id="r"))  # a new ladder never runs a rung twice at once
    ledger.close()
