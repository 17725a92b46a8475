"""The operators of one transformer layer and the components of a training step, named once.

The cost model's layer graph (cost_models/layer_graph.py) has one node per ``LayerOperator``;
the runtime times regions (``Component``), each a group of those operators (``TIMER_OF``);
the step-time breakdown, the profiler, calibration, the benchmarks and their results use the
same names. A recomputation level is a set of operators (``RECOMPUTED``): the runtime wraps
exactly the modules running them in activation checkpointing, the cost model reruns them in
its backward graph and drops the activations they keep. No pydantic, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from functools import lru_cache
from types import MappingProxyType

from plans.enums import Recompute, RecomputeModule


class LayerOperator(StrEnum):
    """One operator of a transformer layer, at the cost model's granularity. The values are
    the layer graph's node names (``moeplan explain`` prints them on the critical path)."""

    # attention block
    attn_norm = "attn_norm"
    """RMSNorm before attention."""
    tp_all_gather = "tp_all_gather"
    """TP attention: all-gather of the sequence before the projections."""
    qkv_gemm = "qkv_gemm"
    """The Q, K and V projections (one GEMM in the cost model, three Linear modules in the
    runtime)."""
    qkv_up_gemm = "qkv_up_gemm"
    """MLA: the query and key/value up-projections from their latents (``qkv_gemm`` is then
    the down-projections to the latents and the shared RoPE key; the latents' RMSNorms are
    priced in memory)."""
    qk_norm = "qk_norm"
    """Per-head RMSNorm of q and k (Qwen3); priced in memory, its time not modelled."""
    sp_a2a_qkv = "sp_a2a_qkv"
    """Ulysses: all-to-all of q, k, v from sequence-sharded to head-sharded."""
    cp_kv_exchange = "cp_kv_exchange"
    """CP attention: the ring exchange of k and v."""
    rope = "rope"
    """Rotary embedding of q and k: priced as its own operator only as a fused region (the
    eager runtime's RoPE passes are inside the calibrated ``elementwise``)."""
    flash_attn = "flash_attn"
    """The attention core: RoPE and scaled-dot-product (flash) attention, with the GQA repeat
    of k and v (runtime.model.AttentionCore)."""
    sp_a2a_out = "sp_a2a_out"
    """Ulysses: all-to-all of the attention output back to sequence-sharded."""
    out_gemm = "out_gemm"
    """The output projection."""
    tp_reduce_scatter = "tp_reduce_scatter"
    """TP attention: reduce-scatter of the output projection."""
    attn_residual = "attn_residual"
    # FFN block
    ffn_norm = "ffn_norm"
    router_gemm = "router_gemm"
    router_topk = "router_topk"
    """Softmax, top-k and the routing weights."""
    dispatch_permute = "dispatch_permute"
    """All-to-all dispatcher: sort (token, slot) rows by expert."""
    ep_dispatch = "ep_dispatch"
    """The EP dispatch collective (all-to-all, or the all-gather of the all-gather dispatcher)."""
    etp_all_gather = "etp_all_gather"
    """Expert TP: all-gather of every rank's tokens."""
    dispatch_scatter = "dispatch_scatter"
    """All-gather dispatcher and expert TP: pick the rows routed to local experts."""
    dispatch_host_wait = "dispatch_host_wait"
    """Eager kernels: GPU time lost while the dispatch waits on the host for its split sizes
    or kept rows (cost_models.dispatch; the runtime's dispatch region holds it)."""
    expert_fc13 = "expert_fc13"
    """The grouped GEMMs fc1 and fc3 (gate and up projections)."""
    expert_swiglu = "expert_swiglu"
    expert_fc2 = "expert_fc2"
    ep_combine = "ep_combine"
    """The EP combine collective (all-to-all, or the reduce-scatter of the all-gather
    dispatcher)."""
    combine_unpermute = "combine_unpermute"
    """All-to-all dispatcher: weighted scatter of the returned rows back to their tokens."""
    combine_gather = "combine_gather"
    """All-gather dispatcher and expert TP: weighted gather into the buffer reduce-scattered."""
    etp_reduce_scatter = "etp_reduce_scatter"
    """Expert TP: reduce-scatter of the combined tokens."""
    shared_fc13 = "shared_fc13"
    shared_swiglu = "shared_swiglu"
    shared_fc2 = "shared_fc2"
    dense_all_gather = "dense_all_gather"
    """A dense-FFN layer under TP: all-gather of the sequence."""
    dense_fc13 = "dense_fc13"
    dense_swiglu = "dense_swiglu"
    dense_fc2 = "dense_fc2"
    dense_reduce_scatter = "dense_reduce_scatter"
    ffn_residual = "ffn_residual"


class Component(StrEnum):
    """A region of a training step the runtime times (runtime.metrics.Timers). The first five
    are regions of a layer, each a group of operators (``TIMER_OF``), timed forward and, as
    ``<component>_bwd``, backward; the others are regions of the step."""

    attention_comm = "attention_comm"
    attention_core = "attention_core"
    dispatch = "dispatch"
    expert_compute = "expert_compute"
    combine = "combine"
    pipeline_comm = "pipeline_comm"
    """Stage-to-stage sends and receives of the pipeline schedule."""
    forward = "forward"
    """Forward compute of the pipeline schedule (includes the forward regions above)."""
    backward = "backward"
    """Backward of the pipeline schedule (includes the ``_bwd`` regions)."""
    loss = "loss"
    """The loss of the last stage's micro-batches (inside ``forward``): logits to float32 and
    cross-entropy."""
    forward_backward = "forward_backward"
    """The whole pipeline schedule of a step (forward, backward, pipeline communication)."""
    grad_sync = "grad_sync"
    """Data-parallel gradient reduction (and ZeRO-1's parameter all-gather)."""
    optimizer = "optimizer"


_O, _C = LayerOperator, Component
_REGIONS: dict[Component, tuple[LayerOperator, ...]] = {
    _C.attention_comm: (_O.tp_all_gather, _O.sp_a2a_qkv, _O.cp_kv_exchange, _O.sp_a2a_out,
                        _O.tp_reduce_scatter),
    _C.attention_core: (_O.rope, _O.flash_attn),
    _C.dispatch: (_O.dispatch_permute, _O.ep_dispatch, _O.etp_all_gather, _O.dispatch_scatter,
                  _O.dispatch_host_wait),
    _C.expert_compute: (_O.expert_fc13, _O.expert_swiglu, _O.expert_fc2),
    _C.combine: (_O.ep_combine, _O.combine_unpermute, _O.combine_gather,
                 _O.etp_reduce_scatter),
}
TIMER_OF: Mapping[LayerOperator, Component] = MappingProxyType({
    op: next((c for c, ops in _REGIONS.items() if op in ops), Component.forward)
    for op in LayerOperator
})
"""The innermost region the runtime times each operator in: a layer region, or ``forward``
for the operators no layer region covers (norms, projections, router, shared and dense FFN,
residuals); their gradients count in the ``_bwd`` region, or ``backward``."""

LAYER_REGIONS: tuple[Component, ...] = tuple(_REGIONS)
"""The regions of a layer, each timed forward and backward (``<component>_bwd``)."""

COMPONENT_KEYS: tuple[str, ...] = (tuple(c.value for c in Component)
                                   + tuple(f"{c.value}_bwd" for c in LAYER_REGIONS))
"""Every key of a measured step's ``components_s`` (0.0 when the layout has no such work)."""

RECOMPUTED: Mapping[Recompute, frozenset[LayerOperator]] = MappingProxyType({
    Recompute.none: frozenset(),
    # the attention core, whose activations grow with the sequence (Korthikanti et al., 2022)
    Recompute.selective: frozenset({LayerOperator.rope, LayerOperator.flash_attn}),
    Recompute.full: frozenset(LayerOperator),
})
"""The operators each recomputation level reruns in backward instead of keeping their
activations; the inputs the set reads from operators outside it are kept."""


_LO, _M = LayerOperator, RecomputeModule
MODULE_OPERATORS: Mapping[RecomputeModule, frozenset[LayerOperator]] = MappingProxyType({
    # Megatron applies RoPE before core attention and keeps its output; moeplan's runtime reruns
    # it with the core (runtime.model.AttentionCore): the nearest module, a few MB apart
    _M.core_attn: RECOMPUTED[Recompute.selective],
    _M.layernorm: frozenset({_LO.attn_norm, _LO.ffn_norm}),
    _M.moe_act: frozenset({_LO.expert_swiglu}),
    _M.mla_up_proj: frozenset({_LO.qkv_up_gemm, _LO.rope}),  # the up-projections and RoPE
    _M.mlp: frozenset({_LO.dense_fc13, _LO.dense_swiglu, _LO.dense_fc2}),
    _M.moe: frozenset({_LO.router_gemm, _LO.router_topk, *_REGIONS[_C.dispatch],
                       *_REGIONS[_C.expert_compute], *_REGIONS[_C.combine]}),
    _M.shared_experts: frozenset({_LO.shared_fc13, _LO.shared_swiglu, _LO.shared_fc2}),
})
"""The layer operators each selective-recomputation module reruns."""
DEFAULT_MODULES: tuple[RecomputeModule, ...] = (RecomputeModule.core_attn,)
"""The modules selective recomputation reruns unless the plan names others (Megatron's
default ``--recompute-modules``)."""


@lru_cache(maxsize=256)
def recomputed_operators(policy: Recompute,
                         modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES
                         ) -> frozenset[LayerOperator]:
    """The operators a recomputation policy reruns in backward: none, every operator (full), or
    the union of the selective modules' operators."""
    if policy != Recompute.selective:
        return RECOMPUTED[policy]
    return frozenset().union(*(MODULE_OPERATORS[m] for m in modules))
