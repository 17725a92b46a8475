"""The operators of one transformer layer as networkx DAGs, forward and backward.

The forward graph is written out per strategy. The backward graph is derived from it: every
operator's gradient runs after the gradients of its consumers; a GEMM becomes a data-gradient
GEMM on the gradient path and a weight-gradient GEMM nothing waits on; a collective runs
reversed (all-gather <-> reduce-scatter, all-to-all back), reported under its forward kind and
fused with the data-gradient of its forward GEMM partner. Recomputed operators rerun in the
backward graph before the gradients that need their outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

import networkx as nx

from cost_models import compute as cc
from cost_models import volumes as vol
from cost_models.dispatch import ALL_GATHER, Passes, eager_permutation
from cost_models.schedule import Stream
from cost_models.volumes import CommKind, Transfer
from plans.layout import tokens_per_rank
from plans.plan import (
    EPFFN,
    AttentionStrategy,
    CPAttention,
    Dispatch,
    FFNStrategy,
    Kernels,
    Recompute,
    TPAttention,
    UlyssesAttention,
)
from plans.specs import ClusterSpec, ModelSpec, Precision

AB = cc.ACT_BYTES


class OpKind(StrEnum):
    gemm = "gemm"
    grouped_gemm = "grouped_gemm"
    attention = "attention"
    memory = "memory"
    comm = "comm"
    host = "host"
    """GPU time lost to the host: the eager dispatch's wait for its split sizes
    (cost_models.dispatch)."""


@dataclass(frozen=True)
class LayerKey:
    """Everything one layer's timing depends on (hashable: the Plan itself is not)."""

    model: ModelSpec
    cluster: ClusterSpec
    seq_len: int
    precision: Precision
    batch: int
    sp: int
    tp: int
    cp: int
    ep: int
    etp: int
    attention: AttentionStrategy
    ffn: FFNStrategy
    recompute: Recompute
    kernels: Kernels
    dense: bool
    """A dense-FFN layer (model.dense_layers) instead of MoE."""

    @property
    def tokens(self) -> float:
        """Tokens per rank outside attention: b x s / (sp x cp x tp)."""
        return tokens_per_rank(self.batch, self.seq_len, self.sp * self.cp * self.tp)


@dataclass(frozen=True)
class Op:
    name: str
    kind: OpKind
    duration_s: float
    bwd: tuple[float, ...] = ()
    """Backward durations: (data-gradient, weight-gradient) for GEMMs, one entry otherwise."""
    comm: CommKind | None = None
    fuse_with: str | None = None
    """GEMM this collective is fused with at tile level (intra-operator overlap)."""
    fuse_rows: float = 0.0
    """Rows of that GEMM; the collective's first 128-row tile chunk is the pipeline fill."""
    selective: bool = False
    """Recomputed in backward under Recompute.selective: the attention core (RoPE and
    FlashAttention), as the runtime reruns it (runtime.parallel.parallelize.apply_recompute)."""
    recompute: bool = False
    """This is a backward-pass rerun of a forward operator."""

    @property
    def stream(self) -> Stream:
        return Stream.comm if self.kind == OpKind.comm else Stream.compute

    @property
    def fill_fraction(self) -> float:
        return 1.0 / max(1, math.ceil(self.fuse_rows / cc.TILE))


class _Builder:
    """Adds operators in program order; the order breaks scheduling ties."""

    def __init__(self, key: LayerKey) -> None:
        self.key = key
        self.graph = nx.DiGraph()

    def add(self, op: Op, *after: str | None) -> str:
        self.graph.add_node(
            op.name, op=op, duration_s=op.duration_s, stream=op.stream, kind=op.kind,
            order=self.graph.number_of_nodes(),
        )
        for a in after:
            if a is not None:
                self.graph.add_edge(a, op.name)
        return op.name

    def gemm(self, name: str, m: float, n: float, k: float, *after: str | None,
             selective: bool = False) -> str:
        c, p = self.key.cluster, self.key.precision
        fwd = cc.gemm_s(m, n, k, c, p)
        bwd = tuple(cc.gemm_s(*g, c, p) for g in cc.backward_gemms(m, n, k))
        return self.add(Op(name, OpKind.gemm, fwd, bwd, selective=selective), *after)

    def grouped(self, name: str, groups: int, m: float, n: float, k: float,
                *after: str | None) -> str:
        c, p = self.key.cluster, self.key.precision
        fwd = cc.grouped_gemm_s(groups, m, n, k, c, p)
        bwd = tuple(cc.grouped_gemm_s(groups, *g, c, p) for g in cc.backward_gemms(m, n, k))
        return self.add(Op(name, OpKind.grouped_gemm, fwd, bwd), *after)

    def memory(self, name: str, fwd_bytes: float, bwd_bytes: float, *after: str | None,
               selective: bool = False) -> str:
        c = self.key.cluster
        op = Op(name, OpKind.memory, cc.elementwise_s(fwd_bytes, c),
                (cc.elementwise_s(bwd_bytes, c),), selective=selective)
        return self.add(op, *after)

    def permutation(self, name: str, fwd_bytes: float, bwd_bytes: float,
                    *after: str | None) -> str:
        """An eager token-permutation step (cost_models.dispatch) at the gather/scatter rate."""
        c = self.key.cluster
        op = Op(name, OpKind.memory, cc.gather_scatter_s(fwd_bytes, c),
                (cc.gather_scatter_s(bwd_bytes, c),))
        return self.add(op, *after)

    def host_wait(self, name: str, seconds: float, *after: str | None) -> str:
        return self.add(Op(name, OpKind.host, seconds, (0.0,)), *after)

    def attention(self, name: str, flops: float, *after: str | None) -> str:
        """The attention core (RoPE and FlashAttention): what Recompute.selective reruns."""
        c = self.key.cluster
        op = Op(name, OpKind.attention, cc.flash_attention_fwd_s(flops, c),
                (cc.flash_attention_bwd_s(flops, c),), selective=True)
        return self.add(op, *after)

    def comm(self, name: str, t: Transfer, *after: str | None, fuse_with: str | None = None,
             rows: float = 0.0, selective: bool = False) -> str:
        d = vol.transfer_s(t, self.key.cluster)
        op = Op(name, OpKind.comm, d, (d,), t.kind, fuse_with, rows, selective)
        return self.add(op, *after)


# ---- forward ----------------------------------------------------------------------------------


def _attention(g: _Builder, x: str | None) -> str:
    k, m = g.key, g.key.model
    h, t, b, s = m.hidden, k.tokens, k.batch, k.seq_len
    norm = g.memory("attn_norm", 2 * t * h * AB, 3 * t * h * AB, x)
    match k.attention:
        case UlyssesAttention():
            a2a_qkv, a2a_out = vol.ulysses_attention(m, b, s, k.sp)
            kv_dim = vol.kv_heads_sent(m, k.sp) * m.head_dim
            qkv = g.gemm("qkv_gemm", t, m.q_dim + 2 * kv_dim, h, norm)
            head_major = g.comm("sp_a2a_qkv", a2a_qkv, qkv, fuse_with="qkv_gemm", rows=t)
            flops = cc.attention_fwd_flops(b, s, s, m.query_heads / k.sp, m.head_dim,
                                           cc.CAUSAL_FRACTION)
            attn = g.attention("flash_attn", flops, head_major)
            seq_major = g.comm("sp_a2a_out", a2a_out, attn, fuse_with="out_gemm", rows=t)
            out = g.gemm("out_gemm", t, h, m.q_dim, seq_major)
        case TPAttention():
            ag, rs = vol.tp_attention(m, b, s, k.tp)
            kv_dim = vol.kv_heads_sent(m, k.tp) * m.head_dim
            gathered = g.comm("tp_all_gather", ag, norm, fuse_with="qkv_gemm", rows=b * s)
            qkv = g.gemm("qkv_gemm", b * s, (m.q_dim + 2 * kv_dim) / k.tp, h, gathered)
            flops = cc.attention_fwd_flops(b, s, s, m.query_heads / k.tp, m.head_dim,
                                           cc.CAUSAL_FRACTION)
            attn = g.attention("flash_attn", flops, qkv)
            proj = g.gemm("out_gemm", b * s, h, m.q_dim / k.tp, attn)
            out = g.comm("tp_reduce_scatter", rs, proj, fuse_with="out_gemm", rows=b * s)
        case CPAttention(zigzag=zigzag):
            (kv,) = vol.cp_attention(m, b, s, k.cp)
            qkv = g.gemm("qkv_gemm", t, m.q_dim + 2 * m.kv_dim, h, norm)
            ring = g.comm("cp_kv_exchange", kv, qkv, fuse_with="flash_attn", rows=t)
            # The slowest rank sets the pace: zig-zag chunks balance the causal mask exactly;
            # contiguous chunks leave the last rank 1 - 1/(2 cp) of its full score rows.
            share = cc.CAUSAL_FRACTION if zigzag else 1 - 1 / (2 * k.cp)
            flops = cc.attention_fwd_flops(b, s / k.cp, s, m.query_heads, m.head_dim, share)
            attn = g.attention("flash_attn", flops, ring)
            out = g.gemm("out_gemm", t, h, m.q_dim, attn)
    return g.memory("attn_residual", 3 * t * h * AB, 0.0, out)


def _swiglu(g: _Builder, prefix: str, rows: float, width: float, fc13: str) -> str:
    """SwiGLU: read fc1 and gate outputs, write the product; backward reads 3, writes 2."""
    return g.memory(f"{prefix}swiglu", 3 * rows * width * AB, 5 * rows * width * AB, fc13)


def _dense_ffn(g: _Builder, norm: str) -> str:
    k, m = g.key, g.key.model
    h, t, f = m.hidden, k.tokens, m.dense_ffn_hidden
    if k.tp == 1:
        fc13 = g.gemm("dense_fc13", t, 2 * f, h, norm)
        act = _swiglu(g, "dense_", t, f, fc13)
        return g.gemm("dense_fc2", t, h, f, act)
    ag, rs = vol.tp_attention(m, k.batch, k.seq_len, k.tp)
    rows = k.batch * k.seq_len
    gathered = g.comm("dense_all_gather", ag, norm, fuse_with="dense_fc13", rows=rows)
    fc13 = g.gemm("dense_fc13", rows, 2 * f / k.tp, h, gathered)
    act = _swiglu(g, "dense_", rows, f / k.tp, fc13)
    fc2 = g.gemm("dense_fc2", rows, h, f / k.tp, act)
    return g.comm("dense_reduce_scatter", rs, fc2, fuse_with="dense_fc2", rows=rows)


def _shared_experts(g: _Builder, norm: str, rows: float, width_divisor: int) -> str | None:
    m = g.key.model
    if not m.shared_experts:
        return None
    f = m.shared_experts * m.shared_expert_ffn_hidden / width_divisor
    fc13 = g.gemm("shared_fc13", rows, 2 * f, m.hidden, norm)
    act = _swiglu(g, "shared_", rows, f, fc13)
    return g.gemm("shared_fc2", rows, m.hidden, f, act)


def _moe_ffn(g: _Builder, norm: str) -> tuple[str, ...]:
    k, m = g.key, g.key.model
    h, t, e = m.hidden, k.tokens, m.experts
    logits = g.gemm("router_gemm", t, e, h, norm)
    topk = g.memory("router_topk", 2 * t * e * cc.FP32_BYTES, 2 * t * e * cc.FP32_BYTES, logits)
    if isinstance(k.ffn, EPFFN):
        n, local, width, gathered_tokens = k.ep, e // k.ep, m.expert_ffn_hidden, t
        per_expert = cc.expert_tokens(t * n, m.top_k, e, k.ffn.capacity_factor)
    else:
        n, local, width, gathered_tokens = k.etp, e, m.expert_ffn_hidden / k.etp, t * k.etp
        per_expert = cc.expert_tokens(gathered_tokens, m.top_k, e, None)
    rows = per_expert * local
    row_bytes = h * AB
    eager = eager_permutation(k.ffn.dispatch if isinstance(k.ffn, EPFFN) else None, n) \
        if k.kernels == Kernels.eager else None
    # Rows of tokens the eager combine scatters into: this rank's, or the group's after an
    # all-gather.
    token_rows = n * t if eager is ALL_GATHER else t

    def permutation(name: str, fused_fwd: float, fused_bwd: float, eager_fwd: Passes | None,
                    eager_bwd: Passes | None, *after: str | None) -> str:
        if eager_fwd is None or eager_bwd is None:
            return g.memory(name, fused_fwd * row_bytes, fused_bwd * row_bytes, *after)
        return g.permutation(name, eager_fwd.rows(rows, token_rows) * row_bytes,
                             eager_bwd.rows(rows, token_rows) * row_bytes, *after)

    e_fwd = eager.dispatch_fwd if eager else None
    e_bwd = eager.dispatch_bwd if eager else None
    if isinstance(k.ffn, EPFFN) and k.ffn.dispatch == Dispatch.all_to_all:
        send, back = vol.ep_ffn(m, t, n, Dispatch.all_to_all, routed_copies=rows)
        perm = permutation("dispatch_permute", t + rows, t + rows, e_fwd, e_bwd, norm, topk)
        ready = g.comm("ep_dispatch", send, perm, fuse_with="expert_fc13", rows=rows)
        shared = _shared_experts(g, norm, t, 1)
    else:
        send, back = (vol.ep_ffn(m, t, n, Dispatch.allgather_reduce_scatter)
                      if isinstance(k.ffn, EPFFN) else vol.tp_ffn(m, t, n))
        # All-gather every rank's tokens, then pick the rows routed to local experts.
        arrived = g.comm(send.kind.value, send, norm, fuse_with="expert_fc13", rows=rows)
        ready = permutation("dispatch_scatter", 2 * rows, rows + n * t, e_fwd, e_bwd,
                            arrived, topk)
        # Shared experts are replicated under EP (local tokens), split by etp under TP.
        shared = _shared_experts(g, norm if k.etp == 1 else arrived, gathered_tokens, k.etp)
    fc13 = g.grouped("expert_fc13", local, per_expert, 2 * width, h, ready)
    act = _swiglu(g, "expert_", rows, width, fc13)
    fc2 = g.grouped("expert_fc2", local, per_expert, h, width, act)
    e_fwd = eager.combine_fwd if eager else None
    e_bwd = eager.combine_bwd if eager else None
    if isinstance(k.ffn, EPFFN) and k.ffn.dispatch == Dispatch.all_to_all:
        returned = g.comm("ep_combine", back, fc2, fuse_with="expert_fc2", rows=rows)
        out = permutation("combine_unpermute", rows + t, rows + t, e_fwd, e_bwd, returned, topk)
    else:
        # Weighted local gather into a zeroed n x tokens buffer, reduce-scatter it back.
        gathered = permutation("combine_gather", rows + n * t, 2 * rows, e_fwd, e_bwd, fc2, topk,
                               shared if k.etp > 1 else None)
        out = g.comm(back.kind.value, back, gathered, fuse_with="expert_fc2", rows=rows)
    if eager is not None and eager.host_sync:
        # The dispatch waits on the host, then the CPU launches its small kernels one by one:
        # the layer's dispatch + combine (forward and backward) never takes less than the
        # measured floor; the shortfall is GPU time lost to the host.
        floor_s = k.cluster.efficiency.dispatch_floor_us.of(
            k.ffn.dispatch if isinstance(k.ffn, EPFFN) else Dispatch.allgather_reduce_scatter
        ) * 1e-6
        moved = sum(g.graph.nodes[name]["op"].duration_s + sum(g.graph.nodes[name]["op"].bwd)
                    for name in g.graph if name in DISPATCH_COMBINE_OPS)
        if floor_s > moved:
            out = g.host_wait("dispatch_host_wait", floor_s - moved, out)
    return (out, shared)


DISPATCH_COMBINE_OPS = frozenset({
    "dispatch_permute", "ep_dispatch", "dispatch_scatter", "combine_gather", "ep_combine",
    "combine_unpermute", "etp_all_gather", "etp_reduce_scatter"})
"""The forward operators that move tokens to and from the experts (dispatch and combine);
their collectives are named after their kind."""


def forward_graph(key: LayerKey) -> nx.DiGraph:
    g = _Builder(key)
    h, t = key.model.hidden, key.tokens
    attn = _attention(g, None)
    norm = g.memory("ffn_norm", 2 * t * h * AB, 3 * t * h * AB, attn)
    outs = (_dense_ffn(g, norm),) if key.dense else _moe_ffn(g, norm)
    g.memory("ffn_residual", 3 * t * h * AB, 0.0, attn, *outs)
    return g.graph


# ---- backward -----------------------------------------------------------------------------------


def _recomputed(op: Op, policy: Recompute) -> bool:
    return policy == Recompute.full or (policy == Recompute.selective and op.selective)


def backward_graph(fwd: nx.DiGraph, policy: Recompute) -> nx.DiGraph:
    """Gradients in reverse program order, plus reruns of recomputed forward operators."""
    ops: dict[str, Op] = {n: d["op"] for n, d in fwd.nodes(data=True)}
    order = sorted(ops, key=lambda n: fwd.nodes[n]["order"])
    # Only outputs some gradient reads are rerun: the layer's output is never needed again.
    rerun = [n for n in order if _recomputed(ops[n], policy) and fwd.out_degree(n)]
    bwd = nx.DiGraph()

    def add(op: Op, after: list[str]) -> None:
        bwd.add_node(op.name, op=op, duration_s=op.duration_s, stream=op.stream, kind=op.kind,
                     order=len(added))
        added.append(op.name)
        bwd.add_edges_from((a, op.name) for a in after)

    def grad(name: str) -> str:
        gemm = ops[name].kind in (OpKind.gemm, OpKind.grouped_gemm)
        return f"{name}.dgrad" if gemm else f"{name}.bwd"

    added: list[str] = []
    for name in reversed(order):
        op = ops[name]
        after = [grad(c) for c in fwd.successors(name)]
        # A gradient that reads this operator's forward inputs needs recomputed ones rerun.
        inputs = [f"recompute.{p}" for p in fwd.predecessors(name) if p in rerun]
        if op.kind == OpKind.comm:
            fuse = grad(op.fuse_with) if op.fuse_with else None
            add(replace(op, name=grad(name), fuse_with=fuse), after)
        elif op.kind in (OpKind.gemm, OpKind.grouped_gemm):
            add(replace(op, name=f"{name}.dgrad", duration_s=op.bwd[0]), after)
            add(replace(op, name=f"{name}.wgrad", duration_s=op.bwd[1]), after + inputs)
        else:
            add(replace(op, name=grad(name), duration_s=op.bwd[0]), after + inputs)
    # Reruns come last in program order: they fill compute gaps (behind communication) and
    # never win a tie against a gradient.
    for name in rerun:
        op = ops[name]
        fuse = f"recompute.{op.fuse_with}" if op.fuse_with in rerun else None
        add(replace(op, name=f"recompute.{name}", fuse_with=fuse, recompute=True),
            [f"recompute.{p}" for p in fwd.predecessors(name) if p in rerun])
    return bwd
