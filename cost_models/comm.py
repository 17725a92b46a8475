"""Collective times: latency + bytes / algorithm bandwidth, hierarchical across nodes.

Buffer conventions (as NCCL names them): ``all_gather_s`` and ``reduce_scatter_s`` take the full
(gathered) buffer; every rank moves (n-1)/n of it. ``all_to_all_s`` takes one rank's send
buffer; (n-1)/n of it leaves the rank. Bandwidths are per GPU per direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plans.specs import ClusterSpec


@dataclass(frozen=True)
class GroupLayout:
    """How a communication group lies over NVLink domains."""

    size: int
    ranks_per_node: int
    nodes: int


def group_layout(size: int, stride: int, gpus_per_node: int) -> GroupLayout:
    """Ranks r0 + i x stride (i < size), where stride is the product of the mesh axes inside
    this one. Rank order, innermost first: (tp | sp | cp), dp, pp for attention and
    (etp, ep), edp, pp for the FFN, so a group of inner axes within gpus_per_node is one node."""
    if size <= 1:
        return GroupLayout(max(size, 1), 1, 1)
    per_node = max(1, min(size, gpus_per_node // stride))
    return GroupLayout(size, per_node, math.ceil(size / per_node))


def _nvlink_b_s(cluster: ClusterSpec, efficiency: float) -> float:
    return cluster.node.nvlink_gb_s * 1e9 * efficiency


def _network_b_s(cluster: ClusterSpec) -> float:
    return cluster.network_gb_s_per_gpu * 1e9 * cluster.efficiency.network


def _ring_s(full_bytes: float, n: int, bytes_per_s: float, latency_s: float,
            steps_latency: bool = False) -> float:
    """One ring all-gather or reduce-scatter: each rank moves (n-1)/n of the full buffer.

    Latency: NCCL's cost model (src/graph/tuning.cc) charges a ring base + (n - 1) x a
    per-step hardware latency. On NVLink the per-step latency of the small-message protocol
    is 0.4 us (LL), so 7 steps cost about one ``nvlink_latency_us``: one latency per
    collective, as calibration fits it. Across nodes each of the n - 1 steps pays
    ``network.latency_us`` (``steps_latency``): the latency floor that makes the achieved
    network bandwidth grow with the message size, as in nccl-tests' bus-bandwidth curves."""
    if n <= 1 or full_bytes <= 0:
        return 0.0
    latency = (n - 1) * latency_s if steps_latency else latency_s
    return latency + (n - 1) / n * full_bytes / bytes_per_s


def all_gather_s(full_bytes: float, layout: GroupLayout, cluster: ClusterSpec) -> float:
    """Ring all-gather; across nodes hierarchical: the ranks of equal local index gather
    full/ranks_per_node over the network, then each node gathers the full buffer on NVLink."""
    intra = _ring_s(
        full_bytes, layout.ranks_per_node, _nvlink_b_s(cluster, cluster.efficiency.nvlink),
        cluster.node.nvlink_latency_us * 1e-6,
    )
    inter = _ring_s(
        full_bytes / layout.ranks_per_node, layout.nodes, _network_b_s(cluster),
        cluster.network.latency_us * 1e-6, steps_latency=True,
    )
    return intra + inter


def reduce_scatter_s(full_bytes: float, layout: GroupLayout, cluster: ClusterSpec) -> float:
    """The mirror of all-gather (intra-node reduce-scatter first): the same bytes and steps."""
    return all_gather_s(full_bytes, layout, cluster)


def all_reduce_s(nbytes: float, layout: GroupLayout, cluster: ClusterSpec) -> float:
    """Reduce-scatter then all-gather (ring all-reduce)."""
    return reduce_scatter_s(nbytes, layout, cluster) + all_gather_s(nbytes, layout, cluster)


def all_to_all_shares(layout: GroupLayout) -> tuple[float, float]:
    """Shares of one rank's all-to-all send buffer (1/n to each of the n ranks, itself
    included) that leave over NVLink (the ranks_per_node - 1 others of its node) and over the
    network (the n - ranks_per_node ranks of other nodes)."""
    n = layout.size
    if n <= 1:
        return 0.0, 0.0
    return (layout.ranks_per_node - 1) / n, (n - layout.ranks_per_node) / n


def concurrent_links_s(nvlink_bytes: float, network_bytes: float, layout: GroupLayout,
                       cluster: ClusterSpec, forwarded: bool = False) -> float:
    """One rank sending ``nvlink_bytes`` over NVLink and ``network_bytes`` over the network at
    once (every peer at the all-to-all rate): the slower link counts, after one latency of the
    network when the group spans nodes, else of NVLink. ``forwarded``: what crosses the network
    is forwarded over NVLink on arrival (DeepEP), one NVLink latency more."""
    if nvlink_bytes <= 0 and network_bytes <= 0:
        return 0.0
    eff = cluster.efficiency
    intra = nvlink_bytes / _nvlink_b_s(cluster, eff.nvlink_all_to_all)
    if layout.nodes == 1:
        return cluster.node.nvlink_latency_us * 1e-6 + intra
    inter = network_bytes / _network_b_s(cluster)
    latency = cluster.network.latency_us + (cluster.node.nvlink_latency_us if forwarded else 0.0)
    return latency * 1e-6 + max(intra, inter)


def all_to_all_s(rank_bytes: float, layout: GroupLayout, cluster: ClusterSpec) -> float:
    """All-to-all(v) with ``rank_bytes`` sent per rank, 1/n to each peer (itself included).
    Across nodes the NVLink share and the network share (all_to_all_shares) move at once: the
    slower one counts."""
    if layout.size <= 1 or rank_bytes <= 0:
        return 0.0
    nvlink, network = all_to_all_shares(layout)
    return concurrent_links_s(nvlink * rank_bytes, network * rank_bytes, layout, cluster)


def send_recv_s(nbytes: float, cluster: ClusterSpec, cross_node: bool) -> float:
    """One point-to-point transfer (pipeline stage to stage)."""
    if nbytes <= 0:
        return 0.0
    if cross_node:
        return cluster.network.latency_us * 1e-6 + nbytes / _network_b_s(cluster)
    return cluster.node.nvlink_latency_us * 1e-6 + nbytes / _nvlink_b_s(
        cluster, cluster.efficiency.nvlink
    )
