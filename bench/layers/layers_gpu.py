"""One attention block under Ulysses SP = N vs TP = N, and one MoE FFN block under EP = N
(all-to-all and all-gather dispatch) vs expert TP = N: measured forward and forward + backward
next to the cost model's communication volume and times.

    torchrun --nproc-per-node N -m bench.layers.layers_gpu --out $OUT/layers_xN.json

Three one-layer plans (Mixtral-8x7B width, seq 8192, micro-batch 1, no overlap, no
recomputation: how this runtime executes a layer) are built and parallelised by the runtime
(runtime.parallel.parallelize.parallelize on a one-layer Transformer, weights drawn on the
device): ``sp_ep_a2a`` (Ulysses SP = N, EP = N, all-to-all), ``sp_ep_ag`` (the same with
all-gather / reduce-scatter dispatch; its attention block is the first plan's and is not rerun)
and ``tp_etp`` (Megatron TP = N with sequence parallelism, expert TP = N). The attention block is
x + attention(norm(x)), the FFN block x + moe(norm(x)), on this rank's [1, seq / N, hidden]
sequence shard; CUDA-event medians after warm-up (wall clock on CPU), the slowest rank's.

Predicted, for the same plans: communication volume per rank (cost_models.volumes: each
collective's buffer bytes and the (n-1)/n of it that leaves a rank, forward; backward moves the
same bytes), each collective's time (volumes.transfer_s), the block's forward and backward time
as the sum of its operators in the cost model's layer graph (layer_graph.forward_graph of
layer.layer_key(plan); under overlap none every operator blocks, so the block time is that sum),
and cost_models.layer.layer_timing(plan) for the whole layer. The raw collectives of the same
sizes are timed too (``measured.collectives_fwd_s``). bf16 on CUDA, fp32 with gloo on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench._dist_bench import collective_fn, finish, init, slowest, timed
from bench._meta import metadata
from cost_models import volumes as vol
from cost_models.layer import layer_key, layer_timing
from cost_models.layer_graph import OpKind, forward_graph
from plans import (
    EPFFN,
    TPFFN,
    Degrees,
    Dispatch,
    Overlap,
    Plan,
    Recompute,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)
from plans.layout import tokens_per_rank
from plans.specs import ModelSpec
from runtime.config import ModelConfig
from runtime.model import Transformer
from runtime.parallel.mesh import build_mesh
from runtime.parallel.parallelize import backend_of, parallelize
from runtime.trainer import model_options

OVERRIDES = {  # flag -> ModelSpec field (smoke tests shrink the model)
    "hidden": "hidden", "ffn_hidden": "expert_ffn_hidden", "experts": "experts",
    "heads": "query_heads", "kv_heads": "kv_heads", "head_dim": "head_dim", "vocab": "vocab",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON result (rank 0 writes it)")
    p.add_argument("--model", default="mixtral-8x7b")
    p.add_argument("--cluster", default="h200")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--top-k", type=int, help="override the model's top-k")
    for flag in OVERRIDES:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, dest=flag,
                       help=f"override model.{OVERRIDES[flag]} (smoke tests)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def model_spec(args, name: str | None = None) -> ModelSpec:
    """Catalog model ``name`` (default ``--model``) as one MoE layer, with the override flags
    (``--top-k`` where the script has it; fewer ``--experts`` than the model routes to clip
    the top-k)."""
    base = catalog.load_model(name or args.model)
    update = {field: getattr(args, flag) for flag, field in OVERRIDES.items()
              if getattr(args, flag)}
    if "experts" in update:
        update["top_k"] = min(base.top_k, update["experts"])
    if getattr(args, "top_k", None):
        update["top_k"] = args.top_k
    update.update(layers=1, dense_layers=0, dense_ffn_hidden=0,
                  name=f"{base.name}-1L")
    return ModelSpec.model_validate({**base.model_dump(), **update})


def plans(model: ModelSpec, cluster_name: str, n: int, seq: int) -> dict[str, Plan]:
    common = dict(
        model=model, cluster=catalog.load_cluster(cluster_name, gpus=n),
        training=TrainingSpec(global_batch=1, seq_len=seq), stage_layers=(1,),
        micro_batch_size=1, overlap=Overlap.none, recompute=Recompute.none,
    )
    return {
        "sp_ep_a2a": Plan(degrees=Degrees(sp=n, ep=n), attention=UlyssesAttention(),
                          ffn=EPFFN(dispatch=Dispatch.all_to_all), **common),
        "sp_ep_ag": Plan(degrees=Degrees(sp=n, ep=n), attention=UlyssesAttention(),
                         ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter), **common),
        "tp_etp": Plan(degrees=Degrees(tp=n, etp=n), attention=TPAttention(), ffn=TPFFN(),
                       **common),
    }


# ---- cost model -----------------------------------------------------------------------------


def block_transfers(plan: Plan, block: str) -> tuple[vol.Transfer, ...]:
    m, d, s = plan.model, plan.degrees, plan.training.seq_len
    tokens = tokens_per_rank(plan.micro_batch_size, s, d.attention_group)
    if block == "attention":
        if isinstance(plan.attention, UlyssesAttention):
            return vol.ulysses_attention(m, plan.micro_batch_size, s, d.sp)
        return vol.tp_attention(m, plan.micro_batch_size, s, d.tp)
    if isinstance(plan.ffn, EPFFN):
        return vol.ep_ffn(m, tokens, d.ep, plan.ffn.dispatch)
    return vol.tp_ffn(m, tokens, d.etp)


def predict_block(plan: Plan, block: str) -> dict:
    graph = forward_graph(layer_key(plan))
    ordered = sorted(graph.nodes, key=lambda name: graph.nodes[name]["order"])
    split = ordered.index("attn_residual") + 1
    names = ordered[:split] if block == "attention" else ordered[split:]
    ops = [graph.nodes[name]["op"] for name in names]
    comm = [op for op in ops if op.kind == OpKind.comm]
    transfers = block_transfers(plan, block)
    return {
        "ops": names,
        "fwd_s": sum(op.duration_s for op in ops),
        "bwd_s": sum(sum(op.bwd) for op in ops),
        "fwd_bwd_s": sum(op.duration_s + sum(op.bwd) for op in ops),
        "comm_fwd_s": sum(op.duration_s for op in comm),
        "comm_fwd_bwd_s": sum(op.duration_s + sum(op.bwd) for op in comm),
        "comm_bytes_per_rank_fwd": sum(t.wire_bytes for t in transfers),
        "comm_bytes_per_rank_fwd_bwd": 2 * sum(t.wire_bytes for t in transfers),
        "transfers": [{"kind": t.kind.value, "collective": t.collective.value,
                       "buffer_bytes": t.buffer_bytes, "wire_bytes_per_rank": t.wire_bytes,
                       "group": t.group_size, "predicted_s": vol.transfer_s(t, plan.cluster)}
                      for t in transfers],
    }


def predict_layer(plan: Plan) -> dict:
    t = layer_timing(plan)
    return {"fwd_s": t.fwd_s, "bwd_s": t.bwd_s, "compute_s": t.compute_s,
            "exposed_comm_s": dict(t.exposed_comm_s)}


# ---- measurement ----------------------------------------------------------------------------


def build_block(plan: Plan, rank: int, world: int, device, dtype, seed: int):
    """The runtime's parallelised one-layer model on this rank; weights drawn on the device
    (the same seed on every rank), since their values do not matter for timing."""
    mesh = build_mesh(plan, rank, world, torch.device(device).type)
    with torch.device("meta"):
        model = Transformer(ModelConfig(plan.model, model_options(plan)))
    parallelize(model, plan, mesh, None, backend_of(device))
    model.to_empty(device=device)
    model.to(dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.train()
    return model.layers["0"]


def measure_block(layer, block: str, x: torch.Tensor, grad: torch.Tensor, device, args
                  ) -> dict:
    params = list(layer.parameters())

    def run(backward: bool) -> None:
        for p in params:
            p.grad = None
        xs = x.detach().requires_grad_(backward)
        if block == "attention":
            y = xs + layer.attention(layer.attention_norm(xs))
        else:
            y = xs + layer.moe(layer.ffn_norm(xs))
        if backward:
            y.backward(grad)

    fwd = timed(lambda: run(False), device, args.warmup, args.repeats)
    fwd_bwd = timed(lambda: run(True), device, args.warmup, args.repeats)
    for p in params:
        p.grad = None
    return {"fwd_s": slowest(fwd, device), "fwd_bwd_s": slowest(fwd_bwd, device)}


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, n, device, dtype = init()
    if n < 2:
        print("error: run under torchrun with at least 2 processes", file=sys.stderr)
        return 2
    model = model_spec(args)
    try:
        layouts = plans(model, args.cluster, n, args.seq)
    except ValueError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        finish(n)
        return 2
    h, tokens = model.hidden, int(tokens_per_rank(1, args.seq, n))
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    x = torch.randn(1, tokens, h, device=device, dtype=dtype, generator=gen)
    grad = torch.randn(1, tokens, h, device=device, dtype=dtype, generator=gen)
    blocks: dict[str, dict] = {}
    layers: dict[str, dict] = {}
    for name, plan in layouts.items():
        layer = build_block(plan, rank, n, device, dtype, args.seed)
        layers[name] = {"summary": plan.summary(), "predicted": predict_layer(plan)}
        parts = ("ffn",) if name == "sp_ep_ag" else ("attention", "ffn")
        for block in parts:
            label = {"sp_ep_a2a": {"attention": "ulysses_sp", "ffn": "ep_a2a"},
                     "sp_ep_ag": {"ffn": "ep_ag_rs"},
                     "tp_etp": {"attention": "tp", "ffn": "etp"}}[name][block]
            measured = measure_block(layer, block, x, grad, device, args)
            pred = predict_block(plan, block)
            raw = [slowest(timed(collective_fn(t, device, dtype), device, args.warmup,
                                 args.repeats), device) for t in block_transfers(plan, block)]
            for t, s in zip(pred["transfers"], raw, strict=True):
                t["measured_s"] = s
            measured["collectives_fwd_s"] = sum(raw)
            blocks[label] = {"block": block, "plan": name, "degree": n, "measured": measured,
                             "predicted": pred}
            if rank == 0:
                print(f"{label:10s} {block:9s} fwd+bwd {measured['fwd_bwd_s'] * 1e3:9.3f} ms "
                      f"(pred {pred['fwd_bwd_s'] * 1e3:8.3f})  comm fwd "
                      f"{measured['collectives_fwd_s'] * 1e3:8.3f} ms (pred "
                      f"{pred['comm_fwd_s'] * 1e3:7.3f}, "
                      f"{pred['comm_bytes_per_rank_fwd'] / 2**20:8.1f} MiB/rank)", flush=True)
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        def ratio(a: str, b: str) -> dict:
            return {k: blocks[a]["measured"][k] / blocks[b]["measured"][k]
                    for k in ("fwd_s", "fwd_bwd_s")} | {
                    "predicted_fwd_bwd": blocks[a]["predicted"]["fwd_bwd_s"]
                    / blocks[b]["predicted"]["fwd_bwd_s"]}

        result = {
            **metadata(),
            "benchmark": "attention (Ulysses SP vs TP) and MoE FFN (EP vs expert TP) blocks, "
                         "measured vs cost model",
            "world": n, "backend": dist.get_backend(), "dtype": str(dtype).removeprefix("torch."),
            "model": model.model_dump(), "cluster_spec": args.cluster, "seq_len": args.seq,
            "micro_batch": 1, "tokens_per_rank": tokens,
            "warmup": args.warmup, "repeats": args.repeats,
            "prediction_sources": {
                "comm_bytes_per_rank": "cost_models.volumes transfers: wire bytes leaving a rank",
                "transfers.predicted_s": "cost_models.volumes.transfer_s",
                "fwd_s / bwd_s": "sum of the block's operators in "
                                 "cost_models.layer_graph.forward_graph(layer_key(plan)) "
                                 "(overlap none, recompute none)",
                "layers.*.predicted": "cost_models.layer.layer_timing(plan), whole layer",
            },
            "blocks": blocks,
            "layers": layers,
            "time_ratio_tp_over_ulysses": ratio("tp", "ulysses_sp"),
            "time_ratio_etp_over_ep_a2a": ratio("etp", "ep_a2a"),
            "time_ratio_ep_ag_rs_over_ep_a2a": ratio("ep_ag_rs", "ep_a2a"),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"-> {args.out}")
    finish(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
