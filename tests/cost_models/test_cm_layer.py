"""The layer DAG, its two-stream schedule, and the dispatcher crossover."""

import pytest

from cost_models.layer import layer_key, layer_timing
from cost_models.layer_graph import forward_graph
from cost_models.volumes import scale_up_ratio
from plans import EPFFN, Degrees, Dispatch, Kernels, Overlap, Recompute
from plans.catalog import load_cluster
from plans.layout import INTER_OP_CHUNKS, ulysses_chunks

DISPATCH_COMBINE = {"dispatch_permute", "ep_dispatch", "dispatch_scatter", "combine_gather",
                    "ep_combine", "combine_unpermute"}


def _dispatch_combine_s(one_node_plan, top_k: int, dispatch: Dispatch) -> float:
    plan = one_node_plan(ffn=EPFFN(dispatch=dispatch), kernels=Kernels.fused)
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"top_k": top_k})})
    g = forward_graph(layer_key(plan))
    return sum(g.nodes[n]["duration_s"] for n in g if n in DISPATCH_COMBINE)


@pytest.mark.parametrize("top_k", range(1, 9))
def test_dispatch_crossover_mixtral_on_one_h800_node(node_plan, top_k):
    # AG/RS moves n/k times the all-to-all bytes at 0.80/0.65 of its bandwidth: the crossover
    # is k = 8 x 0.65/0.80 = 6.5; the all-to-all's permutation passes (fused, every slot
    # routed: gathers both ways and the received rows' regroup, 20 R + 3 T, against the
    # all-gather's compiled scatter and gather, 6 R + 2 n T) bring it into (5, 6).
    a2a = _dispatch_combine_s(node_plan, top_k, Dispatch.all_to_all)
    agrs = _dispatch_combine_s(node_plan, top_k, Dispatch.allgather_reduce_scatter)
    assert (agrs < a2a) == (top_k >= 6)


@pytest.mark.parametrize("name", ["internal-352b", "mixtral-8x7b", "tiny-moe-shared"])
@pytest.mark.parametrize("recompute", list(Recompute))
def test_overlap_is_monotone_where_chunking_pays(node_plan, name, recompute):
    """inter_intra_op is never slower than inter_op (it may fall back to it), nor inter_op than
    none at real widths when the grouped GEMMs' efficiency does not depend on the expert size
    and a call has no fixed time (each chunk calls every GEMM again);
    the tiny model's chunked layer (microseconds of GEMMs per chunk) pays the collectives'
    latency twice and can hide less than that (without recomputation it does), and is priced
    as it runs. With the catalog's measured size curve (grouped_gemm_half_rows) each chunk's
    experts get half the rows at a lower efficiency, which can cost more than the chunking
    hides: Internal-352B on one node (768 rows per expert, 384 per chunk) is priced about 1%
    slower under inter_op than serial, as it would run."""
    # The tiny model has 4 heads: sp = ep = 2 over 4 dp replicas.
    small = {"degrees": Degrees(dp=4, sp=2, ep=2)} if name == "tiny-moe-shared" else {}
    plan = node_plan(name, recompute=recompute, **small)
    t = [layer_timing(plan.model_copy(update={"overlap": o})).total_s for o in Overlap]
    assert t[1] >= t[2] and t[0] > t[2]
    if name != "tiny-moe-shared":
        flat = plan.cluster.model_copy(update={"efficiency": plan.cluster.efficiency.model_copy(
            update={"grouped_gemm_half_rows": 0.0, "grouped_gemm_launch_us": 0.0,
                    "gemm_launch_us": 0.0})})
        plan = plan.model_copy(update={"cluster": flat})
        t = [layer_timing(plan.model_copy(update={"overlap": o})).total_s for o in Overlap]
        assert t[0] >= t[1]


def test_inter_op_chunks_the_ep_dispatch_and_combine(node_plan):
    """inter_op prices what runtime.parallel.overlap runs: the MoE part in two token chunks
    whose dispatch and combine ride the communication stream; at sp = 8 each rank has one of
    Mixtral's 8 KV heads, too few for head groups, so the Ulysses all-to-alls block (exposed in
    full), as under none."""
    plan = node_plan("mixtral-8x7b", recompute=Recompute.none)
    assert ulysses_chunks(Overlap.inter_op, plan.attention, plan.model, plan.degrees.sp) == 1
    by = {o: layer_timing(plan.model_copy(update={"overlap": o})) for o in Overlap}
    key = layer_key(plan)
    chunked = forward_graph(key, INTER_OP_CHUNKS)
    side = {n for n, d in chunked.nodes(data=True) if d["op"].side_stream}
    assert side == {f"{c}@{i}" for c in ("ep_dispatch", "ep_combine")
                    for i in range(INTER_OP_CHUNKS)}
    assert {n.partition("@")[0] for n in chunked} == set(forward_graph(key))
    exposed = {o: t.exposed_comm_s for o, t in by.items()}
    assert exposed[Overlap.inter_op]["sp_all_to_all"] == pytest.approx(
        exposed[Overlap.none]["sp_all_to_all"])
    ep = ("ep_dispatch", "ep_combine")
    assert sum(exposed[Overlap.inter_op][k] for k in ep) < 0.6 * sum(
        exposed[Overlap.none][k] for k in ep)


@pytest.mark.parametrize("recompute", [Recompute.none, Recompute.selective])
def test_inter_op_moves_ulysses_heads_in_groups_beside_the_other_groups_core(node_plan,
                                                                           recompute):
    """At sp = 4 each rank has two of Mixtral's 8 KV heads: inter_op runs Ulysses in two head
    groups (runtime.parallel.attention.ChunkedUlyssesCore), each group's all-to-alls carrying
    its share of the bytes on the communication stream; all but the first group's in and the
    last one's out can hide behind the other group's core (and, under selective recomputation,
    its rerun), so less than 0.6 of the blocking all-to-alls' time stays exposed."""
    plan = node_plan("mixtral-8x7b", recompute=recompute, degrees=Degrees(sp=4, ep=4, dp=2))
    groups = ulysses_chunks(Overlap.inter_op, plan.attention, plan.model, plan.degrees.sp)
    assert groups == INTER_OP_CHUNKS
    key = layer_key(plan)
    serial, grouped = forward_graph(key), forward_graph(key, 1, groups)
    side = {n for n, d in grouped.nodes(data=True) if d["op"].side_stream}
    assert side == {f"{c}@{i}" for c in ("sp_a2a_qkv", "sp_a2a_out") for i in range(groups)}
    assert {n.partition("@")[0] for n in grouped} == set(serial)
    for name in ("sp_a2a_qkv", "sp_a2a_out", "flash_attn"):
        whole = serial.nodes[name]["duration_s"]
        parts = [grouped.nodes[f"{name}@{i}"]["duration_s"] for i in range(groups)]
        assert whole <= sum(parts) < 1.1 * whole  # the same bytes and FLOPs, a call each
    exposed = {o: layer_timing(plan.model_copy(update={"overlap": o})).exposed_comm_s
               for o in (Overlap.none, Overlap.inter_op)}
    assert exposed[Overlap.inter_op]["sp_all_to_all"] < 0.6 * exposed[Overlap.none][
        "sp_all_to_all"]
    # where nothing beside compute hides (efficiency.overlap 0, as fitted on 2 H200s) the
    # groups only add calls: priced slower, as they would run
    blind = plan.cluster.model_copy(update={"efficiency": plan.cluster.efficiency.model_copy(
        update={"overlap": 0.0})})
    t = {o: layer_timing(plan.model_copy(update={"overlap": o, "cluster": blind})).total_s
         for o in (Overlap.none, Overlap.inter_op)}
    assert t[Overlap.inter_op] > t[Overlap.none]


def test_times_add_up_and_serial_means_no_hiding(node_plan):
    plan = node_plan("internal-352b", overlap=Overlap.none, recompute=Recompute.none)
    lt = layer_timing(plan)
    assert lt.fwd_s + lt.bwd_s == pytest.approx(
        lt.compute_s + lt.recompute_s + sum(lt.exposed_comm_s.values()))
    g = forward_graph(layer_key(plan))
    fwd_sum = sum(d["duration_s"] for _, d in g.nodes(data=True))
    assert lt.fwd_s == pytest.approx(fwd_sum)
    assert set(lt.exposed_comm_s) == {"sp_all_to_all", "ep_dispatch", "ep_combine"}
    assert lt.recompute_s == 0


def test_recompute_costs_order_and_selective_hides_behind_comm(node_plan):
    plan = node_plan("internal-352b", overlap=Overlap.inter_intra_op)
    t = {r: layer_timing(plan.model_copy(update={"recompute": r})) for r in Recompute}
    assert t[Recompute.none].bwd_s <= t[Recompute.selective].bwd_s < t[Recompute.full].bwd_s
    # Full recompute reruns the whole forward; selective only the attention core.
    assert t[Recompute.full].recompute_s > 5 * t[Recompute.selective].recompute_s
    assert "recompute.expert_fc13" in t[Recompute.full].critical_path


def test_scale_up_ratio_predicts_hidden_ep_communication(node_plan):
    # With fused GEMM+communication only max(0, comm - gemm) + fill is exposed: R > 1 hides
    # EP dispatch/combine except the fill, R < 1 leaves comm - gemm exposed. R (paper Sec. 7)
    # weighs the routed experts against their dispatch: Table 2's routed shape, without the
    # shared expert, whose GEMMs would hide part of a slow dispatch as well.
    plan = node_plan("internal-352b", overlap=Overlap.inter_intra_op)
    routed = plan.model.model_copy(update={"shared_experts": 0, "shared_expert_ffn_hidden": 0})
    plan = plan.model_copy(update={"model": routed})
    fast = plan.cluster
    slow = fast.model_copy(update={"node": fast.node.model_copy(update={"nvlink_gb_s": 20})})
    assert scale_up_ratio(plan.model, fast, 8) > 1 > scale_up_ratio(plan.model, slow, 8)

    def ep_exposed_share(cluster):
        p = plan.model_copy(update={"cluster": cluster})
        g = forward_graph(layer_key(p))
        comm = g.nodes["ep_dispatch"]["duration_s"] + g.nodes["ep_combine"]["duration_s"]
        lt = layer_timing(p)
        exposed = lt.exposed_comm_s["ep_dispatch"] + lt.exposed_comm_s["ep_combine"]
        return exposed / (2 * comm)   # forward and backward

    assert ep_exposed_share(fast) < 0.1
    assert ep_exposed_share(slow) > 0.4


def test_dense_and_shared_expert_layers(node_plan):
    plan = node_plan("tiny-moe-shared", degrees=Degrees(dp=4, sp=2, ep=2))
    moe = forward_graph(layer_key(plan))
    dense = forward_graph(layer_key(plan, dense=True))
    assert {"shared_fc13", "shared_fc2", "ep_dispatch"} <= set(moe)
    assert "dense_fc13" in dense and "ep_dispatch" not in dense
    # Shared experts do not wait on the dispatch: they can hide it.
    assert not any(p == "ep_dispatch" for p in moe.predecessors("shared_fc13"))
    assert layer_timing(plan, dense=True).total_s > 0


def test_h100_crossover_sits_lower_than_h800(node_plan):
    # Faster NVLink makes the memory passes weigh more, and the fused all-to-all's grow with k
    # (20 R + 3 T against the all-gather's 6 R + 2 n T): on H100 AG/RS wins from k = 5, one
    # below H800's 6.
    plan = node_plan(cluster=load_cluster("h100"), kernels=Kernels.fused)
    for k, wins in ((4, False), (5, True)):
        m = plan.model.model_copy(update={"top_k": k})
        t = {}
        for d in Dispatch:
            g = forward_graph(layer_key(plan.model_copy(update={"model": m,
                                                                "ffn": EPFFN(dispatch=d)})))
            t[d] = sum(g.nodes[n]["duration_s"] for n in g if n in DISPATCH_COMBINE)
        assert (t[Dispatch.allgather_reduce_scatter] < t[Dispatch.all_to_all]) == wins


def test_fused_kernels_price_the_fusable_operators_at_the_fused_factor(node_plan):
    """kernels fused: norms, RoPE (with the GQA expansion, the attention core's prologue),
    SwiGLU and permutations at efficiency.fused_elementwise; the residual adds and the router's
    softmax and top-k (eager in both kernel sets, runtime.kernels) stay at elementwise; an eager
    plan never reads the fused factor."""
    from plans import Kernels

    plan = node_plan()
    eff = plan.cluster.efficiency
    slow = plan.cluster.model_copy(update={"efficiency": eff.model_copy(
        update={"elementwise": 0.05, "fused_elementwise": 0.5})})
    eager = forward_graph(layer_key(plan.model_copy(update={"cluster": slow})))
    other = slow.model_copy(update={"efficiency": slow.efficiency.model_copy(
        update={"fused_elementwise": 0.9})})
    assert eager.nodes["ffn_norm"]["duration_s"] == forward_graph(layer_key(
        plan.model_copy(update={"cluster": other}))).nodes["ffn_norm"]["duration_s"]
    fused = forward_graph(layer_key(plan.model_copy(update={"cluster": slow,
                                                            "kernels": Kernels.fused})))
    for name in ("attn_norm", "ffn_norm", "expert_swiglu", "rope"):
        ratio = eager.nodes[name]["duration_s"] / fused.nodes[name]["duration_s"]
        assert ratio == pytest.approx(10.0), name
    for name in ("router_topk", "attn_residual"):
        assert fused.nodes[name]["duration_s"] == eager.nodes[name]["duration_s"], name
    # the eager permutations are counted pass by pass at gather_scatter (cost_models.dispatch);
    # fused, one pass each way at fused_elementwise
    for name in ("dispatch_permute", "combine_unpermute"):
        other_gs = forward_graph(layer_key(plan.model_copy(update={"cluster": slow.model_copy(
            update={"efficiency": slow.efficiency.model_copy(
                update={"gather_scatter": slow.efficiency.gather_scatter / 2})})})))
        assert other_gs.nodes[name]["duration_s"] == pytest.approx(
            2 * eager.nodes[name]["duration_s"])
        assert eager.nodes[name]["duration_s"] > fused.nodes[name]["duration_s"]
    for name in ("attn_residual", "ffn_residual"):
        assert fused.nodes[name]["duration_s"] == eager.nodes[name]["duration_s"]
    m = plan.model
    # Ulysses: RoPE on the full sequence of this rank's query and key heads, read and written;
    # with GQA the key and value heads repeated to the query heads (read kv, write q wide):
    # as many bytes again
    rope_bytes = 2 * plan.training.seq_len * (m.q_dim + m.kv_dim) / plan.degrees.sp * 2
    assert m.query_heads > m.kv_heads
    rope_bytes *= 2
    assert fused.nodes["rope"]["duration_s"] == pytest.approx(
        rope_bytes / (plan.cluster.gpu.hbm_tb_s * 1e12 * 0.5))


@pytest.mark.parametrize("name", ["internal-352b", "deepseek-v3", "mixtral-8x7b"])
@pytest.mark.parametrize("overlap", list(Overlap))
def test_the_forward_pass_is_the_same_under_every_recomputation_policy(node_plan, name,
                                                                        overlap):
    # layer_timing shares one forward graph and schedule among the policies: the forward
    # operators and their order do not depend on the policy, only the backward's reruns do
    graphs = {}
    for policy in Recompute:
        g = forward_graph(layer_key(node_plan(name, recompute=policy, overlap=overlap)), 2)
        graphs[policy] = (sorted((n, repr(d)) for n, d in g.nodes(data=True)),
                          sorted(g.edges()))
    assert graphs[Recompute.none] == graphs[Recompute.selective] == graphs[Recompute.full]
    timings = {p: layer_timing(node_plan(name, recompute=p, overlap=overlap)) for p in Recompute}
    assert len({t.fwd_s for t in timings.values()}) == 1
    assert timings[Recompute.full].bwd_s > timings[Recompute.none].bwd_s
