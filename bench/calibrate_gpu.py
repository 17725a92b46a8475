"""Measure the kernels and collectives the cost model prices, next to its predictions.

    torchrun --standalone --nproc-per-node 2 bench/calibrate_gpu.py --cluster h200 \
        --out bench/results/calibration_h200.json

Rank 0 times GEMMs, grouped (expert) GEMMs, causal FlashAttention forward + backward and a
device copy on its GPU; then all ranks time NCCL all-to-all, all-gather and reduce-scatter over
a range of sizes (skipped with one process). Every row carries the measured seconds, the cost
model's prediction for the same shape (default efficiency factors of the cluster spec), their
ratio, and the achieved rate, so the efficiency factors can be read off and the model's error
published. Times are medians of CUDA-event-timed repeats after warm-up, on random data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from _meta import write  # noqa: E402

from cost_models import comm as cm  # noqa: E402
from cost_models import compute as cc  # noqa: E402
from plans import Precision, catalog  # noqa: E402
from plans.results import SweepOp  # noqa: E402
from runtime.parallel.comm import all_gather_into, reduce_scatter_into  # noqa: E402

GEMMS = [  # (m, n, k): square, Mixtral expert fc1 / fc2, attention projections, a thin one
    (8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (8192, 4096, 4096),
    (8192, 6144, 4096), (2048, 4096, 4096), (1024, 14336, 4096),
]
GROUPED = [  # (experts, tokens per expert, hidden, ffn)
    (8, 4096, 4096, 14336), (4, 8192, 4096, 14336), (32, 1024, 4096, 14336),
    (16, 2048, 4096, 6400), (128, 256, 2048, 768),
]
ATTENTION = [  # (batch, seq, heads, head_dim)
    (1, 8192, 32, 128), (1, 8192, 4, 128), (2, 4096, 32, 128), (1, 16384, 8, 128),
]
COMM_MIB = [1, 4, 16, 64, 256, 512]


def timed(fn, repeats: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def row(op: SweepOp, name: str, measured: float, predicted: float, work: float, unit: str,
        nbytes: int | None = None) -> dict:
    """One sweep row (plans.results.SweepRow): what ran as op and buffer bytes, the name a
    label for people."""
    sized = {} if nbytes is None else {"bytes": nbytes}
    return {"name": name, "op": op.value, **sized, "measured_s": measured,
            "predicted_s": predicted, "predicted_over_measured": predicted / measured,
            f"achieved_{unit}": work / measured}


def kernels(cluster) -> list[dict]:
    dev = torch.device("cuda")
    out = []
    for m, n, k in GEMMS:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        t = timed(lambda a=a, b=b: a @ b)
        out.append(row(SweepOp.gemm, f"gemm {m}x{n}x{k}", t,
                       cc.gemm_s(m, n, k, cluster, Precision.bf16), 2 * m * n * k / 1e12,
                       "tflops"))
    for e, tpe, h, f in GROUPED:
        x = torch.randn(e * tpe, h, device=dev, dtype=torch.bfloat16)
        w = torch.randn(e, h, f, device=dev, dtype=torch.bfloat16)
        offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * tpe
        t = timed(lambda x=x, w=w, offs=offs: torch._grouped_mm(x, w, offs=offs))
        pred = cc.grouped_gemm_s(e, tpe, f, h, cluster, Precision.bf16)
        out.append(row(SweepOp.grouped_mm, f"grouped_mm {e}x({tpe}x{h} @ {h}x{f})", t, pred,
                       2 * e * tpe * h * f / 1e12, "tflops"))
    for bsz, s, heads, hd in ATTENTION:
        q, k_, v = (torch.randn(bsz, heads, s, hd, device=dev, dtype=torch.bfloat16,
                                requires_grad=True) for _ in range(3))
        fwd = lambda q=q, k_=k_, v=v: F.scaled_dot_product_attention(q, k_, v, is_causal=True)  # noqa: E731
        flops = cc.attention_fwd_flops(bsz, s, s, heads, hd, cc.CAUSAL_FRACTION)
        t_f = timed(fwd)
        g = torch.randn_like(fwd())
        t_fb = timed(lambda q=q, k_=k_, v=v, g=g, fwd=fwd: torch.autograd.grad(
            fwd(q, k_, v), (q, k_, v), g))
        out.append(row(SweepOp.flash_attn, f"flash_attn fwd b{bsz} s{s} h{heads} d{hd}", t_f,
                       cc.flash_attention_fwd_s(flops, cluster), flops / 1e12, "tflops"))
        pred_fb = cc.flash_attention_fwd_s(flops, cluster) + cc.flash_attention_bwd_s(
            flops, cluster)
        out.append(row(SweepOp.flash_attn, f"flash_attn fwd+bwd b{bsz} s{s} h{heads} d{hd}",
                       t_fb, pred_fb, (1 + cc.ATTENTION_BWD_FLOP_RATIO) * flops / 1e12,
                       "tflops"))
    for mib in (256, 1024, 4096):
        x = torch.randn(mib * 2**20 // 2, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        t = timed(lambda x=x, y=y: y.copy_(x))
        moved = 2 * x.numel() * 2  # read + write
        out.append(row(SweepOp.copy, f"copy {mib} MiB", t, cc.memory_s(moved, cluster),
                       moved / 1e12, "tb_s", mib * 2**20))
    return out


def collectives(cluster, world: int) -> list[dict]:
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    layout = cm.group_layout(world, 1, cluster.node.gpus_per_node)
    out = []
    for mib in COMM_MIB:
        full = mib * 2**20
        x = torch.randn(full // 2, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        t = timed(lambda x=x, y=y: dist.all_to_all_single(y, x), repeats=10)
        # all_to_all_s: rank_bytes sent per rank, (n-1)/n of it to peers
        out.append(row(SweepOp.all_to_all, f"all_to_all {mib} MiB/rank", t,
                       cm.all_to_all_s(full, layout, cluster),
                       full * (world - 1) / world / 1e9, "gb_s", full))
        shard = torch.randn(full // 2 // world, device=dev, dtype=torch.bfloat16)
        gathered = torch.empty(shard.numel() * world, device=dev, dtype=torch.bfloat16)
        t = timed(lambda s=shard, g=gathered: all_gather_into(g, s), repeats=10)
        out.append(row(SweepOp.all_gather, f"all_gather {mib} MiB full", t,
                       cm.all_gather_s(full, layout, cluster),
                       full * (world - 1) / world / 1e9, "gb_s", full))
        t = timed(lambda g=gathered, s=shard: reduce_scatter_into(s, g), repeats=10)
        out.append(row(SweepOp.reduce_scatter, f"reduce_scatter {mib} MiB full", t,
                       cm.reduce_scatter_s(full, layout, cluster),
                       full * (world - 1) / world / 1e9, "gb_s", full))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="h200")
    ap.add_argument("--out", default="calibration_h200")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    cluster = catalog.load_cluster(args.cluster, gpus=max(world, 1))
    torch.manual_seed(0)
    rows = kernels(cluster) if rank == 0 else []
    if world > 1:
        dist.init_process_group("nccl")
        rows += collectives(cluster, world)
        dist.destroy_process_group()
    if rank == 0:
        errors = [abs(r["predicted_over_measured"] - 1) for r in rows]
        path = write(Path(args.out).stem, {
            "benchmark": "kernel and collective times vs cost-model predictions",
            "cluster_spec": args.cluster, "world": world, "rows": rows,
            "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors),
        })
        for r in rows:
            rate = next(v for k, v in r.items() if k.startswith("achieved_"))
            print(f"{r['name']:45s} measured {r['measured_s'] * 1e3:9.3f} ms  predicted "
                  f"{r['predicted_s'] * 1e3:9.3f} ms  ratio {r['predicted_over_measured']:5.2f}"
                  f"  rate {rate:8.1f}")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
