"""EP dispatch + combine of the runtime's two dispatchers against top-k, measured next to the
cost model (the dispatcher the planner picks at each point: bench/layers/dispatch_report.py).

    torchrun --nproc-per-node N -m bench.layers.dispatch_gpu --out $OUT/dispatch_xN.json

Measured (N ranks = the EP group): for each top-k, tokens per rank = seq / N (micro-batch 1,
sequence-sharded as under Ulysses SP = EP = N), random routing (k distinct experts per token,
random softmax weights), the runtime's AllToAllDispatcher and AllGatherDispatcher run dispatch
then combine (identity experts), forward alone and forward + backward; CUDA-event medians after
warm-up (wall clock on CPU), the slowest rank's median. The raw collectives of the cost model's
transfers (one per dispatch and one per combine) are timed too.

Predicted, two ways (both from cost_models, no planner):
- ``collectives``: cost_models.volumes.ep_ffn transfers priced by volumes.transfer_s (comm.py);
  backward moves the same bytes reversed, so forward + backward = 2 x forward.
- ``layer_ops``: the operators of the cost model's layer graph (layer_graph.forward_graph of a
  Plan with EPFFN(dispatch=...), sp = ep = N, overlap none, no recomputation) that the
  dispatchers execute: the permutation / local scatter and gather memory passes and the two
  collectives, forward durations and backward durations; plus layer_timing(plan)'s exposed
  ep_dispatch + ep_combine time (forward + backward, which under overlap none is the collectives').

The crossover top-k is the first k at which all-gather + reduce-scatter is faster than
all-to-all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench._dist_bench import collective_fn, finish, init, slowest, timed
from bench._meta import bad_input, write_result
from cost_models import volumes as vol
from cost_models.layer import layer_key, layer_timing
from cost_models.layer_graph import forward_graph
from planner.dispatch_fit import point_plan
from plans import (
    TIMER_OF,
    Component,
    Dispatch,
    catalog,
)
from plans.layout import tokens_per_rank
from plans.notation import DISPATCH_KEYS
from plans.specs import ModelSpec
from runtime.moe import Routing
from runtime.parallel.expert import AllGatherDispatcher, AllToAllDispatcher

DISPATCHES = (Dispatch.all_to_all, Dispatch.allgather_reduce_scatter)
SHORT = {d: DISPATCH_KEYS[d] for d in DISPATCHES}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON result (rank 0 writes it)")
    p.add_argument("--model", default="mixtral-8x7b")
    p.add_argument("--cluster", default="h200")
    p.add_argument("--hidden", type=int, help="override the model's hidden size (smoke tests)")
    p.add_argument("--experts", type=int, help="override the model's expert count")
    p.add_argument("--seq", type=int, default=8192, help="sequence length (micro-batch 1)")
    p.add_argument("--max-top-k", type=int, default=8)
    p.add_argument("--sweep-hidden", type=_ints, help="comma-separated hidden sizes to sweep")
    p.add_argument("--sweep-experts", type=_ints, help="comma-separated expert counts to sweep")
    p.add_argument("--sweep-seq", type=_ints,
                   help="comma-separated sequence lengths to sweep (tokens per rank = seq / N)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def crossover(rows: list[dict], key: str) -> int | None:
    """First top-k at which all-gather + reduce-scatter takes less time than all-to-all."""
    for r in rows:
        a2a, ag = (_get(r, SHORT[d], key) for d in DISPATCHES)
        if ag < a2a:
            return r["top_k"]
    return None


def _get(row: dict, dispatcher: str, key: str) -> float:
    node = row[dispatcher]
    for part in key.split("."):
        node = node[part]
    return node


# ---- cost model -----------------------------------------------------------------------------


def predict(model: ModelSpec, cluster_name: str, n: int, seq: int, dispatch: Dispatch) -> dict:
    cluster = catalog.load_cluster(cluster_name, gpus=n)
    tokens = tokens_per_rank(1, seq, n)  # the sequence sharded over sp = ep = n
    transfers = vol.ep_ffn(model, tokens, n, dispatch)
    coll = [vol.transfer_s(t, cluster) for t in transfers]
    plan = point_plan(model, cluster, n, seq, dispatch)
    graph = forward_graph(layer_key(plan))
    # the operators the runtime's dispatcher times (its dispatch and combine regions)
    ops = [op for _, op in graph.nodes(data="op")
           if TIMER_OF[op.operator] in (Component.dispatch, Component.combine)]
    fwd = sum(op.duration_s for op in ops)
    bwd = sum(sum(op.bwd) for op in ops)
    timing = layer_timing(plan)
    return {
        "transfers": [{"kind": t.kind.value, "collective": t.collective.value,
                       "buffer_bytes": t.buffer_bytes, "wire_bytes_per_rank": t.wire_bytes,
                       "predicted_s": s} for t, s in zip(transfers, coll, strict=True)],
        "collectives": {"fwd_s": sum(coll), "fwd_bwd_s": 2 * sum(coll)},
        "layer_ops": {"ops": [op.name for op in ops], "fwd_s": fwd, "fwd_bwd_s": fwd + bwd},
        "layer_timing_exposed_s": sum(timing.exposed_comm_s.get(k, 0.0)
                                      for k in ("ep_dispatch", "ep_combine")),
    }


# ---- measurement ----------------------------------------------------------------------------


def measure_rows(args, hidden: int, experts: int, seq: int, rank: int, n: int, device, dtype,
                 gen) -> list[dict]:
    """Every top-k of one shape: both dispatchers' dispatch + combine (forward, forward +
    backward), the raw collectives of the cost model's transfers, and the predictions."""
    group = dist.group.WORLD
    tokens = int(tokens_per_rank(1, seq, n))
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    rows = []
    for k in range(1, min(args.max_top_k, experts) + 1):
        model = shape_spec(args, hidden, experts, k)
        scores = torch.rand(tokens, experts, device=device, generator=gen)
        indices = scores.topk(k, dim=-1).indices
        logits = torch.randn(tokens, k, device=device, generator=gen)
        row: dict = {"top_k": k, "tokens_per_rank": tokens}
        for d in DISPATCHES:
            if d == Dispatch.all_to_all:
                disp = AllToAllDispatcher(experts, group, n)
            else:
                disp = AllGatherDispatcher(experts, group, n, rank)

            def step(backward: bool, disp=disp, logits=logits, indices=indices):
                xs = x.detach().requires_grad_(backward)
                w = torch.softmax(logits, -1).requires_grad_(backward)
                routing = Routing(indices, w, torch.zeros((), device=device))
                rows_, _, handle = disp.dispatch(xs, routing)
                y = disp.combine(rows_, handle)
                if backward:
                    y.backward(grad_out)

            fwd = timed(lambda step=step: step(False), device, args.warmup, args.repeats)
            fwd_bwd = timed(lambda step=step: step(True), device, args.warmup, args.repeats)
            pred = predict(model, args.cluster, n, seq, d)
            raw = [slowest(timed(collective_fn(t, device, dtype), device, args.warmup,
                                 args.repeats), device) for t in vol.ep_ffn(model, tokens, n, d)]
            for t, s in zip(pred["transfers"], raw, strict=True):
                t["measured_s"] = s
            row[SHORT[d]] = {
                "measured": {"fwd_s": slowest(fwd, device), "fwd_bwd_s": slowest(fwd_bwd, device),
                             "collectives_fwd_s": sum(raw)},
                "predicted": pred,
            }
        rows.append(row)
        if rank == 0:
            a, g = row["a2a"], row["ag_rs"]
            print(f"h{hidden} e{experts} t{tokens} top-{k}: a2a "
                  f"{a['measured']['fwd_bwd_s'] * 1e3:8.3f} ms (pred "
                  f"{a['predicted']['layer_ops']['fwd_bwd_s'] * 1e3:7.3f})  ag+rs "
                  f"{g['measured']['fwd_bwd_s'] * 1e3:8.3f} ms (pred "
                  f"{g['predicted']['layer_ops']['fwd_bwd_s'] * 1e3:7.3f})  fwd+bwd", flush=True)
    return rows


def shape_spec(args, hidden: int, experts: int, top_k: int) -> ModelSpec:
    base = catalog.load_model(args.model)
    return ModelSpec.model_validate({**base.model_dump(), "hidden": hidden, "experts": experts,
                                     "top_k": top_k})


def sweep_shapes(args) -> list[tuple[int, int, int]]:
    """(hidden, experts, seq) of every measured shape: the grid of --sweep-* lists, or the one
    shape of --hidden / --experts / --seq (the model's where not given)."""
    base = catalog.load_model(args.model)
    hiddens = args.sweep_hidden or [args.hidden or base.hidden]
    expert_counts = args.sweep_experts or [args.experts or base.experts]
    seqs = args.sweep_seq or [args.seq]
    return [(h, e, s) for h in hiddens for e in expert_counts for s in seqs]


def measure(args) -> int:
    rank, n, device, dtype = init()
    if n < 2:
        return bad_input("run under torchrun with at least 2 processes (the EP group)")
    shapes = sweep_shapes(args)
    for _h, experts, seq in shapes:
        if experts % n or seq % n:
            return bad_input(f"{n} ranks must divide the experts ({experts}) and the "
                             f"sequence ({seq})")
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    configs = []
    for h, experts, seq in shapes:
        rows = measure_rows(args, h, experts, seq, rank, n, device, dtype, gen)
        configs.append({"hidden": h, "experts": experts, "seq_len": seq,
                        "tokens_per_rank": rows[0]["tokens_per_rank"], "rows": rows,
                        "crossover_top_k": crossovers(rows)})
    if rank == 0:
        first = configs[0]
        result = {
            "benchmark": "EP dispatch + combine vs top-k: runtime dispatchers vs cost model",
            "world": n,
            "backend": dist.get_backend(),
            "dtype": str(dtype).removeprefix("torch."),
            "model": args.model, "cluster_spec": args.cluster, "hidden": first["hidden"],
            "experts": first["experts"], "seq_len": first["seq_len"], "micro_batch": 1,
            "tokens_per_rank": first["tokens_per_rank"],
            "warmup": args.warmup, "repeats": args.repeats,
            "prediction_sources": {
                "collectives": "cost_models.volumes.ep_ffn + volumes.transfer_s (comm.py); "
                               "fwd_bwd = 2 x fwd",
                "layer_ops": "operators of cost_models.layer_graph.forward_graph for a Plan "
                             "with EPFFN(dispatch), sp = ep = N, overlap none, recompute none: "
                             "forward durations + backward durations",
                "layer_timing_exposed_s": "cost_models.layer.layer_timing(plan).exposed_comm_s"
                                          "[ep_dispatch + ep_combine], forward + backward",
            },
            "rows": first["rows"],
            "crossover_top_k": first["crossover_top_k"],
            "configs": configs,
        }
        write_result(args.out, result)
        print(f"{len(configs)} shapes -> {args.out}")
    finish(n)
    return 0


def crossovers(rows: list[dict]) -> dict:
    return {
        "measured_fwd": crossover(rows, "measured.fwd_s"),
        "measured_fwd_bwd": crossover(rows, "measured.fwd_bwd_s"),
        "measured_collectives_fwd": crossover(rows, "measured.collectives_fwd_s"),
        "predicted_collectives": crossover(rows, "predicted.collectives.fwd_s"),
        "predicted_layer_ops_fwd_bwd": crossover(rows, "predicted.layer_ops.fwd_bwd_s"),
    }


def main(argv=None) -> int:
    return measure(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
