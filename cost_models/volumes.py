"""Bytes each parallel strategy moves per layer per rank (paper Eq. 1-4, counted per collective).

A ``Transfer`` is one collective call. Its ``buffer_bytes`` follows comm.py: the full gathered
buffer for all-gather / reduce-scatter, one rank's send buffer for all-to-all and send/recv.
``wire_bytes`` is what leaves one rank: (n-1)/n of the buffer for every collective but
DeepEP's hierarchical all-to-all, which sends less (``link_bytes``: by link, as it runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from cost_models import comm
from cost_models.compute import ACT_BYTES
from plans.layout import kv_heads_sent, tokens_per_rank
from plans.plan import Dispatch
from plans.specs import ClusterSpec, ModelSpec


class Collective(StrEnum):
    all_to_all = "all_to_all"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    send_recv = "send_recv"
    hierarchical_all_to_all = "hierarchical_all_to_all"
    """DeepEP's dispatch or combine (Dispatch.deepep): the buffer is one rank's routed copies,
    as for ``all_to_all``; ep_link_shares says what each link carries of it."""


class CommKind(StrEnum):
    """What a layer's communication is for; the step-time breakdown reports each kind."""

    sp_all_to_all = "sp_all_to_all"
    tp_all_gather = "tp_all_gather"
    tp_reduce_scatter = "tp_reduce_scatter"
    cp_kv_exchange = "cp_kv_exchange"
    ep_dispatch = "ep_dispatch"
    ep_combine = "ep_combine"
    etp_all_gather = "etp_all_gather"
    etp_reduce_scatter = "etp_reduce_scatter"


COMM_KINDS = {
    CommKind.sp_all_to_all: "Ulysses all-to-alls: sequence-sharded to head-sharded for the "
                            "attention core and back",
    CommKind.tp_all_gather: "attention TP all-gather of the sequence-sharded activations "
                            "before QKV",
    CommKind.tp_reduce_scatter: "attention TP reduce-scatter after the output projection",
    CommKind.cp_kv_exchange: "context parallelism's key/value exchange (ring)",
    CommKind.ep_dispatch: "tokens sent to their experts' EP ranks",
    CommKind.ep_combine: "expert outputs returned to their tokens' ranks",
    CommKind.etp_all_gather: "expert TP all-gather of the tokens before the expert GEMMs",
    CommKind.etp_reduce_scatter: "expert TP reduce-scatter of the expert outputs",
}
"""What each kind of layer communication is, as the breakdowns' legends state it."""


@dataclass(frozen=True)
class Routing:
    """Where a token's routed copies can go: ``top_k`` of ``experts``, and with group-limited
    (node-limited) routing only experts of ``groups_per_token`` of the ``groups`` contiguous
    expert groups (DeepSeek-V3: 8 groups, 4 per token). One group: no limit."""

    experts: int
    top_k: int
    groups: int = 1
    groups_per_token: int = 1

    @classmethod
    def of(cls, model: ModelSpec) -> Routing:
        return cls(model.experts, model.top_k, model.expert_groups, model.groups_per_token)

    @property
    def limited(self) -> bool:
        return 1 <= self.groups_per_token < self.groups


@dataclass(frozen=True)
class Transfer:
    kind: CommKind
    collective: Collective
    buffer_bytes: float
    group_size: int
    stride: int = 1
    """Product of the mesh axes inside the group's axis (see comm.group_layout)."""
    routing: Routing | None = None
    """The routing behind an EP hierarchical all-to-all (ep_link_shares)."""

    @property
    def wire_bytes(self) -> float:
        """Bytes leaving one rank (for the hierarchical all-to-all, the flat one's: an upper
        bound; link_bytes has its own)."""
        n = self.group_size
        return 0.0 if n <= 1 else (n - 1) / n * self.buffer_bytes


def _misses(pool: float, bin_experts: float, k: int) -> float:
    """P(none of k experts drawn uniformly without replacement from ``pool`` falls in a given
    ``bin_experts`` of them): C(pool - bin, k) / C(pool, k)."""
    rest = pool - bin_experts
    if rest < k:
        return 0.0
    return math.exp(math.lgamma(rest + 1) - math.lgamma(rest - k + 1)
                    - math.lgamma(pool + 1) + math.lgamma(pool - k + 1))


def hit_probability(bin_experts: float, routing: Routing) -> float:
    """P(a token routes at least one copy into a given block of ``bin_experts`` contiguous
    experts: one rank's, or one node's), under uniform routing: the token draws its
    groups_per_token groups uniformly, then top_k experts uniformly among theirs.

    A block inside one group is reachable when its group is drawn (probability M / G); a block
    of c whole groups holds j of the drawn ones with the hypergeometric probability
    C(c, j) C(G - c, M - j) / C(G, M), and then j x E / G of the M x E / G experts drawn from.
    A block that neither divides a group nor is made of whole ones is priced without the limit
    (more destinations: an upper bound on the traffic)."""
    e, k = routing.experts, routing.top_k
    group = e / routing.groups
    exact_in = bin_experts <= group and math.isclose(group % bin_experts, 0, abs_tol=1e-9)
    whole = bin_experts >= group and math.isclose(bin_experts % group, 0, abs_tol=1e-9)
    if not routing.limited or not (exact_in or whole):
        return 1.0 - _misses(e, bin_experts, k)
    g, m = routing.groups, routing.groups_per_token
    c = 1 if exact_in else round(bin_experts / group)
    per_group = bin_experts if exact_in else group
    pool = m * group
    out = 0.0
    for j in range(max(1, m - (g - c)), min(c, m) + 1):
        drawn = math.comb(c, j) * math.comb(g - c, m - j) / math.comb(g, m)
        out += drawn * (1.0 - _misses(pool, j * per_group, k))
    return out


def ep_link_shares(dispatch: Dispatch, routing: Routing, layout: comm.GroupLayout
                   ) -> tuple[float, float]:
    """Shares of one rank's k x tokens routed copies that its EP dispatch (or combine, which
    mirrors it) sends over NVLink and over the network, for an EP group of n ranks on N nodes
    of g = n / N ranks each (``layout``), every rank holding E / n experts.

    all_to_all (NCCL's, Megatron-Core's alltoall): every copy goes to its expert's rank, 1/n of
    them to each rank: (g - 1) / n over NVLink, (n - g) / n over the network
    (comm.all_to_all_shares). The routing limit changes no share: by symmetry each copy still
    lands on any node alike.

    deepep (DeepEP, Megatron-Core's flex): a token goes once to each destination node other
    than its own, to the GPU of its own local index there, and once to each destination GPU
    over NVLink (in its node directly, in another node forwarded by that landing GPU), never
    to itself or to a landing GPU, which received it already. With p_node and p_rank the
    probabilities that a token reaches a given node (E / N experts) and a given rank (E / n;
    hit_probability), by linearity of expectation, per token:

        network copies = (N - 1) p_node          (the other nodes)
        NVLink copies  = (n - N) p_rank          (every rank but the N of its local index)

    Every GPU forwards for the others what they forward for it, so these are each GPU's sends
    too. Divided by k: the shares of the routed-copy buffer. allgather_reduce_scatter moves no
    routed copies (comm.all_gather_s prices it): ValueError."""
    if dispatch == Dispatch.all_to_all:
        return comm.all_to_all_shares(layout)
    if dispatch != Dispatch.deepep:
        raise ValueError(f"{dispatch} sends no routed copies")
    n, nodes = layout.size, layout.nodes
    if n <= 1:
        return 0.0, 0.0
    e, k = routing.experts, routing.top_k
    p_rank = hit_probability(e / n, routing)
    p_node = hit_probability(e * layout.ranks_per_node / n, routing)
    return (n - nodes) * p_rank / k, (nodes - 1) * p_node / k


def link_bytes(t: Transfer, gpus_per_node: int) -> tuple[float, float]:
    """Bytes one rank sends over NVLink and over the network for an all-to-all ``t`` (flat
    or hierarchical)."""
    layout = comm.group_layout(t.group_size, t.stride, gpus_per_node)
    if t.collective == Collective.all_to_all:
        nvlink, network = comm.all_to_all_shares(layout)
    elif t.collective == Collective.hierarchical_all_to_all and t.routing is not None:
        nvlink, network = ep_link_shares(Dispatch.deepep, t.routing, layout)
    else:
        raise ValueError(f"{t.collective} is not an all-to-all")
    return nvlink * t.buffer_bytes, network * t.buffer_bytes


def transfer_s(t: Transfer, cluster: ClusterSpec) -> float:
    layout = comm.group_layout(t.group_size, t.stride, cluster.node.gpus_per_node)
    match t.collective:
        case Collective.all_to_all:
            return comm.all_to_all_s(t.buffer_bytes, layout, cluster)
        case Collective.hierarchical_all_to_all:
            if layout.size <= 1:
                return 0.0
            nvlink, network = link_bytes(t, cluster.node.gpus_per_node)
            return comm.concurrent_links_s(nvlink, network, layout, cluster, forwarded=True)
        case Collective.all_gather:
            return comm.all_gather_s(t.buffer_bytes, layout, cluster)
        case Collective.reduce_scatter:
            return comm.reduce_scatter_s(t.buffer_bytes, layout, cluster)
        case Collective.send_recv:
            return comm.send_recv_s(t.buffer_bytes, cluster, layout.nodes > 1)


def ulysses_attention(model: ModelSpec, batch: int, seq_len: int, sp: int) -> tuple[Transfer, ...]:
    """Forward of Ulysses SP (paper Eq. 2): all-to-all of Q, K, V from sequence- to
    head-sharded, and of the attention output back. Per rank: b s/n tokens of q_dim for Q,
    kv_dim (1/m of Q) each for K and V (MLA: every head's K, and V at v_head_dim), attn_out_dim
    for the output. Backward moves the same bytes reversed."""
    tokens = tokens_per_rank(batch, seq_len, sp)
    kv_dim = kv_heads_sent(model, sp) * (model.head_dim + model.v_head_dim)
    qkv = tokens * (model.q_dim + kv_dim) * ACT_BYTES
    out = tokens * model.attn_out_dim * ACT_BYTES
    return (
        Transfer(CommKind.sp_all_to_all, Collective.all_to_all, qkv, sp),
        Transfer(CommKind.sp_all_to_all, Collective.all_to_all, out, sp),
    )


def tp_attention(model: ModelSpec, batch: int, seq_len: int, tp: int) -> tuple[Transfer, ...]:
    """Forward of Megatron TP with sequence parallelism (paper Eq. 1): all-gather of the b s h
    norm output before QKV, reduce-scatter of the b s h projection output after attention."""
    full = batch * seq_len * model.hidden * ACT_BYTES
    return (
        Transfer(CommKind.tp_all_gather, Collective.all_gather, full, tp),
        Transfer(CommKind.tp_reduce_scatter, Collective.reduce_scatter, full, tp),
    )


def cp_attention(model: ModelSpec, batch: int, seq_len: int, cp: int) -> tuple[Transfer, ...]:
    """Forward of ring context parallelism: every rank's K and V chunk (b s/cp x kv_dim each)
    travels the ring, which moves the bytes of an all-gather of the full K and V."""
    full = batch * seq_len * (model.kv_dim + model.v_dim) * ACT_BYTES
    return (Transfer(CommKind.cp_kv_exchange, Collective.all_gather, full, cp),)


def ep_ffn(
    model: ModelSpec, tokens: float, ep: int, dispatch: Dispatch, stride: int = 1,
    routed_copies: float | None = None,
) -> tuple[Transfer, ...]:
    """Forward dispatch and combine of EP over ``tokens`` local tokens (paper Eq. 3).

    all_to_all and deepep: each token goes to k experts, a buffer of k x tokens x h per rank
    in each direction (deepep sends less of it: ep_link_shares). allgather_reduce_scatter:
    all-gather every rank's tokens (n x tokens x h), scatter locally to the local experts;
    gather locally and reduce-scatter the same buffer back. ``routed_copies`` overrides
    k x tokens (capacity padding, the busiest rank's load)."""
    row = model.hidden * ACT_BYTES
    if dispatch.moves_routed_copies:
        routed = tokens * model.top_k if routed_copies is None else routed_copies
        if dispatch == Dispatch.deepep:
            how, routing = Collective.hierarchical_all_to_all, Routing.of(model)
        else:
            how, routing = Collective.all_to_all, None
        return (
            Transfer(CommKind.ep_dispatch, how, routed * row, ep, stride, routing),
            Transfer(CommKind.ep_combine, how, routed * row, ep, stride, routing),
        )
    full = ep * tokens * row
    return (
        Transfer(CommKind.ep_dispatch, Collective.all_gather, full, ep, stride),
        Transfer(CommKind.ep_combine, Collective.reduce_scatter, full, ep, stride),
    )


def tp_ffn(model: ModelSpec, tokens: float, etp: int) -> tuple[Transfer, ...]:
    """Forward of expert TP (paper Eq. 4): all-gather the etp x tokens x h input, reduce-scatter
    the output."""
    full = etp * tokens * model.hidden * ACT_BYTES
    return (
        Transfer(CommKind.etp_all_gather, Collective.all_gather, full, etp),
        Transfer(CommKind.etp_reduce_scatter, Collective.reduce_scatter, full, etp),
    )


def scale_up_ratio(model: ModelSpec, cluster: ClusterSpec, n: int) -> float:
    """R = expert GEMM time / EP dispatch+combine time on NVLink (paper Sec. 4.2):
    comp = 3 GEMMs x 2 k b s h h_ffn / n FLOPs at the grouped-GEMM rate, comm = 2 x k b s h
    (n-1)/n / n x 2 bytes at the all-to-all rate, so R = 1.5 h_ffn bw / peak x n/(n-1),
    independent of k, h, batch and expert count. Overlap hides EP communication only if R > 1."""
    eff = cluster.efficiency
    peak = cluster.gpu.bf16_dense_tflops * 1e12 * eff.grouped_gemm
    bw = cluster.node.nvlink_gb_s * 1e9 * eff.nvlink_all_to_all
    return 1.5 * model.expert_ffn_hidden * bw / peak * n / (n - 1)
