"""Expert load imbalance (cost_models.skew): the busiest EP rank paces the grouped GEMMs and
receives the most dispatched rows."""

import math

import pytest

from cost_models.layer import layer_key
from cost_models.layer_graph import forward_graph
from cost_models.skew import rank_skew
from plans import EPFFN, TPFFN, Degrees, Dispatch, TPAttention


def test_one_rank_or_padded_capacity_has_no_imbalance():
    assert rank_skew(1e4, 8, 1, 3.0, None) == 1.0
    assert rank_skew(1e4, 8, 8, 3.0, 1.25) == 1.0


def test_one_expert_per_rank_carries_the_router_skew():
    # with many routed copies sampling vanishes: the busiest rank is the hottest expert
    assert rank_skew(1e12, 8, 8, 1.3, None) == pytest.approx(1.3, rel=1e-4)


def test_sampling_floor_by_hand():
    # 8 experts on 2 ranks, 8,192 copies: expert CV sqrt(7/8 / 1024), rank CV / sqrt(4),
    # busiest of 2 ranks at sqrt(2 ln 2) deviations
    expected = 1 + math.sqrt(7 / 8 / 1024) / 2 * math.sqrt(2 * math.log(2))
    assert rank_skew(8192, 8, 2, 1.0, None) == pytest.approx(expected)
    assert rank_skew(8192 * 100, 8, 2, 1.0, None) < rank_skew(8192, 8, 2, 1.0, None)


def test_router_skew_is_one_hot_expert_by_hand():
    # 128 experts on 2 ranks, max / mean 8.75: one expert at 8.75, the other 127 at
    # (128 - 8.75) / 127 each; its rank of 64 carries (8.75 + 63 x 0.939) / 64 of the mean
    # (sampling vanishes with many copies)
    expected = (8.75 + 63 * (128 - 8.75) / 127) / 64
    assert rank_skew(1e12, 128, 2, 8.75, None) == pytest.approx(expected, rel=1e-4)


def test_more_experts_per_rank_average_the_skew_out():
    skews = [rank_skew(1e9, 64, ep, 2.0, None) for ep in (2, 4, 8, 16, 32, 64)]
    assert skews == sorted(skews) and skews[-1] == pytest.approx(2.0, rel=1e-3)


def _durations(plan, skew: float) -> dict[str, float]:
    training = plan.training.model_copy(update={"routing_skew": skew})
    g = forward_graph(layer_key(plan.model_copy(update={"training": training})))
    return {n: g.nodes[n]["duration_s"] for n in g}


@pytest.mark.parametrize("dispatch", list(Dispatch))
def test_busiest_rank_paces_expert_gemms_and_dispatched_rows(node_plan, dispatch):
    plan = node_plan(ffn=EPFFN(dispatch=dispatch))
    balanced, skewed = _durations(plan, 1.0), _durations(plan, 2.0)
    assert skewed["expert_fc13"] > 1.5 * balanced["expert_fc13"]
    assert skewed["expert_fc2"] > 1.5 * balanced["expert_fc2"]
    assert skewed["flash_attn"] == balanced["flash_attn"]
    if dispatch.moves_routed_copies:  # the busiest rank receives the most rows
        assert skewed["ep_dispatch"] > 1.5 * balanced["ep_dispatch"]
    else:  # every rank gathers every token either way; only its local scatter grows
        assert skewed["ep_dispatch"] == balanced["ep_dispatch"]
        assert skewed["dispatch_scatter"] > balanced["dispatch_scatter"]


def test_expert_tp_holds_every_expert_on_every_rank(node_plan):
    plan = node_plan(degrees=Degrees(tp=8, etp=8), attention=TPAttention(), ffn=TPFFN())
    assert _durations(plan, 3.0) == _durations(plan, 1.0)
