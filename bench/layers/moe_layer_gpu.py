"""One MoE layer, forward + backward: serial against inter-operator overlapped, with its compute
and its communication measured alone, beside torchtitan's MoE layer on the same shapes.

    torchrun --nproc-per-node N -m bench.layers.moe_layer_gpu --out $OUT/moe_layer_xN.json
    (N = 1: our layer and the peer on one GPU; N = 2: the EP = 2 group)

Shapes (``SHAPES``, tokens per rank ``--tokens``, default 16k, micro-batch of one layer):
by default Mixtral-8x7B (hidden 4096, expert FFN 14336, 8 experts, top-2) and Qwen3-30B-A3B
(hidden 2048, expert FFN 768, 128 experts, top-8); ``--shapes`` adds Phi-3.5-MoE, DeepSeekMoE,
Qwen3-235B-A22B and DeepSeek-V3's routed experts. The layer is runtime.moe.MoE (router over
all tokens, dispatcher, SwiGLU experts whose GEMMs run as ``--expert-gemm`` says, combine),
weights N(0, 0.02), input N(0, 1), bf16 on CUDA
(fp32 on CPU). Per EP dispatcher (N > 1: all-to-all and all-gather / reduce-scatter; N = 1:
the local permutation) the variants are:

- ``serial``: the plain layer, every collective blocking (plan overlap none);
- ``inter_op``: runtime.parallel.overlap's chunked schedule (plans.layout.INTER_OP_CHUNKS token
  chunks: the collectives alone on a communication stream beside the expert GEMMs and
  permutations, what the runtime runs for plan overlap inter_op) (N > 1 only);
- ``compute_alone``: the same router and expert GEMMs with no token movement between ranks:
  the layer on one rank with its E / N local experts (same rows per expert under balanced
  routing, the local permutation instead of the dispatcher);
- ``comm_alone``: the dispatcher's dispatch and combine with identity experts (its collectives
  and permutations, forward + backward).

``overlap_target`` holds inter_op against 1.1 x max(compute_alone, comm_alone) (issue 11's
target). The peer is torchtitan's ``torchtitan.models.common.moe.MoE`` (the 0.3.0 wheel carried
in .whl/ with what its import needs beyond the device image: spmd_types 0.2.3, tyro,
docstring-parser and typeguard; softmax router with renormalised top-k, no load-balance bias):
on one GPU with its local dispatcher; at N = 2 with its AllToAllTokenDispatcher on a
one-dimensional EP DeviceMesh and E / N local experts as plain tensors (what
RoutedExperts.parallelize wires, without DTensor parameters). Where it cannot be imported or
built, the result records the reason instead. Timing: CUDA events (wall clock on CPU), median
after warm-up, the slowest rank's median; the ranks line up at a barrier before each repeat.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from bench._dist_bench import finish, init, release, slowest, timed
from bench._meta import bad_input, package_version, write_result
from plans import Kernels
from plans.catalog import load_model
from plans.enums import ExpertGemm
from plans.layout import INTER_OP_CHUNKS
from runtime.kernels import kernel_ops
from runtime.moe import MoE, Router, Routing
from runtime.parallel.expert import AllGatherDispatcher, AllToAllDispatcher
from runtime.parallel.grad_accumulation import fuse_accumulation, in_gemm, mark_parameters
from runtime.parallel.overlap import ChunkedExpertFFN

SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "phi-3.5-moe", "deepseekmoe", "qwen3-235b-a22b",
          "deepseek-v3")
"""The MoE layers of issues 11 (the first two, the default) and 34: the catalog models'
hidden, expert FFN, experts and top-k."""
DEFAULT_SHAPES = ["mixtral-8x7b", "qwen3-30b-a3b"]

OVERLAP_TARGET = 1.1
"""An overlapped layer within 1.1 x max(its compute, its communication) measured alone."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON result (rank 0 writes it)")
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=SHAPES)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--scale", type=int, default=1,
                   help="divide hidden and FFN widths by this (CPU smoke runs)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peer", action="store_true", help="skip torchtitan's layer")
    p.add_argument("--grad-accumulation-fusion", action="store_true",
                   help="our layer as a plan with grad_accumulation_fusion runs it: the router's "
                        "gate and, where plans.layout.accumulates_experts_in_gemm holds, the "
                        "experts add their weight gradients into bf16 main gradients in the "
                        "GEMMs (runtime.parallel.grad_accumulation)")
    p.add_argument("--kernels", choices=["eager", "fused"], default="eager",
                   help="our layer's memory-bound operators (plan kernels: runtime.kernels)")
    p.add_argument("--expert-gemm", choices=[g.value for g in ExpertGemm],
                   default=ExpertGemm.grouped.value,
                   help="our experts' GEMM path (plans.enums.ExpertGemm, runtime.moe)")
    p.add_argument("--sm-carveout", type=int, default=0,
                   help="SMs the GEMMs leave free during the inter-op variant "
                        "(torch._C._set_sm_carveout_experimental; pair with NCCL_MAX_CTAS)")
    p.add_argument("--trace", action="store_true",
                   help="profile one inter-op step: each stream's busy time and how much of "
                        "it ran beside another stream's kernels")
    p.add_argument("--chunks", type=int, default=INTER_OP_CHUNKS,
                   help="token chunks of the inter-op schedule (the runtime runs "
                        "plans.layout.INTER_OP_CHUNKS)")
    return p.parse_args(argv)


def shape_of(args, name: str) -> dict:
    m = load_model(name)
    return dict(hidden=m.hidden // args.scale, ffn=m.expert_ffn_hidden // args.scale,
                experts=m.experts, top_k=m.top_k)


# ---- our layer ------------------------------------------------------------------------------


def build_moe(shape: dict, local_experts: int, device, dtype, seed: int, ops,
              accumulate: bool = False, gemm: ExpertGemm = ExpertGemm.grouped):
    """runtime.moe.MoE with every expert weight N(0, 0.02) (the router's gate too), holding
    ``local_experts`` of the shape's experts; the router still routes over all of them.
    ``ops``: the memory-bound operators' kernels (runtime.kernels.kernel_ops); ``gemm``: the
    experts' GEMM path (plans.enums.ExpertGemm). ``accumulate``:
    gradient-accumulation fusion as the runtime applies it, each routed weight's gradient
    added into a main gradient in the parameters' dtype (a bf16 sync's), kept across steps as
    a step's micro-batches add into it."""
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs (GBs of experts at full width)
        moe = MoE(shape["hidden"], local_experts, shape["top_k"], shape["ffn"],
                  balance_groups=1, ops=ops, gemm=gemm)
        moe.router = Router(shape["hidden"], shape["experts"], shape["top_k"], 1, ops=ops)
    for p in moe.parameters():
        nn.init.normal_(p, 0.0, 0.02)
    moe = moe.to(dtype=dtype)
    if accumulate:
        fuse_accumulation(moe)
        mark_parameters(moe)
        for p in moe.parameters():
            if in_gemm(p):
                p.main_grad = torch.zeros_like(p)
    return moe


def step_fn(layer, x, grad_out):
    """Forward + backward of ``layer`` on ``x`` (gradients dropped first, as a step after the
    optimizer's zero_grad)."""
    params = list(layer.parameters())

    def step():
        for p in params:
            p.grad = None
        xs = x.detach().requires_grad_()
        layer(xs).backward(grad_out)

    return step


def carved(fn, sms: int):
    """``fn`` with the GEMMs (cuBLAS and the CUTLASS grouped GEMM) launched on all but ``sms``
    SMs, left free for the collectives beside them (0: every SM)."""
    if sms == 0:
        return fn

    def run():
        before = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(sms)
        try:
            fn()
        finally:
            torch._C._set_sm_carveout_experimental(before)

    return run


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in spans)


def _intersect(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def stream_overlap(fn) -> dict:
    """One profiled call of ``fn`` (after a synchronise): the wall span of its kernels, each
    CUDA stream's busy time (union of its kernels' intervals) and kernel count, and the time two
    or more streams had kernels running at once (what an overlapped schedule hides)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_stream: dict[int, list[tuple[int, int]]] = {}
    names: dict[int, dict[str, int]] = {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.duration_ns() <= 0:
            continue
        stream = e.device_resource_id()
        per_stream.setdefault(stream, []).append((e.start_ns(), e.start_ns() + e.duration_ns()))
        kind = "nccl" if "nccl" in e.name().lower() else (
            "gemm" if "gemm" in e.name().lower() or "cutlass" in e.name().lower() else "other")
        names.setdefault(stream, {}).setdefault(kind, 0)
        names[stream][kind] += e.duration_ns()
    unions = {s: _union(v) for s, v in per_stream.items()}
    spans = [x for v in per_stream.values() for x in v]
    wall = (max(b for _, b in spans) - min(a for a, _ in spans)) if spans else 0
    busy_any = _length(_union(spans))
    ordered = sorted(unions)
    both = 0
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            both += _length(_intersect(unions[a], unions[b]))
    return {
        "wall_ms": wall / 1e6, "busy_any_ms": busy_any / 1e6, "concurrent_ms": both / 1e6,
        "streams": {str(s): {"busy_ms": _length(u) / 1e6, "kernels": len(per_stream[s]),
                             "kind_ms": {k: v / 1e6 for k, v in names[s].items()}}
                    for s, u in unions.items()},
    }


def comm_fn(dispatcher, shape, x, grad_out, device):
    """Dispatch then combine with identity experts, forward + backward, under the layer's routing
    statistics (top-k of random scores: balanced in expectation)."""
    t, k, e = x.shape[0], shape["top_k"], shape["experts"]
    gen = torch.Generator(device=device).manual_seed(7)
    indices = torch.rand(t, e, device=device, generator=gen).topk(k, dim=-1).indices
    logits = torch.randn(t, k, device=device, generator=gen)

    def step():
        xs = x.detach().requires_grad_()
        w = torch.softmax(logits, -1).requires_grad_()
        rows, _, handle = dispatcher.dispatch(xs, Routing(indices, w, torch.zeros((),
                                                                                    device=device)))
        dispatcher.combine(rows, handle).backward(grad_out)

    return step


# ---- the peer -------------------------------------------------------------------------------


def build_peer(shape: dict, n: int, device, dtype, seed: int):
    """torchtitan 0.3.0's MoE at ``shape`` (EP over the world when n > 1); raises if torchtitan
    is missing or its API differs."""
    from torchtitan.models.common import moe as tt
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import (
        AllToAllTokenDispatcher,
        LocalTokenDispatcher,
    )

    e, k = shape["experts"], shape["top_k"]
    dispatcher = (AllToAllTokenDispatcher.Config(num_experts=e, top_k=k) if n > 1
                  else LocalTokenDispatcher.Config(num_experts=e, top_k=k))
    config = tt.MoE.Config(
        num_experts=e,
        routed_experts=tt.RoutedExperts.Config(
            inner_experts=tt.GroupedExperts.Config(dim=shape["hidden"], hidden_dim=shape["ffn"],
                                                   num_experts=e // n),
            token_dispatcher=dispatcher),
        router=tt.TokenChoiceTopKRouter.Config(
            num_experts=e, gate=Linear.Config(in_features=shape["hidden"], out_features=e),
            top_k=k, score_func="softmax", route_norm=True),
        load_balance_coeff=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        peer = config.build()
    for p in peer.parameters():
        nn.init.normal_(p, 0.0, 0.02)
    peer = peer.to(dtype=dtype)
    if n > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.distributed.utils import set_spmd_backend

        # torchtitan 0.3.0's all-to-all dispatcher asks torch.compiler._is_non_strict_tracing()
        # (torch >= 2.12) whether it is being traced; the device machines' torch 2.11 lacks it.
        # This layer runs eagerly, never under a tracer, so it is answered False, what newer
        # torch returns outside tracing.
        if not hasattr(torch.compiler, "_is_non_strict_tracing"):
            torch.compiler._is_non_strict_tracing = lambda: False

        # torchtitan 0.3.0's default SPMD backend is "spmd_types": there the all-to-all
        # dispatcher takes its group from the runtime mesh its trainer pushes
        # (current_spmd_mesh().get_group("ep"), None without that trainer: "'NoneType' object
        # has no attribute 'get_group'"), not from the wired ep_mesh. Its trainer sets the
        # backend from parallelism.spmd_backend first; "partial_dtensor" (DTensor only on
        # model-parallel axes; this layer has none) dispatches over the wired ep_mesh.
        set_spmd_backend("partial_dtensor")
        mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("ep",))
        peer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return peer


def peer_result(args, shape, n, device, dtype, x, grad_out) -> dict:
    """The peer's forward + backward time, or why it did not run (every rank agrees: a rank
    that fails tells the others through an all-reduce before anyone times)."""
    if args.no_peer:
        return {"status": "skipped", "reason": "--no-peer"}
    peer = error = None
    try:
        peer = build_peer(shape, n, device, dtype, args.seed)
        params = list(peer.parameters())

        def run():
            for p in params:
                p.grad = None
            xs = x.detach().requires_grad_()
            peer(xs.unsqueeze(0)).squeeze(0).backward(grad_out)

        run()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc()
    ok = torch.tensor([0.0 if error else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error or float(ok) < 1:
        return {"status": "unavailable", "reason": error or "failed on another rank"}
    s = slowest(timed(run, device, args.warmup, args.repeats), device)
    return {"status": "ok", "module": "torchtitan.models.common.moe.MoE",
            "version": package_version("torchtitan"), "fwd_bwd_s": s}


# ---- measurement ----------------------------------------------------------------------------


def measure(args) -> int:
    rank, n, device, dtype = init()
    ops = kernel_ops(Kernels(args.kernels))
    gemm = ExpertGemm(args.expert_gemm)
    group = dist.group.WORLD if n > 1 else None
    shapes = {}
    for name in args.shapes:
        shape = shape_of(args, name)
        if shape["experts"] % n:
            return bad_input(f"{n} ranks must divide the experts ({shape['experts']})")
        gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
        x = torch.randn(args.tokens, shape["hidden"], device=device, dtype=dtype, generator=gen)
        grad_out = torch.randn_like(x)
        local = shape["experts"] // n
        row: dict = {**shape, "tokens_per_rank": args.tokens, "local_experts": local}

        def time_of(fn) -> float:
            return slowest(timed(fn, device, args.warmup, args.repeats), device)

        # the layer's local experts routed to by a router over them alone: the rows per local
        # expert of the EP layer under balanced routing (n T k / E), no token movement
        alone = build_moe({**shape, "experts": local, "top_k": min(shape["top_k"], local)},
                          local, device, dtype, args.seed, ops, args.grad_accumulation_fusion,
                          gemm)
        compute = time_of(step_fn(alone, x, grad_out))
        carved_compute = (time_of(carved(step_fn(alone, x, grad_out), args.sm_carveout))
                          if args.sm_carveout else None)
        del alone
        dispatchers = {"local": None} if n == 1 else {
            "a2a": lambda e=shape["experts"]: AllToAllDispatcher(e, group, n, ops=ops),
            "ag_rs": lambda e=shape["experts"]: AllGatherDispatcher(e, group, n, rank, ops=ops),
        }
        for label, make in dispatchers.items():
            moe = build_moe(shape, local, device, dtype, args.seed, ops,
                            args.grad_accumulation_fusion, gemm)
            if make is not None:
                moe.dispatcher = make()
            variants = {"serial": time_of(step_fn(moe, x, grad_out))}
            if make is not None:
                variants["comm_alone"] = time_of(comm_fn(make(), shape, x, grad_out, device))
                moe.expert_ffn = ChunkedExpertFFN(moe, args.chunks)
                variants["inter_op"] = time_of(carved(step_fn(moe, x, grad_out),
                                                      args.sm_carveout))
                if args.trace and device.type == "cuda":
                    row.setdefault("trace", {}).setdefault(label, {})["inter_op"] = (
                        stream_overlap(carved(step_fn(moe, x, grad_out), args.sm_carveout)))
                bound = max(compute, variants["comm_alone"])
                variants["overlap_target"] = {
                    "bound_s": bound, "ratio": variants["inter_op"] / bound,
                    "met": variants["inter_op"] <= OVERLAP_TARGET * bound}
            variants["compute_alone"] = compute
            if args.trace and device.type == "cuda":
                vars(moe).pop("expert_ffn", None)  # the plain layer again (MoE.expert_ffn)
                row.setdefault("trace", {}).setdefault(label, {})["serial"] = (
                    stream_overlap(step_fn(moe, x, grad_out)))
                if rank == 0:
                    print(f"{name} {label} trace: {json.dumps(row['trace'][label])}",
                          flush=True)
            if carved_compute is not None:
                variants["compute_alone_carved"] = carved_compute
            row[label] = {"fwd_bwd_s": variants}
            del moe
            if rank == 0:
                text = "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in variants.items()
                                 if isinstance(v, float))
                print(f"{name} {label}: {text}", flush=True)
        row["peer"] = peer_result(args, shape, n, device, dtype, x, grad_out)
        # our layer as a plan would run it: the faster dispatcher and overlap setting
        ours = min(min(v["fwd_bwd_s"]["serial"], v["fwd_bwd_s"].get("inter_op", float("inf")))
                   for k, v in row.items() if k in ("local", "a2a", "ag_rs"))
        if row["peer"]["status"] == "ok":
            row["peer"]["our_speedup"] = row["peer"]["fwd_bwd_s"] / ours
        if rank == 0:
            print(f"{name} peer: {json.dumps(row['peer'])}", flush=True)
        shapes[name] = row
        release(device)
    if rank == 0:
        result = {
            "benchmark": "one MoE layer forward + backward: serial, inter-operator overlapped, "
                         "compute and communication alone, torchtitan's layer",
            "world": n, "backend": dist.get_backend() if n > 1 else "none",
            "dtype": str(dtype).removeprefix("torch."), "inter_op_chunks": args.chunks,
            "kernels": args.kernels, "expert_gemm": args.expert_gemm,
            "grad_accumulation_fusion": args.grad_accumulation_fusion,
            "sm_carveout": args.sm_carveout,
            "warmup": args.warmup, "repeats": args.repeats, "scale": args.scale,
            "overlap_target": f"inter_op <= {OVERLAP_TARGET} x max(compute_alone, comm_alone)",
            "shapes": shapes,
        }
        write_result(args.out, result)
        print(f"wrote {args.out}")
    finish(n)
    return 0


if __name__ == "__main__":
    sys.exit(measure(parse_args()))
