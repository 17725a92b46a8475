"""The operators of one transformer layer, forward and backward: entries in program order (each
operator with the operators it runs after), which cost_models.layer schedules, and their networkx
DAGs for reports and calibration (graph_of). The backward pass's structure depends on the forward
pass's alone (``Shape``: names, operators, kinds, edges; not durations), so it is derived once
per layout shape and shared by every cluster and batch size.

The forward graph is written out per strategy. The backward graph is derived from it: every
operator's gradient runs after the gradients of its consumers; a GEMM becomes a data-gradient
GEMM on the gradient path and a weight-gradient GEMM nothing waits on; a collective runs
reversed (all-gather <-> reduce-scatter, all-to-all back), reported under its forward kind and
fused with the data-gradient of its forward GEMM partner. Recomputed operators (the plan's
level as a set of operators, plans.operators.RECOMPUTED) rerun in the backward graph before the
gradients that need their outputs. Every forward node is one ``plans.LayerOperator``, named by
its value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import lru_cache
from types import MappingProxyType
from typing import NamedTuple

import networkx as nx

from cost_models import compute as cc
from cost_models import skew
from cost_models import volumes as vol
from cost_models.dispatch import ALL_GATHER, Passes, eager_permutation, fused_every_slot
from cost_models.schedule import Stream
from cost_models.volumes import CommKind, Transfer
from plans.enums import ExpertGemm
from plans.layout import expert_gemm, kv_heads_sent, tokens_per_rank
from plans.operators import (
    DEFAULT_MODULES,
    TIMER_OF,
    Component,
    LayerOperator,
    recomputed_operators,
)
from plans.plan import (
    EPFFN,
    AttentionStrategy,
    CPAttention,
    Dispatch,
    FFNStrategy,
    Kernels,
    Recompute,
    RecomputeModule,
    TPAttention,
    UlyssesAttention,
)
from plans.specs import ClusterSpec, ModelSpec, Precision

AB = cc.ACT_BYTES
LO = LayerOperator


RMS_NORM_LAUNCHES = (9, 17)
"""runtime.kernels.rms_norm eager, forward: the fp32 cast, pow, mean, + eps, rsqrt, x r, the
weight's fp32 cast, x weight, the cast back; backward 17 (autograd's kernels of those, the
weight gradient's row sum and cast included)."""
ROUTER_LAUNCHES: Mapping[bool, tuple[int, int]] = MappingProxyType(
    {False: (30, 34), True: (28, 27)})
"""runtime.moe.Router without its gate GEMM, eager, by ``router_pre_softmax``: the fp32 cast,
softmax, top-k (renormalising: the weights' sum and division), the slots per expert
(runtime.kernels.count_per_expert: zeros, clamp, + 1, ones, index_add, cast), the summed
probabilities, balance_from_stats (the token count's fill, cat, the balance loss's divisions,
sums and products) and the logged load (max, mean, clamp, division, stack, the running sum and
maximum of later micro-batches); backward through the routing weights and the balance loss.
The token count is a fill on the device: before 2026-12-01 it was ``torch.tensor([tokens],
device=...)``, a host-to-device copy from pageable memory after which ATen waits for the
stream, so the host waited for the GPU's queue to drain at every router call."""
ROPE_LAUNCHES: Mapping[bool, tuple[int, int]] = MappingProxyType(
    {True: (38, 26), False: (36, 24)})
"""runtime.model.AttentionCore.prologue eager, by whether k and v are repeated to q's heads
(GQA): the RoPE tables computed at the call (positions, frequencies, cos and sin), the
rotate-half rotation of q and k (halves, negation, concatenation, products and sum, each cast),
and the two repeat_interleave copies; backward the rotation's gradients and the repeats'
sums."""
SWIGLU_LAUNCHES = (2, 3)
"""runtime.kernels.swiglu eager: silu and the product; backward the two products' gradients and
silu's."""
RESIDUAL_LAUNCHES = (1, 0)
"""A residual add: one kernel; its backward passes the gradient through (no kernel)."""


def eager_launches(op: LayerOperator, model: ModelSpec) -> tuple[int, int]:
    """The kernels the eager runtime launches for memory-bound operator ``op``, forward and
    backward: the non-view ATen operations its PyTorch code dispatches, one kernel each
    (tests/runtime/test_eager_launches.py counts them on the runtime's functions)."""
    match op:
        case LayerOperator.attn_norm | LayerOperator.ffn_norm:
            return RMS_NORM_LAUNCHES
        case LayerOperator.router_topk:
            return ROUTER_LAUNCHES[model.router_pre_softmax]
        case LayerOperator.expert_swiglu | LayerOperator.shared_swiglu | LayerOperator.dense_swiglu:
            return SWIGLU_LAUNCHES
        case LayerOperator.attn_residual | LayerOperator.ffn_residual:
            return RESIDUAL_LAUNCHES
        case LayerOperator.rope:
            return ROPE_LAUNCHES[model.query_heads > model.kv_heads]
    return (0, 0)


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
    dense: bool
    """A dense-FFN layer (model.dense_layers) instead of MoE."""
    kernels: Kernels = Kernels.eager
    """Whether the fusable memory-bound operators run as fused regions (plan.kernels)."""
    routing_skew: float = 1.0
    """TrainingSpec.routing_skew (cost_models.skew)."""
    recompute_modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES
    """Plan.recompute_modules: what selective recomputation reruns."""
    expert_gemm: ExpertGemm | None = None
    """The path the routed experts' GEMMs run (null: plans.layout.expert_gemm's rule at each
    graph's chunk count; cost_models.layer.layer_key resolves it by the plan's target)."""

    @property
    def tokens(self) -> float:
        """Tokens per rank outside attention: b x s / (sp x cp x tp)."""
        return tokens_per_rank(self.batch, self.seq_len, self.sp * self.cp * self.tp)


class Op(NamedTuple):
    """One operator of a layer's pass (a named tuple: a layer's graphs make tens of
    thousands per search)."""

    name: str
    """The node: the operator's value in the forward graph; with a suffix (``.dgrad``,
    ``.wgrad``, ``.bwd``) or the prefix ``recompute.`` in the backward graph."""
    operator: LayerOperator
    kind: OpKind
    duration_s: float
    bwd: tuple[float, ...] = ()
    """Backward durations: (data-gradient, weight-gradient) for GEMMs, one entry otherwise."""
    comm: CommKind | None = None
    fuse_with: str | None = None
    """GEMM this collective is fused with at tile level (intra-operator overlap)."""
    fuse_rows: float = 0.0
    """Rows of that GEMM; the collective's first 128-row tile chunk is the pipeline fill."""
    recompute: bool = False
    """This is a backward-pass rerun of a forward operator."""
    side_stream: bool = False
    """A collective of the chunked MoE layer or of Ulysses in head groups, issued on the
    communication stream beside the other chunk's expert GEMMs or attention core (what
    Overlap.inter_op overlaps)."""
    transfer: Transfer | None = None
    """A forward collective's transfer, which its durations price on the key's cluster
    (priced_on prices it on another)."""

    @property
    def stream(self) -> Stream:
        return Stream.comm if self.kind == OpKind.comm else Stream.compute

    @property
    def fill_fraction(self) -> float:
        return 1.0 / max(1, math.ceil(self.fuse_rows / cc.TILE))


Entry = tuple[Op, tuple[str, ...]]
"""An operator and the names of the operators it runs after, in the order it was added
(``Entries``: one pass of a layer in program order, what its networkx graph is made of)."""
Entries = tuple[Entry, ...]


def graph_of(entries: Entries) -> nx.DiGraph:
    """The networkx DAG of ``entries``: nodes in program order (``order``), each with its
    operator, duration, stream and kind."""
    graph = nx.DiGraph()
    for i, (op, after) in enumerate(entries):
        graph.add_node(op.name, op=op, duration_s=op.duration_s, stream=op.stream, kind=op.kind,
                       order=i)
        graph.add_edges_from((a, op.name) for a in after)
    return graph


def entries_of(graph: nx.DiGraph) -> Entries:
    """The entries of ``graph`` (one built by graph_of, or a subgraph of one)."""
    nodes = graph.nodes
    return tuple((nodes[n]["op"], tuple(graph.predecessors(n)))
                 for n in sorted(graph, key=lambda n: nodes[n]["order"]))


class _Builder:
    """Adds operators in program order; the order breaks scheduling ties."""

    def __init__(self, key: LayerKey) -> None:
        self.key = key
        self.entries: list[Entry] = []

    def add(self, op: Op, *after: str | None) -> str:
        self.entries.append((op, tuple(dict.fromkeys(a for a in after if a is not None))))
        return op.name

    def gemm(self, name: LayerOperator, m: float, n: float, k: float, *after: str | None) -> str:
        c, p = self.key.cluster, self.key.precision
        fwd = cc.gemm_s(m, n, k, c, p)
        bwd = tuple(cc.gemm_s(*g, c, p) for g in cc.backward_gemms(m, n, k))
        return self.add(Op(name.value, name, OpKind.gemm, fwd, bwd), *after)

    def gemms(self, name: LayerOperator, shapes: tuple[tuple[float, float, float], ...],
              *after: str | None) -> str:
        """Several GEMMs (m, n, k) one after the other as one operator (MLA's projections)."""
        c, p = self.key.cluster, self.key.precision
        fwd = sum(cc.gemm_s(*shape, c, p) for shape in shapes)
        grads = [tuple(cc.gemm_s(*g, c, p) for g in cc.backward_gemms(*shape))
                 for shape in shapes]
        bwd = tuple(sum(g[i] for g in grads) for i in range(2))
        return self.add(Op(name.value, name, OpKind.gemm, fwd, bwd), *after)

    def grouped(self, name: LayerOperator, gemm: ExpertGemm, groups: int, m: float, n: float,
                k: float, *after: str | None, at: str = "", m_sd: float = 0.0) -> str:
        """The experts' GEMM as ``gemm`` runs it. ``at``: the chunk suffix of a chunked MoE
        layer's operators (``@0``, ``@1``). ``m_sd``: the spread of the experts' rows, which
        pads the row tiles of the forward and the data gradient (grouped over the rows); the
        weight gradient reduces over them, its tiles fixed (measured on one H200: uneven rows
        slow the first two, not the third, bench/results/h200/*/expert_gemm_parts_*)."""
        c, p = self.key.cluster, self.key.precision
        data, weight = cc.backward_gemms(m, n, k)
        fwd = cc.expert_gemm_s(gemm, groups, m, n, k, c, p, m_sd)
        bwd = (cc.expert_gemm_s(gemm, groups, *data, c, p, m_sd),
               cc.expert_gemm_s(gemm, groups, *weight, c, p, over_rows=False))
        return self.add(Op(name.value + at, name, OpKind.grouped_gemm, fwd, bwd), *after)

    def memory(self, name: LayerOperator, fwd_bytes: float, bwd_bytes: float,
               *after: str | None, at: str = "", fusable: bool = True) -> str:
        """A memory-bound operator at its fused-kernel bytes. ``fusable`` ones (RMSNorm,
        RoPE, SwiGLU, the permutations: runtime.kernels) run as fused regions under
        plan.kernels fused, at efficiency.fused_elementwise; the residual adds (one kernel
        either way), the router's softmax and top-k (eager in both sets) and every eager
        plan's operators as their eager kernels (eager_launches) at efficiency.elementwise."""
        c = self.key.cluster
        if fusable and self.key.kernels == Kernels.fused:
            fwd = cc.fused_elementwise_s(fwd_bytes, c)
            bwd = cc.fused_elementwise_s(bwd_bytes, c)
        else:
            fwd_launches, bwd_launches = eager_launches(name, self.key.model)
            fwd = cc.elementwise_s(fwd_bytes, c, fwd_launches)
            bwd = cc.elementwise_s(bwd_bytes, c, bwd_launches)
        return self.add(Op(name.value + at, name, OpKind.memory, fwd, (bwd,)), *after)

    def permutation(self, name: LayerOperator, fwd_bytes: float, bwd_bytes: float,
                    *after: str | None, at: str = "") -> str:
        """An eager token-permutation step (cost_models.dispatch) at the gather/scatter rate."""
        c = self.key.cluster
        op = Op(name.value + at, name, OpKind.memory, cc.gather_scatter_s(fwd_bytes, c),
                (cc.gather_scatter_s(bwd_bytes, c),))
        return self.add(op, *after)

    def host_wait(self, seconds: float, *after: str | None) -> str:
        name = LayerOperator.dispatch_host_wait
        return self.add(Op(name.value, name, OpKind.host, seconds, (0.0,)), *after)

    def attention(self, flops: float, *after: str | None, at: str = "") -> str:
        """FlashAttention (the core's prologue, RoPE and the GQA expansion, is LO.rope)."""
        c, name = self.key.cluster, LayerOperator.flash_attn
        op = Op(name.value + at, name, OpKind.attention, cc.flash_attention_fwd_s(flops, c),
                (cc.flash_attention_bwd_s(flops, c, self.key.model.head_dim),))
        return self.add(op, *after)

    def comm(self, name: LayerOperator, t: Transfer, *after: str | None,
             fuse_with: LayerOperator | None = None, rows: float = 0.0, at: str = "",
             side_stream: bool = False) -> str:
        d = vol.transfer_s(t, self.key.cluster)
        fused = fuse_with.value + at if fuse_with is not None else None
        op = Op(name.value + at, name, OpKind.comm, d, (d,), t.kind, fused, rows,
                side_stream=side_stream, transfer=t)
        return self.add(op, *after)


# ---- forward ----------------------------------------------------------------------------------


def window_factor(model: ModelSpec, seq_len: int) -> float:
    """The layers' mean attended share of the score matrix over the causal half
    (ModelSpec.attended_share): 1 without windows, less with sliding or chunked layers. One
    layer graph prices every layer, so windowed and full layers are priced at their mean."""
    return model.attended_share(seq_len) / model.layers / cc.CAUSAL_FRACTION


def core_head_dim(model: ModelSpec) -> float:
    """The width at which attention_fwd_flops prices one head: QK^T at head_dim and PV at
    v_head_dim (MLA: 192 and 128), their mean."""
    return (model.head_dim + model.v_head_dim) / 2


def _projections(g: _Builder, rows: float, split: int, kv_heads: int, *after: str | None
                 ) -> str:
    """The projections of ``rows`` tokens into this rank's q, k and v (``split``: the heads
    split over tp; ``kv_heads``: the KV heads after replication). GQA: one Q, K, V GEMM, the
    K and V part on the layers that project their own (ModelSpec.kv_projection_share). MLA
    (Megatron-Core's MLASelfAttention): the down-projections to the latents and the shared RoPE
    key, replicated on every tp rank (the query's split by heads when it has no latent), then
    the up-projections split by heads (``qkv_up_gemm``)."""
    m, h = g.key.model, g.key.model.hidden
    if m.mla is None:
        kv = kv_heads * (m.head_dim + m.v_head_dim) * m.kv_projection_share
        return g.gemm(LO.qkv_gemm, rows, (m.q_dim + kv) / split, h, *after)
    a = m.mla
    kv_down = a.kv_lora_rank + a.qk_rope_head_dim
    if a.q_lora_rank:
        down = g.gemm(LO.qkv_gemm, rows, a.q_lora_rank + kv_down, h, *after)
        up = ((rows, m.q_dim / split, a.q_lora_rank),)
    else:
        down = g.gemms(LO.qkv_gemm, ((rows, kv_down, h), (rows, m.q_dim / split, h)), *after)
        up = ()
    kv_up = m.query_heads * (a.qk_nope_head_dim + a.v_head_dim) / split
    return g.gemms(LO.qkv_up_gemm, (*up, (rows, kv_up, a.kv_lora_rank)), down)


def _attention(g: _Builder, x: str | None, head_chunks: int) -> str:
    k, m = g.key, g.key.model
    h, t, b, s = m.hidden, k.tokens, k.batch, k.seq_len
    window = window_factor(m, s)
    width = core_head_dim(m)
    norm = g.memory(LO.attn_norm, 2 * t * h * AB, 3 * t * h * AB, x)
    match k.attention:
        case UlyssesAttention():
            out = _ulysses(g, norm, head_chunks)
        case TPAttention():
            ag, rs = vol.tp_attention(m, b, s, k.tp)
            kv_dim = kv_heads_sent(m, k.tp) * m.head_dim
            gathered = g.comm(LO.tp_all_gather, ag, norm, fuse_with=LO.qkv_gemm, rows=b * s)
            qkv = _projections(g, b * s, k.tp, kv_heads_sent(m, k.tp), gathered)
            flops = cc.attention_fwd_flops(b, s, s, m.query_heads / k.tp, width,
                                           cc.CAUSAL_FRACTION * window)
            roped = _rope(g, b * s, m.q_dim / k.tp, kv_dim / k.tp, qkv)
            attn = g.attention(flops, roped)
            proj = g.gemm(LO.out_gemm, b * s, h, m.attn_out_dim / k.tp, attn)
            out = g.comm(LO.tp_reduce_scatter, rs, proj, fuse_with=LO.out_gemm, rows=b * s)
        case CPAttention(zigzag=zigzag):
            (kv,) = vol.cp_attention(m, b, s, k.cp)
            qkv = _projections(g, t, 1, m.kv_heads, norm)
            roped = _rope(g, t, m.q_dim, m.kv_dim, qkv)
            ring = g.comm(LO.cp_kv_exchange, kv, roped, fuse_with=LO.flash_attn, rows=t)
            # The slowest rank sets the pace: zig-zag chunks balance the causal mask exactly;
            # contiguous chunks leave the last rank 1 - 1/(2 cp) of its full score rows.
            share = cc.CAUSAL_FRACTION if zigzag else 1 - 1 / (2 * k.cp)
            flops = cc.attention_fwd_flops(b, s / k.cp, s, m.query_heads, width, share * window)
            attn = g.attention(flops, ring)
            out = g.gemm(LO.out_gemm, t, h, m.attn_out_dim, attn)
    return g.memory(LO.attn_residual, 3 * t * h * AB, 0.0, out, fusable=False)


def _ulysses(g: _Builder, norm: str, groups: int) -> str:
    """Ulysses SP: the QKV GEMM, the all-to-all to head shards, the prologue and
    FlashAttention on full sequences of H / sp heads, the all-to-all back and the output GEMM.
    In ``groups`` > 1 head groups (plans.layout.ulysses_chunks: the inter-operator overlapped
    core of runtime.parallel.attention) each group has its share of the all-to-alls' bytes, its
    prologue and its FlashAttention, the collectives on the communication stream beside the
    other group's core, operator names suffixed ``@group``; the output GEMM reads every group.
    One group's collectives can instead fuse with the GEMMs beside them (inter_intra_op).
    MLA's projections run on the rank's tokens before the all-to-all, which moves every head's
    expanded keys and values."""
    k, m = g.key, g.key.model
    h, t, b, s = m.hidden, k.tokens, k.batch, k.seq_len
    side = groups > 1
    a2a_qkv, a2a_out = (replace(x, buffer_bytes=x.buffer_bytes / groups)
                        for x in vol.ulysses_attention(m, b, s, k.sp))
    kv_dim = kv_heads_sent(m, k.sp) * m.head_dim
    qkv = _projections(g, t, 1, kv_heads_sent(m, k.sp), norm)
    heads = k.sp * groups
    flops = cc.attention_fwd_flops(b, s, s, m.query_heads / heads, core_head_dim(m),
                                   cc.CAUSAL_FRACTION * window_factor(m, s))
    up = LO.qkv_up_gemm if m.mla is not None else LO.qkv_gemm
    outs, previous = [], None
    for c in range(groups):
        at = f"@{c}" if side else ""
        head_major = g.comm(LO.sp_a2a_qkv, a2a_qkv, qkv, fuse_with=None if side else
                            up, rows=t, at=at, side_stream=side)
        # One compute stream runs the groups' cores in issue order: group c after group c - 1
        # and, derived from that edge, its gradients before c - 1's, as autograd runs them (so
        # group c's all-to-all gradient runs beside group c - 1's core gradient). Under
        # selective recomputation the edge also puts group c - 1's rerun before group c's (the
        # runtime reruns them in backward order): the same compute, in another order.
        roped = _rope(g, b * s, m.q_dim / heads, kv_dim / heads, head_major, previous, at=at)
        previous = g.attention(flops, roped, at=at)
        outs.append(g.comm(LO.sp_a2a_out, a2a_out, previous, fuse_with=None if side else
                           LO.out_gemm, rows=t, at=at, side_stream=side))
    return g.gemm(LO.out_gemm, t, h, m.attn_out_dim, *outs)


ROPE_BYTES = 2 * AB
"""Bytes per element of q and k of RoPE as one fused kernel: each read and written once
(backward: their gradients, the same)."""


def prologue_bytes(rows: float, q_width: float, kv_width: float) -> tuple[float, float]:
    """Forward and backward bytes of the attention core's prologue (runtime.model.
    AttentionCore.prologue) over ``rows`` sequence positions with ``q_width`` query and
    ``kv_width`` key values per row on this rank: RoPE reads and writes q and k (backward the
    same); with GQA (q_width > kv_width) k and v are repeated to q's width (read kv, write q
    wide; backward read the q-wide gradients, write kv)."""
    rope = rows * (q_width + kv_width) * ROPE_BYTES
    gqa = 2 * rows * (q_width + kv_width) * AB if q_width > kv_width else 0.0
    return rope + gqa, rope + gqa


def _rope(g: _Builder, rows: float, q_width: float, kv_width: float, *after: str | None,
          at: str = "") -> str:
    """The attention core's prologue (RoPE, GQA expansion) before FlashAttention, recomputed
    with the attention core under selective recomputation: a fused region under fused kernels,
    else the eager kernels ROPE_LAUNCHES counts."""
    return g.memory(LO.rope, *prologue_bytes(rows, q_width, kv_width), *after, at=at)


def attention_core_s(model: ModelSpec, batch: int, seq: int, heads: float, kv_heads: float,
                     cluster: ClusterSpec, backward: bool) -> float:
    """The eager runtime's attention core on one rank (``heads`` query and ``kv_heads`` key
    heads of ``model``'s width): its prologue's eager kernels and causal FlashAttention, as the
    layer graph prices them (bench/kernels/calibrate_gpu.py's attention_core rows)."""
    d, rows = model.head_dim, batch * seq
    fwd_bytes, bwd_bytes = prologue_bytes(rows, heads * d, kv_heads * d)
    fwd_launches, bwd_launches = ROPE_LAUNCHES[heads > kv_heads]
    flops = cc.attention_fwd_flops(batch, seq, seq, heads, d, cc.CAUSAL_FRACTION)
    fwd = cc.elementwise_s(fwd_bytes, cluster, fwd_launches) + cc.flash_attention_fwd_s(
        flops, cluster)
    if not backward:
        return fwd
    return fwd + cc.elementwise_s(bwd_bytes, cluster, bwd_launches) + \
        cc.flash_attention_bwd_s(flops, cluster, d)


def _swiglu(g: _Builder, name: LayerOperator, rows: float, width: float, fc13: str,
            at: str = "") -> str:
    """SwiGLU: read fc1 and gate outputs, write the product; backward reads 3, writes 2."""
    return g.memory(name, 3 * rows * width * AB, 5 * rows * width * AB, fc13, at=at)


def _dense_ffn(g: _Builder, norm: str) -> str:
    k, m = g.key, g.key.model
    h, t, f = m.hidden, k.tokens, m.dense_ffn_hidden
    if k.tp == 1:
        fc13 = g.gemm(LO.dense_fc13, t, 2 * f, h, norm)
        act = _swiglu(g, LO.dense_swiglu, t, f, fc13)
        return g.gemm(LO.dense_fc2, t, h, f, act)
    ag, rs = vol.tp_attention(m, k.batch, k.seq_len, k.tp)
    rows = k.batch * k.seq_len
    gathered = g.comm(LO.dense_all_gather, ag, norm, fuse_with=LO.dense_fc13, rows=rows)
    fc13 = g.gemm(LO.dense_fc13, rows, 2 * f / k.tp, h, gathered)
    act = _swiglu(g, LO.dense_swiglu, rows, f / k.tp, fc13)
    fc2 = g.gemm(LO.dense_fc2, rows, h, f / k.tp, act)
    return g.comm(LO.dense_reduce_scatter, rs, fc2, fuse_with=LO.dense_fc2, rows=rows)


def _shared_experts(g: _Builder, norm: str, rows: float, width_divisor: int) -> str | None:
    m = g.key.model
    if not m.shared_experts:
        return None
    f = m.shared_experts * m.shared_expert_ffn_hidden / width_divisor
    fc13 = g.gemm(LO.shared_fc13, rows, 2 * f, m.hidden, norm)
    act = _swiglu(g, LO.shared_swiglu, rows, f, fc13)
    return g.gemm(LO.shared_fc2, rows, m.hidden, f, act)


@dataclass(frozen=True)
class _MoEChunks:
    """The sizes one chunk of an MoE layer moves and computes (_moe_ffn)."""

    chunks: int
    n: int
    """The FFN's group: ep, or etp under expert TP."""
    local: int
    """Experts on this rank."""
    width: float
    """Each local expert's FFN width."""
    gathered_tokens: float
    """Tokens the shared experts see (the all-gathered group's under expert TP)."""
    t: float
    """One chunk's tokens."""
    per_expert: float
    """One chunk's rows per local expert (the busiest EP rank's)."""
    a2a: bool
    """The dispatch moves the routed copies (all-to-all)."""
    eager: object
    """The eager permutation's passes (cost_models.dispatch), None under fused kernels."""
    token_rows: float
    """Rows of tokens the eager combine scatters into: this rank's, or the group's after an
    all-gather."""
    every_slot: tuple | None
    """Fused with every slot routed (dropless, local or all-to-all): gathers both ways."""

    @property
    def side(self) -> bool:
        """Whether the chunks' collectives ride the communication stream beside the other
        chunk's expert GEMMs."""
        return self.chunks > 1

    @property
    def rows(self) -> float:
        return self.per_expert * self.local

    def at(self, c: int) -> str:
        return f"@{c}" if self.side else ""


def experts_path(k: LayerKey, chunks: int) -> ExpertGemm:
    """The path of the routed experts' GEMMs when a micro-batch's experts make ``chunks``
    calls: ``k.expert_gemm``, else the rule over the FFN's group (ep, or etp under expert TP)."""
    return k.expert_gemm or experts_rule(k.model, k.tokens, k.ffn, k.ep, k.etp, chunks)


def experts_rule(model: ModelSpec, tokens: float, ffn: FFNStrategy, ep: int, etp: int,
                 chunks: int) -> ExpertGemm:
    """plans.layout.expert_gemm's path for a layer of ``tokens`` tokens per rank, over the
    FFN's group: ep, or etp under expert TP."""
    return expert_gemm(model, tokens, ep if isinstance(ffn, EPFFN) else etp, chunks)


def _moe_chunks(k: LayerKey, chunks: int) -> _MoEChunks:
    m = k.model
    t, e = k.tokens, m.experts
    if isinstance(k.ffn, EPFFN):
        n, local, width, gathered_tokens = k.ep, e // k.ep, m.expert_ffn_hidden, t
        # the busiest EP rank's load paces the grouped GEMMs and receives the most rows
        busiest = skew.rank_skew(t * n * m.top_k, e, n, k.routing_skew, k.ffn.capacity_factor)
        per_expert = cc.expert_tokens(t * n, m.top_k, e, k.ffn.capacity_factor) * busiest
    else:
        n, local, width, gathered_tokens = k.etp, e, m.expert_ffn_hidden / k.etp, t * k.etp
        per_expert = cc.expert_tokens(gathered_tokens, m.top_k, e, None)
    a2a = isinstance(k.ffn, EPFFN) and k.ffn.dispatch.moves_routed_copies
    # one chunk's share of the tokens and rows
    t, per_expert = t / chunks, per_expert / chunks
    eager = eager_permutation(k.ffn.dispatch if isinstance(k.ffn, EPFFN) else None, n) \
        if k.kernels == Kernels.eager else None
    every_slot = (fused_every_slot(n > 1) if k.kernels == Kernels.fused and a2a
                  and k.ffn.capacity_factor is None else None)
    return _MoEChunks(chunks, n, local, width, gathered_tokens, t, per_expert, a2a, eager,
                      n * t if eager is ALL_GATHER else t, every_slot)


def waits_on_host(key: LayerKey) -> bool:
    """Whether the layer's forward holds its eager dispatch's host wait against its
    collectives' times (_dispatch_host_wait): then whether it has the wait, and how long,
    depends on the network."""
    if key.dense or key.kernels != Kernels.eager:
        return False
    eager = _moe_chunks(key, 1).eager
    return eager is not None and eager.host_sync


def priced_on(entries: Entries, cluster: ClusterSpec) -> Entries:
    """``entries`` (a forward pass's, of no host wait: waits_on_host) with their collectives
    timed on ``cluster``, their other operators as they are: those read the cluster's GPU and
    efficiencies alone, the collectives its NVLink and network too, so a layer built on a
    cluster of other bandwidths is priced on this one (a what-if grid's points)."""
    out = []
    for op, after in entries:
        if op.transfer is not None:
            d = vol.transfer_s(op.transfer, cluster)
            op = op._replace(duration_s=d, bwd=(d,))
        out.append((op, after))
    return tuple(out)


def _moe_ffn(g: _Builder, norm: str, chunks: int) -> tuple[str, ...]:
    """Router over every token, then dispatch, expert GEMMs and combine, in ``chunks`` token
    chunks (plans.layout.moe_chunks: the inter-operator overlapped layer of
    runtime.parallel.overlap; operator names get an ``@chunk`` suffix when chunks > 1)."""
    k, m = g.key, g.key.model
    h, t, e = m.hidden, k.tokens, m.experts
    logits = g.gemm(LO.router_gemm, t, e, h, norm)
    # the router's softmax and top-k run eager under either kernel set (runtime.kernels)
    topk = g.memory(LO.router_topk, 2 * t * e * cc.FP32_BYTES, 2 * t * e * cc.FP32_BYTES, logits,
                    fusable=False)
    x = _moe_chunks(k, chunks)
    dispatched, shared = _moe_dispatch(g, x, norm, topk)
    outs = _moe_experts_and_combine(g, x, dispatched, topk, shared)
    if x.eager is not None and x.eager.host_sync:
        outs = _dispatch_host_wait(g, outs)
    return (*outs, shared)


def _permutation(g: _Builder, x: _MoEChunks, name: LayerOperator, fused_fwd: float,
                 fused_bwd: float, eager_fwd: Passes | None, eager_bwd: Passes | None,
                 *after: str | None, at: str) -> str:
    """A permutation of one chunk's rows: ``fused_*`` rows under fused kernels, the eager
    passes' rows otherwise."""
    row_bytes = g.key.model.hidden * AB
    if eager_fwd is None or eager_bwd is None:
        return g.memory(name, fused_fwd * row_bytes, fused_bwd * row_bytes, *after, at=at)
    return g.permutation(name, eager_fwd.rows(x.rows, x.token_rows) * row_bytes,
                         eager_bwd.rows(x.rows, x.token_rows) * row_bytes, *after, at=at)


def _moe_dispatch(g: _Builder, x: _MoEChunks, norm: str, topk: str
                  ) -> tuple[list[tuple[str, Transfer, str | None]], str | None]:
    """Each chunk's dispatch, as (its rows ready, its combine's transfer, its permutation),
    and the shared experts (after the first chunk's dispatch is issued)."""
    k, m = g.key, g.key.model
    t, n, rows = x.t, x.n, x.rows
    shared = None
    dispatched: list[tuple[str, Transfer, str | None]] = []
    e_fwd = x.eager.dispatch_fwd if x.eager else None
    e_bwd = x.eager.dispatch_bwd if x.eager else None
    for c in range(x.chunks):
        at = x.at(c)
        perm = None
        if x.a2a:
            send, back = vol.ep_ffn(m, t, n, k.ffn.dispatch, routed_copies=rows)
            fwd_rows, bwd_rows = ((x.every_slot[0].rows(rows, t), x.every_slot[1].rows(rows, t))
                                  if x.every_slot else (t + rows, t + rows))
            perm = _permutation(g, x, LO.dispatch_permute, fwd_rows, bwd_rows, e_fwd, e_bwd,
                                norm, topk, at=at)
            ready = g.comm(LO.ep_dispatch, send, perm, fuse_with=LO.expert_fc13, rows=rows,
                           at=at, side_stream=x.side)
            if c == 0:
                shared = _shared_experts(g, norm, t * x.chunks, 1)
        else:
            send, back = (vol.ep_ffn(m, t, n, Dispatch.allgather_reduce_scatter)
                          if isinstance(k.ffn, EPFFN) else vol.tp_ffn(m, t, n))
            # All-gather every rank's tokens, then pick the rows routed to local experts.
            gather = LO.ep_dispatch if isinstance(k.ffn, EPFFN) else LO.etp_all_gather
            arrived = g.comm(gather, send, norm, fuse_with=LO.expert_fc13, rows=rows, at=at,
                             side_stream=x.side)
            ready = _permutation(g, x, LO.dispatch_scatter, 2 * rows, rows + n * t, e_fwd,
                                 e_bwd, arrived, topk, at=at)
            # Shared experts are replicated under EP (local tokens), split by etp under TP.
            if c == 0:
                shared = _shared_experts(g, norm if k.etp == 1 else arrived,
                                         x.gathered_tokens, k.etp)
        dispatched.append((ready, back, perm))
    return dispatched, shared


def _moe_experts_and_combine(g: _Builder, x: _MoEChunks,
                             dispatched: list[tuple[str, Transfer, str | None]], topk: str,
                             shared: str | None) -> list[str]:
    """Each chunk's expert GEMMs and combine; the combined outputs."""
    k, h = g.key, g.key.model.hidden
    t, n, rows = x.t, x.n, x.rows
    e_fwd = x.eager.combine_fwd if x.eager else None
    e_bwd = x.eager.combine_bwd if x.eager else None
    gemm = experts_path(k, x.chunks)
    # routed rows vary from expert to expert; fixed-capacity buffers are computed in full
    capacity = k.ffn.capacity_factor if isinstance(k.ffn, EPFFN) else None
    sd = 0.0 if capacity else cc.routed_rows_sd(x.per_expert, k.model.top_k, k.model.experts)
    outs = []
    for c, (ready, back, _) in enumerate(dispatched):
        at = x.at(c)
        # One compute stream runs the chunks' expert GEMMs in issue order: chunk c after chunk
        # c - 1 (and, derived from that edge, its gradients before c - 1's, as autograd does),
        # and after the next chunk's permutation, so that chunk's dispatch runs beside them.
        previous = f"{LO.expert_fc2.value}@{c - 1}" if c else None
        following = dispatched[c + 1][2] if c + 1 < x.chunks else None
        fc13 = g.grouped(LO.expert_fc13, gemm, x.local, x.per_expert, 2 * x.width, h, ready,
                         previous, following, at=at, m_sd=sd)
        act = _swiglu(g, LO.expert_swiglu, rows, x.width, fc13, at)
        fc2 = g.grouped(LO.expert_fc2, gemm, x.local, x.per_expert, h, x.width, act, at=at,
                        m_sd=sd)
        if x.a2a:
            returned = g.comm(LO.ep_combine, back, fc2, fuse_with=LO.expert_fc2, rows=rows,
                              at=at, side_stream=x.side)
            fwd_rows, bwd_rows = ((x.every_slot[2].rows(rows, t), x.every_slot[3].rows(rows, t))
                                  if x.every_slot else (rows + t, rows + t))
            outs.append(_permutation(g, x, LO.combine_unpermute, fwd_rows, bwd_rows, e_fwd,
                                     e_bwd, returned, topk, at=at))
        else:
            # Weighted local gather into a zeroed n x tokens buffer, reduce-scatter it back.
            gathered = _permutation(g, x, LO.combine_gather, rows + n * t, 2 * rows, e_fwd,
                                    e_bwd, fc2, topk, shared if k.etp > 1 else None, at=at)
            scatter = LO.ep_combine if isinstance(k.ffn, EPFFN) else LO.etp_reduce_scatter
            outs.append(g.comm(scatter, back, gathered, fuse_with=LO.expert_fc2, rows=rows,
                               at=at, side_stream=x.side))
    return outs


def _dispatch_host_wait(g: _Builder, outs: list[str]) -> list[str]:
    """The eager dispatch waits on the host, then the CPU launches its small kernels one by
    one: the layer's dispatch + combine (forward and backward, every chunk) never takes less
    than the measured floor; the shortfall is GPU time lost to the host, before the first
    collective. Returns the layer's outputs (``outs``, or the wait after them)."""
    k = g.key
    floor_s = k.cluster.efficiency.dispatch_floor_us.of(
        k.ffn.dispatch if isinstance(k.ffn, EPFFN) else Dispatch.allgather_reduce_scatter
    ) * 1e-6
    moved = sum(op.duration_s + sum(op.bwd) for op, _ in g.entries
                if op.operator in DISPATCH_COMBINE_OPS)
    if floor_s > moved:
        return [g.host_wait(floor_s - moved, *outs)]
    return outs
DISPATCH_COMBINE_OPS = frozenset(
    op for op, region in TIMER_OF.items()
    if region in (Component.dispatch, Component.combine)
    and op != LayerOperator.dispatch_host_wait)
"""The operators that move tokens to and from the experts: those the runtime times as its
dispatch and combine (plans.operators), less the host wait they are held against."""


_ATTENTION_FFN = EPFFN()
"""The FFN strategy in every attention block's key (_attention_key)."""


def _attention_key(key: LayerKey) -> LayerKey:
    """``key`` without what the attention block does not read (the FFN's axes, strategy and
    kind, the recomputation): the layers that differ only there share it."""
    return replace(key, ep=1, etp=1, ffn=_ATTENTION_FFN, recompute=Recompute.none, dense=False,
                   routing_skew=1.0, recompute_modules=DEFAULT_MODULES, expert_gemm=None)


@lru_cache(maxsize=4096)
def _attention_entries(key: LayerKey, head_chunks: int) -> tuple[Entries, str]:
    """The attention block's entries, the first of a forward pass, and its output."""
    g = _Builder(key)
    out = _attention(g, None, head_chunks)
    return tuple(g.entries), out


def forward_graph(key: LayerKey, chunks: int = 1, head_chunks: int = 1) -> nx.DiGraph:
    """The layer's operators; the MoE part in ``chunks`` token chunks (plans.layout.moe_chunks),
    Ulysses attention in ``head_chunks`` head groups (plans.layout.ulysses_chunks)."""
    return graph_of(forward_entries(key, chunks, head_chunks))


def forward_entries(key: LayerKey, chunks: int = 1, head_chunks: int = 1) -> Entries:
    """The entries of ``forward_graph``."""
    g = _Builder(key)
    h, t = key.model.hidden, key.tokens
    attention, attn = _attention_entries(_attention_key(key), head_chunks)
    g.entries.extend(attention)
    if key.dense:
        outs = (_dense_ffn(g, _ffn_norm(g, attn)),)
    else:
        ffn, outs = _moe_entries(_moe_key(key), attn, chunks)
        g.entries.extend(ffn)
    g.memory(LO.ffn_residual, 3 * t * h * AB, 0.0, attn, *outs, fusable=False)
    return tuple(g.entries)


def _ffn_norm(g: _Builder, attn: str) -> str:
    h, t = g.key.model.hidden, g.key.tokens
    return g.memory(LO.ffn_norm, 2 * t * h * AB, 3 * t * h * AB, attn)


_MOE_ATTENTION = UlyssesAttention()
"""The attention strategy in every MoE block's key (_moe_key)."""


def _moe_key(key: LayerKey) -> LayerKey:
    """``key`` without what an MoE layer's FFN block does not read: the attention strategy and
    how its group splits the tokens (the block reads the tokens per rank, sp x cp x tp's
    product), so the layers that differ only there share it."""
    return replace(key, sp=key.sp * key.cp * key.tp, tp=1, cp=1, attention=_MOE_ATTENTION)


@lru_cache(maxsize=4096)
def _moe_entries(key: LayerKey, attn: str, chunks: int) -> tuple[Entries, tuple[str, ...]]:
    """An MoE layer's FFN block after the attention block's output ``attn``: its norm, router,
    dispatch, experts and combine; and its outputs."""
    g = _Builder(key)
    outs = _moe_ffn(g, _ffn_norm(g, attn), chunks)
    return tuple(g.entries), outs


# ---- backward -----------------------------------------------------------------------------------




class _Grad(StrEnum):
    """What a backward operator is of its forward one (backward_entries)."""

    comm = "comm"
    """The collective run reversed, fused with its partner's data gradient."""
    dgrad = "dgrad"
    wgrad = "wgrad"
    bwd = "bwd"
    """The gradient of a memory-bound, attention or host operator."""
    rerun = "rerun"
    """The forward operator rerun (recomputed)."""


Shape = tuple[tuple[str, LayerOperator, OpKind, str | None, tuple[str, ...]], ...]
"""What the backward graph's structure depends on: each forward operator's name, operator,
kind, fused partner and predecessors, in program order (not its durations, so clusters and
batch sizes of one layout share it)."""


@lru_cache(maxsize=2048)
def _backward_steps(shape: Shape, policy: Recompute, autograd_nodes: bool,
                    modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES
                    ) -> tuple[tuple[int, _Grad, str, str | None, tuple[str, ...]], ...]:
    """backward_entries' operators as (forward operator's index, what it is of it, name, fused
    partner, predecessors), in program order."""
    index = {name: i for i, (name, *_) in enumerate(shape)}
    succs: list[list[str]] = [[] for _ in shape]
    for name, *_, after in shape:
        for a in after:
            succs[index[a]].append(name)
    # Only outputs some gradient reads are rerun: the layer's output is never needed again.
    recomputed = recomputed_operators(policy, modules)
    rerun = {name for i, (name, operator, *_) in enumerate(shape)
             if operator in recomputed and succs[i]}
    gemms = (OpKind.gemm, OpKind.grouped_gemm)

    def grad(name: str) -> str:
        return f"{name}.dgrad" if shape[index[name]][2] in gemms else f"{name}.bwd"

    def waits_for(consumer: str) -> list[str]:
        gemm = shape[index[consumer]][2] in gemms
        return [grad(consumer)] + ([f"{consumer}.wgrad"] if gemm and autograd_nodes else [])

    steps = []
    for i in reversed(range(len(shape))):
        name, _, kind, fuse_with, preds = shape[i]
        after = tuple(dict.fromkeys(w for c in succs[i] for w in waits_for(c)))
        # A gradient that reads this operator's forward inputs needs recomputed ones rerun.
        inputs = tuple(f"recompute.{p}" for p in preds if p in rerun)
        if kind == OpKind.comm:
            fuse = grad(fuse_with) if fuse_with else None
            steps.append((i, _Grad.comm, grad(name), fuse, after))
        elif kind in gemms:
            steps.append((i, _Grad.dgrad, f"{name}.dgrad", fuse_with, after))
            steps.append((i, _Grad.wgrad, f"{name}.wgrad", fuse_with, after + inputs))
        else:
            steps.append((i, _Grad.bwd, grad(name), fuse_with, after + inputs))
    # Reruns come last in program order: they fill compute gaps (behind communication) and
    # never win a tie against a gradient.
    for i, (name, _, _, fuse_with, preds) in enumerate(shape):
        if name in rerun:
            fuse = f"recompute.{fuse_with}" if fuse_with in rerun else None
            steps.append((i, _Grad.rerun, f"recompute.{name}", fuse,
                          tuple(f"recompute.{p}" for p in preds if p in rerun)))
    return tuple(steps)


def shape_of(entries: Entries) -> Shape:
    return tuple((op.name, op.operator, op.kind, op.fuse_with, after) for op, after in entries)


class BackwardStep(NamedTuple):
    """One operator of backward_entries, without its durations."""

    forward: int
    """The index of its forward operator."""
    duration: int
    """Which of that operator's durations it takes: 0 its own (a collective reversed, a
    rerun), 1 and 2 its ``bwd`` ones (a data and a weight gradient, or a gradient)."""
    name: str
    fuse_with: str | None
    after: tuple[str, ...]
    rerun: bool


@lru_cache(maxsize=2048)
def backward_steps(shape: Shape, policy: Recompute, autograd_nodes: bool,
                   modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES
                   ) -> tuple[BackwardStep, ...]:
    """backward_entries' operators, from the forward pass's shape (shape_of)."""
    source = {_Grad.comm: 0, _Grad.rerun: 0, _Grad.dgrad: 1, _Grad.wgrad: 2, _Grad.bwd: 1}
    return tuple(BackwardStep(i, source[grad], name, fuse, after, grad == _Grad.rerun)
                 for i, grad, name, fuse, after in _backward_steps(shape, policy,
                                                                   autograd_nodes, modules))


def backward_entries(fwd: Entries, policy: Recompute, autograd_nodes: bool = False,
                     modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES) -> Entries:
    """Gradients in reverse program order, plus reruns of recomputed forward operators.

    With ``autograd_nodes`` the gradients run as torch autograd runs them (the inter-operator
    overlapped runtime): a GEMM's data and weight gradients are one node, so whatever reads its
    data gradient, on either stream, also waits for its weight gradient; without, the weight
    gradient waits for nothing downstream (a hand-scheduled layer, paper Sec. 4.1)."""
    out = []
    for step in backward_steps(shape_of(fwd), policy, autograd_nodes, modules):
        op = fwd[step.forward][0]
        seconds = op.duration_s if step.duration == 0 else op.bwd[step.duration - 1]
        out.append((Op(step.name, op.operator, op.kind, seconds, op.bwd, op.comm, step.fuse_with,
                       op.fuse_rows, step.rerun, op.side_stream), step.after))
    return tuple(out)


def backward_graph(fwd: nx.DiGraph, policy: Recompute, autograd_nodes: bool = False,
                   modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES) -> nx.DiGraph:
    """The networkx DAG of backward_entries."""
    return graph_of(backward_entries(entries_of(fwd), policy, autograd_nodes, modules))
