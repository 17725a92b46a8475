"""Bytes each parallel strategy moves per layer per rank (paper Eq. 1-4, counted per collective).

A ``Transfer`` is one collective call. Its ``buffer_bytes`` follows comm.py: the full gathered
buffer for all-gather / reduce-scatter, one rank's send buffer for all-to-all and send/recv.
``wire_bytes`` is what leaves one rank: (n-1)/n of the buffer in every case.
"""

from __future__ import annotations

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
class Transfer:
    kind: CommKind
    collective: Collective
    buffer_bytes: float
    group_size: int
    stride: int = 1
    """Product of the mesh axes inside the group's axis (see comm.group_layout)."""

    @property
    def wire_bytes(self) -> float:
        """Bytes leaving one rank."""
        n = self.group_size
        return 0.0 if n <= 1 else (n - 1) / n * self.buffer_bytes


def transfer_s(t: Transfer, cluster: ClusterSpec) -> float:
    layout = comm.group_layout(t.group_size, t.stride, cluster.node.gpus_per_node)
    match t.collective:
        case Collective.all_to_all:
            return comm.all_to_all_s(t.buffer_bytes, layout, cluster)
        case Collective.all_gather:
            return comm.all_gather_s(t.buffer_bytes, layout, cluster)
        case Collective.reduce_scatter:
            return comm.reduce_scatter_s(t.buffer_bytes, layout, cluster)
        case Collective.send_recv:
            return comm.send_recv_s(t.buffer_bytes, cluster, layout.nodes > 1)


def ulysses_attention(model: ModelSpec, batch: int, seq_len: int, sp: int) -> tuple[Transfer, ...]:
    """Forward of Ulysses SP (paper Eq. 2): all-to-all of Q, K, V from sequence- to
    head-sharded, and of the attention output back. Per rank: b s/n tokens of q_dim for Q and
    the output, kv_dim (1/m of Q) each for K and V. Backward moves the same bytes reversed."""
    tokens = tokens_per_rank(batch, seq_len, sp)
    kv_dim = kv_heads_sent(model, sp) * model.head_dim
    qkv = tokens * (model.q_dim + 2 * kv_dim) * ACT_BYTES
    out = tokens * model.q_dim * ACT_BYTES
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
    full = batch * seq_len * 2 * model.kv_dim * ACT_BYTES
    return (Transfer(CommKind.cp_kv_exchange, Collective.all_gather, full, cp),)


def ep_ffn(
    model: ModelSpec, tokens: float, ep: int, dispatch: Dispatch, stride: int = 1,
    routed_copies: float | None = None,
) -> tuple[Transfer, ...]:
    """Forward dispatch and combine of EP over ``tokens`` local tokens (paper Eq. 3).

    all_to_all: each token goes to k experts, k x tokens x h per rank in each direction.
    allgather_reduce_scatter: all-gather every rank's tokens (n x tokens x h), scatter locally
    to the local experts; gather locally and reduce-scatter the same buffer back.
    ``routed_copies`` overrides k x tokens (capacity padding)."""
    row = model.hidden * ACT_BYTES
    if dispatch == Dispatch.all_to_all:
        routed = tokens * model.top_k if routed_copies is None else routed_copies
        return (
            Transfer(CommKind.ep_dispatch, Collective.all_to_all, routed * row, ep, stride),
            Transfer(CommKind.ep_combine, Collective.all_to_all, routed * row, ep, stride),
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
