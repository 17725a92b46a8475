"""Expert parallelism: whole experts per rank of the EP group, tokens moved by a dispatcher
(paper Sec. 3.2: all-to-all, or all-gather + local scatter / local gather + reduce-scatter).
Experts are contiguous per rank: rank r holds experts [r E/n, (r+1) E/n)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plans import Dispatch, MeshAxis
from runtime.kernels import (
    EAGER,
    KernelOps,
    count_per_expert,
    inverse_permutation,
)
from runtime.metrics import Component, Timers
from runtime.model import Shard, Transformer
from runtime.moe import DispatchHandle, MoE, Routing, sort_by_expert, start_host_copy
from runtime.parallel.comm import all_gather, all_to_all, reduce_scatter, sum_replicated
from runtime.parallel.mesh import Mesh


class _Timed:
    runs_shared = False

    def __init__(self, timers: Timers | None):
        self.timers = timers

    def region(self, c: Component) -> AbstractContextManager[None]:
        return nullcontext() if self.timers is None else self.timers.region(c)

    def bwd_to(self, x: torch.Tensor, c: Component) -> torch.Tensor:
        return x if self.timers is None else self.timers.backward_to(x, c)

    def bwd_from(self, y: torch.Tensor, c: Component) -> torch.Tensor:
        return y if self.timers is None else self.timers.backward_from(y, c)

    def dispatch(
        self, tokens: torch.Tensor, routing: Routing
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        return self.send(tokens, routing, self.prepare([routing])[0])

    def prepare(self, routings: list[Routing]) -> list[Any]:
        """What every chunk's dispatch needs to know before its rows move (expert order, the
        peers' row counts), for all chunks of a micro-batch at once: one exchange and at most
        one device-to-host sync, so the chunks' ``send`` never waits on the host."""
        with self.region(Component.dispatch):
            return self._prepare(routings)

    def send(
        self, tokens: torch.Tensor, routing: Routing, prepared: Any
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Move one chunk's rows to their experts' ranks: expert-input rows grouped by local
        expert, rows per local expert, and the handle ``combine`` undoes it with. One timed
        region: the serial layer's send runs its phases back to back."""
        tokens = self.bwd_to(tokens, Component.dispatch)
        with self.region(Component.dispatch):
            rows, counts, handle = self._send_unpack(self._send_exchange(
                self._send_pack(tokens, routing, prepared)))
        return self.bwd_from(rows, Component.dispatch), counts, handle

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        expert_out = self.bwd_to(expert_out, Component.combine)
        with self.region(Component.combine):
            y = self._combine_unpack(self._combine_exchange(
                self._combine_pack(expert_out, handle)))
        return self.bwd_from(y, Component.combine)

    # The phases of send and combine (Megatron-Core's dispatch / combine pre-process,
    # communication and post-process): the collectives alone in ``*_exchange``, the
    # memory-bound permutations around them, so an overlapped schedule can run the
    # collectives on a communication stream and the permutations with the GEMMs
    # (runtime.parallel.overlap). Each phase is timed as its component.

    def send_pack(self, tokens: torch.Tensor, routing: Routing, prepared: Any) -> Moving:
        tokens = self.bwd_to(tokens, Component.dispatch)
        with self.region(Component.dispatch):
            return self._send_pack(tokens, routing, prepared)

    def send_exchange(self, moving: Moving) -> Moving:
        with self.region(Component.dispatch):
            return self._send_exchange(moving)

    def send_unpack(self, moving: Moving) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        with self.region(Component.dispatch):
            rows, counts, handle = self._send_unpack(moving)
        return self.bwd_from(rows, Component.dispatch), counts, handle

    def combine_pack(self, expert_out: torch.Tensor, handle: DispatchHandle) -> Moving:
        expert_out = self.bwd_to(expert_out, Component.combine)
        with self.region(Component.combine):
            return self._combine_pack(expert_out, handle)

    def combine_exchange(self, moving: Moving) -> Moving:
        with self.region(Component.combine):
            return self._combine_exchange(moving)

    def combine_unpack(self, moving: Moving) -> torch.Tensor:
        with self.region(Component.combine):
            y = self._combine_unpack(moving)
        return self.bwd_from(y, Component.combine)


@dataclass
class Moving:
    """Tokens between two phases of a send or combine: the rows in flight, the handle the later
    phases read (a dispatcher keeps its own record in ``handle.extra``) and, while sending, the
    rows per local expert."""

    rows: torch.Tensor
    handle: DispatchHandle
    counts: torch.Tensor | None = None


@dataclass
class _AllToAllPlan:
    """One chunk's all-to-all, known before its rows move."""

    slots: torch.Tensor
    """Flat (token * k + slot) ids in expert order."""
    recv_counts: torch.Tensor
    """[n, local experts] rows each peer sends each local expert."""
    in_splits: list[int]
    out_splits: list[int]


@dataclass
class AllToAllState:
    """An all-to-all dispatch's record: the rows each peer sends and receives, and the
    received rows' order by local expert (known once they arrive)."""

    in_splits: list[int]
    out_splits: list[int]
    order: torch.Tensor | None = None


@dataclass
class SharedExpertsState:
    """Expert TP with shared experts: the gathered tokens they run on, then their partial
    sums until the combine adds them (each dropped once read)."""

    tokens: torch.Tensor | None = None
    out: torch.Tensor | None = None


@dataclass
class _AllGatherPlan:
    """One chunk's rows for the local experts, in the EP group's gathered token order."""

    slots: torch.Tensor
    counts: torch.Tensor


def expert_order(indices: torch.Tensor, experts: int, dropless: bool) -> torch.Tensor:
    """Flat slot ids ordered by expert (stable: token order inside an expert), dropped slots
    (index < 0) last: runtime.moe.sort_by_expert's order without filtering the dropped ones,
    which would wait on the host for their count (the caller cuts them off once the counts
    it needs on the host anyway have arrived)."""
    flat = indices.reshape(-1)
    key = flat if dropless else torch.where(flat >= 0, flat, experts)
    return torch.argsort(key, stable=True)


class AllToAllDispatcher(_Timed):
    """Sort (token, slot) rows by expert, exchange the per-expert counts, all-to-all(v) the
    rows, then regroup the received rows from (source rank, expert) to (expert, source rank)
    order for the grouped GEMM. Combine runs the same steps backwards.

    The one wait on the host is for the split sizes, which all-to-all(v) needs there: the
    count exchange starts first and the counts' copy to the host is started behind it, so the
    sort and the token gather run on the device while the host waits for the copy."""

    def __init__(self, num_experts: int, group, size: int, timers: Timers | None = None,
                 ops: KernelOps = EAGER):
        super().__init__(timers)
        self.group, self.size = group, size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // size
        self.ops = ops

    def _prepare(self, routings: list[Routing]) -> list[_AllToAllPlan]:
        n, el = self.size, self.num_local_experts
        # per chunk: slots in expert order (dropped slots last, cut once the splits are known)
        # and rows per expert
        slots = [expert_order(r.indices, self.num_experts, r.dropless) for r in routings]
        counts = [count_per_expert(r.indices, self.num_experts).view(n, el) for r in routings]
        send_counts = torch.stack(counts, 1)  # [n, c, el]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # the one wait on the host of the dispatch: all-to-all(v) needs its splits there; the
        # copy is started behind the count exchange and read once, for every chunk
        splits = start_host_copy(torch.stack([send_counts.sum(2), recv_counts.sum(2)]))()
        return [
            _AllToAllPlan(chunk_slots, recv_counts[:, i], [row[i] for row in splits[0]],
                          [row[i] for row in splits[1]])
            for i, chunk_slots in enumerate(slots)
        ]

    def _send_pack(self, tokens: torch.Tensor, routing: Routing, prepared: _AllToAllPlan
                   ) -> Moving:
        """The rows in expert order (so in destination-rank order)."""
        k = routing.indices.shape[1]
        slots = prepared.slots
        if not routing.dropless:  # dropped slots sort last: keep the routed ones
            slots = slots[:sum(prepared.in_splits)]
        handle = DispatchHandle(slots, routing.weights, tokens.shape[0], k,
                                AllToAllState(prepared.in_splits, prepared.out_splits))
        return Moving(self.ops.gather_rows(tokens, slots, k), handle,
                      prepared.recv_counts)

    def _send_exchange(self, moving: Moving) -> Moving:
        state = moving.handle.extra
        received = all_to_all(moving.rows, state.out_splits, state.in_splits, self.group)
        return Moving(received, moving.handle, moving.counts)

    def _send_unpack(self, moving: Moving) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Regroup the received rows from (source rank, expert) to (expert, source rank)."""
        n, el = self.size, self.num_local_experts
        received, recv_counts, handle = moving.rows, moving.counts, moving.handle
        # chunk c = src * el + e; expert-major order is key e * n + src
        chunk = torch.repeat_interleave(
            torch.arange(n * el, device=received.device), recv_counts.reshape(-1),
            output_size=received.shape[0],
        )
        order = torch.argsort((chunk % el) * n + torch.div(chunk, el, rounding_mode="floor"),
                              stable=True)
        handle.extra.order = order
        return self.ops.permute_rows(received, order), recv_counts.sum(0), handle

    def _combine_pack(self, expert_out: torch.Tensor, handle: DispatchHandle) -> Moving:
        order = handle.extra.order
        assert order is not None, "combine before the dispatch's rows arrived"
        return Moving(self.ops.permute_rows(expert_out, inverse_permutation(order), order),
                      handle)

    def _combine_exchange(self, moving: Moving) -> Moving:
        state = moving.handle.extra
        rows = all_to_all(moving.rows, state.in_splits, state.out_splits, self.group)
        return Moving(rows, moving.handle)

    def _combine_unpack(self, moving: Moving) -> torch.Tensor:
        h = moving.handle
        return self.ops.weighted_scatter(moving.rows, h.slots, h.weights, h.num_tokens, h.top_k)


class AllGatherDispatcher(_Timed):
    """All-gather the EP group's tokens and routing, keep the rows routed to local experts
    (local scatter); combine weights them, sums per token (local gather) and reduce-scatters
    the partial sums back to the tokens' owners. Every rank holds the same token count."""

    def __init__(
        self, num_experts: int, group, size: int, index: int, timers: Timers | None = None,
        ops: KernelOps = EAGER,
    ):
        super().__init__(timers)
        self.group, self.size, self.index = group, size, index
        self.num_local_experts = num_experts // size
        self.ops = ops

    def _prepare(self, routings: list[Routing]) -> list[_AllGatherPlan]:
        """All-gather every chunk's routing indices at once and pick the rows routed to local
        experts (the filter waits on the host once per chunk, here, before any rows move)."""
        el, n = self.num_local_experts, self.size
        sizes = [r.indices.shape[0] for r in routings]
        gathered = all_gather(torch.cat([r.indices for r in routings]), self.group)
        per_rank = gathered.view(n, sum(sizes), -1)  # every rank holds the same token count
        plans = []
        for indices in torch.split(per_rank, sizes, dim=1):
            local = indices.reshape(-1, indices.shape[-1]) - self.index * el
            local = torch.where((local >= 0) & (local < el), local, -1)
            plans.append(_AllGatherPlan(*sort_by_expert(local, el)))
        return plans

    def _send_pack(self, tokens: torch.Tensor, routing: Routing, prepared: _AllGatherPlan
                   ) -> Moving:
        """Nothing to permute before the all-gather: the tokens go as they are."""
        handle = DispatchHandle(prepared.slots, routing.weights, tokens.shape[0],
                                routing.indices.shape[1], None)
        return Moving(tokens, handle, prepared.counts)

    def _send_exchange(self, moving: Moving) -> Moving:
        h = moving.handle
        all_tokens = all_gather(moving.rows, self.group)
        all_weights = all_gather(h.weights, self.group)
        handle = DispatchHandle(h.slots, all_weights, all_tokens.shape[0], h.top_k, None)
        return Moving(all_tokens, handle, moving.counts)

    def _send_unpack(self, moving: Moving) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """The local scatter: the gathered tokens' rows routed to local experts."""
        h = moving.handle
        return self.ops.gather_rows(moving.rows, h.slots, h.top_k), moving.counts, h

    def _combine_pack(self, expert_out: torch.Tensor, handle: DispatchHandle) -> Moving:
        """The local gather: weighted partial sums for every gathered token."""
        partial = self.ops.weighted_scatter(
            expert_out, handle.slots, handle.weights, handle.num_tokens, handle.top_k
        )
        return Moving(partial, handle)

    def _combine_exchange(self, moving: Moving) -> Moving:
        return Moving(reduce_scatter(moving.rows, self.group), moving.handle)

    def _combine_unpack(self, moving: Moving) -> torch.Tensor:
        return moving.rows


class ExpertTPDispatcher(AllGatherDispatcher):
    """Expert tensor parallelism (Megatron-LM MoE with etp): every rank of the etp group holds
    every expert, fc1/fc3 split by columns and fc2 by rows. Dispatch all-gathers the group's
    tokens and routing and keeps every routed row; each rank's fc2 output is a partial sum over
    its slice of the expert hidden width, and combine's reduce-scatter sums the partials and
    returns each rank its own tokens. With TP attention and sequence parallelism the etp group
    is the tp group and this is Megatron's all-gather before / reduce-scatter after the FFN.
    The shared experts (``shared``, split the same way) run on the gathered tokens, outside
    the timed combine, and their partial sums join the routed experts' before the
    reduce-scatter (cost_models.layer_graph prices them so)."""

    def __init__(self, num_experts: int, group, size: int, timers: Timers | None = None,
                 ops: KernelOps = EAGER, shared: nn.Module | None = None):
        super().__init__(num_experts, group, size, 0, timers, ops)
        self.num_local_experts = num_experts
        self.shared = shared
        self.runs_shared = shared is not None

    def _send_exchange(self, moving: Moving) -> Moving:
        moving = super()._send_exchange(moving)
        if self.shared is not None:
            moving.handle.extra = SharedExpertsState(tokens=moving.rows)
        return moving

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        state = handle.extra
        if isinstance(state, SharedExpertsState) and self.shared is not None:
            state.out, state.tokens = self.shared(state.tokens), None
        return super().combine(expert_out, handle)

    def _combine_pack(self, expert_out: torch.Tensor, handle: DispatchHandle) -> Moving:
        moving = super()._combine_pack(expert_out, handle)
        state = handle.extra
        if not isinstance(state, SharedExpertsState) or state.out is None:
            return moving
        shared, state.out = state.out, None
        return Moving(moving.rows + shared, handle)


def make_dispatcher(kind: Dispatch, num_experts: int, mesh: Mesh, timers: Timers | None,
                    ops: KernelOps = EAGER):
    group, n = mesh.groups[MeshAxis.ep], mesh.size(MeshAxis.ep)
    if kind == Dispatch.all_to_all:
        return AllToAllDispatcher(num_experts, group, n, timers, ops)
    if kind == Dispatch.allgather_reduce_scatter:
        return AllGatherDispatcher(num_experts, group, n, mesh.index(MeshAxis.ep), timers, ops)
    raise ValueError(f"ffn.dispatch: {kind} has no dispatcher in this runtime "
                     "(plans.execution refuses it)")


def apply_expert_parallel(
    model: Transformer,
    mesh: Mesh,
    kind: Dispatch,
    shards: dict[str, Shard],
    timers: Timers | None,
) -> None:
    """Keep this rank's experts and install the dispatcher; balance statistics are summed over
    the attention group so the balance loss is the micro-batch's, whatever the sequence split."""
    for lid, moe, i, n in _moe_layers_split_over(model, mesh, MeshAxis.ep):
        _keep_expert_shards(moe, lid, {"w1": 0, "w2": 0, "w3": 0}, i, n, shards)
        moe.dispatcher = make_dispatcher(kind, model.cfg.spec.experts, mesh, timers, moe.ops)


def _moe_layers_split_over(model: Transformer, mesh: Mesh, axis: MeshAxis
                           ) -> Iterator[tuple[str, MoE, int, int]]:
    """The MoE layers to split over ``axis`` (none where it has one rank), each with this
    rank's index on it and its size; the routers' balance statistics are summed over the
    attention group first."""
    n, i = mesh.size(axis), mesh.index(axis)
    sum_balance_stats_over_attention(model, mesh)
    if n == 1:
        return
    for lid, block in model.layers.items():
        if block.moe is not None:
            yield lid, block.moe, i, n


def _keep_expert_shards(moe: nn.Module, lid: str, dims: dict[str, int], index: int, size: int,
                        shards: dict[str, Shard]) -> None:
    """Keep this rank's slice (``index`` of ``size``) of each stacked expert weight, split
    along ``dims[weight]``, and record it in ``shards``."""
    for w, dim in dims.items():
        shard = Shard(dim, index, size)
        setattr(moe.experts, w, nn.Parameter(shard.take(getattr(moe.experts, w).detach())))
        shards[f"layers.{lid}.moe.experts.{w}"] = shard


def sum_balance_stats_over_attention(model: Transformer, mesh: Mesh) -> None:
    """Sum the routers' balance statistics over the attention group, so the balance loss is the
    micro-batch's whatever the sequence split."""
    attn_group = mesh.groups[MeshAxis.attn]
    if attn_group is None:
        return
    for block in model.layers.values():
        if block.moe is not None:
            block.moe.router.reduce_stats = lambda t, g=attn_group: sum_replicated(t, g)


def apply_expert_tensor_parallel(
    model: Transformer, mesh: Mesh, shards: dict[str, Shard], timers: Timers | None
) -> None:
    """Split every expert over the etp group: w1 and w3 ([E, ffn, h]) by rows of the hidden
    width (column parallel), w2 ([E, h, ffn]) by its columns (row parallel); the shared experts
    the same way, run by the dispatcher on the gathered tokens. The router stays replicated
    and runs on this rank's own tokens."""
    for lid, moe, i, n in _moe_layers_split_over(model, mesh, MeshAxis.etp):
        _keep_expert_shards(moe, lid, {"w1": 1, "w3": 1, "w2": 2}, i, n, shards)
        if moe.shared is not None:
            for w, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                linear = getattr(moe.shared, w)
                shard = Shard(dim, i, n)
                linear.weight = nn.Parameter(shard.take(linear.weight.detach()))
                shards[f"layers.{lid}.moe.shared.{w}.weight"] = shard
        moe.dispatcher = ExpertTPDispatcher(
            model.cfg.spec.experts, mesh.groups[MeshAxis.etp], n, timers, moe.ops, moe.shared
        )
