"""Pipeline step and bubble formulas against hand values."""

import pytest

from cost_models import pipeline as pl


def test_1f1b_uniform_and_uneven():
    # p = 4 stages of 10 ms, m = 8: (8 - 1) x 10 + 4 x 10 = 110 ms; bubble (p - 1) t = 30 ms.
    assert pl.step_s([0.01] * 4, 8) == pytest.approx(0.110)
    assert pl.bubble_s([0.01] * 4) == pytest.approx(0.030)
    # Uneven 10, 12, 10, 14 ms, m = 8: 7 x 14 + 46 = 144 ms.
    assert pl.step_s([0.010, 0.012, 0.010, 0.014], 8) == pytest.approx(0.144)


def test_interleaved_divides_the_bubble_by_vpp():
    # p = 4, v = 2, t = 10 ms per stage, m = 8: 8 x 10 + (4 - 1) x 10 / 2 = 95 ms.
    assert pl.step_s([0.01] * 4, 8, vpp=2) == pytest.approx(0.095)
    assert pl.bubble_s([0.01] * 4, vpp=2) == pytest.approx(0.015)


def test_p2p_crosses_nodes_in_the_paper_layout(plan_352b):
    # pp stride = 1440 / 15 = 96 ranks: 12 nodes apart. 1024 tokens x 4096 x 2 bytes at
    # 50e9 x 0.80 + 10 us.
    assert pl.p2p_transfer_s(plan_352b) == pytest.approx(10e-6 + 1024 * 4096 * 2 / 40e9)
    # Fill and drain 2 x 14 transfers, steady state 2 x 59 hidden to 10%.
    t = pl.p2p_transfer_s(plan_352b)
    assert pl.exposed_p2p_s(plan_352b, t) == pytest.approx(28 * t + 118 * t * 0.1)


def test_head_and_embedding(plan_352b):
    m, c = plan_352b.model, plan_352b.cluster
    head = pl.head_cost(m, c, 1024, 1)
    emb = pl.embedding_cost(m, c, 1024, 1)
    # The LM head GEMM alone: 1024 x 65536 x 4096 at 989e12 x gemm (512 tiles, 4 waves of 132),
    # plus the fixed time per call
    gemm = (2 * 1024 * 65536 * 4096 / (989e12 * c.efficiency.gemm * 512 / 528)
            + c.efficiency.gemm_launch_us * 1e-6)
    # the cross-entropy's passes over 1024 x 65536 logits at the achievable HBM rate: forward 22
    # bytes a logit (fp32 cast, three reads and a write of log-softmax), backward 26
    hbm = c.gpu.hbm_tb_s * 1e12 * c.efficiency.hbm
    ce_fwd, ce_bwd = 1024 * 65536 * 22 / hbm, 1024 * 65536 * 26 / hbm
    norm_fwd = 2 * 1024 * 4096 * 2 / hbm
    assert head.fwd_s == pytest.approx(gemm + ce_fwd + norm_fwd, rel=1e-6)
    # backward: data and weight gradients, each the forward's FLOPs at no more than the peak
    # fraction (their own tile counts fill the waves differently), and the cross-entropy's
    # backward passes
    ideal = 2 * 1024 * 65536 * 4096 / (989e12 * c.efficiency.gemm)
    assert head.bwd_s > 2 * ideal + ce_bwd
    assert emb.total_s < head.total_s / 10


def test_stragglers_by_hand(plan_352b):
    """pp 15 stages wait for the slowest each slot, 12 replicas once per step over m = 60
    micro-batches: c (sqrt(2 ln 15) + sqrt(2 ln 12) / sqrt(60)) of the pipelined time."""
    import math

    d, c = plan_352b.degrees, plan_352b.cluster.stage_time_cv
    assert (d.pp, d.dp, plan_352b.num_micro_batches) == (15, 12, 60)
    share = c * (math.sqrt(2 * math.log(15)) + math.sqrt(2 * math.log(12)) / math.sqrt(60))
    assert pl.straggler_s(2.0, plan_352b) == pytest.approx(2.0 * share)
    steady = plan_352b.cluster.model_copy(update={"stage_time_cv": 0.0})
    assert pl.straggler_s(2.0, plan_352b.model_copy(update={"cluster": steady})) == 0.0
