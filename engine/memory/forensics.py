"""Who holds the device memory: a CUDA allocator snapshot, attributed to parameters, gradients, optimizer state,
DDP reducer buckets, autocast copies, activations, other and fragmentation.

The F1 memory ladder (registrations/molmo2-ar-40k-f1.toml) spent six rungs on component arithmetic that kept
missing >= 10 GiB; the snapshot read (rung 7's forensics) found the block none of them had touched (DDP's reducer
buckets, allocated at construction). This module is that read, made repeatable: it takes the dict
`torch.cuda.memory._snapshot()` returns (pickled by engine.memory.snapshot) and says what was live at the peak.

Two sources, the table says which one it used:
- the allocation history (`device_traces`): every alloc / free / segment event is replayed and the live
  allocations are taken at the moment active memory peaked — the OOM moment of a dying rung, the step's peak of
  a passing one, wherever the snapshot itself was dumped;
- without a history, the segments' blocks at the moment the snapshot was taken.

Classification, strongest evidence first:
1. tensor roles the instrument recorded at dump time (the storage addresses of the model's parameters and
   buffers, their gradients and the optimizer state). A gradient is usually the backward op's output that
   AccumulateGrad *steals*, so its allocation stack names the op (MmBackward0, ToCopyBackward0), not
   AccumulateGrad: only the address says "gradient". Roles cover the tensors live at dump time.
2. the allocation's stack frames, innermost first: the first frame that a rule in FRAME_RULES recognises decides.
   C++ frames (stacks="all") are what find autocast casts (`at::autocast::cached_cast`), reducer buckets
   (`c10d::Reducer`) and everything the autograd engine allocates on its device thread (no Python frames there).
3. otherwise "other" (inputs, clip_grad_norm_ temporaries, allocations recorded without a stack).

Sizes are the sizes the program asked for (the trace's and the blocks' requested_size), so fragmentation =
reserved - active also counts the allocator's rounding. Memory outside the caching allocator (the CUDA context,
NCCL's own buffers) is in no snapshot; nvidia-smi's figure is larger by that much.

Torch-free on purpose: a banked snapshot is read anywhere, and its pickle is loaded with an unpickler that
refuses every class (a torch snapshot is plain dicts, lists, tuples, strings and numbers).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

GIB = 1024**3

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
REDUCER_BUCKETS = "reducer buckets"
AUTOCAST_COPIES = "autocast copies"
ACTIVATIONS = "activations"
OTHER = "other"
FRAGMENTATION = "fragmentation"
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, REDUCER_BUCKETS, AUTOCAST_COPIES, ACTIVATIONS, OTHER)

# The key engine.memory.snapshot adds to torch's snapshot dict: {"device": index, role: [addresses]}.
# torch's own viewers ignore unknown keys, so the pickle still opens at pytorch.org/memory_viz.
ROLES_KEY = "prereg_tensor_roles"
ROLE_CATEGORIES = {"parameters": PARAMETERS, "gradients": GRADIENTS, "optimizer_state": OPTIMIZER_STATE}

# Block states as the C++ snapshot writes them (torch/csrc/cuda/memory_snapshot.cpp; the _snapshot docstring
# spells the second one "active_awaiting_free", the code does not). A pending-free block still holds memory
# (another stream may be reading it), so it counts as active, as torch's own `active_size` counts it.
ACTIVE_STATES = frozenset({"active_allocated", "active_pending_free"})
BLOCK_STATES = ACTIVE_STATES | {"inactive"}

ALLOC, FREE_REQUESTED, FREE_COMPLETED = "alloc", "free_requested", "free_completed"
SEGMENT_GROWS = frozenset({"segment_alloc", "segment_map"})  # cudaMalloc; expandable segments map pages
SEGMENT_SHRINKS = frozenset({"segment_free", "segment_unmap"})
MARKERS = frozenset({"snapshot", "oom", "user_defined"})  # events that move no memory
TRACE_ACTIONS = frozenset({ALLOC, FREE_REQUESTED, FREE_COMPLETED}) | SEGMENT_GROWS | SEGMENT_SHRINKS | MARKERS

LARGEST_PER_CATEGORY = 3


@dataclass(frozen=True)
class FrameRule:
    """A frame that decides a category: a Python frame by function name (optionally only in files whose path
    contains `file`), or a C++ frame whose (demangled) name contains `native`."""

    category: str
    function: str | None = None
    file: str | None = None
    native: str | None = None

    def matches(self, frame: dict[str, Any]) -> bool:
        if is_python(frame):
            return (
                (self.function is None or frame["name"] == self.function)
                and (self.file is None or self.file in frame["filename"])
                and self.native is None
            )
        return self.native is not None and self.native in frame["name"]


# Checked against each frame from the innermost outwards; the first frame any rule matches decides, so an
# autocast cast inside a forward is a cast and Adam's `_init_group` inside the training step is optimizer state.
# These know torch, DDP and autocast only; a workload adds the functions of its own code that hold activations
# outside any module's forward (WorkloadDeclaration.activation_frames: a functional forward, its loss).
FRAME_RULES: tuple[FrameRule, ...] = (
    FrameRule(REDUCER_BUCKETS, native="c10d::Reducer"),  # DDP's buckets, allocated when DDP is constructed
    FrameRule(REDUCER_BUCKETS, function="_ddp_init_helper"),  # the same, when only Python stacks were recorded
    FrameRule(OPTIMIZER_STATE, file="torch/optim/"),  # AdamW's _init_group: exp_avg, exp_avg_sq, step
    FrameRule(OPTIMIZER_STATE, file="torch/distributed/optim/"),  # ZeroRedundancyOptimizer and its buckets
    FrameRule(GRADIENTS, native="AccumulateGrad"),  # a gradient AccumulateGrad had to copy, not steal
    FrameRule(AUTOCAST_COPIES, native="cached_cast"),  # autocast's bf16 copies of weights and inputs
    FrameRule(PARAMETERS, function="to_empty"),
    FrameRule(PARAMETERS, function="_apply"),  # Module.to / .cuda / .float / to_empty's per-tensor lambda
    FrameRule(PARAMETERS, function="__init__", file="torch/nn/modules/"),  # a module built on the device
    FrameRule(PARAMETERS, function="init_weights"),
    FrameRule(PARAMETERS, function="load_state_dict"),
    FrameRule(PARAMETERS, function="_load_from_state_dict"),
    FrameRule(ACTIVATIONS, function="forward"),  # any module's forward: what autograd saves lives here
    FrameRule(ACTIVATIONS, native="torch::autograd::Engine"),  # backward temporaries (the device thread)
    FrameRule(ACTIVATIONS, function="_engine_run_backward"),
    FrameRule(ACTIVATIONS, function="backward"),
)


def frame_rules(activation_frames: Iterable[str] = ()) -> tuple[FrameRule, ...]:
    """FRAME_RULES, and a workload's own functions whose allocations are activations. Appended: a rule decides
    only for the frames it matches, and no generic rule matches a workload's function by its name."""
    return FRAME_RULES + tuple(FrameRule(ACTIVATIONS, function=name) for name in sorted(activation_frames))


def is_python(frame: dict[str, Any]) -> bool:
    return frame["filename"].endswith(".py")


def native_name(name: str, width: int = 80) -> str:
    """A C++ frame's name without its argument list ("(anonymous namespace)" is part of the name, not one)."""
    for i, char in enumerate(name):
        if char == "(" and not name.startswith("(anonymous namespace)", i):
            name = name[:i]
            break
    return name if len(name) <= width else name[: width - 1] + "…"


def frame_label(frame: dict[str, Any]) -> str:
    if is_python(frame):
        return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"
    return native_name(frame["name"])


def deciding_frame(
    frames: Sequence[dict[str, Any]], rules: Sequence[FrameRule] = FRAME_RULES
) -> tuple[str, dict[str, Any] | None]:
    """(category, the frame that decided it): the innermost frame any rule matches."""
    for frame in frames:
        for rule in rules:
            if rule.matches(frame):
                return rule.category, frame
    return OTHER, None


def classify_frames(frames: Sequence[dict[str, Any]], rules: Sequence[FrameRule] = FRAME_RULES) -> str:
    return deciding_frame(frames, rules)[0]


def is_project_code(frame: dict[str, Any]) -> bool:
    return is_python(frame) and "/torch/" not in frame["filename"]


def top_frame(frames: Sequence[dict[str, Any]], rules: Sequence[FrameRule] = FRAME_RULES) -> str:
    """What a reader wants first: the library frame that decided the category (on the autograd thread, the
    backward node that ran, e.g. MmBackward0, rather than the engine), then the innermost frame of the
    project's own code: "adam.py:182 _init_group <- train.py:127 step", "model.py:88 rms_norm"."""
    if not frames:
        return "<no stack recorded>"
    _, decider = deciding_frame(frames, rules)
    if decider is not None and "torch::autograd::Engine" in decider["name"]:
        decider = next((f for f in frames if "Backward" in f["name"] and not is_python(f)), decider)
    if decider is None:
        decider = next((f for f in frames if is_python(f)), None)
    project = next((f for f in frames if is_project_code(f)), None)
    shown = [decider] if decider is not None and not is_project_code(decider) else []
    shown += [project] if project is not None else []
    if not shown:
        return frame_label(frames[0])
    return " <- ".join(frame_label(f) for f in shown)


class Allocation:
    """One allocation's life in the replay: born at an event index (-1: live when the history starts), died at
    one (None: still live when the snapshot was taken)."""

    __slots__ = ("address", "size", "frames", "born", "died", "before_history", "role")

    def __init__(
        self, address: int, size: int, frames: Sequence[dict[str, Any]], born: int, before_history: bool = False
    ):
        self.address = address
        self.size = size
        self.frames = frames
        self.born = born
        self.died: int | None = None
        self.before_history = before_history
        self.role: str | None = None

    def live_at(self, index: int) -> bool:
        return self.born <= index and (self.died is None or self.died > index)

    def category(self, rules: Sequence[FrameRule]) -> str:
        if self.role is not None:
            return ROLE_CATEGORIES[self.role]
        if self.before_history:
            return OTHER
        return classify_frames(self.frames, rules)

    def frame(self, rules: Sequence[FrameRule]) -> str:
        if self.before_history:
            return "<allocated before the recorded history>"
        return top_frame(self.frames, rules)


# ---- the result -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockRow:
    size_bytes: int
    frame: str


@dataclass(frozen=True)
class CategoryRow:
    category: str
    bytes: int
    share: float  # of the reserved total
    count: int
    largest: tuple[BlockRow, ...]


@dataclass(frozen=True)
class Forensics:
    """The attribution at one moment. `rows` are CATEGORIES then FRAGMENTATION; their bytes sum to reserved."""

    device: int
    source: str  # "trace" (replayed to the peak) or "segments" (the blocks at snapshot time)
    moment: str
    active_bytes: int
    reserved_bytes: int
    rows: tuple[CategoryRow, ...]
    notes: tuple[str, ...]

    def bytes_of(self, category: str) -> int:
        for row in self.rows:
            if row.category == category:
                return row.bytes
        raise ValueError(f"category {category!r} is not one of {list(CATEGORIES) + [FRAGMENTATION]}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def markdown(self) -> str:
        source = {
            "trace": "allocation history replayed to the peak of active memory",
            "segments": "the segments' blocks at the moment the snapshot was taken (no allocation history)",
        }
        lines = [
            f"**Memory forensics, device {self.device}** — source: {source[self.source]}; moment: {self.moment}.",
            "",
            f"Reserved {gib(self.reserved_bytes)} GiB = active {gib(self.active_bytes)} GiB + fragmentation "
            f"{gib(self.reserved_bytes - self.active_bytes)} GiB.",
            "",
            "| category | GiB | share of reserved | blocks | largest blocks (GiB, top frame) |",
            "|---|---:|---:|---:|---|",
        ]
        for row in self.rows:
            largest = "; ".join(
                f"{gib(b.size_bytes)} `{b.frame.replace('|', '/')}`" for b in row.largest
            )  # | would end the cell
            lines.append(f"| {row.category} | {gib(row.bytes)} | {100 * row.share:.1f}% | {row.count} | {largest} |")
        lines.append(f"| **reserved** | **{gib(self.reserved_bytes)}** | 100.0% | | |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {note}" for note in self.notes)
        return "\n".join(lines) + "\n"


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


# ---- reading a snapshot -----------------------------------------------------------------------------------


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a memory snapshot holds plain data only; refusing to load {module}.{name}")


def load_snapshot(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        snapshot = _PlainUnpickler(f).load()
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError(f"{path}: not a torch.cuda.memory._snapshot() dict (it has no 'segments')")
    return snapshot


def _segments(snapshot: dict[str, Any], device: int) -> list[dict[str, Any]]:
    return [s for s in snapshot["segments"] if s["device"] == device]


def _trace(snapshot: dict[str, Any], device: int) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces", [])
    return traces[device] if device < len(traces) else []


def pick_device(snapshot: dict[str, Any], device: int | None) -> int:
    present = {s["device"] for s in snapshot["segments"]}
    present |= {i for i, t in enumerate(snapshot.get("device_traces", [])) if t}
    if device is None and len(present) > 1 and ROLES_KEY in snapshot:
        device = snapshot[ROLES_KEY]["device"]  # the rank's own device, recorded by the instrument
    if device is not None:
        if device not in present:
            raise ValueError(
                f"device = {device} has no segments and no trace in this snapshot; devices present: {sorted(present)}"
            )
        return device
    if len(present) != 1:
        raise ValueError(
            f"the snapshot covers devices {sorted(present)}: name one (device=...)"
            if present
            else "the snapshot has no segments and no trace: nothing to attribute"
        )
    return present.pop()


def live_blocks(segments: Iterable[dict[str, Any]]) -> dict[int, Allocation]:
    """The active blocks at snapshot time, by address; checks that each segment's blocks tile it exactly."""
    live: dict[int, Allocation] = {}
    for segment in segments:
        covered = 0
        for block in segment["blocks"]:
            if block["state"] not in BLOCK_STATES:
                raise ValueError(f"block state = {block['state']!r} is not one of {sorted(BLOCK_STATES)}")
            covered += block["size"]
            if block["state"] in ACTIVE_STATES:
                live[block["address"]] = Allocation(block["address"], block["requested_size"], block["frames"], born=-1)
        if covered != segment["total_size"]:
            raise ValueError(
                f"segment at {segment['address']:#x}: its blocks cover {covered} bytes,"
                f" total_size = {segment['total_size']}"
            )
    return live


def _apply_roles(
    snapshot: dict[str, Any], device: int, live_at_snapshot: dict[int, Allocation], notes: list[str]
) -> None:
    roles = snapshot.get(ROLES_KEY)
    if roles is None:
        notes.append(
            "no tensor roles recorded: parameters, gradients and optimizer state are classified by stack "
            "frames only (a gradient stolen from its backward op's output then counts as activations)"
        )
        return
    if roles["device"] != device:
        notes.append(f"tensor roles were recorded for device {roles['device']}, not {device}: not used")
        return
    seen: dict[int, str] = {}
    missing = 0
    for role in ROLE_CATEGORIES:
        for address in roles.get(role, []):
            if address in seen:
                raise ValueError(f"address {address:#x} is recorded both as {seen[address]} and as {role}")
            seen[address] = role
            if address in live_at_snapshot:
                live_at_snapshot[address].role = role
            else:
                missing += 1
    if missing:
        notes.append(
            f"{missing} role addresses are not live blocks of the caching allocator (allocated elsewhere):"
            " not attributed by role"
        )


def _replay(
    trace: list[dict[str, Any]], end_live: dict[int, Allocation], reserved_end: int, notes: list[str]
) -> tuple[int, list[Allocation], int, int]:
    """Replay the history; returns (peak event index, allocations live there, active bytes, reserved bytes)."""
    for i, event in enumerate(trace):
        if event["action"] not in TRACE_ACTIONS:
            raise ValueError(f"trace event {i}: action = {event['action']!r} is not one of {sorted(TRACE_ACTIONS)}")

    # What was live when the history starts: an address whose first event is a free was allocated before it
    # (the ring buffer wrapped, or recording started late); a live block no event touches was there all along.
    first_touch: dict[int, str] = {}
    for event in trace:
        if event["action"] in (ALLOC, FREE_REQUESTED, FREE_COMPLETED):
            first_touch.setdefault(event["addr"], event["action"])
    live: dict[int, Allocation] = {}
    for event in trace:
        address = event.get("addr")
        if (
            event["action"] in (FREE_REQUESTED, FREE_COMPLETED)
            and first_touch[address] != ALLOC
            and address not in live
        ):
            live[address] = Allocation(address, event["size"], (), born=-1, before_history=True)
    for address, allocation in end_live.items():
        if address not in first_touch:
            live[address] = allocation
    everyone = list(live.values())
    before = sum(a.size for a in everyone if a.before_history)
    if before:
        notes.append(
            f"{gib(before)} GiB was allocated before the recorded history and freed inside it "
            f"(max_entries too small, or recording started late): counted as other"
        )

    reserved = (
        reserved_end
        - sum(e["size"] for e in trace if e["action"] in SEGMENT_GROWS)
        + sum(e["size"] for e in trace if e["action"] in SEGMENT_SHRINKS)
    )
    if reserved < 0:
        raise ValueError(
            f"the trace's segment events leave {reserved} bytes reserved when it starts: "
            f"inconsistent with the {reserved_end} bytes the snapshot's segments hold"
        )
    active = sum(a.size for a in live.values())
    peak_index, peak_active, peak_reserved = -1, active, reserved
    for i, event in enumerate(trace):
        action = event["action"]
        if action == ALLOC:
            if event["addr"] in live:
                raise ValueError(f"trace event {i}: alloc at {event['addr']:#x}, which is already live")
            allocation = Allocation(event["addr"], event["size"], event["frames"], born=i)
            live[event["addr"]] = allocation
            everyone.append(allocation)
            active += event["size"]
        elif action == FREE_REQUESTED:
            if event["addr"] not in live:
                raise ValueError(f"trace event {i}: free_requested at {event['addr']:#x}, which is not live")
        elif action == FREE_COMPLETED:
            allocation = live.pop(event["addr"], None)
            if allocation is None or allocation.size != event["size"]:
                raise ValueError(
                    f"trace event {i}: free_completed of {event['size']} bytes at {event['addr']:#x}, "
                    f"where the replay has {allocation and allocation.size} bytes live"
                )
            allocation.died = i
            active -= allocation.size
        elif action in SEGMENT_GROWS:
            reserved += event["size"]
        elif action in SEGMENT_SHRINKS:
            reserved -= event["size"]
        elif action == "oom":
            notes.append(
                f"OOM at trace event {i}: {gib(event['size'])} GiB requested, "
                f"{gib(event['device_free'])} GiB free on the device"
            )
        if active > peak_active:  # the first moment the maximum is reached
            peak_index, peak_active, peak_reserved = i, active, reserved

    ended = {a: x.size for a, x in live.items()}
    expected = {a: x.size for a, x in end_live.items()}
    if ended != expected:
        differ = sorted(set(ended.items()) ^ set(expected.items()))[:5]
        raise ValueError(
            f"the replay's live allocations disagree with the snapshot's active blocks, e.g. (address, bytes) {differ}"
        )
    for address, allocation in live.items():  # the roles were put on the blocks; the replay's objects are these
        allocation.role = end_live[address].role
    return peak_index, [a for a in everyone if a.live_at(peak_index)], peak_active, peak_reserved


def attribute(snapshot: dict[str, Any], device: int | None = None, activation_frames: Iterable[str] = ()) -> Forensics:
    """What held the device's memory at the peak; `activation_frames`: the workload's own activation functions."""
    rules = frame_rules(activation_frames)
    device = pick_device(snapshot, device)
    segments = _segments(snapshot, device)
    trace = _trace(snapshot, device)
    notes: list[str] = []
    end_live = live_blocks(segments)
    _apply_roles(snapshot, device, end_live, notes)
    reserved_end = sum(s["total_size"] for s in segments)

    moves_memory = any(e["action"] not in MARKERS for e in trace)
    if moves_memory:
        peak_index, allocations, active, reserved = _replay(trace, end_live, reserved_end, notes)
        source = "trace"
        moment = (
            "the start of the recorded history"
            if peak_index < 0
            else f"trace event {peak_index} of {len(trace)} (peak of active memory)"
        )
    else:
        allocations = list(end_live.values())
        active, reserved = sum(a.size for a in allocations), reserved_end
        source, moment = "segments", "snapshot time"
        notes.append(
            "no allocation history in the snapshot (recording was off or its buffer held no event): "
            "attributed the blocks live when the snapshot was taken, which may not be the peak"
        )
    if reserved < active:
        raise ValueError(f"{reserved} bytes reserved < {active} bytes active at {moment}: an inconsistent snapshot")

    by_category: dict[str, list[Allocation]] = {c: [] for c in CATEGORIES}
    for allocation in allocations:
        by_category[allocation.category(rules)].append(allocation)
    rows = []
    for category in CATEGORIES:
        members = sorted(by_category[category], key=lambda a: -a.size)
        size = sum(a.size for a in members)
        largest = tuple(BlockRow(a.size, a.frame(rules)) for a in members[:LARGEST_PER_CATEGORY])
        rows.append(CategoryRow(category, size, size / reserved if reserved else 0.0, len(members), largest))
    fragmentation = reserved - active
    rows.append(CategoryRow(FRAGMENTATION, fragmentation, fragmentation / reserved if reserved else 0.0, 0, ()))
    assert sum(r.bytes for r in rows) == reserved  # every reserved byte is in exactly one row
    return Forensics(device, source, moment, active, reserved, tuple(rows), tuple(notes))


def forensics_markdown(path: str | Path, device: int | None = None, activation_frames: Iterable[str] = ()) -> str:
    """The table for a report: `path` is a pickle written by MemoryInstrument (or torch's _dump_snapshot)."""
    return f"`{Path(path).name}`\n\n" + attribute(load_snapshot(path), device, activation_frames).markdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.memory.forensics",
        description="Attribute a CUDA memory snapshot's peak to what holds it.",
    )
    parser.add_argument("snapshot", help="a pickle of torch.cuda.memory._snapshot()")
    parser.add_argument("--device", type=int, default=None, help="the device to read, if the snapshot has several")
    parser.add_argument(
        "--workload", default=None, help="the workload that wrote it: its own activation frames are read as such"
    )
    args = parser.parse_args(argv)
    frames: frozenset[str] = frozenset()
    if args.workload is not None:
        from prereg.registry import get_workload

        frames = get_workload(args.workload).activation_frames
    sys.stdout.write(forensics_markdown(args.snapshot, args.device, frames))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
