"""The rank layout (plans.layout) against a brute-force enumeration of the documented order:
rank = (pp_i x dp + dp_i) x attn + attn_i, and the FFN folds (dp, attn) into (edp, ep, etp)."""

from __future__ import annotations

import itertools

import pytest

from plans import Degrees, MeshAxis
from plans.layout import (
    chunks_of_stage,
    coordinates,
    group_of,
    groups,
    stage_of_chunk,
    stage_peer,
    stride,
    tokens_per_rank,
)

A = MeshAxis
LAYOUTS = [Degrees(pp=2, dp=2, sp=2, ep=4), Degrees(pp=3, dp=4, tp=2, etp=2, ep=2),
           Degrees(pp=1, dp=3, cp=2, ep=3), Degrees(pp=4, vpp=2, dp=1, sp=4, ep=2)]


@pytest.mark.parametrize("d", LAYOUTS, ids=str)
def test_coordinates_follow_the_documented_rank_order(d):
    a = d.attention_group
    seen = set()
    for pp, dp, attn in itertools.product(range(d.pp), range(d.dp), range(a)):
        rank = (pp * d.dp + dp) * a + attn
        local = dp * a + attn
        c = coordinates(rank, d)
        assert (c[A.pp], c[A.dp], c[A.attn], c[A.stage]) == (pp, dp, attn, local)
        edp, rest = divmod(local, d.ep * d.etp)
        assert (c[A.edp], c[A.ep], c[A.etp]) == (edp, *divmod(rest, d.etp))
        seen.add(rank)
    assert seen == set(range(d.world))


@pytest.mark.parametrize("d", LAYOUTS, ids=str)
def test_groups_partition_the_world_and_differ_in_one_coordinate_of_their_view(d):
    views = {A.pp: (A.pp, A.dp, A.attn), A.dp: (A.pp, A.dp, A.attn),
             A.attn: (A.pp, A.dp, A.attn), A.stage: (A.pp, A.stage),
             A.edp: (A.pp, A.edp, A.ep, A.etp), A.ep: (A.pp, A.edp, A.ep, A.etp),
             A.etp: (A.pp, A.edp, A.ep, A.etp)}
    for axis, view in views.items():
        found = groups(d, axis)
        assert sorted(r for g in found for r in g) == list(range(d.world)), axis
        for g in found:
            assert all(b - a == stride(d, axis) for a, b in itertools.pairwise(g)), (axis, g)
            cs = [coordinates(r, d) for r in g]
            assert sorted(c[axis] for c in cs) == list(range(len(g))), (axis, g)
            for other in view:
                if other != axis:
                    assert len({c[other] for c in cs}) == 1, (axis, other, g)
    assert len(groups(d, A.ep)[0]) == d.ep and len(groups(d, A.edp)[0]) == d.edp


def test_embed_pairs_first_and_last_stage_and_stage_peers():
    d = Degrees(pp=3, dp=2, sp=2, ep=2)
    assert groups(d, A.embed) == [[0, 8], [1, 9], [2, 10], [3, 11]]
    assert group_of(9, d, A.embed) == [1, 9]
    assert stage_peer(5, d, 1) == 9 and stage_peer(5, d, -1) == 1
    assert groups(Degrees(dp=2), A.embed) == [[0], [1]]


def test_chunk_c_runs_on_stage_c_mod_pp_and_tokens_per_rank():
    d = Degrees(pp=2, vpp=3, dp=2, tp=2)
    assert [stage_of_chunk(c, d.pp) for c in range(d.stages)] == [0, 1, 0, 1, 0, 1]
    assert list(chunks_of_stage(1, d)) == [1, 3, 5]
    assert tokens_per_rank(2, 4096, d.attention_group) == 2 * 4096 / 2
    assert tokens_per_rank(1, 4096, Degrees(sp=8, ep=8).attention_group) == 512


@pytest.mark.parametrize("d", [Degrees(pp=2, dp=8, sp=4, ep=16), Degrees(pp=3, dp=4, sp=8, ep=32),
                               Degrees(pp=1, dp=16, tp=2, ep=16)], ids=str)
def test_an_ep_group_larger_than_a_node_is_whole_contiguous_nodes(d):
    """Ranks fill nodes of 8 in order: an EP group of 16 or 32 is 2 or 4 whole nodes next to
    each other, every node of it in one group (FFN view pp x edp x ep x etp), and the attention
    group stays inside one node; comm.group_layout prices it so."""
    from cost_models import comm
    per_node = 8
    for group in groups(d, A.ep):
        assert group == list(range(group[0], group[0] + d.ep))
        assert group[0] % per_node == 0
        assert {r // per_node for r in group} == set(range(group[0] // per_node,
                                                         (group[0] + d.ep) // per_node))
    for group in groups(d, A.attn):
        assert len({r // per_node for r in group}) == 1
    layout = comm.group_layout(d.ep, stride(d, A.ep), per_node)
    assert (layout.ranks_per_node, layout.nodes) == (per_node, d.ep // per_node)
    # the replicas of an expert (edp) are one rank of each EP group: every one on its own node
    for group in groups(d, A.edp):
        assert len({r // per_node for r in group}) == len(group)


def test_the_expert_gemm_rule_runs_per_expert_from_the_bound_rows_per_local_expert():
    """plans.layout.expert_gemm: per_expert from PER_EXPERT_MIN_ROWS balanced rows per local
    expert and call, grouped below; the rows count the FFN group's tokens and the chunks."""
    from plans.catalog import load_model
    from plans.enums import ExpertGemm
    from plans.layout import PER_EXPERT_MIN_ROWS, expert_gemm, expert_rows

    m = load_model("mixtral-8x7b")  # 8 experts, top-2: rows = tokens / 4
    at = PER_EXPERT_MIN_ROWS * m.experts / m.top_k
    assert expert_rows(at, m.top_k, m.experts) == PER_EXPERT_MIN_ROWS
    assert expert_gemm(m, at, 1, 1) == ExpertGemm.per_expert
    assert expert_gemm(m, at - 1, 1, 1) == ExpertGemm.grouped
    assert expert_gemm(m, at / 2, 2, 1) == ExpertGemm.per_expert  # two EP ranks' tokens
    assert expert_gemm(m, at, 1, 2) == ExpertGemm.grouped  # two chunks: half the rows each


@pytest.mark.parametrize(("name", "mbs", "gemm"), [
    ("mixtral2l_1gpu.json", 8, "per_expert"),  # 8,192 rows per expert: measured faster
    ("mixtral2l_1gpu.json", 1, "grouped"),  # 1,024: measured slower per expert
    ("qwen4l_1gpu.json", 8, "grouped"),  # 2,048 rows of 768
    ("deepseek4l_1gpu.json", 8, "grouped"),  # 3,072 rows of 1,408
])
def test_the_peer_plans_take_the_measured_faster_expert_path(name, mbs, gemm):
    """The rule on the 1-GPU peer plans (bench/gpu_plans/searched/) at the micro-batches whose
    steps were measured both ways or whose shapes measured per expert far slower."""
    from pathlib import Path

    from plans import Plan
    from plans.catalog import load_plan
    from plans.layout import plan_expert_gemm

    root = Path(__file__).resolve().parents[2] / "bench" / "gpu_plans" / "searched"
    plan = load_plan(root / name)
    plan = Plan.model_validate({**plan.model_dump(), "micro_batch_size": mbs,
                                "prediction": None})
    got = plan_expert_gemm(plan.model, plan.degrees, mbs, plan.training.seq_len, 1)
    assert got.value == gemm
