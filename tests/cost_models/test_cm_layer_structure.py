"""A layer pass's structure is built once per layout shape and shared by clusters; the
networkx graphs of the critical-path report are the scheduled passes'."""

import networkx as nx
import pytest

import cost_models.layer as layer
import cost_models.layer_graph as lg
from cost_models.layer import layer_graphs, layer_key, layer_timing_for, schedule_s
from plans import EPFFN, Dispatch, Kernels, Overlap, Recompute

CASES = [
    ("internal-352b", Overlap.inter_op, Recompute.selective, Kernels.eager),
    ("internal-352b", Overlap.inter_intra_op, Recompute.full, Kernels.fused),
    ("mixtral-8x7b", Overlap.none, Recompute.none, Kernels.fused),
    ("deepseek-v3", Overlap.inter_op, Recompute.full, Kernels.eager),
]


def _clear():
    for cache in (layer._forward, layer._built, layer._backward, layer._backward_of,
                  layer._forward_pass, layer_timing_for, layer._structure, lg.backward_steps,
                  lg._backward_steps):
        cache.cache_clear()


@pytest.mark.parametrize(("name", "overlap", "recompute", "kernels"), CASES)
def test_the_graphs_are_the_scheduled_passes(node_plan, name, overlap, recompute, kernels):
    plan = node_plan(name, overlap=overlap, recompute=recompute, kernels=kernels,
                     ffn=EPFFN(dispatch=Dispatch.all_to_all))
    key = layer_key(plan)
    fwd, bwd = layer_graphs(key, overlap)
    assert lg.entries_of(fwd) == layer._forward(layer._forward_key(key), overlap).entries
    assert lg.entries_of(bwd) == layer._backward(key, overlap).entries
    # the report's backward graph is derived from the forward graph alone
    derived = lg.backward_graph(fwd, recompute, autograd_nodes=overlap == Overlap.inter_op)
    assert list(derived.nodes) == list(bwd.nodes)
    assert list(derived.edges) == list(bwd.edges)
    assert nx.is_directed_acyclic_graph(bwd)
    hidden = plan.cluster.efficiency.overlap
    assert schedule_s(fwd, Overlap.none, hidden) == pytest.approx(
        sum(d for _, d in fwd.nodes(data="duration_s")))


@pytest.mark.parametrize(("name", "overlap", "recompute", "kernels"), CASES)
def test_another_cluster_reuses_the_structure_and_not_the_numbers(
        node_plan, name, overlap, recompute, kernels):
    plan = node_plan(name, overlap=overlap, recompute=recompute, kernels=kernels)
    node = plan.cluster.node
    slower = plan.cluster.model_copy(update={"node": node.model_copy(
        update={"nvlink_gb_s": node.nvlink_gb_s / 3})})
    other = plan.model_copy(update={"cluster": slower})
    _clear()
    fresh = layer_timing_for(layer_key(other), overlap)
    _clear()
    layer_timing_for(layer_key(plan), overlap)
    steps = lg._backward_steps.cache_info()
    reused = layer_timing_for(layer_key(other), overlap)
    assert lg._backward_steps.cache_info().misses == steps.misses
    assert reused == fresh
    assert reused != layer_timing_for(layer_key(plan), overlap)


@pytest.mark.parametrize(("ep", "spans"), [(8, False), (32, True)])
def test_a_layer_is_keyed_on_the_part_of_the_cluster_it_reads(plan_352b, ep, spans):
    """The job's GPU count never reaches a layer, the scale-out network only where a group
    of the layer spans nodes (EP 32 on 8-GPU nodes): priced on the key's projected cluster,
    the layer is what the whole cluster gives, and plans that differ only in what it does not
    read share one key."""
    from dataclasses import replace

    from plans import Degrees

    plan = plan_352b.model_copy(update={"degrees": Degrees(pp=15, dp=12, sp=8, ep=ep)})
    net = plan.cluster.network
    slower = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={
        "network": net.model_copy(update={"nic_gb_s": net.nic_gb_s / 4})})})
    smaller = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpus": 720})})
    for p in (plan, slower, smaller):
        for overlap in (Overlap.none, Overlap.inter_op):
            key = layer_key(p)
            whole = replace(key, cluster=p.cluster)
            _clear()
            assert layer_timing_for(key, overlap) == layer_timing_for(whole, overlap)
    assert layer_key(smaller) == layer_key(plan)
    assert (layer_key(slower) == layer_key(plan)) is not spans


@pytest.mark.parametrize(("name", "overlap", "recompute", "kernels"), CASES)
def test_a_pass_priced_on_another_bandwidths_build_is_the_pass_built_on_its_own(
        node_plan, name, overlap, recompute, kernels):
    # layer._forward builds a pass once on the cluster's compute part and prices its
    # collectives on each cluster (layer_graph.priced_on): the same operators, to the bit,
    # as the pass built on that cluster, the eager dispatch's host wait included
    from plans.layout import moe_chunks, ulysses_chunks

    plan = node_plan(name, overlap=overlap, recompute=recompute, kernels=kernels,
                     ffn=EPFFN(dispatch=Dispatch.all_to_all))
    node = plan.cluster.node
    slower = plan.cluster.model_copy(update={"node": node.model_copy(
        update={"nvlink_gb_s": node.nvlink_gb_s / 3, "nvlink_latency_us": 7.0})})
    _clear()
    layer._forward(layer._forward_key(layer_key(plan)), overlap)
    for cluster in (slower, plan.cluster):
        key = layer._forward_key(layer_key(plan.model_copy(update={"cluster": cluster})))
        built = lg.forward_entries(key, moe_chunks(overlap, key.ffn, key.ep),
                                   ulysses_chunks(overlap, key.attention, key.model, key.sp))
        assert layer._forward(key, overlap).entries == built
        assert layer._forward(key, overlap).durations == tuple(op.duration_s
                                                               for op, _ in built)
    assert layer._built.cache_info().currsize == 1 + lg.waits_on_host(key)
