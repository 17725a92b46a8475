"""A plan's step time, throughput, MFU and memory: the cost model's entry points."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from types import MappingProxyType
from typing import NamedTuple

from cost_models import megatron
from cost_models import pipeline as pl
from cost_models.compute import FP32_BYTES, memory_s
from cost_models.grad_sync import exposed_grad_sync_s, stage_grad_syncs
from cost_models.layer import LayerTiming, layer_timing
from cost_models.memory import (
    GIB,
    WEIGHT_BYTES,
    MemoryBreakdown,
    grad_bytes_per_param,
    memory_breakdown,
)
from cost_models.params import (
    StageParams,
    experts_in_gemm,
    head_in_gemm,
    part_params,
    stage_layer_counts,
    stage_params_of,
)
from plans.enums import CrossEntropy, OptimizerSharding, Target
from plans.operators import Component
from plans.plan import Plan, Prediction
from plans.specs import mfu


@dataclass(frozen=True)
class StageCosts:
    """Forward + backward seconds of one micro-batch, for splitting layers over stages."""

    layer_s: float
    """One MoE layer."""
    dense_layer_s: float
    """One dense-FFN layer (equal to layer_s when the model has none)."""
    embedding_s: float
    """Extra on the first stage."""
    head_s: float
    """Final norm + LM head + loss, extra on the last stage (with MTP modules: their layers,
    projections and heads too)."""
    p2p_s: float
    """One stage-to-stage activation transfer."""



BREAKDOWN_TERMS = {
    "compute": "layer operators, embedding, LM head and loss on the busiest pipeline stage, "
               "over all micro-batches",
    "recompute": "operators rerun in the backward instead of keeping their activations, and "
                 "their exposed communication",
    "grad_accumulation": "adding each micro-batch's weight gradients into the "
                         "main-gradient buffers (a separate pass where it is not fused into "
                         "the weight-gradient GEMMs)",
    "exposed_comm.<kind>": "a layer's communication of that kind that no compute hid "
                           "(kinds: cost_models.volumes.COMM_KINDS)",
    "host": "the GPU waiting on its host (target megatron): kernels launched one by one from "
            "Python and the dropless dispatcher's wait for its split sizes "
            "(cost_models.megatron.host_wait_s)",
    "pipeline_bubble": "the busiest stage idle while the pipeline fills and drains",
    "stragglers": "waiting for the slowest pipeline stage and data-parallel replica "
                  "(stage times vary by cluster.stage_time_cv; cost_models.pipeline."
                  "straggler_s)",
    "pp_p2p": "stage-to-stage activation transfers not hidden by compute",
    "grad_sync": "data-parallel gradient reduce-scatter (all-reduce without ZeRO-1) and "
                 "parameter all-gather not hidden by the backward, worst stage",
    "optimizer": "the optimizer step: the memory-bound update of this GPU's shard (ZeRO-1) or "
                 "of all its parameters, worst stage",
}
"""The step-time breakdown's terms (Evaluation.breakdown_s), in the order they are summed."""

@dataclass(frozen=True)
class Evaluation:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    """model.flops_per_token(seq_len) x tokens per step / (GPUs x bf16 peak x step time)."""
    breakdown_s: Mapping[str, float]
    """Adds up to step_time_s; its terms, in order, are BREAKDOWN_TERMS' (one key
    ``exposed_comm.<kind>`` per CommKind that occurs)."""
    memory: MemoryBreakdown
    layer: LayerTiming
    """One MoE layer, one micro-batch."""
    stage_forward_s: tuple[float, ...]
    """Forward seconds of one micro-batch on each pipeline stage (embedding and head
    included)."""
    stage_backward_s: tuple[float, ...]
    """Backward seconds of one micro-batch on each stage (reruns and gradient accumulation
    included)."""
    feasible: bool
    reason: str | None
    components_s: Mapping[str, float]
    """The step by the runtime's timer components (``plans.COMPONENT_KEYS``, the keys of a
    measured step's ``components_s``), on the busiest stage: each layer region's operators
    over its layers and micro-batches, run back to back (``LayerTiming.region_s``), and the
    step's ``grad_sync`` and ``optimizer``."""

    def prediction(self) -> Prediction:
        return Prediction(
            step_time_s=self.step_time_s,
            tokens_per_s=self.tokens_per_s,
            mfu=self.mfu,
            peak_memory_gib=self.memory.peak_bytes / GIB,
            breakdown_s=dict(self.breakdown_s),
            memory_gib={k: v / GIB for k, v in self.memory.components_bytes.items()},
        )


def _timings(plan: Plan) -> tuple[LayerTiming, LayerTiming]:
    moe = layer_timing(plan)
    if not plan.model.dense_ffn_layers and plan.model.mtp_layer_is_moe:
        return moe, moe
    return moe, layer_timing(plan, dense=True)


def _host_waits(plan: Plan, moe: LayerTiming, dense: LayerTiming
                ) -> tuple[tuple[float, float], tuple[float, float]]:
    """GPU seconds an MoE and a dense layer lose to the host per micro-batch (forward,
    backward): Megatron-Core's launches and waits (cost_models.megatron); none for moeplan's
    runtime, whose host costs its kernel factors hold."""
    if plan.target != Target.megatron:
        return (0.0, 0.0), (0.0, 0.0)
    return megatron.host_wait_s(plan, moe), megatron.host_wait_s(plan, dense, dense=True)


def _edges(plan: Plan) -> tuple[pl.EdgeCost, pl.EdgeCost]:
    """The embedding, and the last stage's head: the LM head and loss, once more per MTP
    module with the module's projection of the hidden state and the next token's embedding
    (2h to h; its layer counts with the stage's layers)."""
    d, tokens = plan.degrees, pl.micro_batch_tokens(plan)
    head = head_edge(plan, plan.cross_entropy)
    if plan.model.mtp_layers:
        head = pl.mtp_head_cost(plan, head)
    return pl.embedding_cost(plan.model, plan.cluster, tokens, d.tp), head


def head_edge(plan: Plan, loss: CrossEntropy) -> pl.EdgeCost:
    """The last stage's final norm, LM head and ``loss`` for one micro-batch
    (cost_models.pipeline.head_cost), the head's weight gradient added into its main gradient
    by the chunked loss's GEMMs where ``head_in_gemm`` (moeplan's runtime; Megatron-Core's
    output layer accumulates in its backward GEMM, priced with the head's GEMMs)."""
    grad_bytes = (grad_bytes_per_param(plan.grad_sync_precision)
                  if head_in_gemm(plan, loss) and plan.target == Target.moeplan else None)
    return pl.head_cost(plan.model, plan.cluster, pl.micro_batch_tokens(plan), plan.degrees.tp,
                        loss, plan.kernels, grad_bytes)


def head_s(plan: Plan, loss: CrossEntropy) -> float:
    """What the loss kinds differ in, per micro-batch: the head's forward and backward
    (head_edge) and the pass adding its weight gradients (_head_accumulation_s)."""
    return head_edge(plan, loss).total_s + _head_accumulation_s(plan, loss)


def _accumulate_s(params: float, per_param: float, plan: Plan) -> float:
    """Adding one micro-batch's gradients of ``params`` weights into the main-gradient buffers
    in a separate pass, ``per_param`` bytes each (_accumulations_s): read the bf16 gradient,
    read and write the main gradient (on the compute stream)."""
    return memory_s(params * per_param, plan.cluster)


def _pass_bytes_per_param(plan: Plan) -> float:
    """Bytes a weight's separate accumulation pass moves (_accumulate_s): the bf16 gradient
    read, the main gradient read and written."""
    return WEIGHT_BYTES + 2 * grad_bytes_per_param(plan.grad_sync_precision)


def _head_accumulation_s(plan: Plan, loss: CrossEntropy) -> float:
    """The last stage's head (final norm, LM head, MTP modules' norms and projections) in
    separate passes, but the weights whose gradients go into the main gradients inside their
    GEMMs (``head_in_gemm``): the LM head's, and under Megatron-Core the MTP projections'
    (2 h x h each, as its output layer's)."""
    parts, m = part_params(plan.model, plan.degrees), plan.model
    params = parts.head.dense
    if head_in_gemm(plan, loss):
        params -= parts.lm_head
        if plan.target == Target.megatron:
            params -= m.mtp_layers * 2 * m.hidden * m.hidden / plan.degrees.tp
    return _accumulate_s(params, _pass_bytes_per_param(plan), plan)


def _chunk_accumulate_s(params: float, plan: Plan) -> float:
    """Adding one more chunk's weight gradients of ``params`` weights into their gradient: read
    both bf16 gradients, write the sum (on the compute stream)."""
    return memory_s(params * 3 * WEIGHT_BYTES, plan.cluster)


class _Accumulations(NamedTuple):
    """One micro-batch's gradient accumulation of one MoE layer, one dense-FFN layer, the
    embedding and the LM head (_accumulations_s)."""

    moe_layer: float
    dense_layer: float
    embedding: float
    head: float


def _accumulations_s(plan: Plan) -> _Accumulations:
    """One micro-batch's gradient accumulation in separate passes, part by part. With
    gradient-accumulation fusion (runtime.parallel.grad_accumulation) the blocks' dense weights
    accumulate inside their GEMMs (their norms' few weights aside), and so do the routed
    experts where ``experts_in_gemm`` and the LM head where ``head_in_gemm``
    (_head_accumulation_s); the embedding never does. A chunked MoE layer
    (inter-operator overlap) computes its experts' weight gradients once per chunk: chunks - 1
    more passes over them (plans.layout.moe_chunks) unless they accumulate in the GEMM."""
    parts = part_params(plan.model, plan.degrees)
    fused = plan.grad_accumulation_fusion
    in_gemm = experts_in_gemm(plan)
    chunks = 1 if in_gemm else megatron.moe_chunks(plan)
    per_param = _pass_bytes_per_param(plan)

    def of(params: StageParams, edge: bool) -> float:
        dense = params.dense if edge or not fused else 0.0
        if in_gemm:
            return _accumulate_s(dense, per_param, plan)
        return (_accumulate_s(dense + params.expert, per_param, plan)
                + _chunk_accumulate_s(params.expert * (chunks - 1), plan))

    return _Accumulations(of(parts.moe_layer, False), of(parts.dense_layer, False),
                          of(parts.embedding, True), _head_accumulation_s(plan, plan.cross_entropy))


def _stage_accumulations_s(plan: Plan) -> list[float]:
    """One micro-batch's gradient accumulation per stage: its layers', the embedding's on
    the first stage, the LM head's on the last."""
    acc = _accumulations_s(plan)
    last = plan.degrees.pp - 1
    return [n_moe * acc.moe_layer + n_dense * acc.dense_layer
            + (acc.embedding if stage == 0 else 0.0) + (acc.head if stage == last else 0.0)
            for stage, (n_moe, n_dense) in enumerate(
                stage_layer_counts(plan.model, plan.stage_layers, plan.degrees.pp))]


def stage_costs(plan: Plan) -> StageCosts:
    moe, dense = _timings(plan)
    emb, head = _edges(plan)
    acc = _accumulations_s(plan)
    host_moe, host_dense = _host_waits(plan, moe, dense)
    moe_s = moe.total_s + sum(host_moe) + acc.moe_layer
    dense_s = dense.total_s + sum(host_dense) + acc.dense_layer
    mtp_s = plan.model.mtp_layers * (moe_s if plan.model.mtp_layer_is_moe else dense_s)
    return StageCosts(
        moe_s, dense_s,
        emb.total_s + acc.embedding,
        head.total_s + acc.head + mtp_s,
        pl.p2p_transfer_s(plan),
    )


def evaluate(plan: Plan) -> Evaluation:
    d, c, eff = plan.degrees, plan.cluster, plan.cluster.efficiency
    moe, dense = _timings(plan)
    emb, head = _edges(plan)
    layers = stage_layer_counts(plan.model, plan.stage_layers, d.pp)
    last = d.pp - 1
    (host_f, host_b), (host_df, host_db) = _host_waits(plan, moe, dense)
    fwd = [n * (moe.fwd_s + host_f) + nd * (dense.fwd_s + host_df) for n, nd in layers]
    bwd = [n * (moe.bwd_s + host_b) + nd * (dense.bwd_s + host_db) for n, nd in layers]
    fwd[0] += emb.fwd_s
    bwd[0] += emb.bwd_s
    fwd[last] += head.fwd_s
    bwd[last] += head.bwd_s
    accumulate_s = _stage_accumulations_s(plan)
    bwd = [b + a for b, a in zip(bwd, accumulate_s, strict=True)]
    stage_s = [f + b for f, b in zip(fwd, bwd, strict=True)]
    busiest = max(range(d.pp), key=stage_s.__getitem__)
    m = plan.num_micro_batches
    n_moe, n_dense = layers[busiest]

    edge = (emb.total_s if busiest == 0 else 0.0) + (head.total_s if busiest == last else 0.0)
    breakdown: dict[str, float] = {
        "compute": m * (n_moe * moe.compute_s + n_dense * dense.compute_s + edge),
        "recompute": m * (n_moe * moe.recompute_s + n_dense * dense.recompute_s),
        "grad_accumulation": m * accumulate_s[busiest],
    }
    for kind in sorted({*moe.exposed_comm_s, *dense.exposed_comm_s}):
        breakdown[f"exposed_comm.{kind}"] = m * (
            n_moe * moe.exposed_comm_s.get(kind, 0.0)
            + n_dense * dense.exposed_comm_s.get(kind, 0.0))
    if plan.target == Target.megatron:
        breakdown["host"] = m * (n_moe * (host_f + host_b) + n_dense * (host_df + host_db))
    breakdown["pipeline_bubble"] = pl.bubble_s(stage_s, d.vpp)
    breakdown["stragglers"] = pl.straggler_s(sum(breakdown.values()), plan)
    breakdown["pp_p2p"] = pl.exposed_p2p_s(plan, pl.p2p_transfer_s(plan))

    # Stage i's last backward is followed by those of stages i-1 .. 0 (the drain), which
    # widens its sync window; the drain alone can hide its last bucket.
    syncs = stage_grad_syncs(plan.model, d, plan.stage_layers, c, plan.grad_sync_precision)
    window = list(accumulate(bwd))
    sharded = plan.optimizer_sharding == OptimizerSharding.zero1
    sync = max(exposed_grad_sync_s(gs, window[i], window[i] - bwd[i], plan.grad_sync_overlap,
                                   eff.overlap, sharded) for i, gs in syncs)
    # The optimizer on the parameters whose states this GPU holds (its ZeRO-1 shard, or all
    # of them): cast the synchronised gradient slice to fp32 (unless it is fp32), read it,
    # read and write master weights and states, read the masters and write the bf16 weights;
    # fused (Optimizer.runs_fused), one pass: read the gradient as it is, read and write
    # masters and states, write the bf16 weights.
    shard = max(p.optimizer_shard(d, plan.optimizer_sharding) for p in stage_params_of(plan))
    grad_bytes = grad_bytes_per_param(plan.grad_sync_precision)
    state = 2 * plan.training.optimizer.state_bytes(plan.optimizer_moments)
    if plan.training.optimizer.runs_fused(plan.kernels):
        per_param = grad_bytes + state + WEIGHT_BYTES
    else:
        cast = grad_bytes + FP32_BYTES if grad_bytes != FP32_BYTES else 0
        per_param = cast + FP32_BYTES + state + FP32_BYTES + WEIGHT_BYTES
    opt = memory_s(shard * per_param, c)
    breakdown[Component.grad_sync.value] = sync
    breakdown[Component.optimizer.value] = opt
    components = {k: m * (n_moe * v + n_dense * dense.region_s[k])
                  for k, v in moe.region_s.items()}
    components[Component.grad_sync.value] = sync
    components[Component.optimizer.value] = opt

    step = sum(breakdown.values())
    tokens = plan.training.tokens_per_step
    mem = memory_breakdown(plan)
    return Evaluation(
        step_time_s=step,
        tokens_per_s=tokens / step,
        mfu=mfu(plan.model, plan.training.seq_len, tokens, step, c.gpus, c.gpu),
        breakdown_s=MappingProxyType(breakdown),
        memory=mem,
        layer=moe,
        stage_forward_s=tuple(fwd),
        stage_backward_s=tuple(bwd),
        feasible=mem.fits,
        reason=mem.reason,
        components_s=MappingProxyType(components),
    )
