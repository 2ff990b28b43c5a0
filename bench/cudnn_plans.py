"""Every execution plan cuDNN offers for the varlen calls, timed: is its heuristic's first plan the fastest?

pack_attention = "varlen-cudnn" (engine/molmo2/attention/cudnn.py) runs the first plan that builds from cuDNN's
heuristics (modes A, then FALLBACK). In the landed step its backward is the largest kernel after the matmuls (about
53 ms of a 0.56 s step, at roughly a quarter of the bf16 ceiling). Here, on the pool's largest one-pass (joined)
plan, random bf16 q/k/v at the decoder's heads, for each of the plan's two calls and for forward and backward: every
plan of heuristic modes A, B and FALLBACK is built and run on the same buffers. Printed per plan: its name, its
workspace, its median time, and its largest difference from the first plan's outputs (a different kernel sums in
another order, so a plan other than the first is a numerics change, a ladder's question).

    python bench/cudnn_plans.py --profile h200-4b [--warmup 3 --repeats 20] --out DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.cudnn_varlen_probe import call_inputs, largest_joined_plan, probe_arguments  # noqa: E402
from bench.flex_configs import timed  # noqa: E402
from engine.molmo2.attention import cudnn as ours  # noqa: E402

MODES = ("A", "B", "FALLBACK")


def plans_of(shape: ours.GraphShape, backward: bool, modes: tuple[str, ...]):
    """The graph of a shape with every plan of the modes built (those that build), and its tensors."""
    cudnn = ours.cudnn_frontend()
    graph, tensors = ours.describe(shape, backward)
    graph.create_execution_plans([getattr(cudnn.heur_mode, mode) for mode in modes])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    return graph, tensors


def time_plans(graph, tensors: dict, buffers: dict, outputs: tuple[str, ...], device: torch.device, warmup: int,
               repeats: int, shape: ours.GraphShape) -> list[dict]:  # fmt: skip
    """Each plan's name, workspace, median seconds and largest difference from plan 0's outputs."""
    cudnn = ours.cudnn_frontend()
    handle = ours._handle(shape.device)
    rows, reference = [], None
    for index in range(graph.get_execution_plan_count()):
        row: dict = {"index": index}
        try:
            row["plan"] = graph.get_plan_name_at_index(index)
            workspace_size = graph.get_workspace_size_plan_at_index(index)
            row["workspace_mib"] = workspace_size / 2**20
            workspace = torch.empty(workspace_size, dtype=torch.uint8, device=device)
            pack = {tensors[name]: tensor for name, tensor in buffers.items()}
            cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
            for name in outputs:
                buffers[name].zero_()
            run = lambda: graph.execute_plan_at_index(pack, workspace, index, handle=handle)  # noqa: E731
            run()
            torch.cuda.synchronize()
            result = {name: buffers[name].float().clone() for name in outputs}
            if reference is None:
                reference = result
            for name in outputs:
                row[f"max_abs_{name}_vs_plan0"] = float((result[name] - reference[name]).abs().max())
            row["ms"] = timed(run, warmup, repeats, device) * 1e3
            row["error"] = None
        except Exception as error:  # a plan that does not build or run is a row with its reason
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args, out_dir, device = probe_arguments(argv)
    if device.type != "cuda":
        raise SystemExit(f"profile {args.profile} runs on the CPU: cuDNN's plans are CUDA kernels")
    cudnn = ours.cudnn_frontend()
    conditions = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
                  "cudnn_frontend": getattr(cudnn, "__version__", "?"), "cudnn_backend": cudnn.backend_version(),
                  "heuristic_modes": list(MODES), "warmup": args.warmup, "repeats": args.repeats,
                  "timing": "median of CUDA-event times per plan after warm-up"}  # fmt: skip
    rows: list[dict] = []
    plan, text = largest_joined_plan(args.profile)
    plan = plan.to(device)
    heads, kv_heads, d = text.num_heads, text.num_kv_heads, text.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    for call in plan.calls:
        name = "causal (text runs)" if call.causal else "full (image runs)"
        nq, nk = call.queries.shape[0], call.keys.shape[0]
        q, k, v, do = call_inputs(call, text, device, g)
        layout = ours.ragged_layout(call.cu_q, call.cu_k, heads, kv_heads, d)
        o, stats = ours._forward(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, call.causal)
        segments = call.cu_q.shape[0] - 1
        for direction in ("forward", "backward"):
            backward = direction == "backward"
            shape = ours._shape(q, k, call.cu_q, call.max_q, call.max_k, call.causal, backward)
            if backward:
                buffers = {"q": q, "k": k, "v": v, "o": o, "dO": do, "stats": stats, "dq": torch.empty_like(q),
                           "dk": torch.empty_like(k), "dv": torch.empty_like(v)}  # fmt: skip
                outputs = ("dq", "dk", "dv")
            else:
                buffers = {"q": q, "k": k, "v": v, "o": torch.empty_like(q),
                           "stats": ours._stats(q, segments, call.max_q)}  # fmt: skip
                outputs = ("o",)
            buffers.update(vars(layout))
            head = {"call": name, "direction": direction, "segments": segments, "queries": nq, "keys": nk,
                    "max_q": call.max_q, "max_k": call.max_k}  # fmt: skip
            for mode in MODES:  # a graph per mode: planning is once per graph
                try:
                    graph, tensors = plans_of(shape, backward, (mode,))
                    found = time_plans(graph, tensors, buffers, outputs, device, args.warmup, args.repeats, shape)
                except Exception as error:  # the mode refused the graph: one row with the reason
                    found = [{"index": None, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}]
                for row in found:
                    rows.append({**head, "mode": mode, **row})
                    print(json.dumps(rows[-1]), flush=True)
            (out_dir / f"cudnn_plans_{args.profile}.json").write_text(
                json.dumps({"conditions": conditions, "rows": rows}, indent=1)
            )
    print(f"\n{'call':20} {'dir':9} {'mode':8} {'#':>3} {'ms':>8} {'ws MiB':>7}  max |plan - plan 0|  plan")
    for row in rows:
        where = f"{row['call']:20} {row['direction']:9} {row['mode']:8} {str(row['index']):>3}"
        if row.get("error"):
            print(f"{where} {'—':>8} {'':7}  {row['error']}")
            continue
        diffs = ", ".join(f"{value:.3g}" for key, value in row.items() if key.startswith("max_abs_"))
        print(f"{where} {row['ms']:8.3f} {row['workspace_mib']:7.1f}  {diffs:18}  {row['plan']}")
    return rows


if __name__ == "__main__":
    main()
