"""The memory_snapshot instrument and its forensics.

CI has no GPU, so the snapshots here are written by `FakeAllocator` in exactly the format of
torch.cuda.memory._snapshot() (torch/cuda/memory.py's docstring; the field names the C++ writes, e.g. the
"active_pending_free" block state): segments of blocks that tile them, and a device trace of alloc /
free_requested / free_completed / segment_alloc / oom events whose sizes are the requested sizes, with stack
frames innermost first, C++ frames interleaved with Python ones as stacks="all" records them. The GPU test
records a real history around a real training step and reads it with the same code.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from engine.memory import forensics as mf
from engine.memory.snapshot import MemoryInstrument

MIB = 1024**2


def cpp(name: str) -> dict:
    return {"filename": "??", "line": 0, "name": name}


def py(path: str, name: str, line: int = 10) -> dict:
    """A Python frame: torch's own files under site-packages, the project's under its checkout."""
    root = "/venv/lib/python3.11/site-packages" if path.startswith("torch/") else "/work/main"
    return {"filename": f"{root}/{path}", "line": line, "name": name}


MALLOC = cpp(
    "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)"
)
EMPTY = cpp("at::native::empty_cuda(c10::ArrayRef<long>, std::optional<c10::ScalarType>, ...)")

STACKS = {
    mf.PARAMETERS: [
        MALLOC,
        EMPTY,
        py("torch/nn/modules/module.py", "<lambda>"),
        py("torch/nn/modules/module.py", "_apply"),
        py("torch/nn/modules/module.py", "to_empty"),
        py("engine/molmo2/runner.py", "load"),
    ],
    mf.GRADIENTS: [
        MALLOC,
        EMPTY,
        cpp("torch::autograd::AccumulateGrad::apply(std::vector<at::Tensor>&&)"),
        cpp("torch::autograd::Engine::evaluate_function(...)"),
        cpp("torch::autograd::Engine::thread_main(...)"),
    ],
    mf.OPTIMIZER_STATE: [
        MALLOC,
        EMPTY,
        cpp("at::zeros_like(...)"),
        py("torch/optim/adamw.py", "_init_group"),
        py("torch/optim/adamw.py", "step"),
        py("engine/molmo2/train/step.py", "step"),
    ],
    mf.REDUCER_BUCKETS: [
        MALLOC,
        EMPTY,
        cpp("c10d::Reducer::initialize_buckets(std::vector<c10d::Reducer::Bucket>...)"),
        cpp("c10d::Reducer::Reducer(...)"),
        py("torch/nn/parallel/distributed.py", "_ddp_init_helper"),
        py("torch/nn/parallel/distributed.py", "__init__"),
    ],
    # a cast inside a module's forward, inside the training step: the cast decides
    mf.AUTOCAST_COPIES: [
        MALLOC,
        EMPTY,
        cpp("at::_ops::_to_copy::call(...)"),
        cpp("at::autocast::cached_cast(c10::ScalarType, at::Tensor const&, c10::DeviceType)"),
        py("torch/nn/modules/linear.py", "forward"),
        py("engine/molmo2/train/step.py", "accumulate_gradients"),
    ],
    mf.ACTIVATIONS: [
        MALLOC,
        EMPTY,
        py("engine/molmo2/model/model.py", "rms_norm"),
        py("engine/molmo2/model/model.py", "forward"),
        py("torch/nn/modules/module.py", "_call_impl"),
        py("engine/molmo2/train/step.py", "accumulate_gradients"),
    ],
    mf.OTHER: [
        MALLOC,
        EMPTY,
        py("torch/nn/utils/clip_grad.py", "_get_total_norm"),
        py("engine/molmo2/train/step.py", "step"),
    ],
}
# What the autograd thread allocates for a weight's gradient before AccumulateGrad steals it: only the address
# (the instrument's tensor roles) can call it a gradient.
STOLEN_GRAD = [
    MALLOC,
    EMPTY,
    cpp("at::mm(...)"),
    cpp("torch::autograd::generated::MmBackward0::apply(...)"),
    cpp("torch::autograd::Engine::evaluate_function(...)"),
]
FREE_STACK = [
    cpp("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::free(...)"),
    py("torch/optim/adamw.py", "_init_group"),
]  # context="all": a free carries the FREEING stack


class FakeAllocator:
    """A scripted program on one device, written out as torch.cuda.memory._snapshot() would: block sizes are
    the requests rounded up to 512 bytes (the caching allocator's rounding), trace sizes the requests."""

    def __init__(self, device: int = 0):
        self.device = device
        self.events: list[dict] = []
        self.segment_sizes: dict[int, int] = {}
        self.live: dict[int, tuple[int, list[dict]]] = {}

    def _event(self, action: str, addr: int, size: int, frames: list[dict]) -> None:
        self.events.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": len(self.events),
                "compile_context": "N/A",
                "user_metadata": "",
                "frames": frames,
            }
        )

    def segment(self, addr: int, size: int) -> None:
        self.segment_sizes[addr] = size
        self._event("segment_alloc", addr, size, [MALLOC])

    def alloc(self, addr: int, size: int, frames: list[dict]) -> None:
        self._event("alloc", addr, size, frames)
        self.live[addr] = (size, frames)

    def free(self, addr: int) -> None:
        size, _ = self.live.pop(addr)
        self._event("free_requested", addr, size, FREE_STACK)
        self._event("free_completed", addr, size, FREE_STACK)

    def marker(self) -> None:
        """What a _snapshot() call leaves in the history: an event that moves no memory and has no frames."""
        self.events.append(
            {
                "action": "snapshot",
                "addr": 0,
                "size": 0,
                "stream": 0,
                "time_us": len(self.events),
                "compile_context": "N/A",
                "user_metadata": "",
            }
        )

    def oom(self, size: int, device_free: int) -> None:
        self.events.append(
            {
                "action": "oom",
                "size": size,
                "device_free": device_free,
                "stream": 0,
                "time_us": len(self.events),
                "frames": STACKS[mf.ACTIVATIONS],
            }
        )

    def blocks(self, seg_addr: int, seg_size: int) -> list[dict]:
        blocks, cursor = [], seg_addr
        for addr in sorted(a for a in self.live if seg_addr <= a < seg_addr + seg_size):
            if addr > cursor:
                blocks.append(
                    {"address": cursor, "size": addr - cursor, "requested_size": 0, "state": "inactive", "frames": []}
                )
            requested_size, frames = self.live[addr]
            rounded = -(-requested_size // 512) * 512
            blocks.append(
                {
                    "address": addr,
                    "size": rounded,
                    "requested_size": requested_size,
                    "state": "active_allocated",
                    "frames": frames,
                }
            )
            cursor = addr + rounded
        if cursor < seg_addr + seg_size:
            blocks.append(
                {
                    "address": cursor,
                    "size": seg_addr + seg_size - cursor,
                    "requested_size": 0,
                    "state": "inactive",
                    "frames": [],
                }
            )
        return blocks

    def snapshot(self, history: bool = True, roles: dict | None = None) -> dict:
        segments = []
        for addr, size in sorted(self.segment_sizes.items()):
            blocks = self.blocks(addr, size)
            active = [b for b in blocks if b["state"] != "inactive"]
            segments.append(
                {
                    "device": self.device,
                    "address": addr,
                    "total_size": size,
                    "stream": 0,
                    "segment_type": "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [MALLOC],
                    "allocated_size": sum(b["size"] for b in active),
                    "active_size": sum(b["size"] for b in active),
                    "requested_size": sum(b["requested_size"] for b in active),
                    "blocks": blocks,
                }
            )
        traces: list[list[dict]] = [[] for _ in range(self.device + 1)]
        if history:
            traces[self.device] = list(self.events)
        snapshot = {"segments": segments, "device_traces": traces, "allocator_settings": {}, "external_annotations": []}
        if roles is not None:
            snapshot[mf.ROLES_KEY] = {"device": self.device, **roles}
        return snapshot


SEG = 0x7F0000000000  # a segment base; every address below is SEG + a multiple of 1 MiB


def at(mib: int) -> int:
    return SEG + mib * MIB


# ---- frames ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("category", mf.CATEGORIES)
def test_each_category_is_recognised_from_its_stack(category):
    assert mf.classify_frames(STACKS[category]) == category


def test_the_innermost_recognised_frame_decides():
    # an Adam state tensor created inside a module's forward (nonsense, but it pins the order): optimizer state
    assert mf.classify_frames(STACKS[mf.OPTIMIZER_STATE][:4] + STACKS[mf.ACTIVATIONS][2:]) == mf.OPTIMIZER_STATE
    # the same frames the other way round: the forward is innermost now
    assert mf.classify_frames(STACKS[mf.ACTIVATIONS][:4] + STACKS[mf.OPTIMIZER_STATE][3:]) == mf.ACTIVATIONS
    assert mf.classify_frames(STOLEN_GRAD) == mf.ACTIVATIONS  # what a stack alone says about a stolen gradient
    assert mf.classify_frames([]) == mf.OTHER


# The fp32 copy of the logits a training step makes outside any module's forward: only the workload knows that
# its own function holds activations there.
LOGITS_CAST = [
    MALLOC,
    EMPTY,
    cpp("at::_ops::_to_copy::call(...)"),
    py("engine/molmo2/train/step.py", "accumulate_gradients"),
    py("engine/molmo2/train/step.py", "step"),
]


def test_a_workloads_activation_frames_are_added_to_the_generic_rules():
    assert mf.classify_frames(LOGITS_CAST) == mf.OTHER  # the generic rules know torch, DDP and autocast only
    rules = mf.frame_rules({"accumulate_gradients"})
    assert mf.classify_frames(LOGITS_CAST, rules) == mf.ACTIVATIONS
    assert mf.top_frame(LOGITS_CAST, rules) == "step.py:10 accumulate_gradients"
    # added, never overriding: a cast inside that function is still a cast, Adam's state still optimizer state
    assert mf.classify_frames(STACKS[mf.AUTOCAST_COPIES], rules) == mf.AUTOCAST_COPIES
    assert mf.classify_frames(STACKS[mf.OPTIMIZER_STATE], rules) == mf.OPTIMIZER_STATE


def test_a_snapshot_is_read_with_the_workloads_activation_frames(tmp_path, capsys):
    fake = FakeAllocator()
    fake.segment(SEG, 64 * MIB)
    fake.alloc(at(0), 8 * MIB, LOGITS_CAST)
    snapshot = fake.snapshot()
    assert mf.attribute(snapshot).bytes_of(mf.OTHER) == 8 * MIB
    read = mf.attribute(snapshot, activation_frames={"accumulate_gradients"})
    assert read.bytes_of(mf.ACTIVATIONS) == 8 * MIB and read.bytes_of(mf.OTHER) == 0
    path = tmp_path / "rank0-first-window.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    assert mf.main([str(path), "--workload", "molmo2"]) == 0  # the workload that wrote it names its frames
    assert "| activations | 0.01 | 12.5% | 1 | 0.01 `step.py:10 accumulate_gradients` |" in capsys.readouterr().out


def test_every_activation_frame_molmo2_declares_is_a_function_of_its_code():
    """A renamed function would silently move its allocations to "other": the names must exist."""
    import ast

    from prereg.registry import get_workload

    root = Path(__file__).resolve().parent.parent / "engine" / "molmo2"
    defined = {
        node.name
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    frames = get_workload("molmo2").activation_frames
    assert frames and frames <= defined, sorted(frames - defined)


def test_top_frame_names_the_deciding_library_frame_then_the_projects_own_code():
    assert mf.top_frame(STACKS[mf.OPTIMIZER_STATE]) == "adamw.py:10 _init_group <- step.py:10 step"
    assert mf.top_frame(STACKS[mf.AUTOCAST_COPIES]) == "at::autocast::cached_cast <- step.py:10 accumulate_gradients"
    assert mf.top_frame(STACKS[mf.ACTIVATIONS]) == "model.py:10 rms_norm"  # the project decided: its innermost frame
    assert mf.top_frame(STACKS[mf.OTHER]) == "clip_grad.py:10 _get_total_norm <- step.py:10 step"
    assert mf.top_frame(STOLEN_GRAD) == "torch::autograd::generated::MmBackward0::apply"  # the node, not the engine
    assert mf.top_frame([MALLOC]) == "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc"
    assert mf.top_frame([]) == "<no stack recorded>"
    assert (
        mf.native_name("torch::cuda::(anonymous namespace)::gather_with_cpp()")
        == "torch::cuda::(anonymous namespace)::gather_with_cpp"
    )


# ---- attribution at snapshot time (no history) -----------------------------------------------------------


def one_block_per_category() -> tuple[FakeAllocator, dict[str, int]]:
    """Each category one allocation of a distinct size; sizes not multiples of 512, so rounding shows."""
    fake = FakeAllocator()
    fake.segment(SEG, 256 * MIB)
    sizes = {}
    for k, category in enumerate(mf.CATEGORIES):
        sizes[category] = (k + 1) * 3 * MIB + 100 * (k + 1)
        fake.alloc(at(32 * k), sizes[category], STACKS[category])
    return fake, sizes


def test_segments_attribution_sums_exactly_and_fragmentation_is_reserved_minus_requested():
    fake, sizes = one_block_per_category()
    result = mf.attribute(fake.snapshot(history=False))
    assert result.source == "segments" and result.moment == "snapshot time"
    for category, size in sizes.items():
        assert result.bytes_of(category) == size
    active = sum(sizes.values())
    assert result.active_bytes == active and result.reserved_bytes == 256 * MIB
    assert result.bytes_of(mf.FRAGMENTATION) == 256 * MIB - active  # includes the 512-byte rounding
    assert sum(row.bytes for row in result.rows) == result.reserved_bytes
    assert [row.category for row in result.rows] == [*mf.CATEGORIES, mf.FRAGMENTATION]
    assert any("no allocation history" in note for note in result.notes)


def test_pending_free_blocks_still_hold_memory():
    fake, sizes = one_block_per_category()
    snapshot = fake.snapshot(history=False)
    for block in snapshot["segments"][0]["blocks"]:
        if block["state"] == "active_allocated" and block["frames"] is STACKS[mf.OTHER]:
            block["state"] = "active_pending_free"
    assert mf.attribute(snapshot).bytes_of(mf.OTHER) == sizes[mf.OTHER]


def test_malformed_snapshots_are_refused():
    fake, _ = one_block_per_category()
    snapshot = fake.snapshot(history=False)
    snapshot["segments"][0]["blocks"][0]["state"] = "active_awaiting_free"
    with pytest.raises(ValueError, match="active_awaiting_free"):
        mf.attribute(snapshot)
    snapshot = fake.snapshot(history=False)
    snapshot["segments"][0]["total_size"] += 512  # blocks no longer tile the segment
    with pytest.raises(ValueError, match="cover"):
        mf.attribute(snapshot)


# ---- the history replayed to the peak --------------------------------------------------------------------


def peak_then_reuse() -> FakeAllocator:
    """Parameters 8 MiB, two activations 16 + 8 MiB: the peak (32 MiB). Then the activations are freed and a
    20 MiB optimizer-state allocation reuses their memory: live at the end (28 MiB), never at the peak."""
    fake = FakeAllocator()
    fake.segment(SEG, 64 * MIB)
    fake.alloc(at(0), 8 * MIB, STACKS[mf.PARAMETERS])
    fake.alloc(at(8), 16 * MIB, STACKS[mf.ACTIVATIONS])
    fake.alloc(at(24), 8 * MIB, STACKS[mf.AUTOCAST_COPIES])
    fake.marker()
    fake.free(at(24))
    fake.free(at(8))
    fake.alloc(at(8), 20 * MIB, STACKS[mf.OPTIMIZER_STATE])
    return fake


def test_replay_attributes_the_peak_and_not_what_was_allocated_after_it():
    fake = peak_then_reuse()
    result = mf.attribute(fake.snapshot())
    assert result.source == "trace"
    assert result.moment == f"trace event 3 of {len(fake.events)} (peak of active memory)"
    assert result.active_bytes == 32 * MIB and result.reserved_bytes == 64 * MIB
    assert result.bytes_of(mf.PARAMETERS) == 8 * MIB
    assert result.bytes_of(mf.ACTIVATIONS) == 16 * MIB
    assert result.bytes_of(mf.AUTOCAST_COPIES) == 8 * MIB
    assert result.bytes_of(mf.OPTIMIZER_STATE) == 0  # allocated after a free, below the peak
    assert result.bytes_of(mf.FRAGMENTATION) == 32 * MIB
    # the same program read at snapshot time sees the end state instead
    end = mf.attribute(fake.snapshot(history=False))
    assert end.bytes_of(mf.OPTIMIZER_STATE) == 20 * MIB and end.bytes_of(mf.ACTIVATIONS) == 0


def test_reserved_at_the_peak_follows_the_segment_events():
    fake = FakeAllocator()
    fake.segment(SEG, 16 * MIB)
    fake.alloc(at(0), 16 * MIB, STACKS[mf.PARAMETERS])  # the peak: 16 of 16 reserved
    fake.segment(at(64), 32 * MIB)  # a later segment: not reserved at the peak
    fake.free(at(0))
    fake.alloc(at(64), 10 * MIB, STACKS[mf.OTHER])
    result = mf.attribute(fake.snapshot())
    assert (result.active_bytes, result.reserved_bytes) == (16 * MIB, 16 * MIB)
    assert result.bytes_of(mf.FRAGMENTATION) == 0


def test_the_replay_is_checked_against_the_segments():
    snapshot = peak_then_reuse().snapshot()
    last = snapshot["device_traces"][0].pop()  # the final alloc, still live in the segments: the replay disagrees
    assert last["action"] == "alloc"
    with pytest.raises(ValueError, match="disagree"):
        mf.attribute(snapshot)


def test_allocations_from_before_a_wrapped_history():
    """The ring buffer dropped the first events: a live block no event touches keeps the stack it was allocated
    with; a block freed inside the window was allocated before it (other, and a note says so)."""
    fake = peak_then_reuse()
    snapshot = fake.snapshot()
    snapshot["device_traces"][0] = fake.events[2:]  # the segment and the parameters' alloc are gone
    result = mf.attribute(snapshot)
    assert result.bytes_of(mf.PARAMETERS) == 8 * MIB  # from the live block's own frames
    assert (result.active_bytes, result.reserved_bytes) == (32 * MIB, 64 * MIB)
    assert result.bytes_of(mf.ACTIVATIONS) == 16 * MIB
    assert not any("before the recorded history" in note for note in result.notes)

    snapshot["device_traces"][0] = fake.events[4:]  # the activations' allocs too: only their frees remain
    result = mf.attribute(snapshot)
    assert result.moment == "the start of the recorded history"
    assert result.bytes_of(mf.OTHER) == 24 * MIB and result.bytes_of(mf.ACTIVATIONS) == 0
    assert result.bytes_of(mf.PARAMETERS) == 8 * MIB and result.active_bytes == 32 * MIB
    assert any("0.02 GiB was allocated before the recorded history" in note for note in result.notes)
    assert result.rows[-2].largest[0].frame == "<allocated before the recorded history>"


def test_oom_is_noted_and_the_peak_is_the_moment_before_it():
    fake = FakeAllocator()
    fake.segment(SEG, 64 * MIB)
    fake.alloc(at(0), 40 * MIB, STACKS[mf.PARAMETERS])
    fake.alloc(at(40), 20 * MIB, STACKS[mf.ACTIVATIONS])
    fake.oom(2 * 1024 * MIB, 100 * MIB)
    fake.free(at(40))  # the exception unwinds the forward
    result = mf.attribute(fake.snapshot())
    assert result.active_bytes == 60 * MIB and result.bytes_of(mf.ACTIVATIONS) == 20 * MIB
    assert "OOM at trace event 3: 2.00 GiB requested, 0.10 GiB free on the device" in result.notes


def test_tensor_roles_name_a_stolen_gradient():
    fake = FakeAllocator()
    fake.segment(SEG, 32 * MIB)
    fake.alloc(at(0), 8 * MIB, STACKS[mf.PARAMETERS])
    fake.alloc(at(8), 8 * MIB, STOLEN_GRAD)
    fake.alloc(at(16), 4 * MIB, STACKS[mf.ACTIVATIONS])
    fake.free(at(16))
    without = mf.attribute(fake.snapshot())
    assert without.bytes_of(mf.GRADIENTS) == 0 and without.bytes_of(mf.ACTIVATIONS) == 12 * MIB
    assert any("no tensor roles" in note for note in without.notes)
    roles = {"parameters": [at(0)], "gradients": [at(8)], "optimizer_state": [at(30)]}  # at(30): not a live block
    result = mf.attribute(fake.snapshot(roles=roles))
    assert result.bytes_of(mf.GRADIENTS) == 8 * MIB
    assert result.bytes_of(mf.ACTIVATIONS) == 4 * MIB  # the freed activation was live at the peak, role-less
    assert any("1 role addresses" in note for note in result.notes)
    with pytest.raises(ValueError, match="both as parameters and as gradients"):
        mf.attribute(fake.snapshot(roles={"parameters": [at(0)], "gradients": [at(0)]}))


def test_a_snapshot_of_several_devices_needs_one_named():
    fake, _ = one_block_per_category()
    snapshot = fake.snapshot(history=False)
    other = FakeAllocator(device=1)
    other.segment(SEG, 4 * MIB)
    snapshot["segments"] += other.snapshot(history=False)["segments"]
    with pytest.raises(ValueError, match=r"devices \[0, 1\]"):
        mf.attribute(snapshot)
    assert mf.attribute(snapshot, device=1).reserved_bytes == 4 * MIB
    snapshot[mf.ROLES_KEY] = {"device": 1, "parameters": [], "gradients": [], "optimizer_state": []}
    assert mf.attribute(snapshot).device == 1  # the instrument's own device, when it recorded one


# ---- the table and the entry point -----------------------------------------------------------------------


def test_markdown_table_and_module_entry_point(tmp_path, capsys):
    path = tmp_path / "rank0-oom.pickle"
    path.write_bytes(pickle.dumps(peak_then_reuse().snapshot()))
    assert mf.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "allocation history replayed to the peak" in out
    assert "| parameters | 0.01 | 12.5% | 1 | 0.01 `module.py:10 _apply <- runner.py:10 load` |" in out
    assert "| fragmentation | 0.03 | 50.0% | 0 |  |" in out
    assert out.startswith("`rank0-oom.pickle`")
    data = mf.attribute(mf.load_snapshot(path)).to_dict()
    assert data["source"] == "trace" and data["rows"][0]["bytes"] == 8 * MIB


def test_a_pickle_with_objects_is_not_loaded(tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": Path("/")}))
    with pytest.raises(pickle.UnpicklingError, match="plain data only"):
        mf.load_snapshot(path)


# ---- the instrument --------------------------------------------------------------------------------------


def test_the_instrument_refuses_a_cpu_device(tmp_path):
    with pytest.raises(ValueError, match=r"memory_snapshot = true needs a CUDA device .* device is 'cpu'"):
        MemoryInstrument(torch.device("cpu"), tmp_path)
    with pytest.raises(ValueError, match="memory_snapshot = true needs a CUDA device"):
        MemoryInstrument.from_config(True, torch.device("cpu"), tmp_path)
    assert MemoryInstrument.from_config(False, torch.device("cpu"), tmp_path) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_history_of_a_real_training_step(tmp_path, monkeypatch):
    """The production path on the tiny geometry: history from before the model exists, two training steps
    (fp32 masters, bf16 autocast, fused AdamW), a dump, the forensics; then a real OOM inside dump_on_oom."""
    from engine.molmo2.run_config import resolve
    from engine.molmo2.runner import Molmo2Runner
    from prereg.workload import Profile

    monkeypatch.setenv("RANK", "3")
    instrument = MemoryInstrument(torch.device("cuda"), tmp_path).start()
    try:
        profile = Profile("cuda-tiny", "cuda", 1, "tiny", "test")
        # Padded and eager: the allocations this test names (autocast's copies of each chunk) are those of that path.
        config = resolve(profile, {"batch": 4, "backward_chunks": 2, "pack": False, "compile": False})
        runner = Molmo2Runner(profile, config, seed=0)
        runner.load()
        runner.train_window(2, lambda: False)
        path = instrument.dump_once("first-step", runner.model, runner.trainer.optimizer)
        assert path == tmp_path / "rank3-first-step.pickle"
        assert instrument.dump_once("first-step") is None
        snapshot = mf.load_snapshot(path)
        result = mf.attribute(snapshot)  # raises if the replay disagrees with the segments
        assert result.source == "trace"
        trainable = sum(p.numel() * 4 for p in runner.model.parameters() if p.requires_grad)
        assert result.bytes_of(mf.PARAMETERS) >= sum(p.numel() * 4 for p in runner.model.parameters())
        assert result.bytes_of(mf.GRADIENTS) > 0
        # most gradients are stolen backward outputs (ToCopyBackward0 under autocast): only their roles say so
        del snapshot[mf.ROLES_KEY]
        assert mf.attribute(snapshot).bytes_of(mf.GRADIENTS) < result.bytes_of(mf.GRADIENTS)
        assert result.bytes_of(mf.OPTIMIZER_STATE) >= 2 * trainable  # exp_avg and exp_avg_sq
        assert result.bytes_of(mf.ACTIVATIONS) > 0 and result.bytes_of(mf.AUTOCAST_COPIES) > 0
        print(result.markdown())

        with pytest.raises(torch.OutOfMemoryError):
            with instrument.dump_on_oom(lambda: (runner.model, runner.trainer.optimizer)):
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        oom = mf.attribute(mf.load_snapshot(tmp_path / "rank3-oom.pickle"))
        assert any(note.startswith("OOM at trace event") for note in oom.notes)
    finally:
        instrument.stop()


def test_a_report_embeds_the_forensics_of_every_recorded_snapshot(tmp_path):
    from engine.report.report import memory_lines
    from prereg.state import RungRun

    path = tmp_path / "rank0-first-window.pickle"
    path.write_bytes(pickle.dumps(peak_then_reuse().snapshot()))
    runs = [
        RungRun(
            "r1", "rung7", (), 0, "finished", False, 1, memory_snapshots=(str(path), str(tmp_path / "gone.pickle"))
        ),
        RungRun("r2", "rung8", (), 0, "finished", False, 2),
    ]
    lines = "\n".join(memory_lines(type("State", (), {"runs": runs})()))
    assert lines.startswith("## Memory forensics")
    assert "### rung rung7 (run r1)" in lines and "rung8" not in lines
    assert "| parameters | 0.01 | 12.5% |" in lines  # the table itself, read from the pickle
    assert f"`{tmp_path / 'gone.pickle'}`: not on this machine" in lines
    assert memory_lines(type("State", (), {"runs": runs[1:]})()) == []
    # The report reads each snapshot with the activation frames of the workload that wrote it.
    fake = FakeAllocator()
    fake.segment(SEG, 64 * MIB)
    fake.alloc(at(0), 8 * MIB, LOGITS_CAST)
    cast = tmp_path / "rank0-cast.pickle"
    cast.write_bytes(pickle.dumps(fake.snapshot()))
    state = type(
        "State", (), {"runs": [RungRun("r3", "A", (), 0, "finished", False, 3, memory_snapshots=(str(cast),))]}
    )
    assert "| activations | 0.00 |" in "\n".join(memory_lines(state()))
    assert "| activations | 0.01 | 12.5% |" in "\n".join(memory_lines(state(), frozenset({"accumulate_gradients"})))
