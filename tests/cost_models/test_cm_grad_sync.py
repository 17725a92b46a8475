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
    """As the runtime runs it: ZeRO-1 hides its reduce-scatter behind the backward window but
    not its all-gather; without ZeRO-1 the whole all-reduce hides; the last bucket only behind
    the drain of the earlier stages."""
    sync = GradSync(1.0, 0.5, last_reduce_scatter_s=0.1, last_all_gather_s=0.05)
    assert exposed_grad_sync_s(sync, 0.2, 0.0, False, 0.9, sharded=True) == 1.5
    assert exposed_grad_sync_s(sync, 0.2, 0.0, True, 0.9, True) == pytest.approx(
        1.0 - 0.9 * 0.2 + 0.5)
    assert exposed_grad_sync_s(sync, 0.2, 0.0, True, 0.9, False) == pytest.approx(
        1.5 - 0.9 * 0.2)
    # a long backward hides all but the last bucket; a long drain hides that too
    assert exposed_grad_sync_s(sync, 5.0, 0.0, True, 0.9, True) == pytest.approx(0.1 + 0.5)
    assert exposed_grad_sync_s(sync, 5.0, 0.0, True, 0.9, False) == pytest.approx(0.15)
    assert exposed_grad_sync_s(sync, 5.0, 5.0, True, 0.9, False) == 0.0


def test_last_bucket_is_one_bucket_of_a_large_group(plan_352b):
    from plans.execution import GRAD_SYNC_BUCKET_PARAMS

    d, c = plan_352b.degrees, plan_352b.cluster
    big = grad_sync(StageParams(1e10, 0.0), d, c, Precision.bf16)
    bucket = grad_sync(StageParams(GRAD_SYNC_BUCKET_PARAMS, 0.0), d, c, Precision.bf16)
    assert big.last_reduce_scatter_s == pytest.approx(bucket.reduce_scatter_s)
    assert bucket.last_reduce_scatter_s == pytest.approx(bucket.reduce_scatter_s)


def test_last_bucket_holds_the_first_registered_parameter():
    """Buckets fill in reverse registration order and never split a parameter, so the last
    one is at least the first parameter (the embedding on the first stage)."""
    from cost_models.grad_sync import last_bucket_params
    from plans.execution import GRAD_SYNC_BUCKET_PARAMS

    assert last_bucket_params(1e9, 0.0) == GRAD_SYNC_BUCKET_PARAMS
    assert last_bucket_params(1e9, 1.3e8) == 1.3e8
    assert last_bucket_params(1e7, 5e6) == 1e7
