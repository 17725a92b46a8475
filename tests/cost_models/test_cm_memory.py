"""Memory per GPU: the paper's activation formulas, ZeRO-1 states, feasibility."""

import pytest

from cost_models import memory_breakdown
from cost_models.memory import in_flight_micro_batches, layer_activation_bytes
from cost_models.params import stage_params
from plans import EPFFN, Degrees, Recompute
from plans.catalog import load_model

GIB = 2**30


def test_paper_activation_formulas(plan_352b):
    # n = 8, k = 3, f = 14336/4096 = 3.5, m = 4; b s h / n = 1024 x 4096.
    m, d = plan_352b.model, plan_352b.degrees
    unit = 1024 * 4096
    before = layer_activation_bytes(m, 1024, d, EPFFN(), Recompute.none, False)
    after = layer_activation_bytes(m, 1024, d, EPFFN(), Recompute.selective, False)
    full = layer_activation_bytes(m, 1024, d, EPFFN(), Recompute.full, False)
    assert before == pytest.approx((2 * 8 + 2 * 3 + 3 * 3 * 3.5 + 12 + 5 / 4) * unit)
    assert after == pytest.approx((2 * 3 * 3.5 + 4 + 2 / 4) * unit)
    assert full == 2 * unit
    # "about half": 66.75 -> 25.5 units.
    assert 0.3 < after / before < 0.6


def test_tp_layout_uses_korthikanti(megatron_352b):
    # 15 (attention 11 + norms 4) + FFN input kept sharded 2 + 2k + 3kf, per b s h / t.
    m, d = megatron_352b.model, megatron_352b.degrees
    b = layer_activation_bytes(m, 1024, d, megatron_352b.ffn, Recompute.none, False)
    assert b == pytest.approx((15 + 2 + 6 + 31.5) * 1024 * 4096)


def test_in_flight_micro_batches():
    assert in_flight_micro_batches(0, 15, 1, 60) == 15
    assert in_flight_micro_batches(14, 15, 1, 60) == 1
    assert in_flight_micro_batches(0, 15, 1, 4) == 4
    # Interleaved, p = 4, v = 2: 2 x 3 + 1 x 4 + 1 = 11 chunk forwards = 5.5 stages'
    # worth = p (1 + (p - 1)/(p v)) (Korthikanti et al. 2022, Sec. 4.2.3).
    assert in_flight_micro_batches(0, 4, 2, 16) == pytest.approx(4 * (1 + 3 / 8))


def test_stage_params_sum_to_the_model():
    for name in ("internal-352b", "tiny-moe-shared"):
        m = load_model(name)
        whole = stage_params(m, Degrees(), (m.layers,))
        assert whole[0].total == m.total_params
    m = load_model("internal-352b")
    split = stage_params(m, Degrees(pp=15, dp=12, sp=8, ep=8), (4,) * 15)
    # Experts split 8 ways, attention replicated, untied head on the last stage.
    assert split[1].expert == 4 * 4 * m.expert_params
    assert split[0].dense - split[1].dense == m.vocab * m.hidden


def test_352b_breakdown_by_hand(plan_352b):
    mem = memory_breakdown(plan_352b)
    assert mem.fits and mem.stage == 0
    p = stage_params(plan_352b.model, plan_352b.degrees, plan_352b.stage_layers)[0]
    c = mem.components_bytes
    assert c["params"] == 2 * p.total
    assert c["grads"] == 2 * p.total          # bf16 sync keeps bf16 main grads
    assert c["optimizer"] == pytest.approx(12 * (p.dense / 96 + p.expert / 12))
    unit = 1024 * 4096
    assert c["activations"] == pytest.approx(15 * 4 * (2 * 3 * 3.5 + 4 + 0.5) * unit)
    assert mem.capacity_bytes == pytest.approx(80 * GIB * 0.92)


def test_full_recompute_and_fp32_grads_change_memory(plan_352b):
    sel = memory_breakdown(plan_352b)
    full = memory_breakdown(plan_352b.model_copy(update={"recompute": Recompute.full}))
    none = memory_breakdown(plan_352b.model_copy(update={"recompute": Recompute.none}))
    assert full.components_bytes["activations"] < sel.components_bytes["activations"]
    assert none.components_bytes["activations"] > 2 * sel.components_bytes["activations"]
    fp32 = memory_breakdown(plan_352b.model_copy(update={"grad_sync_precision": "fp32"}))
    assert fp32.components_bytes["grads"] == 2 * sel.components_bytes["grads"]


def test_over_hbm_is_infeasible_with_numbers(plan_352b):
    from cost_models import evaluate

    big = plan_352b.model_copy(update={"micro_batch_size": 6, "recompute": Recompute.none})
    ev = evaluate(big)
    assert not ev.feasible and not ev.memory.fits
    peak = ev.memory.peak_bytes / GIB
    assert ev.reason == f"peak memory {peak:.1f} GiB > usable 73.6 GiB on stage 0"
