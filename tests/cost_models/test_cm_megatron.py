"""cost_models.megatron: a megatron-target plan priced as Megatron-Core runs it (its host's
launches and the dispatcher's wait, CUDA graphs, EP overlap, what its layers keep), and a
moeplan-target plan priced as before."""

from __future__ import annotations

import pytest

import cost_models
from cost_models import megatron
from plans import (
    EPFFN,
    CudaGraphs,
    Degrees,
    Kernels,
    Overlap,
    PipelineSchedule,
    Plan,
    Precision,
    Recompute,
    Target,
    TPAttention,
    TrainingSpec,
    catalog,
)


def qwen(mbs: int = 1, **update) -> Plan:
    """Qwen3-30B-A3B on 8 B200s as Megatron-Bridge's 25.11 recipe runs it (EP 8)."""
    m = catalog.load_model("qwen3-30b-a3b")
    plan = Plan(target=Target.megatron, model=m, cluster=catalog.load_cluster("b200", gpus=8),
                training=TrainingSpec(global_batch=512, seq_len=4096, precision=Precision.fp8),
                degrees=Degrees(dp=8, ep=8), attention=TPAttention(), ffn=EPFFN(),
                stage_layers=(m.layers,), micro_batch_size=mbs, overlap=Overlap.none,
                recompute=Recompute.none, kernels=Kernels.fused,
                cuda_graphs=CudaGraphs.moe_router)
    return plan.model_copy(update=update)


def test_graphs_replay_their_scope_in_one_launch_and_fp8_adds_quantisations():
    graphed, plain = megatron.launches(qwen()), megatron.launches(
        qwen(cuda_graphs=CudaGraphs.none))
    saved = (megatron.ROUTER.fwd - 1) + (megatron.PREPROCESS.fwd - 1)
    assert plain.before_wait.fwd - graphed.before_wait.fwd == saved
    bf16 = megatron.launches(qwen(training=TrainingSpec(global_batch=512, seq_len=4096)))
    local = 128 // 8
    assert graphed.after_wait.fwd - bf16.after_wait.fwd == 2 * local  # fc1 and fc2 per expert


def test_the_host_binds_at_small_micro_batches_and_stops_binding_at_large_ones():
    """What makes micro-batch size move Megatron-Core's throughput: the launches per layer are
    the same at every micro-batch size, the device time grows with it."""
    def host_share(mbs: int) -> float:
        e = cost_models.evaluate(qwen(mbs))
        return e.breakdown_s["host"] / e.step_time_s

    assert host_share(1) > 0.3
    assert host_share(1) > host_share(2) > host_share(8)
    assert cost_models.evaluate(qwen(8)).tokens_per_s > 1.5 * cost_models.evaluate(
        qwen(1)).tokens_per_s


def test_a_moeplan_target_plan_has_no_host_term_and_keeps_its_pricing():
    plan = qwen(target=Target.moeplan, cuda_graphs=CudaGraphs.none)
    e = cost_models.evaluate(plan)
    assert "host" not in e.breakdown_s
    assert e.memory.components_bytes["logits"] > cost_models.evaluate(
        qwen()).memory.components_bytes["logits"]


def test_megatron_keeps_gemm_inputs_in_fp8_and_full_recompute_keeps_the_layer_input():
    m, d = catalog.load_model("qwen3-30b-a3b"), Degrees(dp=8, ep=8)
    fp8 = megatron.kept_bytes_per_token(m, d, Precision.fp8, Recompute.none, False)
    bf16 = megatron.kept_bytes_per_token(m, d, Precision.bf16, Recompute.none, False)
    assert fp8 < bf16
    assert megatron.kept_bytes_per_token(m, d, Precision.bf16, Recompute.full, False) == \
        2 * m.hidden


def test_ep_overlap_hides_part_of_the_all_to_alls():
    base = dict(degrees=Degrees(pp=2, vpp=2, dp=4, ep=4), stage_layers=(12,) * 4,
                schedule=PipelineSchedule.interleaved_1f1b)
    blocking = megatron.layer_timing(qwen(**base))
    hidden = megatron.layer_timing(qwen(overlap=Overlap.inter_op, **base))
    assert hidden.total_s < blocking.total_s
    ep = sum(blocking.exposed_comm_s.get(k, 0.0) for k in megatron.EP_KINDS)
    assert blocking.total_s - hidden.total_s == pytest.approx(
        min(0.9 * ep, blocking.compute_s))
