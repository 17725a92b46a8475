"""The cost model prices MLA, MTP, the layer pattern, sliding windows and group-limited
routing from the model's shapes."""

from pathlib import Path

import pytest

import cost_models
from cost_models import compute as cc
from cost_models.layer import layer_key
from cost_models.layer_graph import forward_graph
from cost_models.memory import layer_activation_terms
from cost_models.params import stage_layer_counts, stage_params
from cost_models.volumes import ulysses_attention
from plans import (
    EPFFN,
    Degrees,
    Plan,
    Recompute,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)

HF = Path(__file__).parents[1] / "plans" / "hf_configs"


def plan_of(model, pp: int = 1, stage_layers=None, **degrees) -> Plan:
    d = Degrees(pp=pp, **({"dp": 1, "sp": 8, "ep": 8} | degrees))
    attention = TPAttention() if d.tp > 1 else UlyssesAttention()
    return Plan(model=model, cluster=catalog.load_cluster("h800", gpus=d.world),
                training=TrainingSpec(global_batch=8 * d.dp, seq_len=4096), degrees=d,
                attention=attention, ffn=EPFFN(), micro_batch_size=1,
                stage_layers=stage_layers or (model.layers,))


def ops(plan: Plan) -> dict:
    return {n: op for n, op in forward_graph(layer_key(plan)).nodes(data="op")}


def test_mla_projections_are_its_down_and_up_gemms():
    """DeepSeek-V3's MLA on 8-way Ulysses: on 4096 / 8 tokens the down-projection to the
    latents and RoPE key (7168 -> 1536 + 512 + 64) and the up-projections (1536 -> 128 x 192,
    512 -> 128 x 256); the output reads 128 x 128."""
    v3 = catalog.load_model("deepseek-v3")
    plan = plan_of(v3)
    graph, cl, p = ops(plan), plan.cluster, plan.training.precision
    t = 4096 / 8
    assert graph["qkv_gemm"].duration_s == cc.gemm_s(t, 1536 + 512 + 64, 7168, cl, p)
    assert graph["qkv_up_gemm"].duration_s == pytest.approx(
        cc.gemm_s(t, 128 * 192, 1536, cl, p) + cc.gemm_s(t, 128 * 256, 512, cl, p))
    assert graph["out_gemm"].duration_s == cc.gemm_s(t, 7168, 128 * 128, cl, p)
    # the core: QK^T at 192 and PV at 128 over 128 / 8 heads, causal
    flops = cc.attention_fwd_flops(1, 4096, 4096, 16, 160, 0.5)
    assert graph["flash_attn"].duration_s == cc.flash_attention_fwd_s(flops, cl)
    # Ulysses moves q, every head's k (192) and v (128) there, the 128-wide output back
    qkv, out = ulysses_attention(v3, 1, 4096, 8)
    assert qkv.buffer_bytes == t * 128 * (192 + 192 + 128) * 2
    assert out.buffer_bytes == t * 128 * 128 * 2


def test_tp_splits_mla_heads_and_replicates_the_down_projection():
    v3 = catalog.load_model("deepseek-v3")
    tp2, tp4 = (ops(plan_of(v3, tp=tp, sp=1, ep=8, dp=8 // tp)) for tp in (2, 4))
    assert tp2["qkv_gemm"].duration_s == tp4["qkv_gemm"].duration_s  # 4096 rows, replicated
    assert tp4["qkv_up_gemm"].duration_s < tp2["qkv_up_gemm"].duration_s
    assert tp4["flash_attn"].duration_s == pytest.approx(tp2["flash_attn"].duration_s / 2)


def test_mla_keeps_its_latents_and_its_wider_keys():
    v3 = catalog.load_model("deepseek-v3")
    d = Degrees(sp=8, ep=8)
    terms = layer_activation_terms(v3, 1.0, d, EPFFN(), Recompute.none, False)
    assert terms["mla_latents"] == 12 * (1536 + 512)
    # q (128 x 192), k (128 x 192), v (128 x 128) received, and the core's own copies
    # the core's RoPE'd q and k (128 x 192) and v (128 x 128), the log-sum-exp, its output and
    # the output all-to-all'd back
    assert terms["attention_core"] == 4 * 24576 + 2 * 16384 + 4 * 128 + 2 * 16384 + 2 * 16384


def test_mtp_runs_on_the_last_stage():
    v3 = catalog.load_model("deepseek-v3")
    without = v3.model_copy(update={"mtp_layers": 0})
    stages = (16, 15, 15, 15)
    assert stage_layer_counts(v3, stages, 4) == ((13, 3), (15, 0), (15, 0), (16, 0))
    a, b = plan_of(v3, pp=4, stage_layers=stages), plan_of(without, pp=4, stage_layers=stages)
    ea, eb = cost_models.evaluate(a), cost_models.evaluate(b)
    assert ea.stage_forward_s[:3] == eb.stage_forward_s[:3]
    # one more MoE layer, the projection and a second pass of the head and loss
    extra = ea.stage_forward_s[3] - eb.stage_forward_s[3]
    assert extra > ea.layer.fwd_s
    pa, pb = stage_params(v3, a.degrees, stages), stage_params(without, b.degrees, stages)
    assert pa[3].expert - pb[3].expert == pytest.approx(256 // 8 * v3.expert_params)
    assert pa[3].dense - pb[3].dense == pytest.approx(
        v3.layer_params(True, 0) + v3.mtp_extra_params, rel=1e-9)
    assert ea.mfu / eb.mfu == pytest.approx(
        v3.flops_per_token(4096) / without.flops_per_token(4096) * eb.step_time_s
        / ea.step_time_s)


def test_interleaved_dense_layers_are_placed_by_the_pattern():
    maverick = catalog.load_model(str(HF / "llama-4-maverick.json")).model_copy(
        update={"sliding_window": 0, "full_attention_every": 0})
    assert stage_layer_counts(maverick, (24, 24), 2) == ((12, 12), (12, 12))
    assert stage_layer_counts(maverick, (3, 45), 2) == ((1, 2), (23, 22))


def test_sliding_windows_shrink_the_attention_core():
    oss = catalog.load_model("gpt-oss-120b")
    full = oss.model_copy(update={"sliding_window": 0, "full_attention_every": 0})
    windowed, whole = ops(plan_of(oss)), ops(plan_of(full))
    # half the layers over 128 keys of 4096, half causal: (128/4096 (1 - 1/64) + 1/2) / 2 / 1/2
    ratio = (128 / 4096 * (1 - 64 / 4096) + 0.5) / 2 / 0.5
    fa = cc.flash_attention_fwd_s
    flops = cc.attention_fwd_flops(1, 4096, 4096, 8, 64, 0.5)
    assert windowed["flash_attn"].duration_s == fa(flops * ratio, plan_of(oss).cluster)
    assert whole["flash_attn"].duration_s == fa(flops, plan_of(oss).cluster)
    assert oss.attention_flops_per_token(4096) == pytest.approx(
        ratio * full.attention_flops_per_token(4096))


def test_cross_layer_kv_sharing_halves_the_kv_projections():
    hunyuan = catalog.load_model(str(HF / "hunyuan-large.json"))
    own = hunyuan.model_copy(update={"kv_share_layers": 1})
    a, b = ops(plan_of(hunyuan, ep=8)), ops(plan_of(own, ep=8))
    # q and half the layers' k and v: (6400 + 1280 / 2) wide instead of 6400 + 1280
    assert sum(a["qkv_gemm"].bwd) < sum(b["qkv_gemm"].bwd)
    assert a["qkv_gemm"].duration_s <= b["qkv_gemm"].duration_s
    assert own.total_params - hunyuan.total_params == 32 * 2 * 6400 * 640  # 8 x 80 wide
