"""Attention parallelism: Ulysses sequence parallelism (paper Sec. 3.1) and Megatron tensor
parallelism with sequence parallelism in the norm regions (the baseline layout).

Under inter-operator overlap (paper Sec. 4) Ulysses moves its heads in
``plans.layout.ulysses_chunks`` head groups (``ChunkedUlyssesCore``): the chunked MoE layer's
schedule (runtime.parallel.overlap.COLLECTIVES_ALONE) with the all-to-all to head shards as the
dispatch, the attention core as the experts and the all-to-all back as the combine, so group
g + 1's heads move beside group g's core and group g's output beside group g + 1's core. Only
the first group's all-to-all in and the last one's out have no compute beside them; in backward
torch runs each collective's gradient on the communication stream beside the other group's
core gradient (and, under selective recomputation, its rerun)."""

from __future__ import annotations

import torch
from torch import nn

from plans import MeshAxis
from plans.layout import kv_heads_sent
from runtime.metrics import Component, Timers, timed
from runtime.mla import MLAttention
from runtime.model import Attention, Shard, Transformer
from runtime.parallel.comm import (
    all_to_all,
    gather_sequence,
    head_to_seq,
    scatter_sequence,
    seq_to_head,
)
from runtime.parallel.mesh import Mesh
from runtime.parallel.overlap import COLLECTIVES_ALONE, Chunk, Lanes, Step, collect, run_schedule


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

    def _replicate_kv(self, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        if k.shape[2] < self.size:
            rep = self.size // k.shape[2]
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        return k, v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = self._replicate_kv(k, v)
        q, k, v = (self._a2a(seq_to_head, t) for t in (q, k, v))
        return self._a2a(head_to_seq, self._core(q, k, v))


class ChunkedUlyssesCore(UlyssesCore):
    """UlyssesCore in ``chunks`` head groups on two lanes (the module doc). Group g holds, of
    every rank's block of H / n heads, heads g H / (n c) .. (g + 1) H / (n c) - 1, query and KV
    alike, so each group's query heads find their KV heads in it. Per group: its q, k and v in
    one all-to-all of [n, b, s / n, heads, d] (the packing and unpacking copies on the compute
    lane), the core, and the output's all-to-all back; the groups' outputs are put back in head
    order at the end."""

    def __init__(self, inner: nn.Module, group, size: int, chunks: int, timers: Timers | None):
        super().__init__(inner, group, size, timers)
        self.chunks = chunks
        self._lanes: Lanes | None = None
        self.steps = {
            Step.dispatch_pack: self._pack_in, Step.dispatch_exchange: self._exchange,
            Step.dispatch_unpack: self._unpack_in, Step.experts: self._run_core,
            Step.combine_pack: self._pack_out, Step.combine_exchange: self._exchange,
            Step.combine_unpack: self._unpack_out,
        }

    def _groups(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every group's heads of sequence-sharded ``x`` [b, s/n, H, d], each as
        [n, b, s/n, H/(n c), d] (dim 0: the rank the heads go to). Views of ``x`` from one
        unbind, whose gradient is one stack (a view per group would zero-fill and add a whole
        gradient per group)."""
        b, s_local, heads, d = x.shape
        n, c = self.size, self.chunks
        return tuple(t.permute(2, 0, 1, 3, 4) for t in
                     x.reshape(b, s_local, n, c, heads // (n * c), d).unbind(3))

    def _pack_in(self, c: Chunk) -> None:
        # heads x width flattened: MLA's value heads are narrower than its query and key heads
        parts = [c.inputs[name] for name in ("q", "k", "v")]
        c.values["shapes"] = [t.shape[3:] for t in parts]
        c.values["moving"] = torch.cat([t.flatten(3) for t in parts], dim=3)

    def _exchange(self, c: Chunk) -> None:
        moving = c.values.pop("moving")
        splits = [1] * self.size
        c.values["moving"] = timed(self.timers, Component.attention_comm, all_to_all, moving,
                                   splits, splits, self.group)

    def _unpack_in(self, c: Chunk) -> None:
        # [n (sequence block), b, s/n, heads x d] -> [b, s, heads, d] each
        recv = c.values.pop("moving")
        n, b, s_local, _ = recv.shape
        rows = recv.permute(1, 0, 2, 3).reshape(b, n * s_local, -1)
        shapes = c.values.pop("shapes")
        parts = torch.split(rows, [heads * d for heads, d in shapes], dim=2)
        c.values["qkv"] = tuple(t.view(b, n * s_local, *shape)
                                for t, shape in zip(parts, shapes, strict=True))

    def _run_core(self, c: Chunk) -> None:
        c.values["out"] = self._core(*c.values.pop("qkv"))

    def _pack_out(self, c: Chunk) -> None:
        # [b, s, heads, d] -> [n (sequence block), b, s/n, heads, d]
        out = c.values.pop("out")
        b, s, heads, d = out.shape
        c.values["moving"] = out.reshape(b, self.size, s // self.size, heads, d).permute(
            1, 0, 2, 3, 4).contiguous()

    def _unpack_out(self, c: Chunk) -> None:
        c.values["y"] = c.values.pop("moving")  # [n (head block), b, s/n, heads, d]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = self._replicate_kv(k, v)
        if self._lanes is None:
            self._lanes = Lanes(q.device)
        with self._lanes.call((q, k, v)) as outputs:
            chunks = [Chunk({"q": qg, "k": kg, "v": vg}) for qg, kg, vg in
                      zip(*map(self._groups, (q, k, v)), strict=True)]
            run_schedule(self._lanes, COLLECTIVES_ALONE, self.steps, chunks)
            # [n (head block), b, s/n, heads, d] per group -> [b, s/n, n, groups, heads, d]
            ys = [y.permute(1, 2, 0, 3, 4) for y in collect(self._lanes, chunks, "y")]
            out = torch.stack(ys, dim=3)
            outputs.append(out.flatten(2, 4))
        return outputs[0]


def head_groups(model: Transformer) -> int:
    """Head groups this rank's Ulysses cores move heads in (1: blocking, or no Ulysses)."""
    return max((block.attention.core.chunks for block in model.layers.values()
                if isinstance(block.attention.core, ChunkedUlyssesCore)), default=1)


def apply_ulysses(model: Transformer, mesh: Mesh, timers: Timers | None, chunks: int = 1) -> None:
    """Ulysses around every layer's attention core; in ``chunks`` head groups
    (plans.layout.ulysses_chunks) when > 1."""
    group, n = mesh.groups[MeshAxis.attn], mesh.size(MeshAxis.attn)
    if group is None:
        return
    kv = kv_heads_sent(model.cfg.spec, n) // n
    if kv % chunks:
        raise ValueError(f"overlap: {chunks} head groups need the {kv} KV heads per rank to "
                         f"split into them (plans.layout.ulysses_chunks)")
    for block in model.layers.values():
        attn: Attention = block.attention
        attn.core = (ChunkedUlyssesCore(attn.core, group, n, chunks, timers) if chunks > 1
                     else UlyssesCore(attn.core, group, n, timers))


def apply_tensor_parallel_attention(
    model: Transformer, mesh: Mesh, shards: dict[str, Shard], timers: Timers | None
) -> None:
    """Column-parallel Q/K/V (this rank's heads; MLA: its up-projections, the down-projections
    whole on every rank), row-parallel output projection (``tp_splits`` of the attention);
    all-gather of the sequence before and reduce-scatter after (Megatron-LM sequence
    parallelism)."""
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
        attn: Attention | MLAttention = block.attention
        for proj, dim in attn.tp_splits:
            linear: nn.Linear = getattr(attn, proj)
            shard = Shard(dim, i, n)
            linear.weight = nn.Parameter(shard.take(linear.weight.detach()))
            shards[f"layers.{lid}.attention.{proj}.weight"] = shard
        attn.register_forward_pre_hook(enter)
        attn.register_forward_hook(leave)
