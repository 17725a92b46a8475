"""Peak memory per GPU: weights, gradients, optimizer states (ZeRO-1 shards or whole, per
plan.optimizer_sharding), activations, the loss, buffers and the allocator's reserve.

The peak is taken over pipeline stages; the components reported are those of the peak stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from cost_models import megatron
from cost_models.compute import ACT_BYTES, FP32_BYTES
from cost_models.params import (
    StageParams,
    experts_in_gemm,
    head_in_gemm,
    largest_param,
    part_params,
    stage_layer_counts,
    stage_params,
)
from plans.enums import CHUNK_LOGITS, CrossEntropy, Kernels, OptimizerSharding, Target
from plans.execution import GRAD_SYNC_BUCKET_PARAMS
from plans.layout import tokens_per_rank
from plans.operators import DEFAULT_MODULES, LayerOperator, recomputed_operators
from plans.pipeline import peak_in_flight_chunks
from plans.plan import (
    EPFFN,
    Degrees,
    FFNStrategy,
    PipelineSchedule,
    Plan,
    Recompute,
    RecomputeModule,
)
from plans.results import THIS_RUNTIME, RuntimeFacts
from plans.specs import ClusterSpec, ModelSpec, Optimizer, Precision, TrainingSpec

LO = LayerOperator
GIB = 2**30
WEIGHT_BYTES = Precision.bf16.bytes
"""Model weights are held in bf16."""
def optimizer_step_workspace(model: ModelSpec, d: Degrees, p: StageParams,
                             sharding: OptimizerSharding, grad_bytes: int, fused: bool,
                             in_buckets: bool = True) -> float:
    """Bytes alive only during the optimizer step (runtime.parallel.optimizer): the slices of
    the sharded groups, where their reduce-scatters landed (fp32; for the fused AdamW in the
    main gradients' dtype), all at once; the parameters updated in full cast their main
    gradients to fp32 and step one bucket at a time (the fused AdamW reads them as they are).
    A bucket closes once it holds GRAD_SYNC_BUCKET_PARAMS, so it holds at most that many and
    its largest parameter. ``in_buckets`` False: every gradient cast at once (a result measured
    with ``eager_step_in_buckets: false``, plans.results.MEASURED_UNDER); so measured on H200
    (bench/results/gpu_fidelity_h200.json), 11.8 GiB of 1-GPU Mixtral-2L's 59.0 GiB peak was
    this workspace."""
    sharded, local = p.sharded_and_local(d, sharding)
    if fused:
        return grad_bytes * sharded
    bucket = GRAD_SYNC_BUCKET_PARAMS + largest_param(model, d) if in_buckets else local
    return FP32_BYTES * (sharded + min(local, bucket))


MEMORY_TERMS = {
    "params": "the weights this GPU holds (bf16)",
    "grads": "their main gradients (fp32 for an fp32 gradient sync, else bf16)",
    "optimizer": "optimizer states (fp32 master weights, moments in plan.optimizer_moments) "
                 "this GPU holds: its ZeRO-1 shard, or all of them without sharding",
    "activations": "activations kept for the backward, over the micro-batches in flight",
    "activation_working": "the working set of the layer being recomputed or back-propagated",
    "comm_buffers": "a layer's largest communication buffer (the dispatch's all-to-all or "
                    "all-gather, the TP all-gather)",
    "logits": "the loss's logits and their gradient (whole, or one chunk of the chunked "
              "loss)",
    "optimizer_step_workspace": "bytes alive only during the optimizer step (the reduced "
                                "gradient slices, gradients cast to fp32)",
    "allocator_reserve": "what the caching allocator reserves beyond the live bytes "
                         "(fragmentation), a share of the step's transients",
}
"""The memory breakdown's terms (MemoryBreakdown.components_bytes), in order."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the stage with the highest peak."""

    components_bytes: Mapping[str, float]
    """params, grads, optimizer (always resident); activations, comm_buffers, and either
    activation_working (the layer being recomputed or back-propagated) or logits (the loss),
    during forward/backward; optimizer_step_workspace (during the optimizer step); and the
    caching allocator's reserve. The peak is the resident states plus the larger of the two
    phases plus the reserve, so these do not add up to it."""
    peak_bytes: float
    capacity_bytes: float
    """What the plan must fit in (``memory_capacity_bytes``): the GPU's usable memory, or
    the job's memory cap."""
    stage: int
    """Pipeline stage of the peak."""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def reason(self) -> str | None:
        if self.fits:
            return None
        return (f"peak memory {self.peak_bytes / GIB:.1f} GiB > usable "
                f"{self.capacity_bytes / GIB:.1f} GiB on stage {self.stage}")


EP_LOAD = 1.1
"""Rows an EP rank receives, over the balanced share (k x tokens / ep), averaged over a
stage's layers: the memory suite measured up to 1.074 on a rank (single layers up to 1.22)
with the runtime's freshly initialised routers (bench/results/h200/memory, *_ep2_*)."""
BACKWARD_WORKING = 0.2
"""Back-propagating a layer holds, beside its activations, the gradients of its largest
operators' outputs: measured 1.18x the layer's activations at the backward peak of a
fully recomputed layer (mixtral2l_1gpu_mbs8_full)."""


@dataclass(frozen=True)
class Kept:
    """Bytes per token of a tensor (or tensors) of a layer that backward may need."""

    term: str
    """The term of ``layer_activation_terms`` it counts in."""
    bytes_per_token: float
    savers: frozenset[LayerOperator]
    """Operators whose backward reads it: kept while one of them is not recomputed."""
    producer: LayerOperator | None = None
    """The operator that makes it; None: the layer's input."""
    readers: frozenset[LayerOperator] = frozenset()
    """Operators that read it in forward: activation checkpointing keeps the inputs a
    recomputed operator reads from an operator that is not recomputed."""
    rerun_for_savers: bool = False
    """Not kept when its producer is recomputed, though its savers are not: their backward
    reads the producer's rerun (the experts' activation under moe_act, runtime.parallel.
    recompute; Megatron-Core's CheckpointWithoutOutput)."""

    def kept(self, recomputed: frozenset[LayerOperator]) -> bool:
        if self.rerun_for_savers and self.producer in recomputed:
            return False
        return bool(self.savers - recomputed) or (
            self.producer not in recomputed and bool(self.readers & recomputed))


def norm_kept_bytes(width: float, rows: float, fused: bool) -> float:
    """Bytes per token an RMSNorm keeps for backward over ``rows`` rows of ``width`` each:
    eager, an fp32 copy of its input and the fp32 normalised value (8 per element) beside the
    bf16 output the next operator reads (2); fused (runtime.kernels.rms_norm compiled), one
    bf16 tensor (2 per element) and the fp32 inverse norm of each row (4)."""
    return 2.0 * width + 4.0 * rows if fused else 10.0 * width


def _kept_tensors(model: ModelSpec, tp: int, sp: int, ep: int, etp: int, ffn: FFNStrategy,
                  dense: bool, micro_batch: int, kernels: Kernels = Kernels.eager,
                  linears_accumulate: bool = False) -> list[Kept]:
    """The tensors of one layer that this runtime's autograd graph can keep, per token, under
    the layer's degrees (``tp``, ``sp``, ``ep``, ``etp``). Fused kernels (runtime.kernels,
    torch.compile regions) keep less: an RMSNorm only its bf16 output (which the next GEMM
    keeps) and the fp32 inverse norm instead of fp32 copies of its input and normalised
    value; SwiGLU its two inputs and its output (the next GEMM's input), not the SiLU too."""
    fused = kernels == Kernels.fused
    swiglu = 6.0 if fused else 8.0  # bytes per element of the FFN's hidden width
    out = _attention_kept(model, tp, sp, micro_batch, fused, linears_accumulate)
    if dense:
        out.append(Kept("dense_ffn", swiglu * model.dense_ffn_hidden,
                        frozenset({LO.dense_fc13, LO.dense_swiglu, LO.dense_fc2})))
    else:
        out += _moe_kept(model, ep, etp, ffn, swiglu, fused)
    # the residual stream handed to the next layer (that layer's input)
    out.append(Kept("layer_output", 2.0 * model.hidden, frozenset({LO.ffn_residual}),
                    LO.ffn_residual))
    return out


def _attention_kept(model: ModelSpec, tp: int, sp: int, micro_batch: int, fused: bool,
                    linears_accumulate: bool) -> list[Kept]:
    """The layer's input, its norms and the attention block's kept tensors (_kept_tensors)."""
    h = model.hidden
    q, kv, v, o = model.q_dim, model.kv_dim, model.v_dim, model.attn_out_dim
    norm = norm_kept_bytes(h, 1, fused)
    out: list[Kept] = [
        Kept("layer_input", 2.0 * h, frozenset(), None,
             frozenset({LO.attn_norm, LO.attn_residual})),
        Kept("norms", norm, frozenset({LO.attn_norm})),
        Kept("norms", norm, frozenset({LO.ffn_norm})),
    ]
    if tp > 1:
        # torch's Linear makes (and keeps) a batch-major copy of a non-contiguous input per
        # projection; the accumulating Linear (grad_accumulation_fusion) keeps the input as
        # given, one tensor for the three (measured on H200: deepseek4l_tp2_etp2_mbs4's
        # attention kept 2 tp h per token at 2feebb8, 8 tp h at 5dc7a2f)
        copies = 3 if micro_batch > 1 and not linears_accumulate else 1
        out.append(Kept("attention_input", copies * 2.0 * tp * h,
                        frozenset({LO.qkv_gemm}), LO.tp_all_gather, frozenset({LO.qkv_gemm})))
    if model.qk_norm:
        # per-head norms of q and k; eager keeps the fp32 copies (the bf16 output is RoPE's
        # input, which keeps nothing), fused one bf16 tensor and each head's inverse norm
        heads = model.query_heads + model.kv_heads
        qk = norm_kept_bytes(q + kv, heads, True) if fused else 8.0 * (q + kv)
        out.append(Kept("qk_norm", qk, frozenset({LO.qk_norm})))
    if model.mla is not None:
        # the latents the up-projections keep and their RMSNorms (MLA's q and kv latents)
        a = model.mla
        latents = a.q_lora_rank + a.kv_lora_rank
        latent_norm = norm_kept_bytes(latents, 2, fused)
        out.append(Kept("mla_latents", 2.0 * latents + latent_norm,
                        frozenset({LO.qkv_up_gemm})))
    ulysses = sp > 1
    out += [
        # q, k, v as the core receives them (no backward keeps them: the core keeps its own)
        Kept("attention_core", 2.0 * (q + kv + v), frozenset(),
             LO.sp_a2a_qkv if ulysses else (LO.qkv_up_gemm if model.mla else LO.qkv_gemm),
             frozenset({LO.flash_attn})),
        # RoPE'd q, k and v expanded to the query heads, and the fp32 log-sum-exp
        Kept("attention_core", 4.0 * q + 2.0 * o + 4.0 * model.query_heads,
             frozenset({LO.flash_attn})),
        # the core's output, which the out projection keeps too unless an all-to-all follows
        Kept("attention_core", 2.0 * o,
             frozenset({LO.flash_attn} if ulysses else {LO.flash_attn, LO.out_gemm}),
             LO.flash_attn),
    ]
    if ulysses:
        out.append(Kept("attention_core", 2.0 * o, frozenset({LO.out_gemm}), LO.sp_a2a_out))
    return out


def _moe_kept(model: ModelSpec, ep: int, etp: int, ffn: FFNStrategy, swiglu: float,
              fused: bool) -> list[Kept]:
    """An MoE FFN's kept tensors (_kept_tensors): the router's, the expert rows, the shared
    experts'. Per routed row the experts keep, each tensor for the operator whose backward
    reads it: the dispatched row (fc1 and fc3, 2 h), fc1's and fc3's outputs (the SwiGLU,
    4 F), eagerly SiLU's output (the SwiGLU's product, 2 F) and the SwiGLU's output (fc2,
    2 F). The combine keeps the rows it weights (2 k h), and eagerly the weighted rows too,
    which the index-add's autograd node saves as its source (2 k h); the fused combine weights
    and sums in one compiled region whose backward reads the rows only
    (runtime.kernels._fused_weighted_scatter)."""
    h = model.hidden
    combine = 2.0 * h if fused else 4.0 * h
    k = model.top_k * (ffn.capacity_factor if isinstance(ffn, EPFFN)
                       and ffn.capacity_factor else 1.0)
    out = [Kept("router", 4.0 * model.experts + 12.0 * model.top_k,
                frozenset({LO.router_topk}))]
    f = model.expert_ffn_hidden
    if isinstance(ffn, EPFFN):
        moved = ffn.dispatch.moves_routed_copies
        load = EP_LOAD if ep > 1 else 1.0
        rows, dispatched = k * load, LO.ep_dispatch if moved else LO.dispatch_scatter
        width = rows * f  # FFN elements per token
        # the all-to-all returns k rows per token, the all-gather's rows stay at the load
        combined = (k if moved else k * load, LO.ep_combine if moved else LO.expert_fc2,
                    LO.combine_unpermute if moved else LO.combine_gather)
    else:  # expert TP: every rank's tokens gathered (etp k rows a token), F / etp wide
        rows, dispatched = k * etp, LO.dispatch_scatter
        width = k * f
        combined = (k * etp, LO.expert_fc2, LO.combine_gather)
    out += [
        Kept("expert_rows", rows * 2.0 * h, frozenset({LO.expert_fc13}), dispatched),
        # kept for the SwiGLU, and for its rerun when moe_act recomputes it
        Kept("expert_rows", width * 4.0, frozenset({LO.expert_swiglu}), LO.expert_fc13,
             frozenset({LO.expert_swiglu})),
        Kept("expert_rows", width * 2.0, frozenset({LO.expert_fc2}), LO.expert_swiglu,
             rerun_for_savers=True),
        Kept("expert_rows", combined[0] * combine, frozenset({combined[2]}), combined[1]),
    ]
    if not fused:
        out.append(Kept("expert_rows", width * 2.0, frozenset({LO.expert_swiglu}),
                        LO.expert_swiglu))
    if model.shared_experts:
        out.append(Kept("dense_ffn",
                        swiglu * model.shared_experts * model.shared_expert_ffn_hidden,
                        frozenset({LO.shared_fc13, LO.shared_swiglu, LO.shared_fc2})))
    return out


@lru_cache(maxsize=65536)
def _terms_per_token(model: ModelSpec, tp: int, sp: int, ep: int, etp: int, ffn: FFNStrategy,
                     recomputed: frozenset[LayerOperator], dense: bool, micro_batch: int,
                     kernels: Kernels, linears_accumulate: bool
                     ) -> tuple[tuple[str, float], ...]:
    """The bytes per token of ``layer_activation_terms`` with the operators ``recomputed``,
    keyed on the degrees a layer's kept tensors depend on."""
    terms: dict[str, float] = {}
    for t in _kept_tensors(model, tp, sp, ep, etp, ffn, dense, micro_batch, kernels,
                           linears_accumulate):
        if t.kept(recomputed):
            terms[t.term] = terms.get(t.term, 0.0) + t.bytes_per_token
    return tuple(terms.items())


def layer_activation_terms(
    model: ModelSpec, tokens: float, degrees: Degrees, ffn: FFNStrategy, policy: Recompute,
    dense: bool, micro_batch: int = 1, kernels: Kernels = Kernels.eager,
    linears_accumulate: bool = False, modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES,
) -> dict[str, float]:
    """Bytes one layer keeps for backward per micro-batch, ``tokens`` per rank, by the tensor
    this runtime's autograd graph saves (runtime/model.py, runtime/moe.py, runtime/parallel/);
    each term checked against the bytes each module keeps on H200 (bench/memory/memory_suite.py,
    module_kept_bytes; tests/cost_models/test_cm_memory.py holds them to it). A tensor counts
    unless every operator that keeps it is recomputed (``plans.operators.recomputed_operators``
    of the policy and its modules), and the inputs the recomputed operators read from the
    others count (checkpointing keeps them).

    - norms: each RMSNorm keeps its fp32 input copy and fp32 normalised value and hands a bf16
      output to the next operator: 10 h per norm;
    - attention_input (TP attention): the all-gathered sequence, one batch-major copy per
      Q/K/V projection when the micro-batch has more than one sequence, one in all when the
      Linear layers accumulate in their GEMMs (``linears_accumulate``): 2 tp h each;
    - qk_norm (Qwen3): the per-head RMSNorms of q and k keep their fp32 input and normalised
      copies, 8 (q_dim + kv_dim); fused, one bf16 copy and each head's inverse norm;
    - mla_latents (MLA): the q and kv latents the up-projections keep (2 per element) and their
      RMSNorms (as the layer norms: 10 per element eager);
    - attention_core: RoPE'd q, k and v expanded to the query heads (GQA repeat) and the SDPA
      output, 8 q_dim (v and the output at attn_out_dim under MLA), plus the fp32 log-sum-exp;
      Ulysses adds the all-to-all'd output the out projection keeps (2 q_dim). Recomputing the
      core keeps its inputs (q, k, v) and the out projection's input instead;
    - router: fp32 probabilities (4 E) and the top-k indices and weights (12 k);
    - expert rows: the dispatched rows the grouped GEMMs keep (2 k h) and the SwiGLU
      intermediates (fc1, silu, fc3, product: 8 k F; fused 6 k F, no silu), times the EP
      rank's load; recomputing the experts' activation (moe_act) keeps fc1's and fc3's
      outputs only (4 k F); combine keeps the returned rows (2 k h) and, eagerly, the
      weighted rows its scatter-add keeps (2 k h); the all-gather dispatcher keeps both at
      the rank's load; expert TP at etp;
    - dense_ffn: dense layers and shared experts, 8 F (the input is the norm's output);
    - layer_output: the residual stream handed to the next layer (2 h);
    - layer_input: recomputing the whole layer keeps its input (2 h) only."""
    d = degrees
    return {name: b * tokens for name, b in _terms_per_token(
        model, d.tp, d.sp, d.ep, d.etp, ffn, recomputed_operators(policy, modules), dense,
        micro_batch, kernels, linears_accumulate)}


def layer_activation_bytes(
    model: ModelSpec, tokens: float, degrees: Degrees, ffn: FFNStrategy, policy: Recompute,
    dense: bool, micro_batch: int = 1, kernels: Kernels = Kernels.eager,
    linears_accumulate: bool = False, modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES,
) -> float:
    """The sum of ``layer_activation_terms``."""
    d = degrees
    return sum(b * tokens for _, b in _terms_per_token(
        model, d.tp, d.sp, d.ep, d.etp, ffn, recomputed_operators(policy, modules), dense,
        micro_batch, kernels, linears_accumulate))


LOSS_BYTES_PER_LOGIT = 12
"""Peak bytes per logit of the materialized loss (runtime.loss.materialized_cross_entropy:
bf16 logits, float(), cross_entropy): in forward the bf16 logits, their fp32 copy and the fp32
log-probabilities (10); in backward the saved log-probabilities, their gradient and the
logits' fp32 gradient (12). Measured: 11.9 per logit on H200 (qwen4l_1gpu_mbs4)."""
CHUNK_BYTES_PER_LOGIT = {Kernels.eager: 10, Kernels.fused: 2}
"""Peak bytes per logit of one chunk of the chunked loss (runtime.loss), per kernel set:
eager, its logits in the parameter dtype and in fp32, the fp32 gradient computed in place,
cast back (2); fused, the logits in the parameter dtype, which the compiled region overwrites
with their gradient (runtime.kernels.cross_entropy_grad_over)."""
GRAD_BESIDE_LOGITS = 2
"""Bytes per logit more of a fused chunk whose gradient is written beside its logits, not over
them (a result's ``loss_grad_over_logits`` false, plans.results.RuntimeFacts)."""
EMBEDDING_BYTES_PER_TOKEN_H = 2
"""The embedding's output, which the first layer keeps (2 h per token)."""


def loss_bytes(model: ModelSpec, tokens: float, kind: CrossEntropy,
               kernels: Kernels = Kernels.eager, target: Target = Target.moeplan,
               head_in_gemm: bool = False, grad_over_logits: bool = True) -> float:
    """Peak bytes of the last stage's LM head and loss for one micro-batch of ``tokens``.

    materialized: 12 bytes per logit; Megatron-Core's fused loss 2 (target megatron,
    cost_models.megatron.LOSS_BYTES_PER_LOGIT). chunked (runtime.loss): the hidden states'
    gradient it computes in forward and keeps to backward (2 T h) beside the larger of its
    two phases. Over the chunks, one chunk's logits (CHUNK_BYTES_PER_LOGIT[kernels] x
    min(T V, CHUNK_LOGITS)) and, unless the head's weight gradient goes into its main
    gradient inside the GEMMs (``head_in_gemm``, cost_models.params.head_in_gemm: already
    in ``grads``), the weight gradient summed in fp32 (at most 4 V h) and, eagerly, the
    chunk's weight-gradient GEMM output before its add (2 V h); at the end of the forward,
    the sum and its scaled cast to the weight's dtype (6 V h), which alone the backward
    keeps."""
    v, h = model.vocab, model.hidden
    if target == Target.megatron:
        head = megatron.LOSS_BYTES_PER_LOGIT * tokens * v
    elif kind == CrossEntropy.materialized:
        head = LOSS_BYTES_PER_LOGIT * tokens * v
    else:
        per_logit = CHUNK_BYTES_PER_LOGIT[kernels] + (
            GRAD_BESIDE_LOGITS if kernels == Kernels.fused and not grad_over_logits else 0)
        logits = per_logit * min(tokens * v, CHUNK_LOGITS)
        if head_in_gemm:
            weight_grad, kept = 0.0, 0.0
        else:
            weight_grad = 4 * v * h + (2 * v * h if kernels == Kernels.eager else 0)
            kept = 6 * v * h
        head = 2 * tokens * h + max(logits + weight_grad, kept)
    # the final RMSNorm: the runtime's (Megatron-Core's as eager: cost_models.megatron)
    final_norm = norm_kept_bytes(h, 1, kernels == Kernels.fused and target == Target.moeplan)
    return head + (final_norm + EMBEDDING_BYTES_PER_TOKEN_H * h) * tokens


ALLOCATOR_RESERVE = 0.03
"""Reserved over allocated bytes of the caching allocator (expandable segments,
runtime.memory.configure_allocator), per byte of the step's transients (above the resident
states), beside LOSS_RESERVE."""
LOSS_RESERVE = 0.22
"""Reserved over allocated bytes per byte of the loss's transients: its blocks are the step's
largest and shortest-lived, and the pools they leave behind fragment. Measured on H200
(docs/memory.md): 0.17 to 0.22 of the materialized loss's bytes; the two constants keep every
plan of the suite within -3% .. +10%."""


def in_flight_micro_batches(stage: int, pp: int, vpp: int, micro_batches: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the whole stage:
    the most chunk forwards awaiting their backward in the stage's action list
    (plans.pipeline.peak_in_flight_chunks), each 1/vpp of the stage. 1F1B: pp - i warm-up
    forwards on stage i; interleaved (Megatron-LM schedules.get_num_warmup_microbatches;
    Korthikanti et al. 2022, Sec. 4.2.3): 2(pp - i - 1) + (vpp - 1) pp + 1 chunk forwards, or
    all of them when micro_batches = pp."""
    return peak_in_flight_chunks(pp, vpp, micro_batches, stage) / vpp


def _buffer_bytes(model: ModelSpec, tokens: float, d: Degrees, ffn: FFNStrategy) -> float:
    """The largest communication buffer of a layer: all-to-all dispatch k x tokens x h, an
    all-gather n x tokens x h (EP all-gather dispatch, expert TP, attention TP)."""
    row = model.hidden * ACT_BYTES
    if isinstance(ffn, EPFFN) and ffn.dispatch.moves_routed_copies:
        dispatch = model.top_k * (ffn.capacity_factor or 1.0) * tokens * row
    else:
        dispatch = max(d.ep, d.etp) * tokens * row
    return max(dispatch, d.tp * tokens * row)


def grad_bytes_per_param(grad_precision: Precision) -> int:
    """Main gradients accumulate in fp32 for an fp32 sync, in bf16 for a bf16 or fp8 one."""
    return FP32_BYTES if grad_precision == Precision.fp32 else Precision.bf16.bytes


@dataclass(frozen=True)
class _LayerBytes:
    """The per-layer terms of ``_memory``, which the stage split, the sync and the pipeline and
    data-parallel degrees leave alone (_layer_degrees)."""

    stored: tuple[float, float]
    """Bytes one (MoE, dense) layer keeps for backward per micro-batch under the policy."""
    working: tuple[float, float]
    """The (MoE, dense) layer's working set while recomputed or back-propagated."""
    buffers: float
    logits: float


@lru_cache(maxsize=4096)
def _layer_degrees(d: Degrees) -> Degrees:
    """The degrees one layer's memory terms read (tp, sp, cp, ep, etp), with one pipeline stage
    and the fewest data replicas the invariant allows: one _layer_bytes key for the layouts
    that differ in pp, vpp and dp only."""
    inner = d.cp * d.sp * d.tp
    return Degrees(sp=d.sp, tp=d.tp, cp=d.cp, ep=d.ep, etp=d.etp,
                   dp=d.ep * d.etp // math.gcd(d.ep * d.etp, inner))


@lru_cache(maxsize=65536)
def _layer_bytes(model: ModelSpec, degrees: Degrees, ffn: FFNStrategy, seq_len: int, batch: int,
                 policy: Recompute, cross_entropy: CrossEntropy, kernels: Kernels, chunks: int,
                 experts_accumulate_in_gemm: bool, linears_accumulate: bool, target: Target,
                 precision: Precision, modules: tuple[RecomputeModule, ...],
                 head_accumulates_in_gemm: bool, grad_over_logits: bool) -> _LayerBytes:
    d = degrees
    tokens = tokens_per_rank(batch, seq_len, d.attention_group)
    if target == Target.megatron:
        per_layer = {(dense, pol): tokens * megatron.kept_bytes_per_token(
            model, d, precision, pol, dense, modules) for dense in (False, True)
            for pol in (policy, Recompute.none)}
    else:
        per_layer = {
            (dense, pol): layer_activation_bytes(model, tokens, d, ffn, pol, dense, batch,
                                                 kernels, linears_accumulate, modules)
            for dense in (False, True) for pol in (policy, Recompute.none)
        }
    working_of = {dense: (1 + BACKWARD_WORKING) * per_layer[dense, Recompute.none]
                  - per_layer[dense, policy] for dense in (False, True)}
    # A chunked MoE layer (inter-operator overlap) uses each expert weight once per chunk:
    # autograd holds one chunk's weight gradient in the node's input buffer until the next
    # chunk's arrives and sums them, so the layer's backward holds one more expert weight
    # gradient (bf16, the parameters' dtype) than the serial layer's; none when the experts'
    # GEMMs add into the main gradients (no weight gradient is made).
    if chunks > 1 and not experts_accumulate_in_gemm:
        working_of[False] += WEIGHT_BYTES * part_params(model, d).moe_layer.expert
    # the last stage's loss of one micro-batch (b s / (sp cp tp) rows x vocab) and final norm
    return _LayerBytes((per_layer[False, policy], per_layer[True, policy]),
                       (working_of[False], working_of[True]),
                       _buffer_bytes(model, tokens, d, ffn),
                       loss_bytes(model, tokens, cross_entropy, kernels, target,
                                  head_accumulates_in_gemm, grad_over_logits))


@lru_cache(maxsize=65536)
def _resident(model: ModelSpec, degrees: Degrees, stage_layers: tuple[int, ...],
              grad_precision: Precision, opt: Optimizer, moments: Precision,
              sharding: OptimizerSharding, fused_step: bool, step_in_buckets: bool
              ) -> tuple[tuple[tuple[float, float, float], float, float], ...]:
    """Per stage, the resident states (weights, main gradients, optimizer states), their sum
    and the optimizer step's workspace: what the stage's parameters hold whatever the
    activations."""
    d = degrees
    grad_bytes = grad_bytes_per_param(grad_precision)
    opt_bytes = opt.state_bytes(moments)
    # stages holding the same parameters hold the same states and step workspace
    resident: dict[StageParams, tuple[tuple[float, float, float], float, float]] = {}
    for p in stage_params(model, d, stage_layers):
        if p not in resident:
            shard = p.optimizer_shard(d, sharding)  # the states (and update) this GPU holds
            states = (WEIGHT_BYTES * p.total, grad_bytes * p.total, opt_bytes * shard)
            resident[p] = (states, sum(states),
                           optimizer_step_workspace(model, d, p, sharding, grad_bytes,
                                                    fused_step, step_in_buckets))
    return tuple(resident[p] for p in stage_params(model, d, stage_layers))


@lru_cache(maxsize=65536)
def _memory(model: ModelSpec, degrees: Degrees, ffn: FFNStrategy, stage_layers: tuple[int, ...],
            seq_len: int, batch: int, micro_batches: int, schedule: PipelineSchedule,
            policy: Recompute, grad_precision: Precision, opt: Optimizer, capacity: float,
            cross_entropy: CrossEntropy, sharding: OptimizerSharding,
            kernels: Kernels = Kernels.eager, chunks: int = 1,
            experts_accumulate_in_gemm: bool = False,
            linears_accumulate: bool = False, facts: RuntimeFacts = THIS_RUNTIME,
            target: Target = Target.moeplan, precision: Precision = Precision.bf16,
            modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES,
            moments: Precision = Precision.fp32,
            head_accumulates_in_gemm: bool = False) -> MemoryBreakdown:
    d = degrees
    vpp = d.vpp if schedule == PipelineSchedule.interleaved_1f1b else 1
    per = _layer_bytes(model, _layer_degrees(d), ffn, seq_len, batch, policy, cross_entropy,
                       kernels, chunks, experts_accumulate_in_gemm, linears_accumulate, target,
                       precision, modules,
                       head_accumulates_in_gemm and facts.head_grad_in_main_grad,
                       facts.loss_grad_over_logits)
    (stored_moe, stored_dense), (working_moe, working_dense) = per.stored, per.working
    buffers, logits = per.buffers, per.logits
    layers = stage_layer_counts(model, stage_layers, d.pp)
    resident = _resident(model, d, stage_layers, grad_precision, opt, moments, sharding,
                         opt.runs_fused(kernels), facts.eager_step_in_buckets)
    last = d.pp - 1

    # Peak of stage i and its components (MEMORY_TERMS): the resident states plus the larger of
    # the training transients and the optimizer-step workspace (never alive at once), plus the
    # allocator's reserve on that. In training, the loss (last stage) and the recomputed or
    # back-propagated layer's working set come one after the other, so the larger counts.
    peak_stage, peak, parts = 0, -1.0, ()
    for i, ((moe, dense), (states, held, step)) in enumerate(zip(layers, resident,
                                                                 strict=True)):
        if 0 < i < last and layers[i] == layers[i - 1] and resident[i] is resident[i - 1]:
            # the stage before it holds the same and at least as many micro-batches in
            # flight (in_flight_micro_batches falls stage by stage): this one never peaks first
            continue
        stored = moe * stored_moe + dense * stored_dense
        activations = stored * in_flight_micro_batches(i, d.pp, vpp, micro_batches)
        working = (working_dense if moe == 0 else working_moe) if moe + dense else 0.0
        loss = logits if i == last else 0.0
        transient = max(activations + buffers + max(working, loss), step)
        reserve = ALLOCATOR_RESERVE * transient + LOSS_RESERVE * loss
        total = held + transient + reserve
        if total > peak:  # the first on a tie
            peak_stage, peak = i, total
            parts = (*states, activations, working, buffers, loss, step, reserve)
    return MemoryBreakdown(MappingProxyType(dict(zip(MEMORY_TERMS, parts, strict=True))), peak,
                           capacity, peak_stage)


def gpu_usable_bytes(cluster: ClusterSpec) -> float:
    """What one GPU offers a job: gpu.hbm_gib x 2^30 x efficiency.memory_usable (the rest
    stays free for the CUDA context, NCCL's buffers and the prediction's error)."""
    return cluster.gpu.hbm_gib * GIB * cluster.efficiency.memory_usable


def memory_capacity_bytes(cluster: ClusterSpec, training: TrainingSpec) -> float:
    """The bytes per GPU a plan must fit in: the GPU's usable memory, or the job's
    training.memory_cap_gib where that is lower."""
    usable = gpu_usable_bytes(cluster)
    cap = training.memory_cap_gib
    return usable if cap is None else min(usable, cap * GIB)


def memory_breakdown(plan: Plan, facts: RuntimeFacts = THIS_RUNTIME) -> MemoryBreakdown:
    """Peak bytes per GPU of ``plan`` and the capacity it must fit in, as a runtime of
    ``facts`` runs it (a result's, plans.results.RuntimeFacts.of; by default this tree's)."""
    c, t = plan.cluster, plan.training
    capacity = memory_capacity_bytes(c, t)
    return _memory(
        plan.model, plan.degrees, plan.ffn, plan.stage_layers, t.seq_len, plan.micro_batch_size,
        plan.num_micro_batches, plan.schedule, plan.recompute, plan.grad_sync_precision,
        t.optimizer, capacity, plan.cross_entropy, plan.optimizer_sharding, plan.kernels,
        megatron.moe_chunks(plan), experts_in_gemm(plan),
        plan.grad_accumulation_fusion, facts, plan.target, t.precision,
        plan.recompute_modules, plan.optimizer_moments, head_in_gemm(plan, plan.cross_entropy),
    )
