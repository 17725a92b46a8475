"""Data-parallel gradient synchronisation over each parameter's replication groups.

Which ranks hold copies of a parameter (paper Sec. 3): dense weights (attention under Ulysses,
norms, router, shared experts, dense FFN, embedding, LM head) are replicated over every rank of
a stage (dp x sp x cp); TP-sharded attention weights over dp; expert weights over edp (they are
sharded over ep). Tied embeddings split over pipeline stages are also summed between the first
and last stage. Each rank's loss is already divided by the global token count, so the sum of
the replicas' gradients is the gradient of the global mean loss.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from plans import Precision
from runtime.model import Shard, Transformer
from runtime.parallel.mesh import Group, Mesh

SYNC_DTYPES = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16}


class UnsupportedFeature(ValueError):
    """A plan field this runtime does not implement yet."""


def replication_groups(
    model: Transformer, mesh: Mesh, shards: dict[str, Shard], expert_shards: set[str]
) -> dict[str, tuple[Group, ...]]:
    out: dict[str, tuple[Group, ...]] = {}
    for name, _ in model.named_parameters():
        if ".moe.experts." in name:
            groups: tuple[Group, ...] = (Group.edp,)
        elif name in shards and name not in expert_shards:
            groups = (Group.dp,)
        else:
            groups = (Group.stage,)
        tied = model.cfg.spec.tied_embeddings and model.init_key(name) == "tok_embeddings.weight"
        if tied and mesh.degrees.pp > 1:
            groups = (*groups, Group.embed)
        out[name] = groups
    return out


class GradSync:
    """All-reduce of each bucket of gradients (parameters grouped by replication groups)."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        mesh: Mesh,
        groups: dict[str, tuple[Group, ...]],
        precision: Precision,
    ):
        if precision not in SYNC_DTYPES:
            raise UnsupportedFeature(
                f"grad_sync_precision: {precision} gradient sync is not supported by this "
                "runtime yet (fp32 and bf16 are)"
            )
        self.dtype = SYNC_DTYPES[precision]
        self.mesh = mesh
        # one flat bucket per (group sequence); parameters in name order on every replica
        self.buckets: dict[tuple[Group, ...], list[nn.Parameter]] = defaultdict(list)
        for name in sorted(params):
            self.buckets[groups[name]].append(params[name])

    @torch.no_grad()
    def __call__(self) -> None:
        for group_seq, params in self.buckets.items():
            live = [g for g in group_seq if self.mesh.groups.get(g) is not None]
            if not live:
                continue
            grads = [
                p.grad if p.grad is not None else torch.zeros_like(p) for p in params
            ]
            flat = torch.cat([g.reshape(-1) for g in grads]).to(self.dtype)
            for g in live:
                dist.all_reduce(flat, group=self.mesh.groups[g])
            flat = flat.to(torch.float32)
            offset = 0
            for p, g in zip(params, grads, strict=True):
                n = g.numel()
                value = flat[offset : offset + n].view_as(g).to(p.dtype)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
                offset += n
