"""Peak memory per GPU: weights, gradients, ZeRO-1 optimizer states, activations, buffers.

The peak is taken over pipeline stages; the components reported are those of the peak stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from cost_models.compute import ACT_BYTES, FP32_BYTES
from cost_models.params import StageParams, chunk_dense_layers, stage_params
from plans.plan import EPFFN, Degrees, Dispatch, FFNStrategy, PipelineSchedule, Plan, Recompute
from plans.specs import ModelSpec, Optimizer, Precision

GIB = 2**30
WEIGHT_BYTES = Precision.bf16.bytes
"""Model weights are held in bf16."""
OPTIMIZER_STEP_WORKSPACE_BYTES = 4
"""Per parameter of the local ZeRO-1 shard, alive only during the optimizer step: the fp32
gradient slice the reduce-scatter (or, on one rank, the bf16-to-fp32 cast) lands in; the fused
AdamW needs no temporaries. Measured on H200 (bench/results/gpu_fidelity_h200.json): 1-GPU
Mixtral-2L peak 59.0 GiB, 11.8 GiB of it this workspace; without it the predictions of 2-GPU
runs fall up to 30% short."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the stage with the highest peak."""

    components_bytes: Mapping[str, float]
    """params, grads, optimizer (always resident); activations, activation_working (the layer
    being recomputed or back-propagated), comm_buffers, logits (during forward/backward); and
    optimizer_step_workspace (during the optimizer step). The peak is the resident states plus
    the larger of the two phases, so these do not add up to it."""
    peak_bytes: float
    capacity_bytes: float
    """gpu.hbm_gib x 2^30 x efficiency.memory_usable."""
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


def layer_activation_bytes(
    model: ModelSpec, tokens: float, degrees: Degrees, ffn: FFNStrategy, policy: Recompute,
    dense: bool,
) -> float:
    """Activations one layer keeps for backward per micro-batch, ``tokens`` per rank.

    Paper Sec. 4.1 (read as bytes, in units of b s h / n = tokens x h):
    before selective (2n + 2k + 3kf + 12 + 5/m), after (2kf + 4 + 2/m), where 2n is the
    all-gathered FFN input (n = ep) and 4 + 2/m are Q, K, V and the attention output.
    TP layouts (Megatron with sequence parallelism, Korthikanti et al. 2022, Sec. 4.1): 11 for
    attention (flash attention drops the 5as/h score term) + 4 for the two norm inputs, with the
    FFN input kept sharded and re-gathered in backward (2 instead of 2n).
    Dense layers: k = 1, f = dense_ffn_hidden / h, no dispatch copies.
    Full recomputation keeps only the layer input (2)."""
    if policy == Recompute.full:
        return 2 * tokens * model.hidden
    m = model.gqa_ratio
    cf = ffn.capacity_factor if isinstance(ffn, EPFFN) and ffn.capacity_factor else 1.0
    k, f = (1, model.dense_ffn_hidden / model.hidden) if dense else (
        model.top_k * cf, model.expert_ffn_hidden / model.hidden)
    if policy == Recompute.selective:
        return (2 * k * f + 4 + 2 / m) * tokens * model.hidden
    tp_layout = degrees.tp > 1 or degrees.etp > 1
    attention = 15 if tp_layout else 12 + 5 / m
    ffn_in = 2 if dense else (2 if tp_layout else 2 * degrees.ep) + 2 * k
    return (attention + ffn_in + 3 * k * f) * tokens * model.hidden


def in_flight_micro_batches(stage: int, pp: int, vpp: int, micro_batches: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the whole stage.

    1F1B: stage i runs pp - i warm-up forwards before its first backward. Interleaved
    (Megatron-LM schedules.get_num_warmup_microbatches; Korthikanti et al. 2022, Sec. 4.2.3):
    2(pp - i - 1) + (vpp - 1) pp + 1 chunk forwards, each 1/vpp of the stage."""
    if vpp == 1:
        return min(pp - stage, micro_batches)
    chunks = min(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, micro_batches * vpp)
    return chunks / vpp


def _buffer_bytes(model: ModelSpec, tokens: float, d: Degrees, ffn: FFNStrategy) -> float:
    """The largest communication buffer of a layer: all-to-all dispatch k x tokens x h, an
    all-gather n x tokens x h (EP all-gather dispatch, expert TP, attention TP)."""
    row = model.hidden * ACT_BYTES
    if isinstance(ffn, EPFFN) and ffn.dispatch == Dispatch.all_to_all:
        dispatch = model.top_k * (ffn.capacity_factor or 1.0) * tokens * row
    else:
        dispatch = max(d.ep, d.etp) * tokens * row
    return max(dispatch, d.tp * tokens * row)


def grad_bytes_per_param(grad_precision: Precision) -> int:
    """Main gradients accumulate in fp32 for an fp32 sync, in bf16 for a bf16 or fp8 one."""
    return FP32_BYTES if grad_precision == Precision.fp32 else Precision.bf16.bytes


def _state_bytes(p: StageParams, d: Degrees, grad_precision: Precision, opt: Optimizer) -> dict:
    grad_bytes = grad_bytes_per_param(grad_precision)
    # ZeRO-1: optimizer states sharded over the ranks holding the same weights.
    sharded = p.dense / (d.dp * d.cp * d.sp) + p.expert / d.edp
    return {
        "params": WEIGHT_BYTES * p.total,
        "grads": grad_bytes * p.total,
        "optimizer": opt.state_bytes_per_param * sharded,
    }


@lru_cache(maxsize=65536)
def _memory(model: ModelSpec, degrees: Degrees, ffn: FFNStrategy, stage_layers: tuple[int, ...],
            seq_len: int, batch: int, micro_batches: int, schedule: PipelineSchedule,
            policy: Recompute, grad_precision: Precision, opt: Optimizer, capacity: float,
            ) -> MemoryBreakdown:
    d = degrees
    tokens = batch * seq_len / (d.sp * d.cp * d.tp)
    vpp = d.vpp if schedule == PipelineSchedule.interleaved_1f1b else 1
    per_layer = {
        (dense, pol): layer_activation_bytes(model, tokens, d, ffn, pol, dense)
        for dense in (False, True) for pol in (policy, Recompute.none)
    }
    layers = [[0, 0] for _ in range(d.pp)]
    for c, (n, n_dense) in enumerate(
        zip(stage_layers, chunk_dense_layers(stage_layers, model.dense_layers), strict=True)
    ):
        layers[c % d.pp][0] += n - n_dense
        layers[c % d.pp][1] += n_dense
    params = stage_params(model, d, stage_layers)
    buffers = _buffer_bytes(model, tokens, d, ffn)
    # per stage: weights + grads per parameter, optimizer states over the ZeRO-1 shard; on top,
    # the larger of the forward/backward transients and the optimizer-step workspace (they
    # are never alive at once)
    state_bytes = WEIGHT_BYTES + grad_bytes_per_param(grad_precision)
    opt_bytes = opt.state_bytes_per_param
    dense_shard, expert_shard = d.dp * d.cp * d.sp, d.edp
    logits = tokens * model.vocab * FP32_BYTES
    peak_stage, peak = 0, -1.0
    for i in range(d.pp):
        moe, dense = layers[i]
        p = params[i]
        stored = moe * per_layer[False, policy] + dense * per_layer[True, policy]
        working = per_layer[moe == 0, Recompute.none] - per_layer[moe == 0, policy]
        shard = p.dense / dense_shard + p.expert / expert_shard
        training = (stored * in_flight_micro_batches(i, d.pp, vpp, micro_batches)
                    + (working if moe + dense else 0.0) + buffers
                    + (logits if i == d.pp - 1 else 0.0))
        total = (state_bytes * p.total + opt_bytes * shard
                 + max(training, OPTIMIZER_STEP_WORKSPACE_BYTES * shard))
        if total > peak:
            peak_stage, peak = i, total
    i = peak_stage
    moe, dense = layers[i]
    stored = moe * per_layer[False, policy] + dense * per_layer[True, policy]
    parts = _state_bytes(params[i], d, grad_precision, opt)
    parts["activations"] = stored * in_flight_micro_batches(i, d.pp, vpp, micro_batches)
    working = per_layer[moe == 0, Recompute.none] - per_layer[moe == 0, policy]
    parts["activation_working"] = working if moe + dense else 0.0
    parts["comm_buffers"] = buffers
    # fp32 logits of one micro-batch on the last stage: b s/(sp cp) rows x vocab/tp,
    # which is tokens (b s / (sp cp tp)) x vocab.
    parts["logits"] = logits if i == d.pp - 1 else 0.0
    p = params[i]
    step = OPTIMIZER_STEP_WORKSPACE_BYTES * (p.dense / dense_shard + p.expert / expert_shard)
    states = parts["params"] + parts["grads"] + parts["optimizer"]
    training = sum(parts.values()) - states
    parts["optimizer_step_workspace"] = step
    return MemoryBreakdown(MappingProxyType(parts), states + max(training, step), capacity, i)


def memory_breakdown(plan: Plan) -> MemoryBreakdown:
    """Peak bytes per GPU of ``plan`` and the capacity it must fit in."""
    c, t = plan.cluster, plan.training
    capacity = c.gpu.hbm_gib * GIB * c.efficiency.memory_usable
    return _memory(
        plan.model, plan.degrees, plan.ffn, plan.stage_layers, t.seq_len, plan.micro_batch_size,
        plan.num_micro_batches, plan.schedule, plan.recompute, plan.grad_sync_precision,
        t.optimizer, capacity,
    )
