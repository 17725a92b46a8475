"""The cost model names its operators by plans.LayerOperator and prices a recomputation level
as the set plans.RECOMPUTED gives it, in time and memory alike."""

from __future__ import annotations

import pytest

import cost_models.layer as layer
import cost_models.layer_graph as lg
import cost_models.memory as mem
from cost_models.layer import layer_key, layer_timing_for
from cost_models.layer_graph import backward_graph, forward_graph
from cost_models.memory import layer_activation_terms
from plans import (
    EPFFN,
    RECOMPUTED,
    TPFFN,
    CPAttention,
    Degrees,
    Dispatch,
    Kernels,
    LayerOperator,
    Overlap,
    Recompute,
    TPAttention,
)
from plans.catalog import load_cluster
from plans.layout import tokens_per_rank


def _plans(node_plan, model: str, n: int = 8):
    """The model on one node of ``n`` GPUs under each attention and FFN strategy."""
    layouts = (
        dict(degrees=Degrees(sp=n, ep=n)),
        dict(degrees=Degrees(sp=n, ep=n), ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
        dict(degrees=Degrees(tp=n, etp=n), attention=TPAttention(), ffn=TPFFN()),
        dict(degrees=Degrees(cp=n, ep=n), attention=CPAttention()),
    )
    cluster = load_cluster("h800", gpus=n)
    return [node_plan(model, cluster=cluster, **layout) for layout in layouts]


def test_every_layer_graph_node_is_a_layer_operator(node_plan):
    seen: set[LayerOperator] = set()
    # tiny-moe-shared: shared experts, a dense layer, QK norm
    plans = [*_plans(node_plan, "internal-352b"), *_plans(node_plan, "tiny-moe-shared", 2)]
    # MLA: the up-projections from the latents
    plans += _plans(node_plan, "deepseek-v3")[:1]
    # eager kernels: the dispatch's host wait
    plans += [p.model_copy(update={"kernels": Kernels.eager}) for p in plans[:2]]
    # fused kernels: RoPE priced as its own operator
    plans += [p.model_copy(update={"kernels": Kernels.fused}) for p in plans[:2]]
    for plan in plans:
        for dense in (False, True):
            fwd = forward_graph(layer_key(plan, dense))
            for name, op in fwd.nodes(data="op"):
                assert isinstance(op.operator, LayerOperator) and name == op.operator.value
                seen.add(op.operator)
            for _, op in backward_graph(fwd, Recompute.full).nodes(data="op"):
                assert isinstance(op.operator, LayerOperator)
    # every operator but the QK norm, which the cost model prices in memory only
    assert seen == set(LayerOperator) - {LayerOperator.qk_norm}


@pytest.mark.parametrize("policy", list(Recompute))
def test_the_backward_graph_reruns_exactly_the_recomputed_set(node_plan, policy):
    for plan in _plans(node_plan, "internal-352b"):
        fwd = forward_graph(layer_key(plan))
        bwd = backward_graph(fwd, policy)
        reruns = {op.operator for _, op in bwd.nodes(data="op") if op.recompute}
        # the layer's output is never needed again, so its last operator is not rerun
        wanted = {op.operator for n, op in fwd.nodes(data="op")
                  if op.operator in RECOMPUTED[policy] and fwd.out_degree(n)}
        assert reruns == wanted


def test_time_and_memory_both_follow_the_recomputed_set(node_plan, monkeypatch):
    # price selective with the set of none, then of full: both time and memory follow
    plan = node_plan("internal-352b", overlap=Overlap.inter_intra_op)
    d = plan.degrees
    tokens = tokens_per_rank(plan.micro_batch_size, plan.training.seq_len, d.attention_group)

    def priced(policy: Recompute):
        # the passes and the backward structure are cached per key and policy
        for cached in (layer._backward, layer._backward_of, lg.backward_steps,
                       lg._backward_steps):
            cached.cache_clear()
        timing = layer_timing_for.__wrapped__(
            layer_key(plan.model_copy(update={"recompute": policy})), plan.overlap)
        terms = layer_activation_terms(plan.model, tokens, d, plan.ffn, policy, False)
        return timing, terms

    as_none, as_full = priced(Recompute.none), priced(Recompute.full)
    selective = priced(Recompute.selective)
    assert selective != as_none and selective != as_full
    for stand_in, expected in ((Recompute.none, as_none), (Recompute.full, as_full)):
        def patched(policy, modules, stand_in=stand_in):
            return RECOMPUTED[stand_in if policy == Recompute.selective else policy]

        monkeypatch.setattr(lg, "recomputed_operators", patched)
        monkeypatch.setattr(mem, "recomputed_operators", patched)
        assert priced(Recompute.selective) == expected
    # what was priced under the patched sets must not outlive the test
    monkeypatch.undo()
    for cached in (layer._backward, layer._backward_of, lg.backward_steps, lg._backward_steps,
                   mem._terms_per_token, mem._memory):
        cached.cache_clear()


def test_selective_drops_the_core_and_keeps_its_inputs(node_plan):
    plan = node_plan("internal-352b")
    m, d = plan.model, plan.degrees
    terms = {p: layer_activation_terms(m, 1.0, d, plan.ffn, p, False) for p in Recompute}
    # Ulysses: the core keeps q, k, v expanded, its output, the log-sum-exp, and the out
    # projection keeps the all-to-all'd output; recomputing it keeps q, k, v and the latter
    q, kv = m.q_dim, m.kv_dim
    assert terms[Recompute.none]["attention_core"] == 8 * q + 4 * m.query_heads + 2 * q
    assert terms[Recompute.selective]["attention_core"] == 2 * (q + 2 * kv) + 2 * q
    assert {k: v for k, v in terms[Recompute.selective].items() if k != "attention_core"} == {
        k: v for k, v in terms[Recompute.none].items() if k != "attention_core"}
    assert terms[Recompute.full] == {"layer_input": 2.0 * m.hidden}


def test_components_use_the_runtime_timer_names_and_count_reruns_in_forward(node_plan):
    from cost_models import evaluate
    from plans import COMPONENT_KEYS, LAYER_REGIONS

    plan = node_plan("internal-352b")
    e_none, e_full = (evaluate(plan.model_copy(update={"recompute": r}))
                      for r in (Recompute.none, Recompute.full))
    none, full = e_none.components_s, e_full.components_s
    assert set(none) <= set(COMPONENT_KEYS) and set(none) == set(full)
    assert none["optimizer"] == e_none.breakdown_s["optimizer"] > 0
    for c in LAYER_REGIONS:  # every region has work under Ulysses and all-to-all EP
        assert full[c.value] > none[c.value] > 0
        assert full[f"{c.value}_bwd"] == none[f"{c.value}_bwd"] > 0
