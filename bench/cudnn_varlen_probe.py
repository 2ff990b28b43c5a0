"""Would cuDNN's SDPA run pack_attention = "varlen"'s calls faster than torch's FlashAttention-2? A probe for the
next step on issue 5's MFU gap, before any model code depends on it.

The varlen one-pass step spends 106 ms a step in FlashAttention-2 (bench/results/profile_packed-varlen-one-pass-x2-x34):
the image runs' call at ~200 TFLOP/s, the text runs' at ~115. cuDNN's Hopper SDPA kernels (the ones the vision
tower already runs through torch) take the same segments as ragged (THD) tensors with per-segment lengths, grouped
keys and values, and a bottom-right causal band; torch does not expose that path (its varlen_attn is FlashAttention-2
only), the cudnn-frontend Python package (nvidia-cudnn-frontend, carried as a wheel) does.

On the pool's largest packed step, one-pass (joined) plan, random bf16 q/k/v at the decoder's heads, for each of the
plan's two calls: FlashAttention-2 through torch (forward, and forward + backward through autograd) and cuDNN
through cudnn-frontend graphs (forward graph, backward graph), both on the same gathered THD buffers. Printed per
call: times (median of CUDA-event times after warm-up), cuDNN's largest difference from FlashAttention-2 in the
output and each gradient, and whatever stage failed, with its reason. Nothing here is in the training step yet.

    python bench/cudnn_varlen_probe.py --profile h200-4b [--warmup 3 --repeats 20] --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.flex_configs import timed  # noqa: E402
from engine.molmo2.declaration import PROFILES  # noqa: E402
from engine.molmo2.segments import VarlenCall, varlen_call  # noqa: E402
from engine.molmo2.workload import Molmo2Runner  # noqa: E402


def thd_layout(call: VarlenCall, heads: int, kv_heads: int, head_dim: int) -> dict[str, torch.Tensor | int]:
    """cuDNN's view of a varlen call's packed buffers: B segments padded to the longest (dims [B, h, S, d] in
    bshd strides), each segment's real length, and where each segment starts in the packed buffer, in elements."""
    q_lengths = (call.cu_q[1:] - call.cu_q[:-1]).long()
    k_lengths = (call.cu_k[1:] - call.cu_k[:-1]).long()
    starts = lambda cu, width: (cu.long() * width).view(-1, 1, 1, 1)  # noqa: E731  [B + 1]: the exclusive prefix sums
    return {"segments": int(q_lengths.shape[0]), "max_q": call.max_q, "max_k": call.max_k,
            "seq_len_q": q_lengths.int().view(-1, 1, 1, 1), "seq_len_kv": k_lengths.int().view(-1, 1, 1, 1),
            "q_offset": starts(call.cu_q, heads * head_dim), "k_offset": starts(call.cu_k, kv_heads * head_dim),
            "total_q": int(call.cu_q[-1]), "total_k": int(call.cu_k[-1])}  # fmt: skip


class CudnnCall:
    """Forward and backward cuDNN graphs for one varlen call on bf16 THD buffers (q [nq, h, d], k and v [nk, kv_h, d])."""

    def __init__(self, cudnn, handle, layout: dict, causal: bool, heads: int, kv_heads: int, head_dim: int, device):
        self.cudnn, self.handle, self.layout = cudnn, handle, layout
        self.device = device
        B, Sq, Sk, d = layout["segments"], layout["max_q"], layout["max_k"], head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.dims = {"q": ([B, heads, Sq, d], [Sq * heads * d, d, heads * d, 1]),
                     "k": ([B, kv_heads, Sk, d], [Sk * kv_heads * d, d, kv_heads * d, 1])}  # fmt: skip
        self.band = {"diagonal_band_right_bound": 0, "diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT} if causal else {}
        self.gpu = {name: layout[name].to(device) for name in ("seq_len_q", "seq_len_kv", "q_offset", "k_offset")}
        self.stats = torch.empty(B, heads, Sq, 1, dtype=torch.float32, device=device)
        self.forward_graph = self._forward_graph()
        self.backward_graph = self._backward_graph()

    def _graph(self):
        c = self.cudnn
        return c.pygraph(io_data_type=c.data_type.BFLOAT16, intermediate_data_type=c.data_type.FLOAT,
                         compute_data_type=c.data_type.FLOAT, handle=self.handle)  # fmt: skip

    def _tensor(self, graph, which: str, offset):
        dim, stride = self.dims[which]
        t = graph.tensor(dim=dim, stride=stride, data_type=self.cudnn.data_type.BFLOAT16)
        t.set_ragged_offset(offset)
        return t

    def _inputs(self, graph) -> dict:
        g = {name: graph.tensor_like(tensor) for name, tensor in self.gpu.items()}
        g["q"], g["k"], g["v"] = (self._tensor(graph, w, g[o]) for w, o in (("q", "q_offset"), ("k", "k_offset"), ("k", "k_offset")))
        return g

    def _build(self, graph) -> torch.Tensor:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        return torch.empty(graph.get_workspace_size(), device=self.device, dtype=torch.uint8)

    def _forward_graph(self):
        graph = self._graph()
        g = self._inputs(graph)
        o, stats = graph.sdpa(name="sdpa", q=g["q"], k=g["k"], v=g["v"], generate_stats=True, attn_scale=self.scale,
                              use_padding_mask=True, seq_len_q=g["seq_len_q"], seq_len_kv=g["seq_len_kv"], **self.band)  # fmt: skip
        dim, stride = self.dims["q"]
        o.set_output(True).set_dim(dim).set_stride(stride).set_ragged_offset(g["q_offset"])
        stats.set_output(True).set_data_type(self.cudnn.data_type.FLOAT)
        g["o"], g["stats"] = o, stats
        return graph, g, self._build(graph)

    def _backward_graph(self):
        graph = self._graph()
        g = self._inputs(graph)
        dim, stride = self.dims["q"]
        g["o"] = self._tensor(graph, "q", g["q_offset"])
        g["dO"] = self._tensor(graph, "q", g["q_offset"])
        g["stats"] = graph.tensor_like(self.stats)
        round_up = lambda n: -(-n // 64) * 64  # noqa: E731  cuDNN's ragged backward sizes its scratch by these
        dq, dk, dv = graph.sdpa_backward(name="sdpa_backward", q=g["q"], k=g["k"], v=g["v"], o=g["o"], dO=g["dO"],
                                         stats=g["stats"], attn_scale=self.scale, use_padding_mask=True,
                                         seq_len_q=g["seq_len_q"], seq_len_kv=g["seq_len_kv"],
                                         max_total_seq_len_q=round_up(self.layout["total_q"]),
                                         max_total_seq_len_kv=round_up(self.layout["total_k"]), **self.band)  # fmt: skip
        for grad, which, offset in ((dq, "q", "q_offset"), (dk, "k", "k_offset"), (dv, "k", "k_offset")):
            d, s = self.dims[which]
            grad.set_output(True).set_dim(d).set_stride(s).set_ragged_offset(g[offset])
        g["dq"], g["dk"], g["dv"] = dq, dk, dv
        return graph, g, self._build(graph)

    def _pack(self, g: dict, tensors: dict) -> dict:
        pack = {g[name]: tensor for name, tensor in self.gpu.items()}
        pack.update({g[name]: tensor for name, tensor in tensors.items()})
        return pack

    def forward(self, q, k, v) -> torch.Tensor:
        graph, g, workspace = self.forward_graph
        o = torch.empty_like(q)
        graph.execute(self._pack(g, {"q": q, "k": k, "v": v, "o": o, "stats": self.stats}), workspace, handle=self.handle)
        return o

    def backward(self, q, k, v, o, do) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graph, g, workspace = self.backward_graph
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        graph.execute(self._pack(g, {"q": q, "k": k, "v": v, "o": o, "dO": do, "stats": self.stats, "dq": dq, "dk": dk,
                                     "dv": dv}), workspace, handle=self.handle)  # fmt: skip
        return dq, dk, dv


def largest_joined_plan(profile: str):
    runner = Molmo2Runner(PROFILES[profile], {"batch": 12, "camera_counts": [1, 2], "max_crops": 1, "backward_chunks": 1,
                                              "compile": True, "pack": True, "pack_one_pass": True,
                                              "pack_attention": "varlen"}, seed=0)  # fmt: skip
    runner.load_data()
    chunks = [step.chunks[0] for step in runner.pool]
    chunk = max(chunks, key=lambda c: c.prefix.input_ids.shape[1])
    return chunk.packing.segments.joined, runner.config.text


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="h200-4b", choices=sorted(PROFILES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(PROFILES[args.profile].device)
    conditions = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                  "dtype": "bfloat16", "warmup": args.warmup, "repeats": args.repeats,
                  "timing": "median of CUDA-event times per call after warm-up"}  # fmt: skip
    rows: list[dict] = []

    def save(row: dict) -> None:  # after every row: a call that runs out of time still brings back what it finished
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out_dir / f"cudnn_varlen_probe_{args.profile}.json").write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1))

    if device.type != "cuda":
        save({"name": "setup", "error": f"profile {args.profile} runs on the CPU: cuDNN and FlashAttention are CUDA kernels"})
        return rows
    try:
        import cudnn

        conditions["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        conditions["cudnn_backend"] = cudnn.backend_version()
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    except Exception as error:  # the probe's first question: does the package load here at all
        save({"name": "setup", "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"})
        return rows
    plan, text = largest_joined_plan(args.profile)
    plan = plan.to(device)
    heads, kv_heads, d = text.num_heads, text.num_kv_heads, text.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    for call in plan.calls:
        name = "causal (text runs)" if call.causal else "full (image runs)"
        layout = thd_layout(call, heads, kv_heads, d)
        nq, nk = layout["total_q"], layout["total_k"]
        q = torch.randn(nq, heads, d, device=device, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(nk, kv_heads, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
        do = torch.randn(nq, heads, d, device=device, dtype=torch.bfloat16, generator=g)
        row = {"name": name, "segments": layout["segments"], "queries": nq, "keys": nk, "max_q": call.max_q, "max_k": call.max_k}
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fa_out = varlen_call(*leaves, call)
        fa_grads = torch.autograd.grad(fa_out, leaves, do)
        row["fa2_forward_ms"] = timed(lambda: varlen_call(q, k, v, call), args.warmup, args.repeats, device) * 1e3
        row["fa2_fwd_bwd_ms"] = timed(lambda: torch.autograd.grad(varlen_call(*leaves, call), leaves, do), args.warmup,
                                      args.repeats, device) * 1e3  # fmt: skip
        stage = "graphs"
        try:
            probe = CudnnCall(cudnn, handle, layout, call.causal, heads, kv_heads, d, device)
            stage = "forward"
            out = probe.forward(q, k, v)
            row["max_abs_out_vs_fa2"] = float((out.float() - fa_out.float()).abs().max())
            stage = "backward"
            grads = probe.backward(q, k, v, out, do)
            for grad_name, ours, theirs in zip(("dq", "dk", "dv"), grads, fa_grads):
                row[f"max_abs_{grad_name}_vs_fa2"] = float((ours.float() - theirs.float()).abs().max())
            stage = "timing"
            row["cudnn_forward_ms"] = timed(lambda: probe.forward(q, k, v), args.warmup, args.repeats, device) * 1e3
            row["cudnn_fwd_bwd_ms"] = timed(lambda: probe.backward(q, k, v, probe.forward(q, k, v), do), args.warmup,
                                            args.repeats, device) * 1e3  # fmt: skip
            row["error"] = None
        except Exception as error:  # a stage cuDNN refuses is a row with its reason, not a crash
            row["error"] = f"{stage}: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        save(row)
    print(f"\n{'call':20} {'segs':>5} {'FA2 fwd':>8} {'FA2 f+b':>8} {'cuDNN fwd':>9} {'cuDNN f+b':>9}  max |cuDNN - FA2| (o, dq, dk, dv)")
    for row in rows:
        if "segments" not in row:
            print(f"{row['name']:20} {row['error']}")
            continue
        cudnn_times = (f"{row['cudnn_forward_ms']:9.3f} {row['cudnn_fwd_bwd_ms']:9.3f}" if row.get("error") is None
                       else f"{'—':>9} {'—':>9}")  # fmt: skip
        diffs = ", ".join(f"{row[key]:.3g}" for key in ("max_abs_out_vs_fa2", "max_abs_dq_vs_fa2", "max_abs_dk_vs_fa2",
                                                        "max_abs_dv_vs_fa2") if key in row)  # fmt: skip
        print(f"{row['name']:20} {row['segments']:5} {row['fa2_forward_ms']:8.3f} {row['fa2_fwd_bwd_ms']:8.3f} {cudnn_times}  "
              f"{diffs}{'  ' + row['error'] if row.get('error') else ''}")
    return rows


if __name__ == "__main__":
    main()
