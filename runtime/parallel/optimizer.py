"""AdamW over the parallel model: replicated (every replica keeps full optimizer states) or
ZeRO stage 1 (Rajbhandari et al., SC'20): each replica of a bucket keeps the AdamW states of
1/n of it; gradients are reduce-scattered, each rank updates its slice, and the updated slices
are all-gathered back into the parameters. AdamW is elementwise, so both give the same
weights."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plans import Precision
from runtime.parallel.data_parallel import GradSync, reduce_scatter_sum
from runtime.parallel.mesh import Group, Mesh


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8


def _adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: OptimizerConfig):
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
    )
    # states exist from the start so a checkpoint can be loaded into them in place
    for p in [*decay, *no_decay]:
        opt.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return opt


KeyOf = Callable[[str], str]
"""Checkpoint key of a parameter name (global name plus this rank's shard)."""


class ReplicatedAdamW:
    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        replication: dict[str, tuple[Group, ...]],
        precision: Precision,
        cfg: OptimizerConfig,
    ):
        self.params = dict(model.named_parameters())
        self.grad_sync = GradSync(self.params, mesh, replication, precision)
        ps = list(self.params.values())
        self.adam = _adamw([p for p in ps if p.ndim >= 2], [p for p in ps if p.ndim < 2], cfg)

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def sync_gradients(self) -> None:
        self.grad_sync()

    def step(self) -> None:
        self.adam.step()

    def checkpoint_state(self, key_of: KeyOf) -> dict[str, torch.Tensor]:
        return {
            f"optim.{key_of(name)}.{field}": value
            for name, p in self.params.items()
            for field, value in self.adam.state[p].items()
        }


@dataclass
class _Bucket:
    names: list[str]
    params: list[nn.Parameter]
    group: dist.ProcessGroup
    size: int
    index: int
    shard: torch.Tensor
    """This rank's fp32 slice of the flattened (padded) bucket: the tensor AdamW updates."""

    @property
    def padded(self) -> int:
        return self.shard.numel() * self.size


class ZeroAdamW:
    """Buckets replicated over exactly one group of more than one rank are sharded; the rest
    (tied embeddings summed over two groups, parameters on one rank) stay replicated."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        replication: dict[str, tuple[Group, ...]],
        precision: Precision,
        cfg: OptimizerConfig,
    ):
        self.precision = precision
        params = dict(model.named_parameters())
        grouped: dict[tuple[tuple[Group, ...], bool], list[str]] = defaultdict(list)
        for name in sorted(params):
            grouped[(replication[name], params[name].ndim >= 2)].append(name)
        self.buckets: list[tuple[_Bucket, bool]] = []
        rest: dict[str, nn.Parameter] = {}
        for (groups, decay), names in grouped.items():
            live = [g for g in groups if mesh.groups.get(g) is not None]
            if len(live) != 1:
                rest.update({n: params[n] for n in names})
                continue
            g = live[0]
            size, index = mesh.size(g), mesh.index(g)
            total = sum(params[n].numel() for n in names)
            per_rank = -(-total // size)
            flat = torch.cat([params[n].detach().reshape(-1).float() for n in names])
            flat = torch.nn.functional.pad(flat, (0, per_rank * size - total))
            shard = flat[index * per_rank : (index + 1) * per_rank].clone()
            bucket = _Bucket(names, [params[n] for n in names], mesh.groups[g], size, index, shard)
            self.buckets.append((bucket, decay))
        self.rest = rest
        self.rest_sync = GradSync(rest, mesh, replication, precision)
        decay = [b.shard for b, d in self.buckets if d] + [p for p in rest.values() if p.ndim >= 2]
        no_decay = [b.shard for b, d in self.buckets if not d] + [
            p for p in rest.values() if p.ndim < 2
        ]
        self.params = params
        self.adam = _adamw(decay, no_decay, cfg)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Reduce-scatter each sharded bucket's gradients into its shard's ``grad``."""
        for b, _ in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            flat = torch.cat([g.reshape(-1) for g in grads]).float()
            flat = torch.nn.functional.pad(flat, (0, b.padded - flat.numel()))
            b.shard.grad = reduce_scatter_sum(flat, b.group, self.precision)
        self.rest_sync()

    @torch.no_grad()
    def step(self) -> None:
        self.adam.step()
        for b, _ in self.buckets:
            full = b.shard.new_empty(b.padded)
            dist.all_gather_into_tensor(full, b.shard, group=b.group)
            offset = 0
            for p in b.params:
                p.copy_(full[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def checkpoint_state(self, key_of: KeyOf) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for b, _ in self.buckets:
            base = f"optim.zero1.{key_of(b.names[0])}+{len(b.names)}.part{b.index}of{b.size}"
            out[f"{base}.master"] = b.shard
            for field, value in self.adam.state[b.shard].items():
                out[f"{base}.{field}"] = value
        for name, p in self.rest.items():
            for field, value in self.adam.state[p].items():
                out[f"optim.{key_of(name)}.{field}"] = value
        return out
