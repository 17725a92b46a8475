"""Each memory-bound operator of runtime.kernels, eager against fused (plan.kernels), forward and
forward + backward, at Mixtral-8x7B shapes by default (16k tokens of one micro-batch of 4 x
4096, hidden 4096, 32 query and 8 KV heads of 128, expert FFN 14336, top-2 of 8 experts):

    python -m bench.kernels.fused_ops_gpu --out bench/results/h200/kernels/fused_ops_mixtral.json

Per operator: CUDA-event medians after warm-up (wall clock on CPU) of one call on an idle GPU
and of its kernels with the host ahead (``device_``: runtime.measure.device_timed, no host
dispatch inside), the fused speedup, and the
bytes the cost model counts for it (cost_models.layer_graph: its fused-kernel bytes, forward
and backward) over the measured time as a fraction of the GPU's peak HBM bandwidth
(``--hbm-tb-s``): what efficiency.elementwise (eager) and efficiency.fused_elementwise (fused)
stand for, operator by operator. bf16 on CUDA, fp32 on CPU (a smoke run with tiny shapes).

``cross_entropy`` is the chunked loss (runtime.loss.chunked_cross_entropy over ``--vocab``):
its time holds the LM head's three GEMMs, timed alone beside it (``gemms_fwd_bwd_s``: the
same chunks' GEMMs with nothing between them) so that its memory-bound work is the rest, and
its eager and fused results are compared (``fused_vs_eager``: the largest relative difference
of the loss and its two gradients).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from bench._dist_bench import device_timed, init, timed
from bench._meta import write_result
from cost_models.compute import CE_FUSED_BYTES_PER_LOGIT
from plans.enums import Kernels
from runtime.kernels import KernelOps, kernel_ops, rope_tables
from runtime.loss import chunk_tokens, chunked_cross_entropy

FP32 = 4
OPS = ("rms_norm", "rope", "swiglu", "router", "permute", "unpermute", "cross_entropy")


def cases(a: argparse.Namespace, device: torch.device, dtype: torch.dtype
          ) -> dict[str, tuple[Callable[[KernelOps], Callable[[], tuple]], tuple, float, float]]:
    """name -> (call builder, differentiable inputs, forward bytes, backward bytes)."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dt).requires_grad_()

    t, h, e, k, ab = a.tokens, a.hidden, a.experts, a.top_k, dtype.itemsize
    b = t // a.seq
    rows = t * k
    x, w = rand(t, h), rand(h)
    q, kk = rand(b, a.seq, a.heads, a.head_dim), rand(b, a.seq, a.kv_heads, a.head_dim)
    cos, sin = rope_tables(a.seq, a.head_dim, 1e6, device)
    act, gate = rand(rows, a.ffn), rand(rows, a.ffn)
    logits = rand(t, e, dt=torch.float32)
    # balanced routing: token i to experts i, i + 1, ..., i + k - 1 (mod E)
    indices = (torch.arange(t, device=device)[:, None] + torch.arange(k, device=device)) % e
    slots = torch.argsort(indices.reshape(-1), stable=True)
    routed = rand(rows, h)
    weights = torch.rand(t, k, generator=g, device=device).requires_grad_()
    qk = (a.heads + a.kv_heads) * a.head_dim
    head = (rand(t, h), (torch.randn(a.vocab, h, generator=g, device=device, dtype=dtype)
                         * h ** -0.5).requires_grad_())
    labels = torch.randint(0, a.vocab, (t,), generator=g, device=device)
    return {
        "rms_norm": (lambda o: lambda: (o.rms_norm(x, w, 1e-5),), (x, w),
                     2 * t * h * ab, 3 * t * h * ab),
        "rope": (lambda o: lambda: o.rotate_qk(q, kk, cos, sin), (q, kk),
                 2 * t * qk * ab, 2 * t * qk * ab),
        "swiglu": (lambda o: lambda: (o.swiglu(act, gate),), (act, gate),
                   3 * rows * a.ffn * ab, 5 * rows * a.ffn * ab),
        "router": (lambda o: lambda: o.route(logits, k, True)[:1], (logits,),
                   2 * t * e * FP32, 2 * t * e * FP32),
        "permute": (lambda o: lambda: (o.gather_rows(x, slots, k),), (x,),
                    (t + rows) * h * ab, (t + rows) * h * ab),
        "unpermute": (lambda o: lambda: (o.weighted_scatter(routed, slots, weights, t, k),),
                      (routed, weights), (rows + t) * h * ab, (rows + t) * h * ab),
        # the gradients are computed in forward; backward scales them
        "cross_entropy": (lambda o: lambda: (chunked_cross_entropy(*head, labels, 1 / t, o),),
                          head, CE_FUSED_BYTES_PER_LOGIT * t * a.vocab, 0.0),
    }


def head_gemms(h: torch.Tensor, w: torch.Tensor) -> Callable[[], None]:
    """The chunked loss's three GEMMs per chunk (logits, hidden-state gradient, weight
    gradient) with nothing between them: what its time holds beside its memory-bound work."""
    chunk = chunk_tokens(w.shape[0])

    def run() -> None:
        with torch.no_grad():
            for start in range(0, h.shape[0], chunk):
                hc = h[start:start + chunk]
                logits = hc @ w.t()
                logits @ w
                logits.t() @ hc

    return run


def agreement(a: tuple, b: tuple) -> float:
    """Largest relative difference (over the norm of ``b``'s) between paired tensors."""
    return max(float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30))
               for x, y in zip(a, b, strict=True))


def results(call: Callable[[], tuple], inputs: tuple) -> tuple:
    """The outputs of ``call`` and the gradients of its inputs (ones as the upstream)."""
    for i in inputs:
        i.grad = None
    outs = call()
    torch.autograd.backward([o for o in outs if o.requires_grad],
                            [torch.ones_like(o) for o in outs if o.requires_grad])
    got = (*(o.detach() for o in outs), *(i.grad for i in inputs))
    for i in inputs:
        i.grad = None
    return got


def fwd_bwd(call: Callable[[], tuple], inputs: tuple) -> Callable[[], None]:
    def run() -> None:
        outs = [o for o in call() if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for i in inputs:
            i.grad = None

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--hbm-tb-s", type=float, default=4.8,
                   help="the GPU's peak HBM bandwidth (H200: 4.8 TB/s)")
    p.add_argument("--ops", nargs="+", metavar="OP", choices=OPS,
                   help=f"only these operators (default all): {' '.join(OPS)}")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.tokens % a.seq:
        p.error(f"--tokens ({a.tokens}) must be a multiple of --seq ({a.seq})")
    _, _, device, dtype = init()
    sets = {kind: kernel_ops(kind) for kind in Kernels}
    out: dict[str, dict] = {}
    every = cases(a, device, dtype)
    assert tuple(every) == OPS
    for name, (build, inputs, fwd_bytes, bwd_bytes) in every.items():
        if a.ops and name not in a.ops:
            continue
        row: dict = {"fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes}
        for kind, ops in sets.items():
            call = build(ops)
            with torch.no_grad():
                f = timed(call, device, a.warmup, a.repeats)
                f_dev = device_timed(call, device, a.warmup, a.repeats)
            fb = timed(fwd_bwd(call, inputs), device, a.warmup, a.repeats)
            fb_dev = device_timed(fwd_bwd(call, inputs), device, a.warmup, a.repeats)
            row[kind.value] = {
                "fwd_s": f, "fwd_bwd_s": fb, "device_fwd_s": f_dev, "device_fwd_bwd_s": fb_dev,
                "fwd_hbm_fraction": fwd_bytes / f / (a.hbm_tb_s * 1e12),
                "fwd_bwd_hbm_fraction": (fwd_bytes + bwd_bytes) / fb / (a.hbm_tb_s * 1e12),
                "device_fwd_bwd_hbm_fraction": (fwd_bytes + bwd_bytes) / fb_dev
                / (a.hbm_tb_s * 1e12),
            }
        row["fused_speedup_fwd_bwd"] = row["eager"]["fwd_bwd_s"] / row["fused"]["fwd_bwd_s"]
        if name == "cross_entropy":
            row["gemms_fwd_bwd_s"] = device_timed(head_gemms(*inputs), device, a.warmup,
                                                  a.repeats)
            row["fused_vs_eager"] = agreement(results(build(sets[Kernels.fused]), inputs),
                                              results(build(sets[Kernels.eager]), inputs))
        out[name] = row
        print(f"{name:10s} eager {row['eager']['fwd_bwd_s'] * 1e3:8.3f} ms  fused "
              f"{row['fused']['fwd_bwd_s'] * 1e3:8.3f} ms  x{row['fused_speedup_fwd_bwd']:.2f}")
    # the totals are the layers' operators' (the loss's time holds its GEMMs)
    layer = [r for name, r in out.items() if name != "cross_entropy"]
    eager = sum(r["eager"]["fwd_bwd_s"] for r in layer)
    fused = sum(r["fused"]["fwd_bwd_s"] for r in layer)
    on_device = {kind: sum(r[kind]["device_fwd_bwd_s"] for r in layer)
                 for kind in ("eager", "fused")}
    moved = sum(r["fwd_bytes"] + r["bwd_bytes"] for r in layer)
    doc = {
        "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "shapes": {k: getattr(a, k) for k in ("tokens", "seq", "hidden", "heads", "kv_heads",
                                              "head_dim", "ffn", "experts", "top_k", "vocab")},
        "hbm_tb_s": a.hbm_tb_s, "warmup": a.warmup, "repeats": a.repeats, "ops": out,
        "total_fwd_bwd_s": {"eager": eager, "fused": fused},
        "bytes_fraction_fwd_bwd": {
            kind: moved / total / (a.hbm_tb_s * 1e12) if total else None
            for kind, total in (("eager", eager), ("fused", fused))},
        "total_device_fwd_bwd_s": on_device,
        "device_bytes_fraction_fwd_bwd": {
            kind: moved / total / (a.hbm_tb_s * 1e12) if total else None
            for kind, total in on_device.items()},
    }
    write_result(a.out, doc)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
