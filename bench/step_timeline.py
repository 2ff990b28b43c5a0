"""Where one arm's training step spends its wall time on the device: per stream busy time, what overlaps, what
idles, and the main stream's gaps, from a torch.profiler trace of steps timed as bench/peer_molmo2.py times them.

A kernel table (bench/peer_molmo2.py --profile-arm) sums device-seconds; it cannot say which of them the step waits
on. This reads the trace's kernel intervals per stream inside each step's host window (a step is the drain before it
to the drain after it, so its wall time is the benchmark's): the union of every stream's kernels is the device's busy
time, the rest of the window is idle; a second stream's kernels that run while the main stream also runs are
overlap (X7's update under the vision tower); and each stretch of the window the main stream (the one with the
most kernel time) leaves empty is a gap, named by the kernels on either side of it. Each main-stream kernel is also
charged to the host op that launched it (the trace's "External id"; with --record-shapes, that op's input shapes),
which names the eager ops behind an unnamed elementwise kernel.

    python bench/step_timeline.py --profile h200-4b --arm packed-varlen-cudnn-one-pass-x2-x7 --out "$OUT"

Writes step_timeline_<profile>_<arm>.json under --out (conditions, per step and mean figures, the largest gaps, the
kernels by launching op), and prints the table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# What each device kernel is, by its name: the first pattern that matches. Copies and memsets are their own kind
# in the trace (gpu_memcpy, gpu_memset).
KINDS = (
    ("gemm", re.compile(r"nvjet|gemm|xmma|cublas|cutlass.*_mm", re.I)),
    ("attention", re.compile(r"fmha|flash|sdpa|attention|cudnn", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|adam", re.I)),
    ("triton", re.compile(r"^triton_")),
    ("aten", re.compile(r"at::native|elementwise|reduce_kernel|index|scatter|gather|copy", re.I)),
)
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
STEP_NAME = re.compile(r"^step (\d+)$")


def kind_of(event: dict[str, Any]) -> str:
    if event["cat"] != "kernel":
        return "memcpy" if event["cat"] == "gpu_memcpy" else "memset"
    return next((kind for kind, pattern in KINDS if pattern.search(event["name"])), "other")


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (µs in, ms out)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1e3


def analyse(events: list[dict[str, Any]], gap_floor_us: float = 20.0, top: int = 12) -> dict[str, Any]:
    """Steps (host annotations "step N"), each clipped to its window: wall, per-stream busy and kernel kinds, the
    device's busy and idle time, overlap, and the main stream's gaps of at least `gap_floor_us`."""
    steps = sorted(
        (int(m.group(1)), e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and (m := STEP_NAME.match(e.get("name", "")))
    )
    if not steps:
        raise ValueError("the trace holds no 'step N' annotation: profile steps under record_function('step N')")
    device = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("dur", 0) > 0), key=lambda e: e["ts"]
    )
    # a kernel's "External id" is the one of the host op that launched it: an eager kernel's aten op (with its input
    # shapes where the profile recorded them), a compiled graph's kernel its own Triton or extern call
    launchers = {
        e["args"]["External id"]: e for e in events if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }
    origin_totals: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])
    per_stream_total: dict[int, float] = defaultdict(float)
    for e in device:
        per_stream_total[e["args"]["stream"]] += e["dur"]
    main = max(per_stream_total, key=per_stream_total.get) if per_stream_total else None
    rows, gap_totals = [], defaultdict(lambda: [0.0, 0])
    kernel_totals: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for index, start, end in steps:
        inside = []
        for e in device:
            s, t = max(e["ts"], start), min(e["ts"] + e["dur"], end)
            if t > s:
                inside.append((s, t, e))
        streams: dict[int, dict[str, Any]] = {}
        for s, t, e in inside:
            stream = streams.setdefault(e["args"]["stream"], {"intervals": [], "kinds": defaultdict(float)})
            stream["intervals"].append((s, t))
            stream["kinds"][kind_of(e)] += (t - s) / 1e3
            kernel = kernel_totals[e["args"]["stream"]][e["name"]]
            kernel[0] += (t - s) / 1e3
            kernel[1] += 1
            if e["args"]["stream"] == main:
                origin = origin_totals[(e["name"], launched_by(launchers.get(e["args"].get("External id"))))]
                origin[0] += (t - s) / 1e3
                origin[1] += 1
        busy = union_ms([iv for st in streams.values() for iv in st["intervals"]])
        per_stream = {
            str(sid): {"busy_ms": union_ms(st["intervals"]), "kinds_ms": dict(sorted(st["kinds"].items())),
                       "kernels": len(st["intervals"])}
            for sid, st in sorted(streams.items())
        }  # fmt: skip
        gaps = []
        if main in streams:
            ordered = sorted((s, t, e) for s, t, e in inside if e["args"]["stream"] == main)
            cursor, before = start, "(step start)"
            for s, t, e in ordered + [(end, end, {"name": "(step end)"})]:
                if s - cursor >= gap_floor_us:
                    gaps.append({"at_ms": (cursor - start) / 1e3, "ms": (s - cursor) / 1e3, "after": before,
                                 "before": e["name"]})  # fmt: skip
                if t > cursor:
                    cursor, before = t, e["name"]
        for gap in gaps:
            key = (shorten(gap["after"]), shorten(gap["before"]))
            gap_totals[key][0] += gap["ms"]
            gap_totals[key][1] += 1
        wall = (end - start) / 1e3
        rows.append({
            "step": index, "wall_ms": wall, "device_busy_ms": busy, "device_idle_ms": wall - busy,
            "overlap_ms": sum(s["busy_ms"] for s in per_stream.values()) - busy,
            "main_stream_gaps_ms": sum(g["ms"] for g in gaps), "main_stream_gaps": len(gaps),
            "streams": per_stream, "largest_gaps": sorted(gaps, key=lambda g: -g["ms"])[:top],
        })  # fmt: skip
    n = len(rows)
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        for sid, stream in row["streams"].items():
            for kind, ms in stream["kinds_ms"].items():
                kinds[sid][kind] += ms / n
    figures = ("wall_ms", "device_busy_ms", "device_idle_ms", "overlap_ms", "main_stream_gaps_ms")
    mean = {key: statistics.fmean(r[key] for r in rows) for key in figures}
    gap_pairs = sorted(gap_totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "main_stream": main,
        "steps": n,
        "mean": mean,
        "mean_kinds_ms": {sid: dict(sorted(k.items())) for sid, k in sorted(kinds.items())},
        # each stream's kernels by name, the most time first: which fusion or GEMM a kind's milliseconds are
        "top_kernels": {
            str(sid): [
                {
                    "name": name,
                    "kind": kind_of({"name": name, "cat": "kernel"}),
                    "ms_per_step": ms / n,
                    "per_step": count / n,
                }
                for name, (ms, count) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
            ]
            for sid, names in sorted(kernel_totals.items())
        },  # fmt: skip
        # the main stream's kernels by the host op that launched them, the most time first
        "top_origins": [
            {"kernel": name, "launched_by": op, "ms_per_step": ms / n, "per_step": count / n}
            for (name, op), (ms, count) in sorted(origin_totals.items(), key=lambda kv: -kv[1][0])[:top]
        ],
        "gaps_by_neighbours": [
            {"after": a, "before": b, "ms_per_step": total / n, "per_step": count / n}
            for (a, b), (total, count) in gap_pairs
        ],
        "per_step": rows,
    }


def launched_by(op: dict[str, Any] | None) -> str:
    """The launching host op's name, with its input shapes where recorded; "(unknown)" where the trace has none."""
    if op is None:
        return "(unknown)"
    dims = op.get("args", {}).get("Input Dims")
    shapes = [d for d in dims if d] if dims else []
    return f"{op['name']} {shapes}" if shapes else op["name"]


PRINTED = 12  # rows of each printed list; the JSON keeps --top


def shorten(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def print_table(result: dict[str, Any]) -> None:
    m = result["mean"]
    print(f"\n{result['steps']} steps; ms per step (mean): wall {m['wall_ms']:.1f}, "
          f"device busy {m['device_busy_ms']:.1f}, device idle {m['device_idle_ms']:.1f}, "
          f"overlap {m['overlap_ms']:.1f}; main stream {result['main_stream']}: gaps "
          f"{m['main_stream_gaps_ms']:.1f}")  # fmt: skip
    for sid, kinds in result["mean_kinds_ms"].items():
        listed = ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        print(f"  stream {sid}: {sum(kinds.values()):.1f} ms of kernels — {listed}")
    print("  the main stream's largest kernels (ms per step, calls per step):")
    for kernel in result["top_kernels"].get(str(result["main_stream"]), [])[:PRINTED]:
        print(
            f"    {kernel['ms_per_step']:6.2f} {kernel['per_step']:6.1f}  {kernel['kind']:9} {shorten(kernel['name'])}"
        )
    print("  the main stream's kernels by the host op that launched them (ms per step, calls per step):")
    for origin in result["top_origins"][:PRINTED]:
        print(f"    {origin['ms_per_step']:6.2f} {origin['per_step']:6.1f}  {shorten(origin['kernel'], 50)}  <-  "
              f"{shorten(origin['launched_by'], 90)}")  # fmt: skip
    print("  the main stream's gaps, by the kernels either side (ms per step, gaps per step):")
    for gap in result["gaps_by_neighbours"][:PRINTED]:
        print(f"    {gap['ms_per_step']:6.2f} {gap['per_step']:6.1f}  after {gap['after']}  before {gap['before']}")


def main() -> None:
    import torch
    from peer_molmo2 import BASE, OURS, arm_config, drain, landed_only, release
    from torch.profiler import ProfilerActivity, profile, record_function

    from engine.molmo2.declaration import PROFILES
    from engine.molmo2.runner import Molmo2Runner

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--arm", default="packed-varlen-cudnn-one-pass-x2-x7", choices=sorted(OURS))
    parser.add_argument("--batch", type=int, default=BASE["batch"])
    parser.add_argument("--warmup", type=int, default=8, help="steps before the profiled ones (compilation lands here)")
    parser.add_argument("--steps", type=int, default=4, help="profiled steps (4 = one pass of the pool)")
    parser.add_argument("--gap-floor-us", type=float, default=20.0, help="the shortest main-stream gap listed")
    parser.add_argument("--top", type=int, default=40, help="kernels per stream and gap pairs kept in the JSON")
    parser.add_argument("--record-shapes", action="store_true", help="record each host op's input shapes")
    parser.add_argument("--keep-trace", action="store_true", help="also write the trace, gzipped, under --out")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    profile_ = PROFILES[args.profile]
    device = torch.device("cuda" if profile_.device == "cuda" else "cpu")
    extra, switches = OURS[args.arm]
    started = time.perf_counter()
    runner = Molmo2Runner(profile_, arm_config(profile_, BASE | {"batch": args.batch} | extra), seed=0)
    runner.load()
    runner.set_switches(switches)
    release(device)
    pool = runner.pool
    for index in range(args.warmup):
        runner.trainer.step(pool[index % len(pool)])
    drain(device)
    warm_s = time.perf_counter() - started
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=args.record_shapes) as prof:
        for index in range(args.steps):
            drain(device)
            with record_function(f"step {index}"):
                runner.trainer.step(pool[(args.warmup + index) % len(pool)])
                drain(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = path.read_text()
    result = analyse(json.loads(trace)["traceEvents"], args.gap_floor_us, args.top)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"step_timeline_{args.profile}_{args.arm}"
    if args.keep_trace:
        (out / f"{name}.trace.json.gz").write_bytes(gzip.compress(trace.encode()))
    conditions = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "arm": args.arm,
        "landed_only": landed_only(extra, switches),
        "config": extra,
        "switches": list(switches),
        "batch": args.batch,
        "warmup_steps": args.warmup,
        "profiled_steps": args.steps,
        "load_and_warm_up_s": warm_s,
        "step": "drain, the step, drain (bench/peer_molmo2.py's timing), under torch.profiler",
        "gap_floor_us": args.gap_floor_us,
        "record_shapes": args.record_shapes,
    }
    (out / f"{name}.json").write_text(json.dumps({"conditions": conditions, **result}, indent=1))
    print(json.dumps(conditions))
    print_table(result)
    print(f"written: {out / name}.json")


if __name__ == "__main__":
    main()
