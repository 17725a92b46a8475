"""The expert GEMMs of one MoE layer, forward + backward, in each way the runtime could run
them:

- ``grouped``: the runtime's: three ``torch._grouped_mm`` calls on weights stored
  [E, out, in] (Linear layout, the B operand a transposed view), autograd's backward;
- ``grouped_in_out``: the same on weights stored [E, in, out] (B contiguous);
- ``grouped_w13``: w1 and w3 as one [E, 2 x ffn, hidden] weight, one grouped GEMM for both;
- ``per_expert``: one cuBLAS matmul per expert (the row counts read on the host once per call);
- ``per_expert_w13``: the same with w1 and w3 as one weight;
- ``per_expert_fn``: one cuBLAS matmul per expert in one autograd function (``ExpertLinear``),
  each result written into its slice, each weight gradient into its slice;
- ``grouped_accumulate``: ``grouped`` with each weight gradient then added into a main gradient
  (the runtime's accumulation without fusion);
- ``per_expert_fn_accumulate``: ``per_expert_fn`` with the weight gradients accumulated into
  the main gradients by the GEMMs themselves (``addmm_``: gradient-accumulation fusion);
- ``runtime_accumulating``: the runtime's form of that (runtime.parallel.grad_accumulation):
  grouped GEMMs forward and for the rows' gradient, per-expert accumulating weight gradients;
- ``dense``: every row through expert 0's weights as plain cuBLAS matmuls, the same FLOPs as
  one GEMM per weight: the ceiling a grouped GEMM could reach at this shape;
- ``swiglu``: the SwiGLU between the GEMMs alone (its inputs made by no GEMM), which every
  variant above runs alike: a variant's GEMM time is its time less this one's;
- ``fc1_dgrad``, ``fc1_wgrad``, ``fc2_dgrad``, ``fc2_wgrad``: one grouped GEMM alone (w1's, or
  w2's over the FFN-wide rows), its backward computing one gradient: the rows' (dgrad, grouped
  over M as the forward) or the weight's (wgrad, grouped over K): which of the two the
  backward's time goes to.

``--balanced`` gives every expert the same row count (a multiple of the tile sizes where the
token count allows) instead of a router's mildly uneven one: how much uneven, unaligned row
counts cost the GEMMs.

Each is timed with the host ahead of the GPU (``runtime.measure.device_timed``), forward alone and
forward + backward, and reported as seconds and as TFLOP/s of the GEMMs' FLOPs. The routed rows
per expert are drawn from a top-k router over random logits (a mildly uneven load). SwiGLU runs
eagerly in every variant alike; it is not what is compared.

    python -m bench.kernels.expert_gemm_gpu --shape SHAPE --out RESULT.json    (SHAPE: see SHAPES)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._dist_bench import device_timed
from bench._meta import write_result
from runtime.parallel.grad_accumulation import per_expert_accumulating

SHAPES = {
    # name: (experts, hidden, ffn_hidden, top_k), the models' published configurations
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseekmoe-16b": (64, 2048, 1408, 6),
    "deepseek-v3": (256, 7168, 2048, 8),
}


PARTS = ("fc1_dgrad", "fc1_wgrad", "fc2_dgrad", "fc2_wgrad")
"""The variants that time one GEMM, and one of its gradients."""


def _counts(tokens: int, experts: int, top_k: int, device: torch.device) -> torch.Tensor:
    logits = torch.randn(tokens, experts, device=device)
    idx = logits.topk(top_k, dim=-1).indices.flatten()
    return torch.bincount(idx, minlength=experts)


def _grouped(x, w, offs, in_out: bool):
    # w: [E, out, in] (Linear layout) or [E, in, out]
    return torch._grouped_mm(x, w if in_out else w.transpose(-2, -1), offs=offs)


def _per_expert(x, w, counts: list[int]):
    # w: [E, out, in]
    outs = [chunk @ w[e].t() for e, chunk in enumerate(torch.split(x, counts))]
    return torch.cat(outs)


class ExpertLinear(torch.autograd.Function):
    """Rows grouped by expert times each expert's ``w[e]`` ([E, out, in]) as one cuBLAS matmul
    per expert, every result written into its slice of one output (no split / cat / select
    backward). With ``main_grad`` the weight gradient is added into it by the GEMM itself
    (``addmm_``, beta = 1: gradient-accumulation fusion) and no weight gradient is returned."""

    @staticmethod
    def forward(ctx, x, w, counts: list[int], main_grad):
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.main_grad = counts, main_grad
        out = x.new_empty(x.shape[0], w.shape[1])
        start = 0
        for e, c in enumerate(counts):
            torch.mm(x[start:start + c], w[e].t(), out=out[start:start + c])
            start += c
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = torch.empty_like(x)
        gw = None if ctx.main_grad is not None else torch.zeros_like(w)
        target = ctx.main_grad if ctx.main_grad is not None else gw
        start = 0
        for e, c in enumerate(ctx.counts):
            ge, xe = g[start:start + c], x[start:start + c]
            torch.mm(ge, w[e], out=gx[start:start + c])
            target[e].addmm_(ge.t(), xe)
            start += c
        return gx, gw, None, None


def variants(experts, hidden, ffn, device, dtype):
    def p(*shape):
        return (torch.randn(*shape, device=device, dtype=dtype) * 0.02).requires_grad_()

    w1, w3, w2 = p(experts, ffn, hidden), p(experts, ffn, hidden), p(experts, hidden, ffn)
    w1t, w3t, w2t = (p(experts, hidden, ffn), p(experts, hidden, ffn), p(experts, ffn, hidden))
    w13 = p(experts, 2 * ffn, hidden)

    def grouped(x, offs, counts):
        h = F.silu(_grouped(x, w1, offs, False)) * _grouped(x, w3, offs, False)
        return _grouped(h, w2, offs, False)

    def grouped_in_out(x, offs, counts):
        h = F.silu(_grouped(x, w1t, offs, True)) * _grouped(x, w3t, offs, True)
        return _grouped(h, w2t, offs, True)

    def grouped_w13(x, offs, counts):
        a, b = _grouped(x, w13, offs, False).chunk(2, dim=-1)
        return _grouped(F.silu(a) * b, w2, offs, False)

    def per_expert(x, offs, counts):
        c = counts.tolist()
        h = F.silu(_per_expert(x, w1, c)) * _per_expert(x, w3, c)
        return _per_expert(h, w2, c)

    def per_expert_w13(x, offs, counts):
        c = counts.tolist()
        a, b = _per_expert(x, w13, c).chunk(2, dim=-1)
        return _per_expert(F.silu(a) * b, w2, c)

    main = [torch.zeros_like(w) for w in (w1, w3, w2)]

    def per_expert_fn(x, offs, counts, fused=False):
        c = counts.tolist()
        m1, m3, m2 = main if fused else (None, None, None)
        h = (F.silu(ExpertLinear.apply(x, w1, c, m1)) * ExpertLinear.apply(x, w3, c, m3))
        return ExpertLinear.apply(h, w2, c, m2)

    def per_expert_fn_accumulate(x, offs, counts):
        return per_expert_fn(x, offs, counts, fused=True)

    def grouped_accumulate(x, offs, counts):
        return grouped(x, offs, counts)

    def add_into_main():
        # the unfused accumulation: each weight gradient added into its main gradient
        for w, m in zip((w1, w3, w2), main, strict=True):
            m.add_(w.grad)

    grouped_accumulate.after_backward = add_into_main

    for w, m in zip((w1, w3, w2), main, strict=True):
        w.main_grad = m

    def runtime_accumulating(x, offs, counts):
        # what the runtime runs under gradient-accumulation fusion for few wide experts
        mm = per_expert_accumulating(counts)
        return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)

    def dense(x, offs, counts):
        h = F.silu(x @ w1[0].t()) * (x @ w3[0].t())
        return h @ w2[0].t()

    gates: list[torch.Tensor] = []  # the SwiGLU's two inputs, made once at the rows' count

    def swiglu(x, offs, counts):
        if not gates:
            gates.extend(torch.randn(x.shape[0], ffn, device=device, dtype=dtype)
                         .requires_grad_() for _ in range(2))
        return F.silu(gates[0]) * gates[1]

    swiglu.inputs = lambda: tuple(gates)

    # one grouped GEMM of each kind alone; backward with one operand's gradient: the rows'
    # (dgrad, grouped over M as the forward) or the weight's (wgrad, grouped over K)
    hin = torch.randn(1, ffn, device=device, dtype=dtype)  # resized to the rows on first use
    parts = {}
    for name in PARTS:
        gemm, grad = name.split("_")

        def part(x, offs, counts, gemm=gemm, grad=grad):
            w = w1 if gemm == "fc1" else w2
            if gemm == "fc2" and hin.shape[0] != x.shape[0]:
                hin.resize_(x.shape[0], ffn).normal_()
            rows = x if gemm == "fc1" else hin
            if grad == "dgrad":
                return _grouped(rows.detach().requires_grad_(), w.detach(), offs, False)
            return _grouped(rows.detach(), w, offs, False)
        parts[name] = part

    params = (w1, w3, w2, w1t, w3t, w2t, w13)
    return params, {**parts,
        "dense": dense, "swiglu": swiglu,
        "grouped": grouped, "grouped_in_out": grouped_in_out, "grouped_w13": grouped_w13,
        "per_expert": per_expert, "per_expert_w13": per_expert_w13,
        "per_expert_fn": per_expert_fn, "grouped_accumulate": grouped_accumulate,
        "per_expert_fn_accumulate": per_expert_fn_accumulate,
        "runtime_accumulating": runtime_accumulating}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--balanced", action="store_true",
                    help="every expert the same row count instead of a router's")
    ap.add_argument("--variants", nargs="+", metavar="NAME",
                    help="time only these variants (default: all; names as the output prints)")
    ap.add_argument("--out", required=True, help="result JSON path")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: expert_gemm_gpu.py times CUDA kernels; no GPU here")
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    torch.manual_seed(0)
    experts, hidden, ffn, top_k = SHAPES[a.shape]
    counts = (torch.full((experts,), a.tokens * top_k // experts, device=device)
              if a.balanced else _counts(a.tokens, experts, top_k, device))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = int(counts.sum())
    x = (torch.randn(rows, hidden, device=device, dtype=dtype)).requires_grad_()
    grads = {(rows, hidden): torch.randn(rows, hidden, device=device, dtype=dtype),
             (rows, ffn): torch.randn(rows, ffn, device=device, dtype=dtype)}
    gemm_flops = 3 * 2 * rows * hidden * ffn  # three GEMMs forward
    results = {}
    params, fns = variants(experts, hidden, ffn, device, dtype)
    if unknown := sorted(set(a.variants or ()) - set(fns)):
        sys.exit(f"error: --variants: no variant {unknown[0]!r} (all: {', '.join(fns)})")
    for name, fn in fns.items():
        if a.variants and name not in a.variants:
            continue
        def fwd(fn=fn):
            with torch.no_grad():
                fn(x, offs, counts)

        def fwd_bwd(fn=fn):
            for t in (x, *params, *getattr(fn, "inputs", tuple)()):
                t.grad = None  # each call's gradients are fresh tensors, never added
            out = fn(x, offs, counts)
            out.backward(grads[tuple(out.shape)])
            if hasattr(fn, "after_backward"):
                fn.after_backward()

        f = device_timed(fwd, device, 3, a.repeats)
        fb = device_timed(fwd_bwd, device, 3, a.repeats)
        # a part is one of the three GEMMs, its backward one gradient (as many FLOPs again)
        flops, bwd_flops = (gemm_flops / 3, gemm_flops / 3) if name in PARTS else (
            gemm_flops, 2 * gemm_flops)
        results[name] = {"fwd_s": f, "fwd_bwd_s": fb, "bwd_s": fb - f,
                         "fwd_tflops": flops / f / 1e12,
                         "fwd_bwd_tflops": (flops + bwd_flops) / fb / 1e12}
        print(f"{a.shape:14s} {name:16s} fwd {f * 1e3:7.2f} ms "
              f"({flops / f / 1e12:5.0f} TF/s)  fwd+bwd {fb * 1e3:7.2f} ms "
              f"({(flops + bwd_flops) / fb / 1e12:5.0f} TF/s)", flush=True)
    doc = {"shape": a.shape, "tokens": a.tokens, "balanced": a.balanced,
        "experts": experts, "hidden": hidden, "ffn_hidden": ffn, "top_k": top_k,
        "rows": rows, "rows_per_expert": counts.tolist(), "gemm_flops_fwd": gemm_flops,
        "variants": results}
    write_result(Path(a.out), doc)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
