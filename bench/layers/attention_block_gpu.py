"""One attention block, forward + backward, as the runtime runs it, per kernel set and
recomputation: on one GPU the block alone, under Ulysses SP = N its all-to-alls' exposed time,
blocking and in overlapped head groups.

    torchrun --nproc-per-node N -m bench.layers.attention_block_gpu --out
    $OUT/attention_block_xN.json
    (N = 1: one GPU, no communication; N = 2: Ulysses SP = 2 over NCCL)
    python -m bench.layers.attention_block_gpu --simulate-sp 2 --out ...  (one GPU: one SP rank's
    compute, its all-to-alls kept on the rank)

The block is x + attention(attention_norm(x)) of a one-layer model built and parallelised by the
runtime from a plan (runtime.parallel.parallelize: Ulysses SP = N and EP = N, ``kernels`` and
``recompute`` as the variant says), at the attention shapes of the
catalog models (``--models``; Mixtral-8x7B: hidden 4096, 32 query and 8 KV heads of 128;
Qwen3-30B-A3B: hidden 2048, 32 and 4 heads of 128 with QK norm), ``--batch`` sequences of
``--seq`` tokens (default 4 x 4,096: 16k tokens, the MoE layer bench's), each rank holding
seq / N tokens of every sequence. Variants, for each kernel set (``--kernels``) and
recomputation (``--recompute``: none, or selective, which reruns RoPE and SDPA in backward):

- ``block``: the runtime's block under overlap none; at N > 1 its four all-to-alls (q, k, v to
  head shards, the output back; runtime.parallel.attention.UlyssesCore) block;
- ``compute_alone`` (N > 1): the same block with each all-to-all replaced by its local pack and
  unpack (the same copies, no exchange): what the block would take with its communication
  hidden entirely;
- ``comm_alone`` (N > 1, once per model): the four all-to-alls forward + backward on tensors of
  the block's shapes, pack and unpack included;
- ``compute_alone_device`` (N > 1 or simulated): the compute alone with the host ahead of the
  GPU (runtime.measure.spun: a spin kernel holds the GPU while the host queues the
  block), as in a step whose host runs ahead; the block alone on an idle GPU also waits for
  the host's dispatch, which the head groups' second core call and stream events add to;
- ``compute_alone_host`` (the same cases): the host's time to issue the compute alone while
  the GPU is held (the same spin): what a step's host has to keep ahead of;
- ``head_groups`` (where plans.layout.ulysses_chunks gives more than one group at SP = N): the
  block under overlap inter_op, Ulysses in head groups on two streams
  (runtime.parallel.attention.ChunkedUlyssesCore), with its own ``compute_alone`` and
  ``compute_alone_device`` (each group's exchange left out, the packing, the streams and their
  events kept), ``comm_alone`` (each
  group's two all-to-alls) and ``exposed_comm``.

With ``--simulate-sp N`` on one process the block is one rank of Ulysses SP = N without the
exchange: seq / N tokens of every sequence, the core on full sequences of H / N heads (the
weights are the ones every SP rank holds); it gives ``compute_alone`` of both cores, so one GPU
measures what the head groups cost the compute.

``exposed_comm`` = block - compute_alone; ``predicted`` is the cost model's block for the same
plan (``--cluster``, default the fitted ``h200-runtime``): its attention operators forward and
backward, recomputed ones included, scheduled on two streams as the plan's overlap runs them
(overlap none: their sum). Timing: CUDA events (wall clock on CPU), median after warm-up, the
slowest rank's; ranks line up at a barrier before each repeat (runtime.measure.timed).
bf16 on CUDA, fp32 over gloo on CPU (smoke tests shrink the model with the override flags).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench._dist_bench import finish, init, release, slowest, spun, timed
from bench._meta import bad_input, write_result
from cost_models.layer import layer_graphs, layer_key, schedule_s
from cost_models.layer_graph import OpKind
from plans import Kernels, Overlap, Plan, Recompute, UlyssesAttention, catalog
from plans.enums import Dispatch
from plans.layout import kv_heads_sent, ulysses_chunks
from plans.plan import EPFFN, Degrees
from plans.specs import ModelSpec, TrainingSpec
from runtime.config import ModelConfig
from runtime.model import Transformer
from runtime.parallel.attention import ChunkedUlyssesCore, UlyssesCore
from runtime.parallel.comm import all_to_all, head_to_seq, seq_to_head
from runtime.parallel.mesh import build_mesh
from runtime.parallel.overlap import Chunk
from runtime.parallel.parallelize import backend_of, parallelize
from runtime.trainer import model_options

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
"""Issue 11's two shapes (the MoE layer bench's), here their attention."""
OVERRIDES = {  # flag -> ModelSpec field (smoke tests shrink the model)
    "hidden": "hidden", "ffn_hidden": "expert_ffn_hidden", "experts": "experts",
    "heads": "query_heads", "kv_heads": "kv_heads", "head_dim": "head_dim", "vocab": "vocab",
}


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
    p.add_argument("--simulate-sp", type=int, default=1, metavar="N",
                   help="on one process: one rank of Ulysses SP = N, all-to-alls kept local")
    for flag in OVERRIDES:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, dest=flag,
                       help=f"override model.{OVERRIDES[flag]} (smoke tests)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---- the one-layer model and its plan ------------------------------------------------------


def model_spec(args, name: str) -> ModelSpec:
    """Catalog model ``name`` as one MoE layer, with the override flags (fewer ``--experts``
    than the model routes to clip the top-k)."""
    base = catalog.load_model(name)
    update = {field: getattr(args, flag) for flag, field in OVERRIDES.items()
              if getattr(args, flag)}
    if "experts" in update:
        update["top_k"] = min(base.top_k, update["experts"])
    update.update(layers=1, dense_layers=0, dense_ffn_hidden=0, name=f"{base.name}-1L")
    return ModelSpec.model_validate({**base.model_dump(), **update})


def layer_plan(model: ModelSpec, args, sp: int, kernels: Kernels,
               recompute: Recompute = Recompute.none, overlap: Overlap = Overlap.none) -> Plan:
    """``model`` under Ulysses SP = EP = ``sp`` (1: one GPU, no parallelism) on ``args.cluster``,
    one micro-batch of ``args.batch`` sequences of ``args.seq`` tokens."""
    return Plan(
        model=model, cluster=catalog.load_cluster(args.cluster, gpus=sp),
        training=TrainingSpec(global_batch=args.batch, seq_len=args.seq), stage_layers=(1,),
        micro_batch_size=args.batch, degrees=Degrees(sp=sp, ep=sp),
        attention=UlyssesAttention(), ffn=EPFFN(dispatch=Dispatch.all_to_all),
        overlap=overlap, recompute=recompute, kernels=kernels,
    )


def predict(plan: Plan) -> dict:
    """The cost model's attention block, forward + backward: the forward graph's operators up
    to the attention residual with the backward graph's nodes of the same operators
    (recomputed ones included), each pass scheduled on two streams as ``plan.overlap`` runs
    them (under none every operator blocks: the sum); of its operators, the seconds of those
    of communication and of those recomputed."""
    fwd, bwd = layer_graphs(layer_key(plan), plan.overlap)
    order = sorted(fwd.nodes, key=lambda name: fwd.nodes[name]["order"])
    names = order[:order.index("attn_residual") + 1]
    operators = {fwd.nodes[name]["op"].operator for name in names}
    back = [name for name, node in bwd.nodes.items() if node["op"].operator in operators]
    hidden = plan.cluster.efficiency.overlap
    ops = [fwd.nodes[name]["op"] for name in names] + [bwd.nodes[name]["op"] for name in back]
    return {"block_s": (schedule_s(fwd.subgraph(names), plan.overlap, hidden)
                        + schedule_s(bwd.subgraph(back), plan.overlap, hidden)),
            "comm_s": sum(op.duration_s for op in ops if op.kind == OpKind.comm),
            "recompute_s": sum(op.duration_s for op in ops if op.recompute)}


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


def block_step(layer, x: torch.Tensor, grad: torch.Tensor):
    """One forward + backward of ``layer``'s x + attention(attention_norm(x)), upstream
    gradient ``grad``; the parameters' gradients dropped before each."""
    params = list(layer.parameters())

    def run() -> None:
        for p in params:
            p.grad = None
        xs = x.detach().requires_grad_(True)
        (xs + layer.attention(layer.attention_norm(xs))).backward(grad)

    return run


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


class LocalChunkedUlyssesCore(ChunkedUlyssesCore):
    """ChunkedUlyssesCore whose exchanges are left out: each group's packed heads stay on the
    rank (the same shape), the copies, streams and events as the runtime issues them."""

    def _exchange(self, c: Chunk) -> None:
        """Nothing: the packed heads in ``c.values["moving"]`` stay as they are."""


# ---- measurement ----------------------------------------------------------------------------


def comm_fn(model: ModelSpec, args, n: int, device, dtype, group, groups: int = 1):
    """The block's all-to-alls, forward + backward, on tensors of its shapes: blocking, the
    four of UlyssesCore; in ``groups`` head groups, each group's two (q, k and v packed in one,
    the output back) as ChunkedUlyssesCore sends them."""
    b, s, d = args.batch, args.seq, model.head_dim
    kv = kv_heads_sent(model, n)  # KV heads fewer than n are replicated first
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    if groups > 1:
        q, k = model.query_heads // (n * groups), kv // (n * groups)
        sends = [make(n, b, s // n, w, d) for _ in range(groups) for w in (q + 2 * k, q)]
        splits = [1] * n

        def run_groups() -> None:
            xs = [t.detach().requires_grad_(True) for t in sends]
            outs = [all_to_all(t, splits, splits, group) for t in xs]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        return run_groups

    inputs = [make(b, s // n, model.query_heads, d), make(b, s // n, kv, d),
              make(b, s // n, kv, d), make(b, s, model.query_heads // n, d)]
    grads = [make(b, s, model.query_heads // n, d), make(b, s, kv // n, d),
             make(b, s, kv // n, d), make(b, s // n, model.query_heads, d)]

    def run() -> None:
        xs = [t.detach().requires_grad_(True) for t in inputs]
        outs = [seq_to_head(t, group) for t in xs[:3]] + [head_to_seq(xs[3], group)]
        torch.autograd.backward(outs, grads)

    return run


def _text(variant: dict) -> str:
    return "  ".join(f"{k.removesuffix('_s')} {v * 1e3:.2f} ms" for k, v in variant.items()
                     if k.endswith("_s")) + \
        f"  (predicted {variant['predicted']['block_s'] * 1e3:.2f} ms)"


def measure(args) -> int:
    rank, n, device, dtype = init()
    group = dist.group.WORLD if n > 1 else None
    sp = args.simulate_sp if n == 1 else n  # the SP degree of the rank measured
    if sp < 1 or (n > 1 and args.simulate_sp != 1):
        finish(n)
        return bad_input("--simulate-sp: a positive degree, on one process only", rank)
    rows: dict[str, dict] = {}
    for name in args.models:
        try:
            model = model_spec(args, name)
            layer_plan(model, args, sp, Kernels.eager, Recompute.none)
            if args.seq % sp:
                raise ValueError(f"--seq: {args.seq} tokens do not split over SP = {sp}")
        except ValueError as e:
            finish(n)
            return bad_input(f"{name}: {str(e).splitlines()[-1].strip()}", rank)
        groups = ulysses_chunks(Overlap.inter_op, UlyssesAttention(), model, sp)
        gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
        x = torch.randn(args.batch, args.seq // sp, model.hidden, device=device, dtype=dtype,
                        generator=gen)
        grad = torch.randn_like(x)

        def time_of(fn) -> float:
            return slowest(timed(fn, device, args.warmup, args.repeats), device)

        def spun_of(fn) -> tuple[float, float]:  # no collective inside: each rank alone
            on_device, on_host = spun(fn, device, args.warmup, args.repeats)
            return slowest(on_device, device), slowest(on_host, device)

        def core_times(layer, local, x: torch.Tensor, grad: torch.Tensor) -> dict:
            """The block as built where it is the rank measured (its exchanges, or no SP),
            then, with ``local`` in place of its core (each exchange left out), its compute
            alone: idle GPU, host ahead, the host's own time; and the exposed all-to-alls."""
            out: dict = {}
            if n > 1 or sp == 1:
                out["block_s"] = time_of(block_step(layer, x, grad))
            if local is None:
                return out
            layer.attention.core = local
            out["compute_alone_s"] = time_of(block_step(layer, x, grad))
            out["compute_alone_device_s"], out["compute_alone_host_s"] = \
                spun_of(block_step(layer, x, grad))
            if "block_s" in out:
                out["exposed_comm_s"] = out["block_s"] - out["compute_alone_s"]
            return out

        row: dict = {"hidden": model.hidden, "query_heads": model.query_heads,
                     "kv_heads": model.kv_heads, "head_dim": model.head_dim,
                     "qk_norm": model.qk_norm, "tokens_per_rank": args.batch * args.seq // sp,
                     "sp": sp, "head_groups": groups, "variants": {}}
        if n > 1:
            row["comm_alone_s"] = time_of(comm_fn(model, args, n, device, dtype, group))
            if groups > 1:
                row["head_groups_comm_alone_s"] = time_of(
                    comm_fn(model, args, n, device, dtype, group, groups))
        for kernels in map(Kernels, args.kernels):
            for recompute in map(Recompute, args.recompute):
                plan = layer_plan(model, args, sp, kernels, recompute)
                # one process: the block as built (sp 1) or one simulated SP rank's compute
                layer = build_block(plan if n > 1 else layer_plan(model, args, 1, kernels,
                                                                  recompute),
                                    rank, n, device, dtype, args.seed)
                inner = layer.attention.core if n == 1 else layer.attention.core.inner
                variant = {"kernels": kernels.value, "recompute": recompute.value,
                           **core_times(layer, LocalUlyssesCore(inner, None, sp, None)
                                        if sp > 1 else None, x, grad),
                           "predicted": predict(plan)}
                if groups > 1:
                    overlapped = layer_plan(model, args, sp, kernels, recompute,
                                            Overlap.inter_op)
                    if n > 1:
                        layer = build_block(overlapped, rank, n, device, dtype, args.seed)
                        assert isinstance(layer.attention.core, ChunkedUlyssesCore)
                        inner = layer.attention.core.inner
                    local = LocalChunkedUlyssesCore(inner, None, sp, groups, None)
                    variant["head_groups"] = {"groups": groups, **core_times(layer, local, x, grad),
                                              "predicted": predict(overlapped)}
                row["variants"][f"{kernels.value}/{recompute.value}"] = variant
                if rank == 0:
                    print(f"{name} {kernels.value} recompute {recompute.value}: "
                          f"{_text(variant)}", flush=True)
                    if groups > 1:
                        print(f"  in {groups} head groups: {_text(variant['head_groups'])}",
                              flush=True)
                del layer
                release(device)
        if rank == 0 and n > 1:
            print(f"{name} comm alone {row['comm_alone_s'] * 1e3:.2f} ms" + (
                f", in {groups} head groups {row['head_groups_comm_alone_s'] * 1e3:.2f} ms"
                if groups > 1 else ""), flush=True)
        rows[name] = row
    if rank == 0:
        result = {
            "benchmark": "one attention block forward + backward as the runtime runs it: per "
                         "kernel set and recomputation; under Ulysses SP its compute alone, its "
                         "all-to-alls alone and their exposed time, blocking and in overlapped "
                         "head groups",
            "world": n, "simulated_sp": args.simulate_sp,
            "backend": dist.get_backend() if n > 1 else "none",
            "dtype": str(dtype).removeprefix("torch."), "seq_len": args.seq,
            "batch": args.batch, "cluster_spec": args.cluster,
            "prediction": "cost_models.layer_graph: the attention operators' forward and "
                          "backward (recomputation included), each pass scheduled on two "
                          "streams as the variant's overlap runs them (none: summed)",
            "warmup": args.warmup, "repeats": args.repeats,
            "models": rows,
        }
        write_result(args.out, result)
        print(f"wrote {args.out}")
    finish(n)
    return 0


if __name__ == "__main__":
    sys.exit(measure(parse_args()))
