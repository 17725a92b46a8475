"""The one-layer model the layer benchmarks time (bench/layers/attention_block_gpu.py,
deepseek_layers_gpu.py): a catalog model cut to one MoE layer, built and parallelised by the
runtime from a plan."""

from __future__ import annotations

import torch

from plans import Plan, catalog
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
