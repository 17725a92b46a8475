"""The one-layer model the layer benchmarks time (bench/layers/attention_block_gpu.py,
deepseek_layers_gpu.py): a catalog model cut to one MoE layer, its plan, built and parallelised
by the runtime from the plan; its blocks' forward + backward, and the cost model's price of
each block for the same plan."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cost_models.layer import layer_graphs, layer_key, schedule_s
from cost_models.layer_graph import Op
from plans import Plan, catalog
from plans.enums import Dispatch, Kernels, Overlap, Recompute
from plans.plan import EPFFN, Degrees, UlyssesAttention
from plans.specs import ModelSpec, TrainingSpec
from runtime.config import ModelConfig
from runtime.model import Transformer
from runtime.parallel.mesh import build_mesh
from runtime.parallel.parallelize import backend_of, parallelize
from runtime.trainer import model_options

OVERRIDES = {  # flag -> ModelSpec field (smoke tests shrink the model)
    "hidden": "hidden", "ffn_hidden": "expert_ffn_hidden", "experts": "experts",
    "heads": "query_heads", "kv_heads": "kv_heads", "head_dim": "head_dim", "vocab": "vocab",
}


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


BLOCKS = ("attention", "moe")
"""The layer's blocks: x + attention(attention_norm(x)), then x + moe(ffn_norm(x))."""


def predicted_blocks(plan: Plan) -> dict[str, tuple[float, list[Op]]]:
    """Each block as the cost model prices it, forward + backward: ``attention`` is the forward
    graph's operators up to the attention residual, ``moe`` those after it, each with the
    backward graph's nodes of the same operators (recomputed ones included). Per block: its
    seconds, each pass scheduled on two streams as ``plan.overlap`` runs them (under none
    every operator blocks: the sum), and its ops (forward, then backward)."""
    fwd, bwd = layer_graphs(layer_key(plan), plan.overlap)
    order = sorted(fwd.nodes, key=lambda name: fwd.nodes[name]["order"])
    cut = order.index("attn_residual") + 1
    hidden = plan.cluster.efficiency.overlap
    out = {}
    for block, names in zip(BLOCKS, (order[:cut], order[cut:]), strict=True):
        operators = {fwd.nodes[name]["op"].operator for name in names}
        back = [name for name, node in bwd.nodes.items() if node["op"].operator in operators]
        seconds = (schedule_s(fwd.subgraph(names), plan.overlap, hidden)
                   + schedule_s(bwd.subgraph(back), plan.overlap, hidden))
        out[block] = (seconds, [fwd.nodes[name]["op"] for name in names]
                      + [bwd.nodes[name]["op"] for name in back])
    return out


def block_step(layer, block: str, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``layer``'s ``block`` (BLOCKS) on ``x``, upstream gradient
    ``grad``; the parameters' gradients dropped before each."""
    params = list(layer.parameters())
    norm, inner = ((layer.attention_norm, layer.attention) if block == "attention"
                   else (layer.ffn_norm, layer.moe))

    def run() -> None:
        for p in params:
            p.grad = None
        xs = x.detach().requires_grad_(True)
        y = xs + inner(norm(xs))
        y.backward(grad)

    return run


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
