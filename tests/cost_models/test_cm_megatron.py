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
    # fc1 and fc2 quantised per expert, and the experts' fp8 padding (dropless)
    assert (graphed.after_wait.fwd - bf16.after_wait.fwd
            == 2 * local + megatron.FP8_PADDING.fwd)


def test_fp8_padding_copies_the_routed_rows_where_the_experts_rows_are_unaligned():
    """TEGroupedMLP pads each expert's rows to a multiple of 16 under fp8 current scaling,
    32 under MXFP8 (TE's Fp8Padding, a no-op when already aligned): dropless, 8 bytes per
    routed row and hidden element each way at the fused kernels' rate; capacity-bound with
    aligned capacity x ep, nothing."""
    plan = qwen()
    c = plan.cluster
    rows = 4096 * 8  # micro-batch 1 x 4,096 tokens, top-8
    want = rows * 2048 * 8 / (c.gpu.hbm_tb_s * 1e12 * c.efficiency.fused_elementwise)
    fwd, bwd = megatron.fp8_padding_s(plan)
    assert fwd == pytest.approx(want) and bwd == pytest.approx(want)
    # capacity 1.0: ceil(4096 x 8 / 128) = 256 rows per source rank, x ep 8 = 2048 = 64 x 32
    assert megatron.fp8_padding_s(qwen(ffn=EPFFN(capacity_factor=1.0))) == (0.0, 0.0)
    # capacity 1.01: ceil(258.56) = 259, x 8 = 2072, not a multiple of 16: padded
    assert megatron.fp8_padded(qwen(ffn=EPFFN(capacity_factor=1.01)))
    # capacity 258 / 256: 258 x 8 = 2064 = 129 x 16, not a multiple of 32: MXFP8 alone pads
    cf = EPFFN(capacity_factor=258 / 256)
    assert not megatron.fp8_padded(qwen(ffn=cf))
    mx = TrainingSpec(global_batch=512, seq_len=4096, precision=Precision.fp8,
                      fp8_recipe="mxfp8")
    assert megatron.fp8_padded(qwen(ffn=cf, training=mx))
    bf16 = qwen(training=TrainingSpec(global_batch=512, seq_len=4096))
    assert megatron.fp8_padding_s(bf16) == (0.0, 0.0)
    assert megatron.fp8_padding_s(plan, dense=True) == (0.0, 0.0)
    from cost_models.layer import layer_key, layer_timing_for

    raw, casts = layer_timing_for(layer_key(plan), Overlap.none), megatron.fp8_cast_s(plan)
    timing = megatron.layer_timing(plan)
    assert timing.fwd_s == pytest.approx(raw.fwd_s + casts[0] + fwd)
    assert timing.bwd_s == pytest.approx(raw.bwd_s + casts[1] + bwd)


def test_expert_biases_are_added_expert_by_expert_from_python():
    """GPT-OSS's experts carry biases: TEGroupedMLP adds fc2's per local expert in eager
    PyTorch (moe/experts.py _apply_bias): per expert 2 launches forward and 4 backward, the
    concatenations once (1, 2), and 12 / 16 bytes per routed row and hidden element at the
    plain memory rate; a model without them, or a dense layer, has none."""
    from plans.enums import LinearBias

    plain = qwen(training=TrainingSpec(global_batch=512, seq_len=4096))
    biased = plain.model_copy(update={"model": plain.model.model_copy(
        update={"linear_bias": LinearBias.all})})
    local = 128 // 8
    a, b = megatron.launches(plain).after_wait, megatron.launches(biased).after_wait
    assert (b.fwd - a.fwd, b.bwd - a.bwd) == (2 * local + 1, 4 * local + 2)
    c = plain.cluster
    rows = 4096 * 8
    fwd, bwd = megatron.expert_bias_s(biased)
    assert fwd == pytest.approx(rows * 2048 * 12 / (c.gpu.hbm_tb_s * 1e12 * c.efficiency.hbm))
    assert bwd == pytest.approx(fwd * 16 / 12)
    assert megatron.expert_bias_s(plain) == (0.0, 0.0)
    assert megatron.expert_bias_s(biased, dense=True) == (0.0, 0.0)
    qkv = biased.model_copy(update={"model": plain.model.model_copy(
        update={"linear_bias": LinearBias.qkv})})
    assert megatron.expert_bias_s(qkv) == (0.0, 0.0)
    assert megatron.layer_timing(biased).fwd_s == pytest.approx(
        megatron.layer_timing(plain).fwd_s + fwd)


def test_the_clamped_activation_runs_eager_and_waits_for_its_offset(monkeypatch):
    """GPT-OSS's clamped SwiGLU (swiglu_limit): Megatron-Core clamps the two halves and
    concatenates them in eager PyTorch before its fused quick-GEGLU, then copies the linear
    offset to the device, a copy after which PyTorch waits for the stream: 4 launches
    forward, 9 backward, 16 / 30 bytes per routed row and expert-FFN column at the plain
    memory rate, one more wait per forward, and again in backward where moe_act reruns it."""
    from plans import RecomputeModule

    bf16 = TrainingSpec(global_batch=512, seq_len=4096)
    plain = qwen(training=bf16)
    clamped = plain.model_copy(update={"model": plain.model.model_copy(
        update={"swiglu_limit": 7.0})})
    rerun = clamped.model_copy(update={"recompute": Recompute.selective,
                                       "recompute_modules": (RecomputeModule.moe_act,)})
    local = 128 // 8
    a, b = megatron.launches(plain), megatron.launches(clamped)
    assert (b.after_wait.fwd - a.after_wait.fwd, b.after_wait.bwd - a.after_wait.bwd) == (4, 9)
    assert (a.to_act_wait, b.to_act_wait) == (0, megatron.DISPATCH_COMBINE.fwd // 2 + local + 4)
    assert megatron.launches(rerun).before_wait.bwd - megatron.launches(
        plain.model_copy(update={"recompute": Recompute.selective, "recompute_modules": (
            RecomputeModule.moe_act,)})).before_wait.bwd == 4
    assert (megatron.act_waits(plain), megatron.act_waits(clamped),
            megatron.act_waits(rerun), megatron.act_waits(clamped, dense=True)) == (
        (0, 0), (1, 0), (1, 1), (0, 0))
    c = plain.cluster
    fwd, bwd, again = megatron.act_clamp_s(clamped)
    assert fwd == pytest.approx(4096 * 8 * 768 * 16 / (c.gpu.hbm_tb_s * 1e12 * c.efficiency.hbm))
    assert (bwd, again) == (pytest.approx(fwd * 30 / 16), 0.0)
    assert megatron.act_clamp_s(rerun)[2] == fwd
    assert megatron.act_clamp_s(plain) == (0.0, 0.0, 0.0)
    t, u = megatron.layer_timing(plain), megatron.layer_timing(clamped)
    assert (u.fwd_s - t.fwd_s, u.bwd_s - t.bwd_s) == (pytest.approx(fwd), pytest.approx(bwd))
    # with no host time per launch, only the waits are left: the dispatcher's and the clamp's
    monkeypatch.setattr(megatron, "HOST_US_PER_LAUNCH", 0.0)
    wait = megatron.D2H_SYNC_US * 1e-6
    host = megatron.host_wait_s(clamped, u)
    assert host == (pytest.approx(2 * wait + megatron.count_gather_s(clamped)), 0.0)
    assert megatron.host_wait_s(rerun, megatron.layer_timing(rerun))[1] == pytest.approx(wait)
    # capacity-bound, the clamp's wait is the layer's only one
    bound = clamped.model_copy(update={"ffn": EPFFN(capacity_factor=1.0)})
    assert megatron.host_wait_s(bound, megatron.layer_timing(bound)) == (
        pytest.approx(wait), 0.0)


def test_the_clamps_keep_fc1s_output_unless_moe_act_reruns_them():
    from plans import RecomputeModule

    m, d = catalog.load_model("qwen3-30b-a3b"), Degrees(dp=8, ep=8)
    clamped = m.model_copy(update={"swiglu_limit": 7.0})
    none = [megatron.kept_bytes_per_token(x, d, Precision.bf16, Recompute.none, False)
            for x in (m, clamped)]
    act = [megatron.kept_bytes_per_token(x, d, Precision.bf16, Recompute.selective, False,
                                         (RecomputeModule.moe_act,)) for x in (m, clamped)]
    from cost_models.memory import EP_LOAD

    assert none[1] - none[0] == pytest.approx(m.top_k * EP_LOAD * 4 * m.expert_ffn_hidden)
    assert act[1] == act[0]


def test_current_scaling_reads_each_operand_once_more_for_its_amax():
    """fp8 casts: 4 bytes per element under MXFP8 (the block scales in the cast's pass), 6
    under per-tensor current scaling (TE's amax pass over the bf16 operand first)."""
    from plans import Fp8Recipe

    def casts(recipe):
        return megatron.fp8_cast_s(qwen(training=TrainingSpec(
            global_batch=512, seq_len=4096, precision=Precision.fp8, fp8_recipe=recipe)))

    mx, cs = casts(Fp8Recipe.mxfp8), casts(Fp8Recipe.tensorwise)
    assert cs[0] == pytest.approx(1.5 * mx[0]) and cs[1] == pytest.approx(1.5 * mx[1])
    with pytest.raises(ValueError, match="fp8_recipe mxfp8 needs precision fp8"):
        TrainingSpec(precision=Precision.bf16, fp8_recipe=Fp8Recipe.mxfp8)


def test_the_dropless_wait_includes_the_count_all_gather_over_the_ep_group():
    """The alltoall dispatcher gathers every rank's tokens per expert (int64, 128 experts)
    over EP 8 inside one node before its host reads them: one NVLink ring all-gather of
    8 x 128 x 8 bytes, latency-bound; the flex dispatchers' own kernels exchange theirs."""
    from cost_models import comm
    from plans import Dispatch

    plan = qwen()
    c = plan.cluster
    full = 8 * 128 * 8
    want = (c.node.nvlink_latency_us * 1e-6
            + 7 / 8 * full / (c.node.nvlink_gb_s * 1e9 * c.efficiency.nvlink))
    assert megatron.count_gather_s(plan) == pytest.approx(want)
    assert megatron.count_gather_s(plan) == pytest.approx(
        comm.all_gather_s(full, comm.GroupLayout(8, 8, 1), c))
    assert megatron.count_gather_s(qwen(ffn=EPFFN(dispatch=Dispatch.deepep))) == 0.0
    fwd, _ = megatron.host_wait_s(plan, megatron.layer_timing(plan))
    assert fwd >= megatron.count_gather_s(plan) + megatron.D2H_SYNC_US * 1e-6


def test_a_layerwise_graph_replays_the_whole_layer_in_one_launch():
    plan = qwen(ffn=EPFFN(capacity_factor=1.0), cuda_graphs=CudaGraphs.layer)
    n = megatron.launches(plan)
    assert n.before_wait == megatron.Launches(1, 1) and n.after_wait == megatron.NONE
    assert megatron.syncs(plan) == 0


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
    overlapped = qwen(overlap=Overlap.inter_op, **base)
    hidden = megatron.layer_timing(overlapped)
    assert hidden.total_s < blocking.total_s
    ep = sum(blocking.exposed_comm_s.get(k, 0.0) for k in megatron.EP_KINDS)
    assert 0 < megatron.paired_share(overlapped) < 1
    assert blocking.total_s - hidden.total_s == pytest.approx(
        megatron.paired_share(overlapped) * min(0.9 * ep, blocking.compute_s))


def test_ep_overlap_pairs_only_the_steady_state_of_the_schedule():
    """Megatron-Core's warmup forwards ((pp - rank - 1) x 2 + (vpp - 1) x pp + 1 per rank) and
    their cooldown backwards run unpaired: pp2 vpp24 over 32 micro-batches warms up 49 and 47
    of 768 chunk passes; without pipelining one of the micro-batches."""
    piped = qwen(degrees=Degrees(pp=2, vpp=24, dp=4, ep=4), stage_layers=(1,) * 48,
                 schedule=PipelineSchedule.interleaved_1f1b, overlap=Overlap.inter_op)
    m = piped.num_micro_batches
    assert megatron.paired_share(piped) == pytest.approx(1 - (49 + 47) / (2 * 24 * m))
    flat = qwen(degrees=Degrees(dp=8, ep=8), overlap=Overlap.inter_op)
    assert megatron.paired_share(flat) == pytest.approx(1 - 1 / flat.num_micro_batches)


def test_yarn_runs_megatron_cores_unfused_rope_on_gpt_attention_only():
    """YaRN on GPT attention (GPT-OSS's rope_scaling): Megatron-Bridge turns the RoPE fusion
    off and Megatron-Core runs _apply_rotary_pos_emb_bshd for q and for k, 12 launches
    forward and 7 backward each in place of TE's one, 24 / 28 bytes per element of q and k at
    the plain memory rate in place of the fused kernel's 4 at the fused rate; rerun under full
    recomputation. MLA's YaRN runs Megatron-Core's fused MLA kernels: nothing added."""
    yarn = catalog.load_model("gpt-oss-120b").rope_scaling
    assert yarn.attention_factor == pytest.approx(1.35, abs=0.005)
    plain = qwen(training=TrainingSpec(global_batch=512, seq_len=4096),
                 cuda_graphs=CudaGraphs.none)
    roped = plain.model_copy(update={"model": plain.model.model_copy(
        update={"rope_scaling": yarn})})
    assert not megatron.rope_unfused(plain) and megatron.rope_unfused(roped)
    a, b = megatron.launches(plain), megatron.launches(roped)
    assert (b.before_wait.fwd - a.before_wait.fwd, b.before_wait.bwd - a.before_wait.bwd) == (
        2 * 11, 2 * 6)
    assert b.after_wait == a.after_wait
    graphed = [megatron.launches(x.model_copy(update={"cuda_graphs": CudaGraphs.attn_moe_router}))
               for x in (plain, roped)]
    assert graphed[0] == graphed[1]  # replayed inside the attention's graph
    m, c = roped.model, roped.cluster
    elements = 4096 * (m.q_dim + m.kv_dim)  # micro-batch 1, tp 1: every q and k element
    fused = elements * 4 / (c.gpu.hbm_tb_s * 1e12 * c.efficiency.fused_elementwise)
    fwd, bwd, again = megatron.rope_unfused_s(roped)
    assert fwd == pytest.approx(elements * 24 / (c.gpu.hbm_tb_s * 1e12 * c.efficiency.hbm)
                                - fused)
    assert bwd == pytest.approx(elements * 28 / (c.gpu.hbm_tb_s * 1e12 * c.efficiency.hbm)
                                - fused)
    assert again == 0.0
    full = roped.model_copy(update={"recompute": Recompute.full})
    assert megatron.rope_unfused_s(full)[2] == pytest.approx(fwd)
    t, u = megatron.layer_timing(plain), megatron.layer_timing(roped)
    assert (u.fwd_s - t.fwd_s, u.bwd_s - t.bwd_s) == (pytest.approx(fwd), pytest.approx(bwd))
    v3 = catalog.load_model("deepseek-v3")
    assert v3.rope_scaling is not None and v3.mla is not None
    mla = plain.model_copy(update={"model": v3.model_copy(update={"layers": 4})})
    assert not megatron.rope_unfused(mla) and megatron.rope_unfused_s(mla) == (0.0, 0.0, 0.0)


def test_the_unfused_rope_counts_are_megatron_cores_own():
    """ROPE_UNFUSED and ROPE_UNFUSED_BYTES counted on megatron-core 0.15.3's
    _apply_rotary_pos_emb_bshd itself (the 25.11 container's 0d8e0714 has the same function):
    each dispatched non-view operation launches one kernel; bytes are each kernel's inputs
    read and output written, those of t-sized tensors per element of t."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import warnings

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.embeddings.rope_utils import (
            _apply_rotary_pos_emb_bshd,
        )

    s, b, heads, d = 16, 2, 4, 8
    t = torch.randn(s, b, heads, d, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.randn(s, 1, 1, d)

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.launches, self.t_bytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func.overloadpacket.__name__ not in ("empty", "empty_like"):
                self.launches += 1
                self.t_bytes += sum(x.numel() * x.element_size() for x in tree_leaves(
                    (args, kwargs, out)) if isinstance(x, torch.Tensor) and x.numel() >= t.numel()
                    // 2)
            return out

    with Kernels() as fwd:
        y = _apply_rotary_pos_emb_bshd(t, freqs, mscale=1.35)
    grad = torch.randn_like(y)
    with Kernels() as bwd:
        torch.autograd.grad(y, t, grad)
    assert (fwd.launches, bwd.launches) == (megatron.ROPE_UNFUSED.fwd, megatron.ROPE_UNFUSED.bwd)
    assert (fwd.t_bytes / t.numel(), bwd.t_bytes / t.numel()) == megatron.ROPE_UNFUSED_BYTES
