"""Attention parallelism: Ulysses sequence parallelism (paper Sec. 3.1) and Megatron tensor
parallelism with sequence parallelism in the norm regions (the baseline layout)."""

from __future__ import annotations

import torch
from torch import nn

from plans import MeshAxis
from runtime.metrics import Component, Timers, timed
from runtime.model import Attention, Shard, Transformer
from runtime.parallel.comm import gather_sequence, head_to_seq, scatter_sequence, seq_to_head
from runtime.parallel.mesh import Mesh


class UlyssesCore(nn.Module):
    """Around the attention core: all-to-all from sequence-sharded [b, s/n, H, d] to
    head-sharded [b, s, H/n, d], the core on full sequences, and back (DeepSpeed-Ulysses).
    KV heads fewer than n are replicated first so every rank receives the KV head its query
    heads read (a multiple of kv_heads, checked by the plan)."""

    def __init__(self, inner: nn.Module, group, size: int, timers: Timers | None):
        super().__init__()
        self.inner = inner
        self.group = group
        self.size = size
        self.timers = timers

    def _a2a(self, fn, x: torch.Tensor) -> torch.Tensor:
        return timed(self.timers, Component.attention_comm, fn, x, self.group)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.timers is None:
            return self.inner(q, k, v)
        q, k, v = (self.timers.backward_to(t, Component.attention_core) for t in (q, k, v))
        with self.timers.region(Component.attention_core):
            out = self.inner(q, k, v)
        return self.timers.backward_from(out, Component.attention_core)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[2] < self.size:
            rep = self.size // k.shape[2]
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        q, k, v = (self._a2a(seq_to_head, t) for t in (q, k, v))
        return self._a2a(head_to_seq, self._core(q, k, v))


def apply_ulysses(model: Transformer, mesh: Mesh, timers: Timers | None) -> None:
    group, n = mesh.groups[MeshAxis.attn], mesh.size(MeshAxis.attn)
    if group is None:
        return
    for block in model.layers.values():
        attn: Attention = block.attention
        attn.core = UlyssesCore(attn.core, group, n, timers)


def apply_tensor_parallel_attention(
    model: Transformer, mesh: Mesh, shards: dict[str, Shard], timers: Timers | None
) -> None:
    """Column-parallel Q/K/V (this rank's heads), row-parallel output projection; all-gather of
    the sequence before and reduce-scatter after (Megatron-LM sequence parallelism)."""
    group, n, i = mesh.groups[MeshAxis.attn], mesh.size(MeshAxis.attn), mesh.index(MeshAxis.attn)
    if group is None:
        return
    spec = model.cfg.spec
    if spec.kv_heads % n:
        raise ValueError(
            f"degrees.tp: this runtime's TP attention needs tp ({n}) to divide "
            f"model.kv_heads ({spec.kv_heads})"
        )

    def enter(_module, args):
        return (timed(timers, Component.attention_comm, gather_sequence, args[0], group),)

    def leave(_module, _args, out):
        return timed(timers, Component.attention_comm, scatter_sequence, out, group)

    for lid, block in model.layers.items():
        attn: Attention = block.attention
        for proj, dim in (("wq", 0), ("wk", 0), ("wv", 0), ("wo", 1)):
            linear: nn.Linear = getattr(attn, proj)
            shard = Shard(dim, i, n)
            linear.weight = nn.Parameter(shard.take(linear.weight.detach()))
            shards[f"layers.{lid}.attention.{proj}.weight"] = shard
        attn.register_forward_pre_hook(enter)
        attn.register_forward_hook(leave)
