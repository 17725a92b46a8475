"""One attention block, forward + backward, as the runtime runs it, per kernel set and
recomputation: on one GPU the block alone, under Ulysses SP = N its all-to-alls' exposed time.

    torchrun --nproc-per-node N bench/attention_block_gpu.py --out $OUT/attention_block_xN.json
    (N = 1: one GPU, no communication; N = 2: Ulysses SP = 2 over NCCL)

The block is x + attention(attention_norm(x)) of a one-layer model built and parallelised by the
runtime from a plan (runtime.parallel.parallelize: Ulysses SP = N and EP = N, overlap none,
``kernels`` and ``recompute`` as the variant says; bench/layers_gpu.build_block), at the
attention shapes of the catalog models (``--models``; Mixtral-8x7B: hidden 4096, 32 query and 8
KV heads of 128; Qwen3-30B-A3B: hidden 2048, 32 and 4 heads of 128 with QK norm), ``--batch``
sequences of ``--seq`` tokens (default 4 x 4,096: 16k tokens, the MoE layer bench's), each rank
holding seq / N tokens of every sequence. Variants, for each kernel set (``--kernels``) and
recomputation (``--recompute``: none, or selective, which reruns RoPE and SDPA in backward):

- ``block``: the runtime's block; at N > 1 its four all-to-alls (q, k, v to head shards, the
  output back; runtime.parallel.attention.UlyssesCore) block, as the runtime runs them under
  every overlap setting (plans.execution: the attention's collectives block);
- ``compute_alone`` (N > 1): the same block with each all-to-all replaced by its local pack and
  unpack (the same copies, no exchange): what the block would take with its communication
  hidden entirely;
- ``comm_alone`` (N > 1, once per model): the four all-to-alls forward + backward on tensors of
  the block's shapes, pack and unpack included.

``exposed_comm`` = block - compute_alone; ``predicted`` is the cost model's block for the same
plan (``--cluster``, default the fitted ``h200-runtime``): its attention operators forward and
backward, recomputed ones included, summed as overlap none runs them. Timing: CUDA events
(wall clock on CPU), median after warm-up, the slowest rank's; ranks line up at a barrier
before each repeat (bench/_dist_bench).
bf16 on CUDA, fp32 over gloo on CPU (smoke tests shrink the model with the override flags).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _dist_bench import finish, init, slowest, timed  # noqa: E402
from _meta import metadata  # noqa: E402
from layers_gpu import OVERRIDES, build_block, model_spec  # noqa: E402

from cost_models.layer import layer_key  # noqa: E402
from cost_models.layer_graph import OpKind, backward_graph, forward_graph  # noqa: E402
from plans import (  # noqa: E402
    EPFFN,
    Degrees,
    Dispatch,
    Kernels,
    Overlap,
    Plan,
    Recompute,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)
from plans.io import write_atomic  # noqa: E402
from plans.specs import ModelSpec  # noqa: E402
from runtime.parallel.attention import UlyssesCore  # noqa: E402
from runtime.parallel.comm import head_to_seq, seq_to_head  # noqa: E402

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
"""Issue 11's two shapes (the MoE layer bench's), here their attention."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON result (rank 0 writes it)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--cluster", default="h200-runtime",
                   help="catalog cluster of the plans (the cost model's prediction)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences")
    p.add_argument("--kernels", nargs="+", default=[k.value for k in Kernels],
                   choices=[k.value for k in Kernels])
    p.add_argument("--recompute", nargs="+", default=["none", "selective"],
                   choices=["none", "selective"])
    for flag in OVERRIDES:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, dest=flag,
                       help=f"override model.{OVERRIDES[flag]} (smoke tests)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def block_plan(model: ModelSpec, args, n: int, kernels: Kernels, recompute: Recompute) -> Plan:
    return Plan(
        model=model, cluster=catalog.load_cluster(args.cluster, gpus=n),
        training=TrainingSpec(global_batch=args.batch, seq_len=args.seq), stage_layers=(1,),
        micro_batch_size=args.batch, degrees=Degrees(sp=n, ep=n),
        attention=UlyssesAttention(), ffn=EPFFN(dispatch=Dispatch.all_to_all),
        overlap=Overlap.none, recompute=recompute, kernels=kernels,
    )


def predict(plan: Plan) -> dict:
    """The cost model's block: its attention operators (the forward graph up to the attention
    residual) forward, and their nodes of the backward graph (recomputed ones included); under
    overlap none every operator blocks, so the block is their sum."""
    fwd = forward_graph(layer_key(plan))
    order = sorted(fwd.nodes, key=lambda name: fwd.nodes[name]["order"])
    block = [fwd.nodes[name]["op"] for name in order[:order.index("attn_residual") + 1]]
    operators = {op.operator for op in block}
    bwd = [node["op"] for node in backward_graph(fwd, plan.recompute).nodes.values()
           if node["op"].operator in operators]
    ops = block + bwd
    return {"block_s": sum(op.duration_s for op in ops),
            "comm_s": sum(op.duration_s for op in ops if op.kind == OpKind.comm),
            "recompute_s": sum(op.duration_s for op in bwd if op.recompute)}


# ---- the all-to-alls' local stand-ins (compute alone) ---------------------------------------


def local_seq_to_head(x: torch.Tensor, n: int) -> torch.Tensor:
    """runtime.parallel.comm._seq_to_head's pack and unpack without the exchange: this rank's
    own rows stand in for its peers' ([b, s/n, H, d] -> [b, s, H/n, d])."""
    b, s_local, heads, d = x.shape
    send = x.reshape(b, s_local, n, heads // n, d).permute(2, 0, 1, 3, 4).contiguous()
    return send.permute(1, 0, 2, 3, 4).reshape(b, n * s_local, heads // n, d)


def local_head_to_seq(x: torch.Tensor, n: int) -> torch.Tensor:
    """runtime.parallel.comm._head_to_seq's pack and unpack without the exchange
    ([b, s, H/n, d] -> [b, s/n, H, d])."""
    b, s, heads_local, d = x.shape
    send = x.reshape(b, n, s // n, heads_local, d).permute(1, 0, 2, 3, 4).contiguous()
    return send.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * heads_local, d)


LOCAL = {seq_to_head: local_seq_to_head, head_to_seq: local_head_to_seq}


class LocalUlyssesCore(UlyssesCore):
    """UlyssesCore whose all-to-alls stay on the rank (the block's compute alone)."""

    def _a2a(self, fn, x: torch.Tensor) -> torch.Tensor:
        return LOCAL[fn](x, self.size)


# ---- measurement ----------------------------------------------------------------------------


def step_fn(layer, x: torch.Tensor, grad: torch.Tensor):
    params = list(layer.parameters())

    def run() -> None:
        for p in params:
            p.grad = None
        xs = x.detach().requires_grad_(True)
        y = xs + layer.attention(layer.attention_norm(xs))
        y.backward(grad)

    return run


def comm_fn(model: ModelSpec, args, n: int, device, dtype, group):
    """The block's four all-to-alls, forward + backward, on tensors of its shapes."""
    b, s, d = args.batch, args.seq, model.head_dim
    kv = max(model.kv_heads, n)  # UlyssesCore replicates KV heads fewer than n first
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    inputs = [make(b, s // n, model.query_heads, d), make(b, s // n, kv, d),
              make(b, s // n, kv, d), make(b, s, model.query_heads // n, d)]
    grads = [make(b, s, model.query_heads // n, d), make(b, s, kv // n, d),
             make(b, s, kv // n, d), make(b, s // n, model.query_heads, d)]

    def run() -> None:
        xs = [t.detach().requires_grad_(True) for t in inputs]
        outs = [seq_to_head(t, group) for t in xs[:3]] + [head_to_seq(xs[3], group)]
        torch.autograd.backward(outs, grads)

    return run


def measure(args) -> int:
    rank, n, device, dtype = init()
    group = dist.group.WORLD if n > 1 else None
    rows: dict[str, dict] = {}
    for name in args.models:
        try:
            model = model_spec(args, name)
            block_plan(model, args, n, Kernels.eager, Recompute.none)
        except ValueError as e:
            if rank == 0:
                print(f"error: {name}: {str(e).splitlines()[-1].strip()}", file=sys.stderr)
            finish(n)
            return 2
        gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
        x = torch.randn(args.batch, args.seq // n, model.hidden, device=device, dtype=dtype,
                        generator=gen)
        grad = torch.randn_like(x)

        def time_of(fn) -> float:
            return slowest(timed(fn, device, args.warmup, args.repeats), device)

        row: dict = {"hidden": model.hidden, "query_heads": model.query_heads,
                     "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                     "qk_norm": model.qk_norm, "tokens_per_rank": args.batch * args.seq // n,
                     "variants": {}}
        if n > 1:
            row["comm_alone_s"] = time_of(comm_fn(model, args, n, device, dtype, group))
        for kernels in map(Kernels, args.kernels):
            for recompute in map(Recompute, args.recompute):
                plan = block_plan(model, args, n, kernels, recompute)
                layer = build_block(plan, rank, n, device, dtype, args.seed)
                variant = {"kernels": kernels.value, "recompute": recompute.value,
                           "block_s": time_of(step_fn(layer, x, grad)),
                           "predicted": predict(plan)}
                if n > 1:
                    core = layer.attention.core
                    layer.attention.core = LocalUlyssesCore(core.inner, None, n, None)
                    variant["compute_alone_s"] = time_of(step_fn(layer, x, grad))
                    variant["exposed_comm_s"] = variant["block_s"] - variant["compute_alone_s"]
                row["variants"][f"{kernels.value}/{recompute.value}"] = variant
                if rank == 0:
                    text = "  ".join(f"{k.removesuffix('_s')} {v * 1e3:.2f} ms"
                                     for k, v in variant.items() if k.endswith("_s"))
                    text += f"  (predicted {variant['predicted']['block_s'] * 1e3:.2f} ms)"
                    print(f"{name} {kernels.value} recompute {recompute.value}: {text}",
                          flush=True)
                del layer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0 and n > 1:
            print(f"{name} comm alone {row['comm_alone_s'] * 1e3:.2f} ms", flush=True)
        rows[name] = row
    if rank == 0:
        result = {
            **metadata(),
            "benchmark": "one attention block forward + backward as the runtime runs it: per "
                         "kernel set and recomputation; under Ulysses SP its compute alone, its "
                         "all-to-alls alone and their exposed time",
            "world": n, "backend": dist.get_backend() if n > 1 else "none",
            "dtype": str(dtype).removeprefix("torch."), "seq_len": args.seq,
            "batch": args.batch, "cluster_spec": args.cluster,
            "prediction": "cost_models.layer_graph: the attention operators' forward and "
                          "backward (recomputation included) summed, overlap none",
            "warmup": args.warmup, "repeats": args.repeats,
            "models": rows,
        }
        write_atomic(args.out, json.dumps(result, indent=2) + "\n", "--out", force=True)
        print(f"wrote {args.out}")
    finish(n)
    return 0


if __name__ == "__main__":
    sys.exit(measure(parse_args()))
