"""The routed experts' GEMM paths (plans.enums.ExpertGemm) forward + backward at the MoE
shapes of issue 34, each run as the runtime runs it (runtime.moe.GroupedExperts), beside the
dense ceiling at the same FLOPs:

- ``grouped``, ``per_expert``: GroupedExperts with that ExpertGemm, its SwiGLU from
  ``--kernels`` (the plan's kernels: runtime.kernels);
- ``grouped_w13_stored``: w1 and w3 stored as one [E, 2 x ffn, hidden] weight, one grouped
  GEMM for both;
- ``dense``: every row through one expert's weights as plain cuBLAS matmuls, the same FLOPs:
  the ceiling a grouped GEMM could reach at the shape.

    python -m bench.kernels.expert_paths_gpu --out RESULT.json [--shapes NAME ...] [--tokens 16384]
        [--kernels fused|eager]

The rows per expert come from a top-k router over random logits (a mildly uneven load), the
same for every path of a shape; weights N(0, 0.02), inputs N(0, 1), bf16 on CUDA (fp32 on
CPU, the smoke test's). Timing: ``runtime.measure.device_timed`` (the host ahead of the GPU, as in
a step; per_expert's wait for the rows per expert on the host counted where it happens),
median of ``--repeats`` after ``--warmup``. Writes JSON (bench/_meta.py's metadata), per shape
each path's forward and forward + backward seconds and TFLOP/s and the fastest ExpertGemm; the
last lines are a table of forward + backward milliseconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from bench._dist_bench import device_timed, init, release
from bench._meta import bad_input, write_result
from plans.catalog import load_model
from plans.enums import ExpertGemm, Kernels
from runtime.kernels import kernel_ops
from runtime.moe import GroupedExperts, grouped_mm


def _catalog(name: str) -> tuple[int, int, int, int]:
    m = load_model(name)
    return m.experts, m.hidden, m.expert_ffn_hidden, m.top_k


SHAPES = ("mixtral-8x7b", "phi-3.5-moe", "deepseekmoe", "qwen3-235b-a22b", "qwen3-30b-a3b",
          "deepseek-v3")
"""The catalog models whose routed experts are measured (experts, hidden, expert FFN, top-k)."""
RUNTIME_PATHS = tuple(ExpertGemm)
EXTRA = ("grouped_w13_stored", "dense")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="result JSON")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--tokens", type=int, default=16384, help="tokens routed (each to top-k)")
    p.add_argument("--kernels", choices=[k.value for k in Kernels], default="fused",
                   help="the SwiGLU's kernels (plan kernels: runtime.kernels)")
    p.add_argument("--scale", type=int, default=1,
                   help="divide hidden and FFN widths by this (CPU smoke runs)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _counts(tokens: int, experts: int, top_k: int, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    return torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=experts)


def build(name: str, experts: int, hidden: int, ffn: int, ops, device, dtype):
    """(function of (rows, counts), its parameters) of path ``name``."""
    def weight(*shape):
        return nn.Parameter(torch.randn(*shape, device=device, dtype=dtype) * 0.02)

    if name in RUNTIME_PATHS:
        with torch.device("meta"):  # its weights made where they run, in their dtype
            module = GroupedExperts(experts, hidden, ffn, ops, ExpertGemm(name))
        for key, p in list(module.named_parameters()):
            setattr(module, key, weight(*p.shape))
        return module, list(module.parameters())
    if name == "grouped_w13_stored":
        w13, w2 = weight(experts, 2 * ffn, hidden), weight(experts, hidden, ffn)

        def stored(x, counts):
            gate, up = grouped_mm(x, w13, counts).chunk(2, dim=-1)
            return grouped_mm(ops.swiglu(gate, up), w2, counts)

        return stored, [w13, w2]
    w1, w3, w2 = weight(ffn, hidden), weight(ffn, hidden), weight(hidden, ffn)

    def dense(x, counts):
        return ops.swiglu(x @ w1.t(), x @ w3.t()) @ w2.t()

    return dense, [w1, w3, w2]


def measure_shape(args, name: str, device, dtype, ops) -> dict:
    experts, hidden, ffn, top_k = _catalog(name)
    hidden, ffn = hidden // args.scale, ffn // args.scale
    counts = _counts(args.tokens, experts, top_k, device, args.seed)
    rows = int(counts.sum())
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen)
    flops = 3 * 2 * rows * hidden * ffn  # three GEMMs forward; the backward twice that
    paths = {}
    for path in (*RUNTIME_PATHS, *EXTRA):
        fn, params = build(path, experts, hidden, ffn, ops, device, dtype)

        def fwd(fn=fn):
            with torch.no_grad():
                fn(x, counts)

        def fwd_bwd(fn=fn, params=params):
            for t in (x, *params):
                t.grad = None
            fn(x, counts).backward(grad)

        f = device_timed(fwd, device, args.warmup, args.repeats)
        fb = device_timed(fwd_bwd, device, args.warmup, args.repeats)
        paths[path] = {"fwd_s": f, "fwd_bwd_s": fb, "fwd_tflops": flops / f / 1e12,
                       "fwd_bwd_tflops": 3 * flops / fb / 1e12}
        print(f"{name:16s} {path:19s} fwd {f * 1e3:8.2f} ms  fwd+bwd {fb * 1e3:8.2f} ms "
              f"({3 * flops / fb / 1e12:4.0f} TF/s)", flush=True)
        del fn, params
        x.grad = None
        release(device)
    fastest = min(RUNTIME_PATHS, key=lambda p: paths[p]["fwd_bwd_s"])
    return {"experts": experts, "hidden": hidden, "ffn_hidden": ffn, "top_k": top_k,
            "rows": rows, "rows_per_expert": counts.tolist(), "gemm_flops_fwd": flops,
            "paths": paths, "fastest": fastest.value,
            "fastest_over_grouped": (paths[ExpertGemm.grouped]["fwd_bwd_s"]
                                     / paths[fastest]["fwd_bwd_s"])}


def table(shapes: dict) -> list[str]:
    """Forward + backward milliseconds per shape and path, at 80 columns."""
    cols = (*RUNTIME_PATHS, "dense")
    heads = {"grouped": "grouped", "grouped_w13": "w13", "per_expert": "per_exp",
             "dense": "dense"}
    lines = [f"{'fwd+bwd ms':16s}" + "".join(f"{heads[c]:>9s}" for c in cols) + "  fastest"]
    for name, row in shapes.items():
        lines.append(f"{name:16s}" + "".join(f"{row['paths'][c]['fwd_bwd_s'] * 1e3:9.2f}"
                                             for c in cols)
                     + f"  {row['fastest']} {row['fastest_over_grouped']:.3f}x")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tokens < 1 or args.scale < 1 or args.repeats < 1 or args.warmup < 0:
        return bad_input("--tokens, --scale and --repeats must be >= 1, --warmup >= 0")
    _, _, device, dtype = init()
    ops = kernel_ops(Kernels(args.kernels))
    shapes = {name: measure_shape(args, name, device, dtype, ops) for name in args.shapes}
    doc = {"benchmark": "routed experts' GEMM paths (plans.enums.ExpertGemm) "
           "forward + backward, beside the dense ceiling", "tokens": args.tokens,
           "kernels": args.kernels, "dtype": str(dtype).removeprefix("torch."),
           "scale": args.scale, "warmup": args.warmup, "repeats": args.repeats,
           "shapes": shapes}
    write_result(args.out, doc)
    print("\n".join(table(shapes)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
