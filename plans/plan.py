"""The Plan: the one contract between the planner and the runtime.

A plan embeds the specs it was made for, so it is self-contained: the runtime needs nothing
else, and a person can write one by hand. Every overlap, recomputation and precision choice is a
field here so the planner can search it and the runtime can obey it.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from plans.enums import (
    CrossEntropy,
    CudaGraphs,
    Dispatch,
    ExpertGemm,
    Kernels,
    OptimizerSharding,
    Overlap,
    PipelineSchedule,
    Recompute,
    RecomputeModule,
    Target,
)
from plans.notation import (
    ATTENTION_TAGS,
    DISPATCH_TAGS,
    NO_GAF,
    OPTIMIZER_SHARDING_TAGS,
    OVERLAP_TAGS,
    SCHEDULE_TAGS,
    SYNC_AFTER_BWD,
    Prefix,
    recompute_tag,
)
from plans.specs import (
    MAX_LAYERS,
    ClusterSpec,
    Frozen,
    GPUs,
    ModelSpec,
    OptionalLayers,
    Precision,
    Tokens,
    TrainingSpec,
    mfu,
)

SCHEMA_VERSION = 1


class MeshAxis(StrEnum):
    """Named axes of the device mesh and the process groups along them (plans.layout): the
    attention view (pp, dp, attn), the FFN view (pp, edp, ep, etp) of the same ranks, the
    stage view (pp, stage), and the tied-embedding pairs."""

    pp = "pp"
    dp = "dp"
    """Same attention shard, other data replicas: replication group of TP-sharded weights."""
    attn = "attn"
    """The ranks sharing one sequence's attention: cp x sp x tp (one of them is the degree)."""
    stage = "stage"
    """Every rank of a pipeline stage (dp x attn): replication group of dense weights."""
    edp = "edp"
    """Same experts, other EP groups: replication group of expert weights."""
    ep = "ep"
    etp = "etp"
    """Ranks holding slices of the same experts (expert tensor parallelism)."""
    embed = "embed"
    """First and last stage ranks at the same position: the two copies of tied embeddings."""


class Degrees(Frozen):
    """Parallel degrees. Invariants: world = pp x dp x cp x sp x tp (attention view)
    = pp x edp x ep x etp (FFN view), so ep x etp must divide dp x cp x sp x tp."""

    pp: GPUs = 1
    """Pipeline stages (physical)."""
    vpp: GPUs = 1
    """Virtual stages per physical stage (interleaved 1F1B); 1 otherwise."""
    dp: GPUs = 1
    """Data-parallel replicas of the attention (and dense) weights."""
    sp: GPUs = 1
    """Ulysses sequence-parallel degree of attention."""
    tp: GPUs = 1
    """Tensor-parallel degree of attention."""
    cp: GPUs = 1
    """Context-parallel degree of attention."""
    ep: GPUs = 1
    """Expert-parallel degree of the MoE FFN."""
    etp: GPUs = 1
    """Tensor-parallel degree inside each expert."""

    @model_validator(mode="after")
    def _check(self) -> Degrees:
        inner = self.dp * self.cp * self.sp * self.tp
        if inner % (self.ep * self.etp):
            raise ValueError(
                f"ep x etp ({self.ep} x {self.etp} = {self.ep * self.etp}) must divide "
                f"dp x cp x sp x tp ({self.dp} x {self.cp} x {self.sp} x {self.tp} = {inner})"
            )
        return self

    @property
    def attention_group(self) -> int:
        """Ranks that share one sequence's attention: cp x sp x tp."""
        return self.cp * self.sp * self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree, derived: dp x cp x sp x tp / (ep x etp)."""
        return self.dp * self.attention_group // (self.ep * self.etp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.attention_group

    @property
    def stages(self) -> int:
        """Model chunks along the pipeline: pp x vpp."""
        return self.pp * self.vpp


# ---- attention strategies (tagged union on `kind`) ------------------------------------------


class UlyssesAttention(Frozen):
    """DeepSpeed-Ulysses SP: sequence-sharded activations, all-to-all to head-sharded for the
    attention core and back (paper Sec. 3.1)."""

    kind: Literal["ulysses_sp"] = "ulysses_sp"


class TPAttention(Frozen):
    """Megatron tensor parallelism with sequence parallelism in the norm regions:
    all-gather before QKV, reduce-scatter after the output projection."""

    kind: Literal["tp"] = "tp"


class CPAttention(Frozen):
    """Context parallelism: sequence-sharded attention exchanging K/V (ring)."""

    kind: Literal["cp"] = "cp"
    zigzag: bool = True
    """Zig-zag chunk assignment to balance the causal mask."""


AttentionStrategy = Annotated[
    UlyssesAttention | TPAttention | CPAttention, Field(discriminator="kind")
]


# ---- FFN strategies ---------------------------------------------------------------------------


MIN_CAPACITY_FACTOR = 0.01
"""Below 1% of its balanced share an expert would drop nearly every token: a typing mistake (and
a denormal factor made the cost model drop all tokens while the runtime kept one per expert)."""


class EPFFN(Frozen):
    """Expert parallelism: whole experts per rank, tokens moved by the dispatcher."""

    kind: Literal["ep"] = "ep"
    dispatch: Dispatch = Dispatch.all_to_all
    capacity_factor: float | None = Field(None, ge=MIN_CAPACITY_FACTOR)
    """Tokens each expert accepts, as a multiple of the balanced share; None is dropless."""


class TPFFN(Frozen):
    """Tensor parallelism inside every expert (etp), all experts on every rank."""

    kind: Literal["tp"] = "tp"


FFNStrategy = Annotated[EPFFN | TPFFN, Field(discriminator="kind")]


# ---- schedule, overlap, recomputation ---------------------------------------------------------


NonNegative = Annotated[float, Field(ge=0)]


class Prediction(Frozen):
    """What the cost model predicts for a plan."""

    step_time_s: float = Field(gt=0)
    tokens_per_s: float = Field(gt=0)
    mfu: float = Field(gt=0)
    """Model FLOPs (ModelSpec.flops_per_token) / (GPUs x peak x step time)."""
    peak_memory_gib: float = Field(ge=0)
    breakdown_s: dict[str, NonNegative]
    """Step-time components (compute, exposed communication by kind, bubble, grad sync); they
    sum to step_time_s."""
    memory_gib: dict[str, NonNegative] = {}
    """Peak-memory components per GPU."""

    def problems(self, plan: Plan) -> list[str]:
        """Where the stored numbers contradict each other for ``plan`` (a hand-edited block):
        tokens/s and MFU follow from the step time, the components sum to it."""
        out = []
        tokens, c = plan.training.tokens_per_step, plan.cluster
        derived = {
            "tokens_per_s": (self.tokens_per_s, tokens / self.step_time_s),
            "mfu": (self.mfu, mfu(plan.model, plan.training.seq_len, tokens, self.step_time_s,
                                  c.gpus, c.gpu)),
        }
        if self.breakdown_s:
            derived["step_time_s"] = (self.step_time_s, sum(self.breakdown_s.values()))
        for name, (stored, expected) in derived.items():
            if not math.isclose(stored, expected, rel_tol=1e-6):
                what = ("the sum of breakdown_s" if name == "step_time_s"
                        else "what step_time_s implies")
                out.append(f"prediction.{name}: {stored:.6g} contradicts {what} "
                           f"({expected:.6g}); the prediction was edited")
        return out


# ---- the plan -----------------------------------------------------------------------------------


class Plan(Frozen):
    schema_version: Literal[1] = SCHEMA_VERSION
    """Version of this schema; a plan of another version is refused."""
    target: Target = Target.moeplan
    """The runtime that executes this plan; it is priced as that runtime runs it and refused
    where that runtime cannot run a field (plans.execution)."""
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    degrees: Degrees
    attention: AttentionStrategy = UlyssesAttention()
    ffn: FFNStrategy = EPFFN()
    stage_layers: tuple[OptionalLayers, ...] = Field(max_length=MAX_LAYERS)
    """Transformer layers of each model chunk in pipeline order (pp x vpp entries)."""
    micro_batch_size: Tokens = 1
    """Sequences per micro-batch per data-parallel replica."""
    schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    overlap: Overlap = Overlap.inter_intra_op
    recompute: Recompute = Recompute.selective
    recompute_modules: tuple[RecomputeModule, ...] = (RecomputeModule.core_attn,)
    """The modules selective recomputation reruns (plans.operators.MODULE_OPERATORS; under
    none or full: the default only); Megatron-Core's ``--recompute-modules``."""
    cross_entropy: CrossEntropy = CrossEntropy.materialized
    """How the last stage computes the LM head and loss (memory: cost_models.memory; time:
    cost_models.pipeline.cross_entropy_s). The search takes the kind whose head is priced
    faster where it fits: under eager kernels the materialized loss (the eager chunked loss
    measured 17 ms slower per 2-GPU pp2 Mixtral step, bench/results/h200/
    ab_loss_allocator_x2.json), under fused ones the chunked loss at the catalog's
    vocabularies (bench/results/h200/searched/)."""
    kernels: Kernels = Kernels.eager
    """The layers' memory-bound operators as eager PyTorch or fused regions (priced at
    cluster.efficiency.elementwise or fused_elementwise; the eager token permutation pass by
    pass, cost_models.dispatch). Eager is the default so a plan written before this field runs
    and is priced as it was measured; the search picks fused."""
    grad_sync_precision: Precision = Precision.bf16
    """Precision of data-parallel gradient reduce-scatter and parameter all-gather."""
    grad_sync_overlap: bool = True
    """Overlap the data-parallel gradient reduce-scatter (the all-reduce without ZeRO-1) with the
    last micro-batch's backward, bucket by bucket (Megatron-LM's ``--overlap-grad-reduce``); the
    ZeRO-1 parameter all-gather runs after the optimizer step either way."""
    grad_accumulation_fusion: bool = True
    """Weight-gradient GEMMs add into the main gradients in their epilogue (Megatron-LM's
    gradient-accumulation fusion); false: each micro-batch's gradients are added by a separate
    memory-bound pass."""
    expert_gemm: ExpertGemm | None = None
    """How the routed experts run their GEMMs: null, as plans.layout.expert_gemm's rule picks
    by rows per local expert; grouped or per_expert, as written (a plan measured on one path
    names it)."""
    optimizer_sharding: OptimizerSharding = OptimizerSharding.zero1
    optimizer_moments: Literal[Precision.fp32, Precision.bf16] = Precision.fp32
    """Precision of Adam's moments (exp_avg, exp_avg_sq): fp32, or bf16 as Megatron-Core's
    precision-aware optimizer keeps them (``--use-precision-aware-optimizer --exp-avg-dtype
    bf16 --exp-avg-sq-dtype bf16``, fp32 master weights); priced in memory and in the
    optimizer step's bytes (plans.specs.Optimizer.state_bytes)."""
    """Optimizer states sharded over each parameter's replicas (ZeRO-1) or kept in full."""
    cuda_graphs: CudaGraphs = CudaGraphs.none
    """The layer parts captured as CUDA graphs (Megatron-Core's ``--cuda-graph-scope``)."""
    prediction: Prediction | None = None

    @field_validator("schema_version", mode="before")
    @classmethod
    def _version(cls, v: object) -> object:
        if v != SCHEMA_VERSION:
            raise ValueError(
                f"this moeplan reads plans of schema_version {SCHEMA_VERSION}; the file has {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _check(self) -> Plan:
        d, m, t = self.degrees, self.model, self.training
        problems: list[str] = []
        if d.world != self.cluster.gpus:
            problems.append(
                f"degrees: pp x dp x cp x sp x tp = {d.pp} x {d.dp} x {d.cp} x {d.sp} x {d.tp} "
                f"= {d.world} must equal cluster.gpus ({self.cluster.gpus})"
            )
        problems += _attention_problems(self.attention, d, m, t)
        problems += _ffn_problems(self.ffn, d, m)
        if (self.cuda_graphs == CudaGraphs.layer and isinstance(self.ffn, EPFFN)
                and self.ffn.capacity_factor is None):
            problems.append("cuda_graphs: layer graphs whole layers, whose shapes must be "
                            "static; a dropless MoE layer's change every micro-batch (set "
                            "ffn.capacity_factor)")
        if len(self.stage_layers) != d.stages:
            problems.append(
                f"stage_layers: {len(self.stage_layers)} entries, need pp x vpp = "
                f"{d.pp} x {d.vpp} = {d.stages}"
            )
        elif sum(self.stage_layers) != m.layers:
            problems.append(
                f"stage_layers: sum {sum(self.stage_layers)} must equal model.layers ({m.layers})"
            )
        per_step = d.dp * self.micro_batch_size
        if t.global_batch % per_step:
            problems.append(
                f"micro_batch_size: training.global_batch ({t.global_batch}) must be a multiple "
                f"of dp x micro_batch_size ({d.dp} x {self.micro_batch_size} = {per_step})"
            )
        elif self.schedule == PipelineSchedule.interleaved_1f1b:
            if d.vpp < 2:
                problems.append(f"degrees.vpp: interleaved_1f1b needs vpp >= 2, got {d.vpp}")
            if self.num_micro_batches % d.pp:
                problems.append(
                    f"micro_batch_size: interleaved_1f1b needs micro-batches "
                    f"({self.num_micro_batches}) to be a multiple of pp ({d.pp})"
                )
        elif d.vpp != 1:
            problems.append(f"degrees.vpp: schedule 1f1b needs vpp = 1, got {d.vpp}")
        mods = self.recompute_modules
        if len(set(mods)) != len(mods) or not mods:
            problems.append("recompute_modules: give each module once, at least one")
        elif self.recompute != Recompute.selective and mods != (RecomputeModule.core_attn,):
            problems.append(f"recompute_modules: modules are for recompute selective, got "
                            f"recompute {self.recompute}")
        if self.grad_sync_precision == Precision.fp8 and t.precision != Precision.fp8:
            problems.append(
                "grad_sync_precision: fp8 gradient sync needs training.precision fp8, "
                f"got {t.precision}"
            )
        if self.prediction is not None and not problems:
            problems += self.prediction.problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ---- derived values -------------------------------------------------------------------------
    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step per pipeline: global_batch / (dp x micro_batch_size)."""
        return self.training.global_batch // (self.degrees.dp * self.micro_batch_size)

    # ---- the one plan notation (tables, exports, logs) --------------------------------------
    def layout_notation(self) -> str:
        """Degrees and strategies: `pp4 vpp2 dp2 sp8 ep8 a2a mbs1` (vpp shown when > 1; the
        attention group as sp / tp / cp; the FFN as `epN a2a`, `epN ag+rs`, `epN deepep` or
        `etpN`); the short names are plans.notation's, which parses them back."""
        d = self.degrees
        vpp = f" vpp{d.vpp}" if d.vpp > 1 else ""
        attention = f"{ATTENTION_TAGS[self.attention.kind]}{d.attention_group}"
        if isinstance(self.ffn, EPFFN):
            ffn = f"ep{d.ep} {DISPATCH_TAGS[self.ffn.dispatch]}"
            if self.ffn.capacity_factor is not None:
                ffn += f" cf{self.ffn.capacity_factor:g}"
        else:
            ffn = f"etp{d.etp}"
        return f"pp{d.pp}{vpp} dp{d.dp} {attention} {ffn} mbs{self.micro_batch_size}"

    def options_notation(self) -> str:
        """Schedule, overlap, recomputation, gradient sync: `i1f1b ov:inter+intra rc:sel
        sync:bf16`, plus `sync-after-bwd` / `no-gaf` / `ce:chunked` where the gradient
        sync is not overlapped, gradient accumulation not fused or the loss chunked,
        `k:fused` where the memory-bound operators are fused, `os:none` where the optimizer
        states are not sharded, `cg:SCOPE` where Megatron-Core graphs part of each layer and
        `t:megatron` where the plan is for a target other than moeplan (plans.notation)."""
        out = (f"{SCHEDULE_TAGS[self.schedule]} {Prefix.overlap}{OVERLAP_TAGS[self.overlap]} "
               f"{Prefix.recompute}{recompute_tag(self.recompute, self.recompute_modules)} "
               f"{Prefix.sync}{self.grad_sync_precision.value}")
        if not self.grad_sync_overlap:
            out += f" {SYNC_AFTER_BWD}"
        if not self.grad_accumulation_fusion:
            out += f" {NO_GAF}"
        if self.cross_entropy != CrossEntropy.materialized:
            out += f" {Prefix.cross_entropy}{self.cross_entropy.value}"
        if self.kernels != Kernels.eager:
            out += f" {Prefix.kernels}{self.kernels.value}"
        if self.optimizer_sharding != OptimizerSharding.zero1:
            out += f" {Prefix.optimizer_sharding}{OPTIMIZER_SHARDING_TAGS[self.optimizer_sharding]}"
        if self.cuda_graphs != CudaGraphs.none:
            out += f" {Prefix.cuda_graphs}{self.cuda_graphs.value}"
        if self.target != Target.moeplan:
            out += f" {Prefix.target}{self.target.value}"
        return out

    def summary(self) -> str:
        """The plan in one line: layout_notation() then options_notation()."""
        return f"{self.layout_notation()} {self.options_notation()}"


def _attention_problems(
    a: AttentionStrategy, d: Degrees, m: ModelSpec, t: TrainingSpec
) -> list[str]:
    out: list[str] = []
    others = {"ulysses_sp": ("tp", "cp"), "tp": ("sp", "cp"), "cp": ("sp", "tp")}[a.kind]
    for axis in others:
        if getattr(d, axis) != 1:
            out.append(
                f"degrees.{axis}: attention kind {a.kind} needs {axis} = 1, "
                f"got {getattr(d, axis)}"
            )
    n = d.attention_group
    if m.query_heads % n and a.kind != "cp":
        out.append(f"degrees: attention degree {n} must divide model.query_heads ({m.query_heads})")
    if a.kind == "tp":
        out += [f"degrees.tp ({n}) must divide model.{name} ({getattr(m, name)}): TP splits the "
                "vocabulary and the dense FFNs too (Megatron-LM's layout)"
                for name in ("vocab", "dense_ffn_hidden") if getattr(m, name) % n]
    if a.kind == "tp" and m.kv_heads % n:
        out.append(
            f"degrees.tp ({n}) must divide model.kv_heads ({m.kv_heads}): TP attention splits "
            "whole KV heads (Megatron-LM's rule; Ulysses SP replicates them instead)"
        )
    elif a.kind != "cp" and n > m.kv_heads and n % m.kv_heads:
        out.append(
            f"degrees: attention degree {n} above model.kv_heads ({m.kv_heads}) must be a "
            "multiple of it (KV heads are replicated)"
        )
    if a.kind != "cp" and n < m.kv_heads and m.kv_heads % n:
        out.append(f"degrees: attention degree {n} must divide model.kv_heads ({m.kv_heads})")
    shard = 2 * d.cp if isinstance(a, CPAttention) and a.zigzag else d.cp * d.sp * d.tp
    if t.seq_len % shard:
        out.append(
            f"training.seq_len ({t.seq_len}) must be a multiple of {shard} (sequence shards)"
        )
    return out


def _ffn_problems(f: FFNStrategy, d: Degrees, m: ModelSpec) -> list[str]:
    out: list[str] = []
    if f.kind == "ep" and d.etp != 1:
        out.append(f"degrees.etp: ffn kind ep needs etp = 1, got {d.etp}")
    if f.kind == "tp" and d.ep != 1:
        out.append(f"degrees.ep: ffn kind tp needs ep = 1, got {d.ep}")
    cf = getattr(f, "capacity_factor", None)
    if cf is not None and cf > m.experts / m.top_k:
        out.append(
            f"ffn.capacity_factor ({cf:g}) must be at most model.experts / model.top_k "
            f"({m.experts} / {m.top_k}), where no token is dropped; null means dropless"
        )
    if m.experts % d.ep:
        out.append(f"degrees.ep ({d.ep}) must divide model.experts ({m.experts})")
    if m.expert_ffn_hidden % d.etp:
        out.append(
            f"degrees.etp ({d.etp}) must divide model.expert_ffn_hidden ({m.expert_ffn_hidden})"
        )
    if m.shared_expert_ffn_hidden % d.etp:
        out.append(f"degrees.etp ({d.etp}) must divide model.shared_expert_ffn_hidden "
                   f"({m.shared_expert_ffn_hidden}): expert TP splits the shared experts too")
    return out
