"""`prereg new`: registrations to start from, with blanks that validation refuses until they are filled.

A blank is a string value holding `<FILL: what goes here>`. The schema refuses a document that still holds one,
naming its field path, so a template is never frozen half-written.
"""

from __future__ import annotations

from typing import Any

BLANK_MARK = "<FILL:"

COMMAND = """\
# A pre-registration for a script of your own (workload = "command"). Fill in every value marked FILL, then
#   prereg check FILE                       validates it and prints the plan (it writes nothing)
#   prereg freeze FILE                      locks it into the ledger, with the hashes of command.sources
#   prereg run ID --file FILE               the oracle gate, then the rungs
#   prereg verdict ID                       the frozen rules applied to what was measured
id = "<FILL: a unique id: lowercase letters, digits, dots and dashes, e.g. my-kernel-speedup>"
title = "<FILL: one line saying what is tested>"
question = "<FILL: the question the ladder answers>"
workload = "command"
profile = "local"                       # local: this machine's CPU | cuda: one GPU | cuda-xN: N GPUs (torchrun)

[command]
# Split like a shell line (no shell), run in cwd. The rung's instructions arrive in its environment:
# PREREG_SWITCHES (comma-separated), PREREG_CONFIG (JSON), PREREG_STEPS, PREREG_LOG_EVERY, PREREG_SEED,
# PREREG_RUNG, PREREG_RUN_DIR; it appends one JSON object per window to the file PREREG_WINDOWS names, e.g.
# {"steps": 20, "s_per_step": 0.031, "loss": 2.31} (steps: cumulative, required).
run = "<FILL: the command that trains, e.g. python train.py>"
# Runs once per oracle with PREREG_PROBE, PREREG_SWITCH, PREREG_SEED, PREREG_CONFIG; prints one JSON object of
# observations as its last stdout line, e.g. {"loss_abs": 1.2e-4}, or {"error": "why it could not run"}.
probe = "<FILL: the command that measures baseline against the item, e.g. python probe.py>"
cwd = "."                               # relative to this file's folder
sources = ["<FILL: the files the commands run, e.g. train.py>"]   # hashed at freeze; a changed one refuses the run
switches = ["<FILL: the switch your script reads from PREREG_SWITCHES, e.g. fast_kernel>"]
config = ["batch"]                      # the keys protocol.config and rungs may set
metrics = ["s_per_step", "loss"]        # every key a window may carry besides steps
probes = { parity = ["loss_abs"] }      # probe -> the observations it reports

[cost]
ceiling_gpu_h = 0.05                    # device-hours for the whole ladder, oracles included
on_ceiling = "stop"                     # stop | finish-rung | continue (an overrun is recorded)

[[items]]
id = "X1"
title = "<FILL: what the switch changes>"
switch = "<FILL: the switch named in command.switches>"
bitwise = false                         # is the item bitwise-identical to the baseline by construction?

  [[items.oracles]]
  id = "X1a"
  kind = "tolerance"
  probe = "parity"
  bounds = { loss_abs = 1e-4 }          # frozen: an item that fails its oracle is dropped, never re-toleranced

[protocol]
steps = 200
log_every = 20                          # one window = log_every steps
discard_first = 40                      # warm-up steps left out of every read
seed = 0
config = { batch = 64 }

  [[protocol.rungs]]
  id = "A"                              # the baseline: no items
  [[protocol.rungs]]
  id = "B"
  items = ["X1"]

[reads]
speedup = "(A.s_per_step - B.s_per_step) / A.s_per_step"

[[rules]]
id = "land"
when = "speedup >= 0.05"
outcome = "land-X1"
land = ["X1"]
[[rules]]
id = "park"
when = "speedup < 0.05"
outcome = "park-X1"
park = ["X1"]

[[kill]]
id = "K-nan"
when = "not finite(loss)"               # checked on every window as it lands
rungs = ["B"]
drops = ["X1"]

[[expectations]]
n = 1
claim = "X1 makes a step at least 5% faster"
confidence = "medium"
check = "speedup >= 0.05"
"""

TEMPLATES = {"command": COMMAND}


def first_blank(data: Any, path: str = "") -> tuple[str, str] | None:
    """(field path, text) of the first blank left in a document's data, or None."""
    if isinstance(data, str):
        return (path or "(document)", data) if BLANK_MARK in data else None
    if isinstance(data, dict):
        for key, value in data.items():
            found = first_blank(value, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(data, list):
        for index, value in enumerate(data):
            label = value.get("id") if isinstance(value, dict) else None
            found = first_blank(value, f"{path}.{label if label is not None else index}")
            if found:
                return found
    return None


def blanks(text: str) -> list[str]:
    """Every blank a template's text holds, in order (what `prereg new` tells the user to fill)."""
    found = []
    start = text.find(BLANK_MARK)
    while start != -1:
        end = text.index(">", start)
        found.append(text[start : end + 1])
        start = text.find(BLANK_MARK, end)
    return found
