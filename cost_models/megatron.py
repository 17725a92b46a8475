"""A megatron-target plan as Megatron-Core runs it, where that differs from moeplan's runtime:
the host's kernel launches and the dropless dispatcher's wait on the device, CUDA graphs, the
EP all-to-all overlap between micro-batches, the experts' fp8 padding, biases and clamped
activation, YaRN's unfused RoPE, and the tensors its layers keep for backward.
Pure functions of the plan; each is read only for ``plan.target == Target.megatron``
(cost_models.evaluate, cost_models.memory).

The launch counts below are priors: read off Megatron-Core 0.15's TransformerLayer, MoELayer,
TopKRouter, MoEAlltoAllTokenDispatcher and TEGroupedMLP with TransformerEngine 2.x (fused
RoPE, fused attention, fused permutation and router, TE's GroupedLinear), not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType

from cost_models import comm
from cost_models.layer import LayerTiming, layer_key, layer_timing_for
from cost_models.layer_graph import ROPE_BYTES
from cost_models.volumes import CommKind
from plans.enums import (
    CudaGraphs,
    Dispatch,
    Fp8Recipe,
    LinearBias,
    Overlap,
    Precision,
    Recompute,
    RecomputeModule,
    Target,
)
from plans.layout import kv_heads_sent, tokens_per_rank
from plans.layout import moe_chunks as layout_moe_chunks
from plans.operators import DEFAULT_MODULES
from plans.plan import EPFFN, Degrees, Plan
from plans.specs import ModelSpec

HOST_US_PER_LAUNCH = 40.0
"""Host time of one kernel Megatron-Core launches from Python: PyTorch's dispatch of the
operation, autograd's record of it, TransformerEngine's module logic around it and the
launch. Fitted (one number) to the two published runs where the host binds alone, Qwen3-30B-A3B
and Qwen3-235B-A22B on DGX-B200 at micro-batch 1 (Megatron-Bridge 25.11,
bench/data/megatron_bridge_25_11.yaml; the value that gives them errors of equal size and
opposite sign, -5% and +5%, with the experts' fp8 padding priced); held out: DeepSeek-V3
on DGX-B200 at micro-batch 1 and every other row (docs/fidelity_at_scale.md). Its floor,
17.6 us, is measured here: moeplan's own eager layer operators, one PyTorch op each, on H200
(``elementwise_launch_us``, bench/results/calibration_h200.json). Taken for every host (x86
DGX, Grace) alike."""
D2H_SYNC_US = 10.0
"""A wait of the host on the device: the small copy (the split sizes to the host, or the
clamped activation's offset to the device, ``ACT_CLAMP``) and the host's wake-up before it
launches again, the GPU idle meanwhile. A prior (the order of one launch and one small
copy)."""


@dataclass(frozen=True)
class Launches:
    """Kernels one pass of a layer part launches from the host (forward, backward)."""

    fwd: int
    bwd: int

    def __add__(self, other: Launches) -> Launches:
        return Launches(self.fwd + other.fwd, self.bwd + other.bwd)


NONE = Launches(0, 0)
ATTENTION = Launches(12, 24)
"""The attention block: fused input norm + QKV GEMM (2), q/k norms (2), fused RoPE (2),
fused attention with its preparation (3), output projection (1), bias-dropout-add (1),
the residual (1); backward about twice as many (data and weight gradients)."""
ROUTER = Launches(12, 24)
"""Pre-MLP norm, the router's gate GEMM, the fused top-k / softmax, the load-balancing loss
and statistics (``moe_router_fusion``): CUDA graph scope ``moe_router``."""
PREPROCESS = Launches(6, 0)
"""The dispatcher's preprocessing: tokens per expert, their all-gather over the EP group and
the split sizes (scope ``moe_preprocess``); nothing in backward."""
DISPATCH_COMBINE = Launches(8, 8)
"""Fused permute (2), all-to-all, chunk sort; chunk unsort, all-to-all, fused un-permute
with the routing weights; never graphed (their sizes change every micro-batch)."""
EXPERTS_FIXED = Launches(3, 6)
"""TEGroupedMLP's splits, SwiGLU (``bias_activation_fusion``) and concatenations."""
PER_EXPERT_GEMMS = Launches(2, 4)
"""TE's GroupedLinear runs one GEMM per local expert: fc1 and fc2 forward, their data and
weight gradients backward."""
DENSE_FFN = Launches(6, 12)
"""A dense layer's MLP: fused norm + fc1, SwiGLU, fc2, the residual."""
TP_COLLECTIVES = Launches(2, 2)
"""Under TP > 1, the sequence-parallel all-gather and reduce-scatter of the attention."""
EXPERT_BIAS = Launches(2, 4)
"""TEGroupedMLP's fc2 bias (``_apply_bias``; its fc1 bias is TE's GEMM epilogue), per local
expert: the bias times the expert's routing weights and its sum with the expert's output;
backward the two products with the output gradient and their sums (the bias's and the
routing weights' gradients). Once per layer beside them (``EXPERT_BIAS_CONCAT``): the
experts' outputs concatenated; backward the split's gradients (fc2's output and the routing
weights) concatenated."""
EXPERT_BIAS_CONCAT = Launches(1, 2)
FP8_PADDING = Launches(3, 3)
"""TEGroupedMLP's fp8 padding (``fp8_padded``): the routed rows and their routing weights
padded (TE's Fp8Padding, once each) and the output unpadded (Fp8Unpadding); in backward the
mirror copies of their gradients."""
ACT_CLAMP = Launches(4, 9)
"""GPT-OSS's clamped activation (``act_clamped``), in eager PyTorch before the fused
quick-GEGLU, read off Megatron-Core 0.15.3 fusions/fused_bias_geglu.py
weighted_bias_quick_geglu_impl (lines 424-434): forward the gate half clamped, the linear
half clamped, the two concatenated, and the linear offset made a device tensor
(``torch.tensor(offset, device=...)``: a copy from pageable host memory, after which PyTorch
synchronises the stream, ``at::cuda::memcpy_and_sync``, pytorch/pytorch#120996); backward,
from PyTorch's clamp_backward (torch/csrc/autograd/FunctionsManual.cpp), the gate half's
zero fill, ``<=`` and ``where``, the linear half's zero fill, ``>=``, ``<=``, ``and`` and
``where``, and the chunk's backward concatenating the two halves' gradients."""
ACT_CLAMP_BYTES = (16, 30)
"""Bytes per routed row and expert-FFN column (fc1's output is 2 F wide) of ``ACT_CLAMP``'s
kernels, bf16 values and bool masks: forward each clamp reads and writes its half (2 x 4),
the concatenation reads and writes both (8); backward the gate half's mask (read 2, write 1)
and where (read 3, write 2), 8; the linear half's two comparisons (3 each), their and (3) and
where (5), 14; the concatenation of the gradients, 8."""
FC1_SHARE = 2 / 3
"""fc1's share of the experts' forward (its output 2 F wide against fc2's F): the part of
``expert_compute`` before the clamped activation's wait."""
ROPE_UNFUSED = Launches(12, 7)
"""Megatron-Core's unfused RoPE (``rope_unfused``), per call, in place of TransformerEngine's
fused RoPE (one kernel each way, counted in ``ATTENTION``); read off Megatron-Core 0d8e0714
(the 25.11 container's Megatron-LM; 0.15.3 the same function)
models/common/embeddings/rope_utils.py ``_apply_rotary_pos_emb_bshd`` (lines 92-126), the
tensor t a [s, b, heads, d] q or k: forward cos and sin of the angles, each times the
attention factor and cast to t's dtype (6 kernels over the [s, d] table), t x cos,
``_rotate_half``'s negation and concatenation, x sin, their sum and the concatenation with
the (empty) unrotated part (6 over t); backward (autograd) the two products with the
gradient, the negation's, the chunk's concatenation, the two paths' sum, the unrotated
slice's zero-filled gradient (``slice_backward``) and its sum (7)."""
ROPE_UNFUSED_BYTES = (24, 28)
"""Bytes per element of q and k (bf16) of ``ROPE_UNFUSED``'s kernels over t, forward and
backward (the tables' kernels move a position's bytes, not a head's: not counted): forward
the products 4 each, the negation 2 (half of t read, half written), its concatenation 4,
the sum 6 and the last concatenation 4; backward the products 4 each, the negation 2, the
concatenation 4, the sum 6, the zero fill 2 and its sum 6."""
ROPE_CALLS = 2
"""Calls of the RoPE per attention pass: q and k, one each (transformer/attention.py lines
837 and 850, Megatron-Core 0d8e0714: split_qkv, as ``fused_single_qkv_rope`` is off)."""


RERUN_LAUNCHES = {
    RecomputeModule.core_attn: 3, RecomputeModule.layernorm: 1, RecomputeModule.moe_act: 1,
    RecomputeModule.mla_up_proj: 4, RecomputeModule.mlp: DENSE_FFN.fwd,
    RecomputeModule.shared_experts: DENSE_FFN.fwd, RecomputeModule.moe: 0}
"""Kernels a selective module's rerun launches in backward (priors, as the counts above):
the fused attention with its preparation; the pre-MLP norm (the input norm is fused into the
QKV GEMM); the experts' fused SwiGLU; MLA's two up-projection GEMMs and their RoPE; a dense
or shared MLP's forward; moe reruns the router, the preprocessing and everything after the
wait (counted in ``launches``)."""


def _graphed(part: Launches, graphed: bool) -> Launches:
    """A graphed part replays as one launch per pass."""
    return Launches(min(part.fwd, 1), min(part.bwd, 1)) if graphed else part


def _quantized(gemms: int, plan: Plan) -> Launches:
    """fp8 (TransformerEngine) quantises each GEMM's input in forward and its output's
    gradient in backward: one more launch per GEMM each way."""
    return Launches(gemms, gemms) if plan.training.precision == Precision.fp8 else NONE


@dataclass(frozen=True)
class LayerLaunches:
    """One layer's host launches per micro-batch, split at the dispatcher's wait."""

    before_wait: Launches
    """Attention, router and the dispatcher's preprocessing (all of a dense layer)."""
    after_wait: Launches
    """Permutation, all-to-alls, experts and combine: launched once the host has the split
    sizes, onto an idle GPU."""
    to_act_wait: int = 0
    """Of ``after_wait``'s forward launches, those before the clamped activation's wait
    (``act_clamped``): the permutation, the dispatch, fc1's GEMMs with their quantisations
    and fp8 padding, and the clamp; 0 without that wait."""


def launches(plan: Plan, dense: bool = False) -> LayerLaunches:
    """Kernels one layer launches from the host per micro-batch, less what CUDA graphs
    replay; full recomputation reruns the forward's in backward. A layerwise graph
    (``CudaGraphs.layer``) replays the whole layer as one launch each way."""
    g = plan.cuda_graphs
    if g == CudaGraphs.layer:
        return LayerLaunches(Launches(1, 1), NONE)
    to_act = 0
    attention = ATTENTION + (Launches(ROPE_CALLS * (ROPE_UNFUSED.fwd - 1),
                                      ROPE_CALLS * (ROPE_UNFUSED.bwd - 1))
                             if rope_unfused(plan) else NONE)
    before = (_graphed(attention, g == CudaGraphs.attn_moe_router)
              + (TP_COLLECTIVES if plan.degrees.tp > 1 else NONE) + _quantized(2, plan))
    after = NONE
    if dense:
        before = before + DENSE_FFN + _quantized(2, plan)
    else:
        local = (plan.model.experts // plan.degrees.ep if isinstance(plan.ffn, EPFFN)
                 else plan.model.experts)
        router = g in (CudaGraphs.moe_router, CudaGraphs.attn_moe_router)
        before = before + _graphed(ROUTER, router) + _graphed(PREPROCESS, router)
        if plan.model.shared_experts:
            before = before + DENSE_FFN + _quantized(2, plan)
        after = (DISPATCH_COMBINE + EXPERTS_FIXED + _quantized(2 * local, plan)
                 + Launches(local * PER_EXPERT_GEMMS.fwd, local * PER_EXPERT_GEMMS.bwd)
                 + (FP8_PADDING if fp8_padded(plan) else NONE))
        if expert_bias(plan):
            after = (after + EXPERT_BIAS_CONCAT
                     + Launches(local * EXPERT_BIAS.fwd, local * EXPERT_BIAS.bwd))
        if act_clamped(plan):
            after = after + ACT_CLAMP
            to_act = (DISPATCH_COMBINE.fwd // 2 + local + _quantized(local, plan).fwd
                      + (FP8_PADDING.fwd - 1 if fp8_padded(plan) else 0) + ACT_CLAMP.fwd)
    if plan.recompute == Recompute.full:
        before = before + Launches(0, before.fwd)
        after = after + Launches(0, after.fwd)
    elif plan.recompute == Recompute.selective:
        mods = set(plan.recompute_modules)
        if dense:
            mods -= {RecomputeModule.moe, RecomputeModule.moe_act,
                     RecomputeModule.shared_experts}
        else:
            mods.discard(RecomputeModule.mlp)
        if not plan.model.shared_experts:
            mods.discard(RecomputeModule.shared_experts)
        if plan.model.mla is None:
            mods.discard(RecomputeModule.mla_up_proj)
        rerun = sum((RERUN_LAUNCHES[m] for m in mods), 0)
        if RecomputeModule.moe_act in mods and act_clamped(plan, dense):
            rerun += ACT_CLAMP.fwd
        if RecomputeModule.moe in mods:
            rerun += (ROUTER.fwd + PREPROCESS.fwd + after.fwd
                      + (DENSE_FFN.fwd if plan.model.shared_experts else 0))
        before = before + Launches(0, rerun)
    return LayerLaunches(before, after, to_act)


def syncs(plan: Plan, dense: bool = False) -> int:
    """Device-to-host waits of one layer per micro-batch: a dropless MoE layer's dispatcher
    reads the tokens per expert on the host (the all-to-all's split sizes, GroupedLinear's
    per-expert rows) once per forward, again when full recomputation reruns it; a
    capacity-bound one (ffn.capacity_factor) has static sizes."""
    if dense or not isinstance(plan.ffn, EPFFN) or plan.ffn.capacity_factor is not None:
        return 0
    return 2 if plan.recompute == Recompute.full else 1


def rope_unfused(plan: Plan) -> bool:
    """Whether Megatron-Core runs the attention's RoPE unfused (``ROPE_UNFUSED``): YaRN
    (``rope_scaling``) on GPT attention. Megatron-Bridge v0.2.1's provider turns
    ``apply_rope_fusion`` off for a ``position_embedding_type`` other than rope
    (utils/fusions.py lines 62-74; GPT-OSS's is yarn), and Megatron-Core 0d8e0714 falls back to
    the unfused RoPE anyway for an attention factor other than 1 (rope_utils.py lines 279-284).
    MLA's YaRN is fused: its own kernels (multi_latent_attention.py lines 692-716,
    ``fused_apply_mla_rope_for_q`` / ``_kv``) under the recipes' ``apply_rope_fusion``
    (Megatron-Bridge's scripts/performance/utils/helpers.py line 107) and Megatron-LM's
    default."""
    return plan.model.rope_scaling is not None and plan.model.mla is None


def rope_unfused_s(plan: Plan) -> tuple[float, float, float]:
    """Device seconds the unfused RoPE adds per micro-batch over the fused one the layer graph
    prices (``ROPE_BYTES`` at the fused kernels' rate): ``ROPE_UNFUSED_BYTES`` per element of
    this rank's q and k, plain memory-bound PyTorch kernels at ``efficiency.hbm``; forward,
    backward, and the forward's rerun under full recomputation; zeros where it is fused."""
    if not rope_unfused(plan):
        return 0.0, 0.0, 0.0
    from cost_models.compute import fused_elementwise_s, memory_s

    m, d = plan.model, plan.degrees
    elements = tokens_per_rank(plan.micro_batch_size, plan.training.seq_len,
                               d.attention_group) * (
        m.q_dim + kv_heads_sent(m, d.tp * d.sp) * m.head_dim)
    fused = fused_elementwise_s(elements * ROPE_BYTES, plan.cluster)
    fwd, bwd = (memory_s(elements * b, plan.cluster) - fused for b in ROPE_UNFUSED_BYTES)
    return fwd, bwd, fwd if plan.recompute == Recompute.full else 0.0


def act_clamped(plan: Plan, dense: bool = False) -> bool:
    """Whether a MoE layer's experts run GPT-OSS's clamped activation (``swiglu_limit``):
    TEGroupedMLP calls weighted_bias_quick_geglu_impl (moe/experts.py line 904, Megatron-Core
    0.15.3, under ``bias_activation_fusion``, which Megatron-Bridge's GPT-OSS provider sets),
    whose clamp runs as eager PyTorch before the fused activation (``ACT_CLAMP``) and whose
    offset's copy to the device waits for the GPU's queue to drain, once per call."""
    return not dense and plan.model.swiglu_limit > 0


def act_reruns(plan: Plan) -> bool:
    """Whether the experts' activation runs again in backward: ``moe_act`` (TEGroupedMLP's
    CheckpointWithoutOutput reruns it when backward reaches fc2, moe/experts.py lines
    943-949), ``moe`` or full recomputation."""
    if plan.recompute == Recompute.full:
        return True
    mods = set(plan.recompute_modules)
    return plan.recompute == Recompute.selective and bool(
        mods & {RecomputeModule.moe_act, RecomputeModule.moe})


def act_waits(plan: Plan, dense: bool = False) -> tuple[int, int]:
    """The clamped activation's waits per micro-batch (``ACT_CLAMP``), forward and backward
    (its rerun, ``act_reruns``); (0, 0) without it."""
    if not act_clamped(plan, dense):
        return 0, 0
    return 1, int(act_reruns(plan))


def act_clamp_s(plan: Plan, dense: bool = False) -> tuple[float, float, float]:
    """Device seconds of the clamped activation's eager kernels per micro-batch (``ACT_CLAMP``,
    ``ACT_CLAMP_BYTES`` per routed row of this rank and expert-FFN column, plain memory-bound
    PyTorch kernels at ``efficiency.hbm``): forward, backward, and the forward's rerun in
    backward (``act_reruns``); zeros without it."""
    if not act_clamped(plan, dense):
        return 0.0, 0.0, 0.0
    from cost_models.compute import memory_s

    m, d = plan.model, plan.degrees
    cells = tokens_per_rank(plan.micro_batch_size, plan.training.seq_len,
                            d.attention_group) * m.top_k * m.expert_ffn_hidden
    fwd, bwd = (memory_s(cells * b, plan.cluster) for b in ACT_CLAMP_BYTES)
    return fwd, bwd, fwd if act_reruns(plan) else 0.0


AFTER_WAIT = ("dispatch", "expert_compute", "combine")
"""The layer regions (plans.Component) the host launches after the dispatcher's wait."""


def host_wait_s(plan: Plan, timing: LayerTiming, dense: bool = False) -> tuple[float, float]:
    """GPU time one layer loses to its host per micro-batch, forward and backward.

    Forward: the dispatcher's wait empties the GPU's queue every MoE layer, and what follows
    it (the experts' many small launches) starts on an idle GPU: with h1, d1 the host and
    device times of the part after the wait and h2, d2 those of the rest of the layer up to
    the next wait, the layer takes max(max(h1, d1) + d2, h1 + h2), plus the waits. The
    clamped activation's wait (``act_waits``) splits the part after the dispatcher's:
    max(hA, dA) up to it (the dispatch, fc1 and the clamp: ``to_act_wait``, ``FC1_SHARE``),
    then max(max(hB, dB) + d2, hB + h2); alone (capacity-bound), it is the layer's one wait.
    A layer with no wait (dense, capacity-bound) lets the host run ahead: max(h, d).
    Backward has no dispatcher wait, so the host runs ahead over the layers:
    max(host, device), plus the clamped activation's rerun's wait."""
    n = launches(plan, dense)
    us = HOST_US_PER_LAUNCH * 1e-6
    h1, h2 = n.after_wait.fwd * us, n.before_wait.fwd * us
    host_bwd = (n.after_wait.bwd + n.before_wait.bwd) * us
    waits = syncs(plan, dense)
    act_fwd, act_bwd = act_waits(plan, dense)
    wait_s = D2H_SYNC_US * 1e-6
    if waits or act_fwd:
        clamp = act_clamp_s(plan, dense)[0]  # in fwd_s, outside the regions
        d1 = min(timing.fwd_s - clamp, sum(timing.region_s[k] for k in AFTER_WAIT))
        d2 = timing.fwd_s - clamp - d1
        if act_fwd:
            ha, hb = n.to_act_wait * us, h1 - n.to_act_wait * us
            da = min(d1, timing.region_s["dispatch"]
                     + FC1_SHARE * timing.region_s["expert_compute"]) + clamp
            db = d1 + clamp - da
            layer = (max(ha, da) + max(max(hb, db) + d2, hb + h2) if waits
                     else max(max(hb, db) + d2 + da, hb + h2 + ha))  # the clamp's wait alone
        else:
            layer = max(max(h1, d1) + d2, h1 + h2)
        fwd = layer + waits * (wait_s + count_gather_s(plan)) + act_fwd * wait_s
    else:
        fwd = max(h1 + h2, timing.fwd_s)
    return fwd - timing.fwd_s, max(0.0, host_bwd - timing.bwd_s) + act_bwd * wait_s


def moe_chunks(plan: Plan) -> int:
    """Token chunks a MoE layer runs in: Megatron-Core's EP overlap overlaps two micro-batches
    and leaves the layer whole (1); moeplan's runtime chunks it (plans.layout.moe_chunks)."""
    if plan.target == Target.megatron:
        return 1
    return layout_moe_chunks(plan.overlap, plan.ffn, plan.degrees.ep)


EP_KINDS = (CommKind.ep_dispatch.value, CommKind.ep_combine.value)


FP8_CAST_BYTES = MappingProxyType({Fp8Recipe.mxfp8: 4, Fp8Recipe.tensorwise: 6})
"""Bytes per element of TransformerEngine's quantisation of a GEMM operand under fp8, by
recipe: read the bf16 tensor, write its fp8 copy row-wise and column-wise (the data and weight
gradients read one each), 4; MXFP8 computes its block scales in that pass; per-tensor current
scaling (tensorwise) first reads the bf16 tensor once more for its amax (TE's
Float8CurrentScalingQuantizer: the amax, the scale from it, then the cast), 2 more. Weights
are quantised once per step (``is_first_microbatch``), not counted."""


def fp8_cast_s(plan: Plan, dense: bool = False) -> tuple[float, float]:
    """Device seconds of one layer's fp8 quantisations per micro-batch, forward (each GEMM's
    input) and backward (each GEMM's output gradient), at the fused kernels' rate; 0 in bf16.
    Elements per token of this rank: QKV in h, out q / tp, the routed rows' fc1 in k h and
    fc2 in k F; backward QKV (q + 2 kv) / tp, out h, fc1 2 k F, fc2 k h; dense or shared FFN
    h and F in, 2 F and h out."""
    if plan.training.precision != Precision.fp8:
        return 0.0, 0.0
    from cost_models.compute import fused_elementwise_s

    m, d = plan.model, plan.degrees
    fwd = m.hidden + m.q_dim / d.tp
    bwd = (m.q_dim + 2 * m.kv_dim) / d.tp + m.hidden
    widths = [m.dense_ffn_hidden] if dense else [
        m.shared_experts * m.shared_expert_ffn_hidden] if m.shared_experts else []
    for f in widths:
        fwd, bwd = fwd + m.hidden + f, bwd + 2 * f + m.hidden
    if not dense:
        k, f = m.top_k, m.expert_ffn_hidden
        fwd, bwd = fwd + k * (m.hidden + f), bwd + k * (2 * f + m.hidden)
    tokens = tokens_per_rank(plan.micro_batch_size, plan.training.seq_len, d.attention_group)
    per = FP8_CAST_BYTES[plan.training.fp8_recipe]
    return tuple(fused_elementwise_s(tokens * e * per, plan.cluster)
                 for e in (fwd, bwd))


FP8_ALIGN_ROWS = MappingProxyType({Fp8Recipe.mxfp8: 32, Fp8Recipe.tensorwise: 16})
"""Rows each expert's fp8 grouped GEMM input must be a multiple of, by recipe:
TransformerEngine's Fp8Padding aligns to 32 under MXFP8 and 16 under the other recipes
(module/fp8_padding.py)."""
FP8_PADDING_BYTES = 8
"""Bytes per routed row and hidden element of TEGroupedMLP's fp8 padding, each way: forward
the rows padded and the experts' output unpadded, each a bf16 read and write (2 x 2 x 2);
backward the same two copies of their gradients."""


def fp8_padded(plan: Plan, dense: bool = False) -> bool:
    """Whether TEGroupedMLP pads its experts' rows: under fp8 it passes them through TE's
    Fp8Padding and its output through Fp8Unpadding (moe/experts.py, Megatron-Core 0.15.3;
    the recipes leave ``moe_router_padding_for_fp8`` off), which copy nothing when every
    expert's rows are already a multiple of ``FP8_ALIGN_ROWS`` ("no padding needed",
    TransformerEngine's fp8_padding.py). Dropless, the rows per expert change every
    micro-batch: taken as unaligned (all local experts aligned at once is chance).
    Capacity-bound and padded, each local expert gets capacity x ep rows, the capacity
    ceil(tokens x top_k / experts x capacity factor) per source rank (moe_utils.get_capacity)."""
    if dense or plan.training.precision != Precision.fp8 or not isinstance(plan.ffn, EPFFN):
        return False
    cf = plan.ffn.capacity_factor
    if cf is None:
        return True
    m, d = plan.model, plan.degrees
    tokens = tokens_per_rank(plan.micro_batch_size, plan.training.seq_len, d.attention_group)
    capacity = math.ceil(tokens * m.top_k / m.experts * cf)
    return capacity * d.ep % FP8_ALIGN_ROWS[plan.training.fp8_recipe] != 0


def fp8_padding_s(plan: Plan, dense: bool = False) -> tuple[float, float]:
    """Device seconds of TEGroupedMLP's fp8 padding copies per micro-batch, forward and
    backward (``fp8_padded``; 0 where it copies nothing): ``FP8_PADDING_BYTES`` per routed
    row (tokens x top_k of this rank) and hidden element each way, at the fused kernels'
    rate."""
    if not fp8_padded(plan, dense):
        return 0.0, 0.0
    from cost_models.compute import fused_elementwise_s

    m, d = plan.model, plan.degrees
    rows = tokens_per_rank(plan.micro_batch_size, plan.training.seq_len,
                           d.attention_group) * m.top_k
    s = fused_elementwise_s(rows * m.hidden * FP8_PADDING_BYTES, plan.cluster)
    return s, s


EXPERT_BIAS_BYTES = (12, 16)
"""Bytes per routed row and hidden element of TEGroupedMLP's fc2 bias (``EXPERT_BIAS``),
forward and backward, all bf16 (the routing weights in the router's dtype, the model's under
Megatron-Bridge's GPT-OSS provider): forward the bias's product with the routing weights
written (2), its sum with the expert's output (read 2 + 2, write 2) and the concatenation
(read 2, write 2); backward the two products with the output gradient (read 2, write 2,
each), their sums (read 2, each) and the concatenation of fc2's output's gradient (read 2,
write 2)."""


def expert_bias(plan: Plan, dense: bool = False) -> bool:
    """Whether a MoE layer's experts carry biases (``linear_bias`` all, GPT-OSS), which
    Megatron-Core 0.15.3's TEGroupedMLP adds to fc2's output expert by expert from Python
    (moe/experts.py ``_apply_bias``): eager PyTorch operations over the routed rows."""
    return not dense and plan.model.linear_bias == LinearBias.all


def expert_bias_s(plan: Plan, dense: bool = False) -> tuple[float, float]:
    """Device seconds of the experts' fc2 bias per micro-batch, forward and backward
    (``EXPERT_BIAS_BYTES`` per routed row of this rank and hidden element, plain memory-bound
    PyTorch kernels at ``efficiency.hbm``); 0 without expert biases."""
    if not expert_bias(plan, dense):
        return 0.0, 0.0
    from cost_models.compute import memory_s

    m, d = plan.model, plan.degrees
    rows = tokens_per_rank(plan.micro_batch_size, plan.training.seq_len,
                           d.attention_group) * m.top_k
    fwd, bwd = (memory_s(rows * m.hidden * b, plan.cluster) for b in EXPERT_BIAS_BYTES)
    return fwd, bwd


COUNT_BYTES = 8
"""Bytes of one expert's token count as the dispatcher gathers it (int64)."""


def count_gather_s(plan: Plan) -> float:
    """The alltoall dispatcher's all-gather of every rank's tokens per expert over the EP
    (x expert-TP) group, before its host reads the split sizes (``preprocess``:
    ``gather_from_sequence_parallel_region``, Megatron-Core 0.15.3
    moe/token_dispatcher.py): experts x COUNT_BYTES a rank, a latency-bound collective
    every dropless MoE layer's forward waits for. The flex dispatchers exchange their
    counts inside their own kernels (not priced here)."""
    if not isinstance(plan.ffn, EPFFN) or plan.ffn.dispatch != Dispatch.all_to_all:
        return 0.0
    d = plan.degrees
    group = d.ep * d.etp
    layout = comm.group_layout(group, 1, plan.cluster.node.gpus_per_node)
    return comm.all_gather_s(group * plan.model.experts * COUNT_BYTES, layout, plan.cluster)


def paired_share(plan: Plan) -> float:
    """Share of a rank's micro-batch passes (per model chunk) that Megatron-Core's EP overlap
    runs paired, one micro-batch's forward beside another's backward: only the steady state.
    Its warmup forwards and their cooldown backwards run alone, their all-to-alls exposed
    (Megatron-Core 0.15.3 pipeline_parallel/schedules.py get_pp_rank_microbatches: (pp - rank
    - 1) x 2 + (chunks - 1) x microbatch_group_size_per_vp_stage, which defaults to pp, plus
    the one extra forward the overlap schedules; without pipelining combined_1f1b.py runs the
    first forward and the last backward alone). The mean over the pipeline's ranks."""
    d = plan.degrees
    total = plan.num_micro_batches * d.vpp
    if d.pp == 1:
        return 1 - 1 / total
    warmup = [min(total, (d.pp - r - 1) * 2 + (d.vpp - 1) * d.pp + 1) for r in range(d.pp)]
    return 1 - sum(warmup) / (d.pp * total)


def layer_timing(plan: Plan, dense: bool = False) -> LayerTiming:
    """One layer's device time as Megatron-Core schedules it, its fp8 quantisations and
    padding, the experts' biases and clamped activation and YaRN's unfused RoPE included
    (``fp8_cast_s``, ``fp8_padding_s``, ``expert_bias_s``, ``act_clamp_s``,
    ``rope_unfused_s``): its communication blocks
    (overlap none), except under its EP overlap (overlap inter_op:
    ``--overlap-moe-expert-parallel-comm``), which runs one micro-batch's forward beside
    another's backward so that each one's dispatch and combine all-to-alls run beside the
    other's compute: in the passes it pairs (``paired_share``) a share ``efficiency.overlap``
    of them is hidden, at most the layer's compute; in the others none."""
    timing = layer_timing_for(layer_key(plan, dense), Overlap.none)
    casts, pads = fp8_cast_s(plan, dense), fp8_padding_s(plan, dense)
    bias, (clamp_f, clamp_b, clamp_rerun) = expert_bias_s(plan, dense), act_clamp_s(plan, dense)
    rope_f, rope_b, rope_rerun = rope_unfused_s(plan)
    fwd = casts[0] + pads[0] + bias[0] + clamp_f + rope_f
    bwd = casts[1] + pads[1] + bias[1] + clamp_b + rope_b
    rerun = clamp_rerun + rope_rerun
    if fwd or bwd:
        timing = replace(timing, fwd_s=timing.fwd_s + fwd,
                         bwd_s=timing.bwd_s + bwd + rerun,
                         compute_s=timing.compute_s + fwd + bwd,
                         recompute_s=timing.recompute_s + rerun)
    if plan.overlap != Overlap.inter_op:
        return timing
    exposed = dict(timing.exposed_comm_s)
    ep = sum(exposed.get(k, 0.0) for k in EP_KINDS)
    if not ep:
        return timing
    hidden = paired_share(plan) * min(plan.cluster.efficiency.overlap * ep, timing.compute_s)
    for k in EP_KINDS:
        if k in exposed:
            exposed[k] -= hidden * exposed[k] / ep
    keep = 1 - hidden / timing.total_s
    return replace(timing, fwd_s=timing.fwd_s * keep, bwd_s=timing.bwd_s * keep,
                   exposed_comm_s=MappingProxyType(exposed))


# ---- memory ------------------------------------------------------------------------------------

LOSS_BYTES_PER_LOGIT = 2
"""Megatron-Core's loss (``cross_entropy_fusion_impl te``, the Megatron-Bridge recipes'):
TransformerEngine's fused cross-entropy reads the bf16 logits and writes their gradient in
place, so the logits' own 2 bytes are the loss's peak."""
ROUTED_WEIGHT_BYTES = 4
"""A routed row's routing weight, fp32 (the router's dtype), kept by the weighted SwiGLU."""
ROUTER_DTYPE_BYTES = 4
"""The router runs in fp32 (``moe_router_dtype fp32``, Megatron-Bridge's Qwen3 provider): its
gate keeps an fp32 copy of its input, its logits and probabilities are fp32."""


def kept_bytes_per_token(m: ModelSpec, d: Degrees, precision: Precision, policy: Recompute,
                         dense: bool, modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES
                         ) -> float:
    """Bytes one layer keeps for backward per token of this rank (b s / (tp cp) tokens under
    sequence parallelism), as Megatron-Core with TransformerEngine saves them; a GEMM's input
    is kept in the GEMM's precision (TE keeps the fp8 copy it quantised under fp8):

    - input norm fused with the QKV GEMM: its input (2 h), output (the GEMM's input) and the
      fp32 inverse norm;
    - MLA: the down-projection's output (the latents' norms' input, 2 per element) and the
      normed latents the up-projections keep (their GEMMs' input), q_lora_rank + kv_lora_rank;
    - q/k norms (qk_norm): their inputs, 2 (q + kv) / tp;
    - fused attention: RoPE'd q, k, v, its output and fp32 log-sum-exp; the output
      projection's input is that output (its fp8 copy under fp8);
    - pre-MLP norm: its input (2 h); the fp32 router: its input copy (4 h), logits,
      probabilities and the routing map and permutation map (13 E);
    - each routed row (k per token, at the rank's EP load): fc1's input, the SwiGLU's input
      (fc1's 2 F-wide output), fc2's input and the row's fp32 routing weight: TEGroupedMLP
      applies the weights in its weighted SwiGLU (``weighted_bias_swiglu_impl``), and the
      dispatcher's un-permute runs without them (``unpermute(..., probs=None)``,
      moe/experts.py and moe/token_dispatcher.py, Megatron-Core 0.15.3), so the combine keeps
      no rows; with GPT-OSS's clamped activation (``swiglu_limit``, ``ACT_CLAMP``) fc1's
      output is kept by the clamps (their backward's masks read it) besides the clamped copy
      the activation keeps, 4 F more, unless moe_act reruns them;
    - dense FFN and shared experts: the same per token, without routing.

    Full recomputation keeps each layer's input only. Selective recomputation reruns
    ``modules`` (``--recompute-modules``; TransformerLayer and its submodules, Megatron-Core
    0.15), each dropping what it discards: core_attn the log-sum-exp (the core's inputs are
    the checkpoint's, kept); mla_up_proj the up-projections' outputs, the core's q, k, v
    (``CheckpointWithoutOutput`` discards them once the core has run); moe_act fc2's input
    (the SwiGLU's output); mlp a dense layer's FFN, keeping its input (2 h); shared_experts
    the shared FFN; moe the whole MoE block (router, routed rows, shared experts), keeping its
    input (2 h). layernorm drops nothing counted here: the input norm is fused into the QKV
    GEMM, and the pre-MLP norm's output is kept by no one but its readers, whose own copies
    (the router's fp32 input, the dispatched rows) are counted with them."""
    from cost_models.memory import EP_LOAD  # the memory model's one rank-load margin

    if policy == Recompute.full:
        return 2.0 * m.hidden
    mods = frozenset(modules) if policy == Recompute.selective else frozenset()
    gemm_in = float(precision.bytes) if precision == Precision.fp8 else 2.0
    h, tp = m.hidden, d.tp
    q, kv = m.q_dim / tp, m.kv_dim / tp
    out = 2.0 * h + gemm_in * h + 4.0
    if m.mla is not None:
        out += (2.0 + gemm_in) * (m.mla.q_lora_rank + m.mla.kv_lora_rank) + 8.0
    if m.qk_norm:
        out += 2.0 * (q + kv)
    if RecomputeModule.mla_up_proj not in mods or m.mla is None:
        out += 2.0 * (q + 2 * kv)
    out += 2.0 * q
    if RecomputeModule.core_attn not in mods:
        out += 4.0 * m.query_heads / tp
    if gemm_in < 2.0:
        out += gemm_in * q
    out += 2.0 * h + 4.0
    if dense:
        if RecomputeModule.mlp in mods:
            return out + 2.0 * h
        return out + gemm_in * h + (4.0 + gemm_in) * m.dense_ffn_hidden
    if RecomputeModule.moe in mods:
        return out + 2.0 * h
    out += ROUTER_DTYPE_BYTES * (h + 3 * m.experts) + m.experts
    load = EP_LOAD if d.ep > 1 else 1.0
    f = m.expert_ffn_hidden
    fc2_in = 0.0 if RecomputeModule.moe_act in mods else gemm_in
    clamp = 4.0 if m.swiglu_limit and RecomputeModule.moe_act not in mods else 0.0
    out += m.top_k * load * (gemm_in * h + (4.0 + clamp + fc2_in) * f + ROUTED_WEIGHT_BYTES)
    if m.shared_experts and RecomputeModule.shared_experts not in mods:
        out += gemm_in * h + (4.0 + gemm_in) * m.shared_experts * m.shared_expert_ffn_hidden
    return out
