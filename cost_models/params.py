"""Parameters held by one GPU of each pipeline stage, split into the two sync groups."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plans.enums import CrossEntropy, ExpertGemm, Target
from plans.layout import (
    accumulates_experts_in_gemm,
    accumulates_head_in_gemm,
    moe_chunks,
    plan_expert_gemm,
    stage_of_chunk,
)
from plans.plan import Degrees, OptimizerSharding, Plan
from plans.specs import ModelSpec


@dataclass(frozen=True)
class StageParams:
    """Parameters on one GPU of a pipeline stage."""

    dense: float
    """Attention, norms, router, shared experts, dense FFNs, embedding / LM head: replicated
    over dp x cp x sp (split by tp)."""
    expert: float
    """Routed experts: E/ep experts, each split by etp; replicated over edp."""

    @property
    def total(self) -> float:
        return self.dense + self.expert

    def sharded_and_local(self, d: Degrees, sharding: OptimizerSharding) -> tuple[float, float]:
        """This GPU's optimizer shard split in two: the slices of the groups ZeRO-1 shards over
        more than one rank, and the parameters it updates in full (a group on one rank, or
        every group without sharding)."""
        if sharding == OptimizerSharding.none:
            return 0.0, self.total
        groups = ((self.dense, d.dp * d.cp * d.sp), (self.expert, d.edp))  # (params, replicas)
        return (sum(n / r for n, r in groups if r > 1), sum(n for n, r in groups if r == 1))

    def optimizer_shard(self, d: Degrees, sharding: OptimizerSharding) -> float:
        """Parameters whose optimizer states (and update) this GPU holds: with ZeRO-1 a
        1/replicas slice of each group (dense over dp x cp x sp, experts over edp), else
        all of them (Plan.optimizer_sharding)."""
        return sum(self.sharded_and_local(d, sharding))


def largest_param(model: ModelSpec, d: Degrees) -> float:
    """An upper bound on one parameter tensor on a GPU: the embedding or head (V x h / tp), one
    of a layer's three routed-expert weights (runtime.moe holds w1, w3 and w2 of its E / ep
    experts as one tensor each), a dense FFN's weight, or a layer's attention or shared experts
    whole."""
    m = model
    return max(m.vocab * m.hidden / d.tp,
               m.experts // d.ep * m.hidden * m.expert_ffn_hidden / d.etp,
               m.dense_ffn_hidden * m.hidden / d.tp,
               m.attention_params / d.tp,
               m.shared_expert_params / d.etp)


def chunk_dense_layers(stage_layers: tuple[int, ...], pattern: tuple[bool, ...]
                       ) -> tuple[int, ...]:
    """Dense-FFN layers in each model chunk, the chunks holding consecutive layers in order:
    the layers ``pattern`` (ModelSpec.moe_pattern) marks not MoE."""
    out, first = [], 0
    for n in stage_layers:
        out.append(n - sum(pattern[first:first + n]))
        first += n
    return tuple(out)


@lru_cache(maxsize=4096)
def stage_layer_counts(model: ModelSpec, stage_layers: tuple[int, ...], pp: int) -> tuple[
        tuple[int, int], ...]:
    """(MoE layers, dense-FFN layers) per physical stage (chunk c on stage c mod pp), by the
    model's layer pattern; the MTP modules' layers (ModelSpec.mtp_layers, of the last layer's
    kind) run on the last stage with the loss, as Megatron-Core places them."""
    out = [[0, 0] for _ in range(pp)]
    for c, (n, n_dense) in enumerate(
        zip(stage_layers, chunk_dense_layers(stage_layers, model.moe_pattern), strict=True)
    ):
        out[stage_of_chunk(c, pp)][0] += n - n_dense
        out[stage_of_chunk(c, pp)][1] += n_dense
    out[-1][0 if model.mtp_layer_is_moe else 1] += model.mtp_layers
    return tuple((a, b) for a, b in out)


@dataclass(frozen=True)
class PartParams:
    """Parameters on one GPU per model part: (dense-group, expert-group) pairs."""

    moe_layer: StageParams
    dense_layer: StageParams
    embedding: StageParams
    head: StageParams
    """Final norm and LM head (a tied embedding's copy counts only with pp > 1)."""
    lm_head: float
    """The LM head's weight within ``head`` (vocab x h / tp; 0 where it is the tied
    embedding's, one stage)."""


@lru_cache(maxsize=4096)
def part_params(model: ModelSpec, degrees: Degrees) -> PartParams:
    """Per layer, its mean over the layers: cross-layer KV sharing (kv_share_layers) leaves
    some layers without K and V projections. The head carries the MTP modules' projections
    and norms (their layers count with the stage's layers: stage_layer_counts)."""
    d, m = degrees, model
    borrowed = (1 - m.kv_projection_share) * m.kv_projection_params
    attention = (m.attention_params - borrowed) / d.tp + 2 * m.hidden
    moe_dense = attention + m.router_params + m.shared_expert_params / d.etp
    experts = m.experts // d.ep * m.expert_params / d.etp
    vocab = m.vocab * m.hidden / d.tp
    lm_head = vocab if d.pp > 1 or not m.tied_embeddings else 0.0
    return PartParams(
        moe_layer=StageParams(moe_dense, experts),
        dense_layer=StageParams(attention + m.dense_ffn_params / d.tp, 0.0),
        embedding=StageParams(vocab, 0.0),
        head=StageParams(m.hidden + lm_head + m.mtp_layers * m.mtp_extra_params / d.tp, 0.0),
        lm_head=lm_head,
    )


@lru_cache(maxsize=4096)
def stage_params(model: ModelSpec, degrees: Degrees, stage_layers: tuple[int, ...]) -> tuple[
        StageParams, ...]:
    """Per physical stage; chunk c of an interleaved schedule lives on stage c mod pp."""
    parts = part_params(model, degrees)
    dense = [0.0] * degrees.pp
    expert = [0.0] * degrees.pp
    for i, (n_moe, n_dense) in enumerate(stage_layer_counts(model, stage_layers, degrees.pp)):
        dense[i] += n_dense * parts.dense_layer.dense + n_moe * parts.moe_layer.dense
        expert[i] += n_moe * parts.moe_layer.expert
    dense[0] += parts.embedding.dense
    dense[-1] += parts.head.dense
    return tuple(StageParams(a, b) for a, b in zip(dense, expert, strict=True))


def stage_params_of(plan: Plan) -> tuple[StageParams, ...]:
    return stage_params(plan.model, plan.degrees, plan.stage_layers)


def pinned_expert_gemm(plan: Plan) -> ExpertGemm | None:
    """The experts' GEMM path the plan fixes whatever its layout: Megatron-Core's
    GroupedLinear runs grouped; on moeplan's runtime the path the plan names (None: the rule)."""
    return ExpertGemm.grouped if plan.target != Target.moeplan else plan.expert_gemm


def expert_gemm_of(plan: Plan) -> ExpertGemm:
    """How the plan's routed experts run their GEMMs: ``pinned_expert_gemm``, else as
    plans.layout.expert_gemm picks for the plan's layout (the runtime builds them with the
    same rule, runtime.trainer.model_options)."""
    d = plan.degrees
    return plan_expert_gemm(plan.model, d, plan.micro_batch_size, plan.training.seq_len,
                            moe_chunks(plan.overlap, plan.ffn, d.ep), pinned_expert_gemm(plan))


def head_in_gemm(plan: Plan, loss: CrossEntropy) -> bool:
    """Whether the last stage's LM head adds its weight gradient into its main gradient inside
    its GEMMs under ``loss``: moeplan's runtime as plans.layout.accumulates_head_in_gemm
    decides it; Megatron-Core under gradient-accumulation fusion, whatever the loss (its
    output layer is a ColumnParallelLinear, whose backward accumulates the weight gradient
    into main_grad, megatron/core/tensor_parallel/layers.py 553-567 at 0.15.3; so does MTP's
    eh_proj)."""
    if plan.target == Target.megatron:
        return plan.grad_accumulation_fusion
    return accumulates_head_in_gemm(plan.grad_accumulation_fusion, loss, plan.model,
                                    plan.degrees.pp)


def experts_in_gemm(plan: Plan) -> bool:
    """Whether the plan's routed experts add their weight gradients into the main gradients
    inside their GEMMs (plans.layout.accumulates_experts_in_gemm on the experts per rank: E / ep
    of width F / etp, run as ``expert_gemm_of``), as the runtime decides it from the same rule."""
    m, d = plan.model, plan.degrees
    return accumulates_experts_in_gemm(plan.grad_accumulation_fusion, m.experts // d.ep,
                                       m.expert_ffn_hidden // d.etp, expert_gemm_of(plan))
