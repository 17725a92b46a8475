"""Collectives against hand arithmetic (H800: NVLink 200 GB/s, network 8 x 50 / 8 GB/s)."""

import pytest

from cost_models import comm
from cost_models.comm import GroupLayout


def test_group_layout_over_nodes():
    assert comm.group_layout(8, 1, 8) == GroupLayout(8, 8, 1)      # sp inside a node
    assert comm.group_layout(12, 8, 8) == GroupLayout(12, 1, 12)   # dp across 12 nodes
    assert comm.group_layout(16, 1, 8) == GroupLayout(16, 8, 2)    # 16 ranks over 2 nodes
    assert comm.group_layout(8, 2, 8) == GroupLayout(8, 4, 2)      # ep over etp 2
    assert comm.group_layout(1, 4, 8) == GroupLayout(1, 1, 1)


def test_intra_node_ring_all_gather(h800):
    # 8 ranks, 800 MB full buffer: 3 us + 7/8 x 800e6 / (200e9 x 0.80).
    t = comm.all_gather_s(800e6, comm.group_layout(8, 1, 8), h800)
    assert t == pytest.approx(3e-6 + 7 / 8 * 800e6 / 160e9)
    assert comm.reduce_scatter_s(800e6, comm.group_layout(8, 1, 8), h800) == t
    assert comm.all_reduce_s(800e6, comm.group_layout(8, 1, 8), h800) == pytest.approx(2 * t)


def test_intra_node_all_to_all(h800):
    # 8 ranks, 80 MB per rank: 7/8 leave at 200e9 x 0.65.
    t = comm.all_to_all_s(80e6, comm.group_layout(8, 1, 8), h800)
    assert t == pytest.approx(3e-6 + 7 / 8 * 80e6 / 130e9)


def test_hierarchical_all_gather_over_two_nodes(h800):
    # 16 ranks, 8 per node: NVLink ring over 8 of the full 1.6 GB, then a network ring over
    # 2 nodes of 1.6 GB / 8 at 50e9 x 0.80.
    t = comm.all_gather_s(1.6e9, comm.group_layout(16, 1, 8), h800)
    nvlink = 3e-6 + 7 / 8 * 1.6e9 / 160e9
    network = 10e-6 + 1 / 2 * 0.2e9 / 40e9
    assert t == pytest.approx(nvlink + network)


def test_network_only_ring_and_all_to_all(h800):
    # 12 ranks one per node: 11 ring steps, 11/12 of the buffer on the network.
    assert comm.all_gather_s(1.2e9, comm.group_layout(12, 8, 8), h800) == pytest.approx(
        11 * 10e-6 + 11 / 12 * 1.2e9 / 40e9)
    # 16-rank all-to-all over 2 nodes: 7/16 stays on NVLink, 8/16 crosses; the slower counts.
    t = comm.all_to_all_s(160e6, comm.group_layout(16, 1, 8), h800)
    assert t == pytest.approx(10e-6 + max(7 / 16 * 160e6 / 130e9, 8 / 16 * 160e6 / 40e9))


def test_send_recv(h800):
    assert comm.send_recv_s(8e6, h800, cross_node=True) == pytest.approx(10e-6 + 8e6 / 40e9)
    assert comm.send_recv_s(8e6, h800, cross_node=False) == pytest.approx(3e-6 + 8e6 / 160e9)
    assert comm.all_gather_s(1e9, comm.group_layout(1, 1, 8), h800) == 0.0


def test_network_latency_floor_by_message_size(h800):
    """Across nodes each ring step pays the network latency: small messages are latency-bound
    and the achieved bus bandwidth rises with the message size toward bandwidth x efficiency,
    as nccl-tests' curves do."""
    layout = comm.group_layout(12, 8, 8)
    bus = [11 / 12 * size / comm.all_gather_s(size, layout, h800)
           for size in (1e4, 1e6, 1e8, 1e10)]
    assert bus == sorted(bus) and bus[0] < 0.1 * 40e9 and bus[-1] > 0.99 * 40e9
