"""Pipeline schedule time from per-stage micro-batch times, and the extra work of the first
(embedding) and last (final norm, LM head, loss) stages."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from cost_models import comm
from cost_models import compute as cc
from plans.enums import CrossEntropy, Kernels
from plans.layout import loss_chunks, stride, tokens_per_rank
from plans.plan import Degrees, MeshAxis, Plan
from plans.specs import ClusterSpec, ModelSpec, Precision

AB = cc.ACT_BYTES


def step_s(stage_s: Sequence[float], micro_batches: int, vpp: int = 1) -> float:
    """Forward + backward of all micro-batches through the pipeline, p2p excluded.

    1F1B (Narayanan et al. 2021, Sec. 2.2; uneven stages): (m - 1) max_i t_i + sum_i t_i, with
    t_i a stage's forward + backward time of one micro-batch. Interleaved 1F1B with vpp chunks
    per stage divides the bubble by vpp (ibid., Sec. 2.2.2: bubble (p - 1)/v x t):
    m max_i t_i + (sum_i t_i - max_i t_i) / vpp."""
    return micro_batches * max(stage_s) + bubble_s(stage_s, vpp)


def straggler_s(pipelined_s: float, plan: Plan) -> float:
    """Waiting for the slowest GPU. Each micro-batch's stage time varies by a coefficient of
    variation c (ClusterSpec.stage_time_cv); in the 1F1B steady state every slot waits for
    the slowest of the pp stages, and the expected maximum of n such times is about
    t (1 + c sqrt(2 ln n)) (the Gaussian extreme-value bound); the dp replicas wait for each
    other once per step, at the gradient sync, where m micro-batches have averaged c down to
    c / sqrt(m). ``pipelined_s`` is the schedule's compute and bubble on the busiest stage."""
    d, c = plan.degrees, plan.cluster.stage_time_cv

    def spread(n: int) -> float:
        return math.sqrt(2 * math.log(n)) if n > 1 else 0.0

    replicas = d.dp * d.cp
    return pipelined_s * c * (spread(d.pp) + spread(replicas) / math.sqrt(plan.num_micro_batches))


def bubble_s(stage_s: Sequence[float], vpp: int = 1) -> float:
    """Idle time of the busiest stage: (sum_i t_i - max_i t_i) / vpp."""
    return (sum(stage_s) - max(stage_s)) / vpp


@dataclass(frozen=True)
class EdgeCost:
    """Forward and backward seconds of one micro-batch's extra work on an end stage."""

    fwd_s: float
    bwd_s: float

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


def micro_batch_tokens(plan: Plan) -> float:
    """Tokens of one micro-batch per rank outside attention: b s / (sp cp tp)."""
    return tokens_per_rank(plan.micro_batch_size, plan.training.seq_len,
                           plan.degrees.attention_group)


def mtp_head_cost(plan: Plan, head: EdgeCost) -> EdgeCost:
    """The last stage's head with ``plan.model.mtp_layers`` MTP modules: each runs the shared
    LM head and loss once more and projects its two normed inputs (2h to h, split over tp:
    Megatron-Core's eh_proj) before its layer."""
    m, c, p = plan.model, plan.cluster, plan.training.precision
    rows = micro_batch_tokens(plan) * plan.degrees.tp
    shape = (rows, m.hidden / plan.degrees.tp, 2 * m.hidden)
    fwd = cc.gemm_s(*shape, c, p)
    bwd = sum(cc.gemm_s(*g, c, p) for g in cc.backward_gemms(*shape))
    n = 1 + m.mtp_layers
    return EdgeCost(n * head.fwd_s + m.mtp_layers * fwd, n * head.bwd_s + m.mtp_layers * bwd)


@lru_cache(maxsize=1024)
def embedding_cost(model: ModelSpec, cluster: ClusterSpec, tokens: float, tp: int) -> EdgeCost:
    """Token lookup for ``tokens`` per rank (read and write tokens x h); backward scatter-adds
    into an fp32 gradient (read dy, read and write the fp32 rows). Under TP the vocab-parallel
    lookup's partial sums are reduce-scattered to sequence-parallel (all-gathered back)."""
    c, h, t = cluster, model.hidden, tokens
    layout = comm.group_layout(tp, 1, c.node.gpus_per_node)
    rs = comm.reduce_scatter_s(t * tp * h * AB, layout, c)
    fwd = cc.memory_s(2 * t * h * AB, c) + rs
    bwd = cc.memory_s(t * h * (AB + 2 * cc.FP32_BYTES), c) + rs
    return EdgeCost(fwd, bwd)


@lru_cache(maxsize=1024)
def head_cost(model: ModelSpec, cluster: ClusterSpec, tokens: float, tp: int,
              loss: CrossEntropy = CrossEntropy.materialized,
              kernels: Kernels = Kernels.eager,
              main_grad_bytes: int | None = None) -> EdgeCost:
    """Final RMSNorm, LM-head GEMM (bf16 also in fp8 training) over b s/(sp cp) rows and
    vocab/tp columns, and the cross-entropy (cross_entropy_s; ``main_grad_bytes`` as there).
    The chunked loss runs the head's backward GEMMs in the forward too (runtime.loss). Under
    TP the norm output is
    all-gathered first (reduce-scattered back in backward) and the loss's per-row statistics
    are all-gathered over the vocabulary shards (runtime.loss.sharded_cross_entropy)."""
    c, m, t = cluster, model, tokens
    rows = t * tp
    layout = comm.group_layout(tp, 1, c.node.gpus_per_node)
    ag = comm.all_gather_s(rows * m.hidden * AB, layout, c)
    gemm_fwd, gemm_bwd = head_gemm_s(model, cluster, tokens, tp)
    chunks = 1
    if loss == CrossEntropy.chunked:
        gemm_fwd, gemm_bwd = gemm_fwd + gemm_bwd, 0.0
        chunks = loss_chunks(rows, m.vocab // tp)
    ce_fwd, ce_bwd = cross_entropy_s(model, cluster, rows, tp, loss, kernels, main_grad_bytes)
    if tp > 1:  # each chunk's per-row maximum, sum and label logit gathered over the shards
        ce_fwd += chunks * comm.all_gather_s(tp * 3 * cc.FP32_BYTES * rows / chunks, layout, c)
    fwd = cc.memory_s(2 * t * m.hidden * AB, c) + ag + gemm_fwd + ce_fwd
    bwd = ce_bwd + gemm_bwd + ag + cc.memory_s(3 * t * m.hidden * AB, c)
    return EdgeCost(fwd, bwd)


def cross_entropy_s(model: ModelSpec, cluster: ClusterSpec, rows: float, tp: int,
                    loss: CrossEntropy, kernels: Kernels,
                    main_grad_bytes: int | None = None) -> tuple[float, float]:
    """The loss's memory-bound passes over ``rows`` x vocab/tp logits, forward and backward
    (runtime.loss as the plan's kernels run it):

    - materialized: torch's cross-entropy, cost_models.compute.CE_FWD_BYTES_PER_LOGIT and
      CE_BWD_BYTES_PER_LOGIT;
    - chunked: the same passes chunk by chunk under eager kernels, the compiled region's
      CE_FUSED_BYTES_PER_LOGIT under fused ones, all in the forward (which computes the
      gradients); then the head's weight gradient (vocab/tp x h) summed over the
      plans.layout.loss_chunks chunks in fp32: eager, each later chunk's bf16 product added
      in a pass of its own (the first's cast 6 bytes an element, each add 10); fused, inside
      the GEMMs, each later chunk's GEMM reading the fp32 sum (4: its fp32 writes ran in the
      GEMMs' time, +5.3 ms over 18 chunks of Qwen3-30B-A3B's 152k x 2048 head on H200,
      bench/results/h200/kernels/fused_loss_qwen3.json). Its backward scales the kept gradients (the
      fp32 weight gradient read, scaled, cast: 14 bytes an element over several chunks, 4
      over one);
    - chunked with ``main_grad_bytes`` (the head's gradient into its main gradient,
      cost_models.params.head_in_gemm): every chunk's GEMM adds into the main gradient of
      ``main_grad_bytes`` an element, reading it (its writes in the GEMMs' time, as above),
      under either kernel set; nothing is summed, cast or scaled apart, in forward or
      backward."""
    logits = rows * model.vocab / tp
    if loss == CrossEntropy.materialized:
        return (cc.memory_s(logits * cc.CE_FWD_BYTES_PER_LOGIT, cluster),
                cc.memory_s(logits * cc.CE_BWD_BYTES_PER_LOGIT, cluster))
    weights = model.vocab / tp * model.hidden
    later = loss_chunks(rows, model.vocab // tp) - 1  # chunks of this rank's vocabulary rows
    if kernels == Kernels.fused:
        per_logit, summed = cc.CE_FUSED_BYTES_PER_LOGIT, 4 * later
    else:
        per_logit = cc.CE_FWD_BYTES_PER_LOGIT + cc.CE_BWD_BYTES_PER_LOGIT
        summed = 6 + 10 * later if later else 0
    scaled = 14 if later or kernels == Kernels.fused else 4
    if main_grad_bytes is not None:
        summed, scaled = main_grad_bytes * (later + 1), 0
    return (cc.memory_s(logits * per_logit + weights * summed, cluster),
            cc.memory_s(weights * scaled, cluster))


def head_gemm_s(model: ModelSpec, cluster: ClusterSpec, tokens: float, tp: int
                ) -> tuple[float, float]:
    """The LM head's GEMMs over b s/(sp cp) rows and vocab/tp columns (bf16 also in fp8
    training): forward logits; backward data and weight gradients."""
    rows, cols, h = tokens * tp, model.vocab / tp, model.hidden
    fwd = cc.gemm_s(rows, cols, h, cluster, Precision.bf16)
    bwd = sum(cc.gemm_s(*g, cluster, Precision.bf16) for g in cc.backward_gemms(rows, cols, h))
    return fwd, bwd


def p2p_transfer_s(plan: Plan) -> float:
    """One stage-to-stage send of b x s/(sp cp) x h activations (sequence-parallel shards under
    TP: tokens x h per rank); across nodes when the pp stride reaches a node."""
    d, c = plan.degrees, plan.cluster
    if d.pp == 1:
        return 0.0
    return comm.send_recv_s(micro_batch_tokens(plan) * plan.model.hidden * AB, c,
                            _pp_crosses_nodes(d, c.node.gpus_per_node))


@lru_cache(maxsize=4096)
def _pp_crosses_nodes(d: Degrees, gpus_per_node: int) -> bool:
    """Whether neighbouring pipeline stages sit on different nodes (the pp stride reaches a
    node)."""
    return comm.group_layout(d.pp, stride(d, MeshAxis.pp), gpus_per_node).nodes > 1


def exposed_p2p_s(plan: Plan, transfer_s: float) -> float:
    """Fill and drain put 2 (pp vpp - 1) transfers on the critical path (activations down,
    gradients up); in the steady state each stage sends 2 vpp per micro-batch, hidden behind
    compute up to efficiency.overlap."""
    d = plan.degrees
    if d.pp == 1:
        return 0.0
    vpp = d.vpp
    fill_drain = 2 * (d.pp * vpp - 1) * transfer_s
    steady = 2 * vpp * (plan.num_micro_batches - 1) * transfer_s
    return fill_drain + steady * (1 - plan.cluster.efficiency.overlap)
