"""Data-parallel gradient sync: groups, precision and overlap."""

import pytest

from cost_models.grad_sync import GradSync, exposed_grad_sync_s, grad_sync
from cost_models.params import StageParams
from plans import Precision


def test_fp32_is_twice_bf16(plan_352b):
    p, d, c = StageParams(1e9, 0.0), plan_352b.degrees, plan_352b.cluster
    fp32 = grad_sync(p, d, c, Precision.fp32)
    bf16 = grad_sync(p, d, c, Precision.bf16)
    # Dense group dp x sp = 96 ranks of stride 1: 8 per node over 12 nodes, hierarchical.
    nvlink = 3e-6 + 7 / 8 * 2e9 / 160e9
    network = 11 * 10e-6 + 11 / 12 * 2e9 / 8 / 40e9  # 11 ring steps over the network
    assert bf16.reduce_scatter_s == pytest.approx(nvlink + network)
    latency = 3e-6 + 11 * 10e-6
    assert fp32.reduce_scatter_s - latency == pytest.approx(2 * (bf16.reduce_scatter_s - latency))


def test_expert_group_crosses_nodes_one_rank_each(plan_352b):
    # edp = 12 ranks of stride ep = 8: one per node, network ring only.
    sync = grad_sync(StageParams(0.0, 1e9), plan_352b.degrees, plan_352b.cluster, Precision.bf16)
    assert sync.all_gather_s == pytest.approx(11 * 10e-6 + 11 / 12 * 2e9 / 40e9)


def test_exposure():
    sync = GradSync(1.0, 0.5)
    assert exposed_grad_sync_s(sync, 0.2, 0.1, overlap=False, hidden_share=0.9) == 1.5
    assert exposed_grad_sync_s(sync, 0.2, 0.1, True, 0.9) == pytest.approx(1.5 - 0.9 * 0.3)
    assert exposed_grad_sync_s(sync, 5.0, 5.0, True, 0.9) == pytest.approx(0.15)
