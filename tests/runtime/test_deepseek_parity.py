"""MLA attention under Ulysses and TP, and sigmoid group-limited routing with the expert bias
under EP, reproduce the one-rank reference (loss 1e-5, every gradient 1e-4); a small
DeepSeek-V3-like model (MLA, a dense first layer, a shared expert, sigmoid routing over
groups) with EP over 8 ranks spanning 2 virtual nodes does too."""

from __future__ import annotations

import pytest
from dist_workers import make_plan
from test_mla_router import MLA, SIGMOID_GROUPS
from test_parity import check_one_step

from plans import Dispatch, MeshAxis, Overlap, Recompute
from plans.layout import groups

A2A, AG = Dispatch.all_to_all, Dispatch.allgather_reduce_scatter
INTER = Overlap.inter_op
NO_Q_LORA = {**MLA, "mla": {**MLA["mla"], "q_lora_rank": 0}}
DEEPSEEK = {**MLA, **SIGMOID_GROUPS}

TWO = {
    "sp2_mla": dict(sp=2, spec_update=MLA),
    # two head groups of one head a rank: the narrower value heads move with q and k
    "sp2_mla_inter_op_head_groups_selective": dict(
        sp=2, overlap=INTER, recompute=Recompute.selective, spec_update=MLA),
    "tp2_mla": dict(tp=2, tp_attention=True, spec_update=MLA),
    "tp2_mla_no_q_lora": dict(tp=2, tp_attention=True, spec_update=NO_Q_LORA),
    "ep2_a2a_sigmoid_groups": dict(dp=2, ep=2, dispatch=A2A, spec_update=SIGMOID_GROUPS),
    "ep2_allgather_sigmoid_groups_inter_op": dict(dp=2, ep=2, dispatch=AG, overlap=INTER,
                                                  spec_update=SIGMOID_GROUPS),
    "sp2_ep2_deepseek": dict(sp=2, ep=2, spec_update=DEEPSEEK),
}


@pytest.mark.parametrize("layout", TWO)
def test_two_ranks_match_reference(pool2, layout):
    check_one_step(pool2, make_plan(**TWO[layout]))


def test_mla_heads_move_in_groups_under_inter_op(pool2):
    plan = make_plan(**TWO["sp2_mla_inter_op_head_groups_selective"])
    got = pool2.run("dist_workers", "ulysses_head_groups", plan.model_dump_json())
    assert got == [[2] * plan.model.layers] * 2


PER_NODE = 4
TINY_V3 = {**DEEPSEEK, "layers": 2, "qk_norm": False, "router_pre_softmax": False}
"""tiny-moe-shared (8 experts, a dense first layer, a shared expert, tied vocabulary) with
MLA and DeepSeek-V3's router, cut to its dense layer and one MoE layer."""
ACROSS = {
    "sp2_dp4_ep8_a2a_inter_op": dict(sp=2, dp=4, ep=8, overlap=INTER),
    "tp2_dp4_ep8_a2a": dict(tp=2, dp=4, ep=8, tp_attention=True),
    "dp8_ep8_allgather": dict(dp=8, ep=8, dispatch=AG),
}


@pytest.mark.parametrize("layout", ACROSS)
def test_deepseek_v3_like_ep_spanning_two_nodes_matches_reference(pool8, layout):
    plan = make_plan(model="tiny-moe-shared", spec_update=TINY_V3, global_batch=8,
                     gpus_per_node=PER_NODE, **ACROSS[layout])
    (ep_group,) = groups(plan.degrees, MeshAxis.ep)
    assert {r // PER_NODE for r in ep_group} == {0, 1}
    check_one_step(pool8, plan)
