"""bench/step_timeline.py's reading of a profiler trace, on a trace written by hand: every figure it reports is
checked against the intervals it was given, so a wrong union, a gap missed at a window's edge or a kernel counted
in the wrong step fails here."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from step_timeline import analyse, kind_of, union_ms  # noqa: E402

MAIN, SIDE = 7, 21


def kernel(name: str, ts: float, dur: float, stream: int = MAIN, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "device": 0}}


def step(index: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"step {index}", "ts": ts, "dur": dur}


def test_union_merges_overlaps_and_keeps_disjoint_intervals():
    assert union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == 2.5
    assert union_ms([(0, 1000), (200, 300)]) == 1.0
    assert union_ms([]) == 0.0


@pytest.mark.parametrize(
    ("name", "cat", "kind"),
    [
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "kernel", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "kernel", "attention"),
        ("void cudnn::fusion::fmha_reduce_head_ragged<true>(void const*)", "kernel", "attention"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamWMathFunctor>", "kernel", "optimizer"),
        ("triton_poi_fused__unsafe_view_cat_mul_silu_silu_backward_split_view_2", "kernel", "triton"),
        ("void at::native::elementwise_kernel<128, 4>", "kernel", "aten"),
        ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", "memcpy"),
        ("Memset (Device)", "gpu_memset", "memset"),
        ("some_vendor_kernel", "kernel", "other"),
    ],
)
def test_kernels_are_named_by_kind(name, cat, kind):
    assert kind_of({"name": name, "cat": cat}) == kind


def test_a_step_window_gives_busy_idle_overlap_and_the_main_streams_gaps():
    # step 0: [0, 10,000) µs. Main stream: gemm [500, 4,500), triton [4,600, 5,000), attention [6,000, 9,000).
    # Side stream: the optimizer [3,000, 7,000) (overlapping both main kernels and the gap between them).
    # step 1: [10,000, 12,000) with one gemm [10,000, 11,900); a side kernel starting in step 0 and running into
    # step 1 counts in each step only for the part inside it.
    events = [
        step(0, 0, 10_000),
        step(1, 10_000, 2_000),
        kernel("nvjet_gemm_a", 500, 4_000),
        kernel("triton_poi_fused_add", 4_600, 400),
        kernel("cudnn_sdpa_fprop", 6_000, 3_000),
        kernel("multi_tensor_apply_kernel<Adam>", 3_000, 4_000, SIDE),
        kernel("multi_tensor_apply_kernel<Adam>", 9_500, 1_000, SIDE),
        kernel("nvjet_gemm_b", 10_000, 1_900),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},  # a host op: never a device interval
    ]
    result = analyse(events, gap_floor_us=50, top=5)
    assert result["main_stream"] == MAIN
    first, second = result["per_step"]
    assert first["wall_ms"] == 10.0
    # union: [500, 9,000) minus main's gap [5,000, 6,000) covered by the side stream, plus [9,500, 10,000)
    assert first["device_busy_ms"] == pytest.approx(8.5 + 0.5)
    assert first["device_idle_ms"] == pytest.approx(1.0)
    # side [3,000, 7,000) over main's [3,000, 4,500) and [4,600, 5,000) and [6,000, 7,000)
    assert first["overlap_ms"] == pytest.approx(1.5 + 0.4 + 1.0)
    assert first["streams"][str(MAIN)]["kinds_ms"] == {"attention": 3.0, "gemm": 4.0, "triton": 0.4}
    assert first["streams"][str(SIDE)]["kinds_ms"] == {"optimizer": 4.5}
    gaps = {(g["after"], g["before"]): g["ms"] for g in first["largest_gaps"]}
    assert gaps == {
        ("(step start)", "nvjet_gemm_a"): 0.5,
        ("nvjet_gemm_a", "triton_poi_fused_add"): 0.1,
        ("triton_poi_fused_add", "cudnn_sdpa_fprop"): 1.0,
        ("cudnn_sdpa_fprop", "(step end)"): 1.0,
    }
    assert first["main_stream_gaps_ms"] == pytest.approx(2.6)
    # step 1: the side kernel's tail [10,000, 10,500) overlaps the gemm; the main stream idles its last 0.1 ms
    assert second["device_busy_ms"] == pytest.approx(1.9)
    assert second["streams"][str(SIDE)]["kinds_ms"] == {"optimizer": 0.5}
    assert second["overlap_ms"] == pytest.approx(0.5)
    assert [(g["after"], g["before"], g["ms"]) for g in second["largest_gaps"]] == [
        ("nvjet_gemm_b", "(step end)", pytest.approx(0.1))
    ]
    assert result["mean"]["wall_ms"] == 6.0
    main = [(k["name"], k["kind"], k["ms_per_step"], k["per_step"]) for k in result["top_kernels"][str(MAIN)]]
    assert main == [("nvjet_gemm_a", "gemm", 2.0, 0.5), ("cudnn_sdpa_fprop", "attention", 1.5, 0.5),
                    ("nvjet_gemm_b", "gemm", 0.95, 0.5), ("triton_poi_fused_add", "triton", 0.2, 0.5)]  # fmt: skip
    side = result["top_kernels"][str(SIDE)]
    assert [(k["name"], k["ms_per_step"], k["per_step"]) for k in side] == [
        ("multi_tensor_apply_kernel<Adam>", pytest.approx(2.5), 1.5)  # 4 + 0.5 in step 0, 0.5 in step 1
    ]
    assert result["gaps_by_neighbours"][0]["ms_per_step"] == pytest.approx(0.5)  # 1.0 ms over two steps


def test_the_main_streams_kernels_are_attributed_to_the_host_op_that_launched_them():
    # two eager copies launched by aten::copy_ (shapes recorded), one by an op the trace lost, a side-stream kernel
    # (not attributed: only the main stream's are), and a cpu_op with no kernel
    def host_op(name, ts, args):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": 5, "args": args}

    def launched(name, ts, dur, external, stream=MAIN):
        event = kernel(name, ts, dur, stream)
        event["args"]["External id"] = external
        return event

    events = [
        step(0, 0, 1_000),
        host_op("aten::copy_", 0, {"External id": 11, "Input Dims": [[4, 8], [4, 8], []]}),
        host_op("aten::copy_", 10, {"External id": 12, "Input Dims": [[4, 8], [4, 8], []]}),
        host_op("aten::mul", 20, {"External id": 13}),
        launched("elementwise_kernel", 0, 300, 11),
        launched("elementwise_kernel", 300, 100, 12),
        launched("elementwise_kernel", 400, 50, 99),
        launched("multi_tensor_apply_kernel", 0, 200, 13, SIDE),
    ]
    origins = [(o["kernel"], o["launched_by"], o["ms_per_step"], o["per_step"]) for o in analyse(events)["top_origins"]]
    assert origins == [
        ("elementwise_kernel", "aten::copy_ [[4, 8], [4, 8]]", pytest.approx(0.4), 2.0),
        ("elementwise_kernel", "(unknown)", pytest.approx(0.05), 1.0),
    ]


def test_a_gap_shorter_than_the_floor_is_not_listed():
    events = [step(0, 0, 1_000), kernel("a", 0, 400), kernel("b", 410, 590)]
    result = analyse(events, gap_floor_us=20)
    assert result["per_step"][0]["largest_gaps"] == []
    assert analyse(events, gap_floor_us=5)["per_step"][0]["main_stream_gaps"] == 1


def test_a_trace_without_step_annotations_is_refused():
    with pytest.raises(ValueError, match="no 'step N' annotation"):
        analyse([kernel("a", 0, 10)])


def test_the_tool_profiles_an_arm_end_to_end_on_the_cpu(tmp_path):
    """The whole path at the tiny geometry: load, warm-up, profiled steps, the trace read back, the JSON written.
    The CPU has no device kernels, so every step is host time and device idle; the H200 fills the streams."""
    import json
    import subprocess

    command = [sys.executable, "bench/step_timeline.py", "--profile", "cpu-tiny", "--arm", "baseline", "--batch", "6",
               "--warmup", "1", "--steps", "2", "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "step_timeline_cpu-tiny_baseline.json").read_text())
    assert report["conditions"]["profiled_steps"] == 2 and report["conditions"]["landed_only"] is True
    assert [row["step"] for row in report["per_step"]] == [0, 1]
    assert report["mean"]["wall_ms"] > 0 and report["mean"]["device_busy_ms"] == 0
    assert report["mean"]["device_idle_ms"] == report["mean"]["wall_ms"] and report["main_stream"] is None
