"""Expert parallelism over more ranks than a node holds: 8 gloo ranks on virtual nodes of 4
(the plan's cluster.node.gpus_per_node), so every EP group of 8 spans 2 nodes, reproduce the
one-rank reference (loss 1e-5, every gradient 1e-4), as the search may now plan them
(planner.space.ep_degrees)."""

from __future__ import annotations

import pytest
from dist_workers import make_plan
from test_parity import check_one_step

from plans import Dispatch, MeshAxis, Overlap
from plans.layout import groups

PER_NODE = 4
SMALL = {"layers": 2}
"""tiny-moe-shared (8 experts, shared experts, tied vocabulary) cut to its dense layer and one
MoE layer: 8 ranks share the CI's 2 cores."""
ACROSS = {
    "sp2_dp4_ep8_a2a_inter_op": dict(sp=2, dp=4, ep=8, overlap=Overlap.inter_op),
    "dp8_ep8_allgather": dict(dp=8, ep=8, dispatch=Dispatch.allgather_reduce_scatter),
}


@pytest.mark.parametrize("layout", ACROSS)
def test_ep_spanning_two_nodes_matches_reference(pool8, layout):
    plan = make_plan(model="tiny-moe-shared", spec_update=SMALL, global_batch=8,
                     gpus_per_node=PER_NODE, **ACROSS[layout])
    (ep_group,) = groups(plan.degrees, MeshAxis.ep)
    assert {r // PER_NODE for r in ep_group} == {0, 1}  # the group is both virtual nodes
    check_one_step(pool8, plan)
