"""Kernel times against hand arithmetic (H800: 989 TFLOP/s bf16, 3.35 TB/s, 132 SMs; the
efficiency factors read from the catalog cluster, bench/kernels/hopper_factors.py's fit)."""

import math

import pytest

from cost_models import compute as cc
from plans import Efficiency, Precision


def test_large_square_gemm_is_compute_bound_with_wave_quantisation(h800):
    # 4096^3: 32 x 32 = 1024 tiles over 132 SMs -> 8 waves, 1024/1056 of them filled; plus the
    # fixed time per call
    flops = 2 * 4096**3
    expected = (flops / (989e12 * h800.efficiency.gemm * 1024 / 1056)
                + h800.efficiency.gemm_launch_us * 1e-6)
    assert cc.gemm_s(4096, 4096, 4096, h800, Precision.bf16) == pytest.approx(expected)


def test_tile_quantisation_pads_partial_tiles(h800):
    # m = 129 rows launch 2 tile rows: useful share 129 / 256; 2 x 32 = 64 tiles, one wave of
    # 132 SMs: 64/132 filled.
    eff = cc.tile_efficiency(129, 4096, 132)
    assert eff == pytest.approx(129 / 256 * 64 / 132)


def test_shallow_k_is_penalised_and_fp8_doubles_peak(h800):
    # k = 64: a quarter of FULL_SPEED_K = 256 -> 4x the compute time of the rate-only bound.
    launch = h800.efficiency.gemm_launch_us * 1e-6  # the fixed time per call: no faster in fp8
    deep = cc.gemm_s(4096, 4096, 4096, h800, Precision.bf16) - launch
    fp8 = cc.gemm_s(4096, 4096, 4096, h800, Precision.fp8) - launch
    assert fp8 == pytest.approx(deep * 989 / 1979)
    assert cc.depth_efficiency(64) == pytest.approx(0.25)


def test_skinny_gemm_hits_the_hbm_roofline(h800):
    # m = 8 rows x 16896 x 8192: 132 tiles (one full wave), each padded to 128 rows, take 2 x 128
    # x 16896 x 8192 / (989e12 x gemm) ~ 50 us at the tensor-core rate; the bytes (8*8192 +
    # 8192*16896 + 8*16896) x 2 over 3.35e12 x 0.85 take ~ 97 us.
    traffic = (8 * 8192 + 8192 * 16896 + 8 * 16896) * 2
    assert cc.gemm_s(8, 16896, 8192, h800, Precision.bf16) == pytest.approx(
        traffic / (3.35e12 * 0.85) + h800.efficiency.gemm_launch_us * 1e-6)


def test_grouped_gemm_for_balanced_experts(h800):
    # Mixtral on ep 8: 1024 tokens per rank x 8 ranks x top-2 / 8 experts = 2048 per expert.
    per_expert = cc.expert_tokens(8 * 1024, 2, 8, None)
    assert per_expert == 2048
    # One local expert, fc1+gate: 2048 x 28672 x 4096. Tiles 16 x 224 = 3584 over 132 SMs:
    # 28 waves, 3584/3696 filled; at grouped_gemm x 2048 / (2048 + grouped_gemm_half_rows).
    e = h800.efficiency
    peak = e.grouped_gemm * 2048 / (2048 + e.grouped_gemm_half_rows)
    t = cc.grouped_gemm_s(1, per_expert, 2 * 14336, 4096, h800, Precision.bf16)
    assert t == pytest.approx(2 * 2048 * 28672 * 4096 / (989e12 * peak * 3584 / 3696)
                              + e.grouped_gemm_launch_us * 1e-6)
    assert cc.expert_tokens(8 * 1024, 2, 8, 1.25) == 2048 * 1.25


def test_flash_attention_causal_forward_and_backward(h800):
    # s = 8192, 4 heads of 128 (32 heads / sp 8): 4 x 8192^2 x 4 x 128 x 0.5 FLOPs.
    flops = cc.attention_fwd_flops(1, 8192, 8192, 4, 128, cc.CAUSAL_FRACTION)
    assert flops == 4 * 8192 * 8192 * 4 * 128 * 0.5
    fwd = cc.flash_attention_fwd_s(flops, h800)
    assert fwd == pytest.approx(flops / (989e12 * h800.efficiency.attention))
    assert cc.flash_attention_bwd_s(flops, h800, 128) == pytest.approx(2.5 * fwd)
    # heads wider than 128 (MLA's 192): the backward at attention_wide_bwd of that rate
    wide = h800.efficiency.attention_wide_bwd
    assert wide < 1
    assert cc.flash_attention_bwd_s(flops, h800, 192) == pytest.approx(2.5 * fwd / wide)


def test_memory_bound_op(h800):
    # RMSNorm of 1024 tokens x 4096: read + write bf16 = 16 MiB at 3.35e12 x 0.85.
    nbytes = 2 * 1024 * 4096 * 2
    assert cc.memory_s(nbytes, h800) == pytest.approx(nbytes / 2.8475e12)
    assert math.isclose(cc.memory_s(0, h800), 0.0)


def test_grouped_gemm_efficiency_curve_over_rows_per_expert(h800):
    """Half-point 0 (the uncalibrated default): grouped_gemm at every expert size. Half-point
    H: half of grouped_gemm at H rows per expert, 2/3 at 2H, over the smallest dimension of the
    GEMM."""
    h800 = h800.model_copy(update={"efficiency": Efficiency()})
    assert h800.efficiency.grouped_gemm_half_rows == 0
    for rows in (16, 256, 4096):
        assert cc.grouped_efficiency(rows, 1536, 2048, h800) == h800.efficiency.grouped_gemm
    curved = h800.model_copy(update={"efficiency": h800.efficiency.model_copy(
        update={"grouped_gemm_half_rows": 128.0})})
    peak = h800.efficiency.grouped_gemm
    assert cc.grouped_efficiency(128, 1536, 2048, curved) == pytest.approx(peak / 2)
    assert cc.grouped_efficiency(256, 1536, 2048, curved) == pytest.approx(peak * 2 / 3)
    # the weight gradient's reduction runs over the rows: the same size, the same efficiency
    assert cc.grouped_efficiency(2048, 1536, 128, curved) == pytest.approx(peak / 2)
    # compute-bound experts take 1 / efficiency as long
    flat = cc.grouped_gemm_s(8, 4096, 14336, 4096, h800, Precision.bf16)
    slow = cc.grouped_gemm_s(8, 4096, 14336, 4096, curved, Precision.bf16)
    assert slow == pytest.approx(flat * (4096 + 128) / 4096)


@pytest.mark.parametrize(("mbs", "gemm"), [(8, "per_expert"), (1, "grouped")])
def test_the_layer_prices_the_expert_path_the_runtime_builds(mbs, gemm):
    """The experts' GEMMs are priced on the path plans.layout.expert_gemm picks (the one the
    runtime builds, tests/runtime/test_units.py): per-expert GEMMs at the dense GEMM's efficiency,
    grouped ones at the grouped GEMM's; a Megatron-Core plan stays grouped."""
    from cost_models import compute as cc
    from cost_models.layer import layer_key
    from cost_models.layer_graph import forward_graph
    from cost_models.params import expert_gemm_of
    from plans import Plan
    from plans.catalog import load_cluster, load_model
    from plans.enums import ExpertGemm, Target
    from plans.plan import Degrees
    from plans.specs import TrainingSpec

    model = load_model("mixtral-8x7b").model_copy(update={"layers": 2})
    plan = Plan(model=model, cluster=load_cluster("h200").with_gpus(1),
                training=TrainingSpec(global_batch=8, seq_len=4096), degrees=Degrees(),
                stage_layers=(2,), micro_batch_size=mbs)
    path = ExpertGemm(gemm)
    assert expert_gemm_of(plan) == path
    rows = plan.micro_batch_size * 4096 * model.top_k / model.experts
    shape = (rows, 2 * model.expert_ffn_hidden, model.hidden)
    fc13 = forward_graph(layer_key(plan)).nodes["expert_fc13"]["op"]
    c, p = plan.cluster, plan.training.precision
    sd = cc.routed_rows_sd(rows, model.top_k, model.experts)  # routed rows, uneven
    assert fc13.duration_s == pytest.approx(
        cc.expert_gemm_s(path, model.experts, *shape, c, p, sd))
    other = next(g for g in ExpertGemm if g != path)
    assert fc13.duration_s != pytest.approx(
        cc.expert_gemm_s(other, model.experts, *shape, c, p, sd))
    per_expert = cc.expert_gemm_s(ExpertGemm.per_expert, model.experts, *shape, c, p)
    assert per_expert == pytest.approx(model.experts * cc.gemm_s(*shape, c, p))
    megatron = plan.model_copy(update={"target": Target.megatron})
    assert expert_gemm_of(megatron) == ExpertGemm.grouped


def test_a_plan_that_names_its_expert_path_is_priced_on_it():
    """Plan.expert_gemm pins the path (a plan measured on one path names it): a micro-batch-8
    Mixtral plan the rule would run per expert, pinned grouped, prices its expert GEMMs
    grouped; Megatron-Core and torchtitan refuse a pinned per-expert path."""
    from cost_models import compute as cc
    from cost_models.layer import layer_key
    from cost_models.layer_graph import forward_graph
    from cost_models.params import expert_gemm_of
    from plans import Plan
    from plans.catalog import load_cluster, load_model
    from plans.enums import ExpertGemm, Target
    from plans.execution import ExportOnly, refusals
    from plans.plan import Degrees
    from plans.specs import TrainingSpec

    model = load_model("mixtral-8x7b").model_copy(update={"layers": 2})
    rule = Plan(model=model, cluster=load_cluster("h200").with_gpus(1),
                training=TrainingSpec(global_batch=8, seq_len=4096), degrees=Degrees(),
                stage_layers=(2,), micro_batch_size=8)
    pinned = rule.model_copy(update={"expert_gemm": ExpertGemm.grouped})
    assert expert_gemm_of(rule) == ExpertGemm.per_expert
    assert expert_gemm_of(pinned) == ExpertGemm.grouped
    shape = (8 * 4096 * model.top_k / model.experts, 2 * model.expert_ffn_hidden, model.hidden)
    fc13 = forward_graph(layer_key(pinned)).nodes["expert_fc13"]["op"]
    c, p = pinned.cluster, pinned.training.precision
    sd = cc.routed_rows_sd(shape[0], model.top_k, model.experts)
    assert fc13.duration_s == pytest.approx(
        cc.expert_gemm_s(ExpertGemm.grouped, model.experts, *shape, c, p, sd))
    per_expert = rule.model_copy(update={"expert_gemm": ExpertGemm.per_expert})
    for target in (Target.megatron, ExportOnly.torchtitan):
        assert any("expert_gemm" in r for r in refusals(per_expert, target=target))
        assert not any("expert_gemm" in r for r in refusals(pinned, target=target))


def test_routed_rows_pad_each_groups_last_row_tile():
    # E[ceil(r / 128)] with r ~ normal(mean, sd): a Monte-Carlo estimate of the same
    import random

    rng = random.Random(0)
    for mean, sd in ((128, 11.3), (512, 22.6), (1000, 30.0)):
        draws = [math.ceil(max(1, round(rng.gauss(mean, sd))) / cc.TILE) for _ in range(40000)]
        assert cc.row_tiles(mean, sd) == pytest.approx(sum(draws) / len(draws), rel=0.01)
    assert cc.row_tiles(128, 0.0) == 1 and cc.row_tiles(129, 0.0) == 2
    assert cc.routed_rows_sd(128, 8, 256) == pytest.approx(math.sqrt(128 * (1 - 8 / 256)))


def test_uneven_rows_slow_a_grouped_gemm_of_few_rows_per_expert():
    # on H200, DeepSeek-V3's 256 experts at 128 rows each: half of them spill into a second
    # row tile; Mixtral's 8 at 4,096 rows: one partly empty tile in 32 (measured on one H200,
    # bench/results/h200/*/expert_gemm_parts_*: +48% and about 0)
    from plans.catalog import load_cluster

    h200 = load_cluster("h200")

    def ratio(experts, rows, n, k, top_k):
        sd = cc.routed_rows_sd(rows, top_k, experts)
        return (cc.grouped_gemm_s(experts, rows, n, k, h200, Precision.bf16, sd)
                / cc.grouped_gemm_s(experts, rows, n, k, h200, Precision.bf16))

    assert ratio(256, 128, 2048, 7168, 8) > 1.1
    assert 1.0 < ratio(8, 4096, 14336, 4096, 2) < 1.03


def test_grouped_rows_come_in_blocks_each_streaming_its_experts_weights():
    # torch._grouped_mm on sm90, measured on one H200 (bench/results/h200/deepseek_v3/
    # expert_gemm_rows_*): 128-row blocks up to 128 mean rows, 256-row blocks above, each
    # block re-reading its expert's weights; the weight gradient is grouped over its rows'
    # reduction and keeps its output tiles
    from plans.catalog import load_cluster

    h200 = load_cluster("h200")
    bf16 = Precision.bf16
    assert h200.efficiency.grouped_gemm_stream_tb_s is not None
    assert cc.grouped_block_rows(128) == 128 and cc.grouped_block_rows(129) == 256

    def fwd(rows, sd=0.0, cluster=h200):
        return cc.grouped_gemm_s(256, rows, 2048, 7168, cluster, bf16, sd)

    # 160 and 256 rows both fill one 256-row block per expert
    assert fwd(160) == pytest.approx(fwd(256), rel=0.02)
    # at 128 mean rows half the experts spill into a second block, whose weights stream again
    sd = cc.routed_rows_sd(128, 8, 256)
    assert fwd(128, sd) / fwd(128) == pytest.approx(cc.row_tiles(128, sd), rel=0.05)
    wgrad = cc.grouped_gemm_s(256, 2048, 7168, 128, h200, bf16, sd, over_rows=False)
    assert wgrad == cc.grouped_gemm_s(256, 2048, 7168, 128, h200, bf16, over_rows=False)
    # a cluster whose grouped kernel is not fitted keeps 128-row tiles, weights read once
    prior = h200.model_copy(update={"efficiency": h200.efficiency.model_copy(
        update={"grouped_gemm_stream_tb_s": None})})
    assert fwd(128, sd, prior) / fwd(128, cluster=prior) < 0.9 * cc.row_tiles(128, sd)
