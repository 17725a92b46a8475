"""Paper Eq. 1-4 ratios from bytes counted per collective.

Per rank, one forward pass, n = 8 ranks, m = 4 (Internal-352B: q_dim = h = 4096, kv_dim = h/4):
(1) TP attention: all-gather + reduce-scatter of b s h: 2 x (n-1)/n x bsh elements.
(2) SP attention: all-to-all of Q, K, V (b s/n x (h + 2h/m)) and of the output (b s/n x h):
    (n-1)/n x bsh (2 + 2/m)/n elements: half of Eq. 2 as printed (see the reference page), so
    (2)/(1) = (1 + 1/m)/n = 0.15625, half of the paper's 0.3125 ("about one-fourth" printed).
(3) EP all-to-all: k copies there and back: 2k/n x bsh (n-1)/n (as printed).
(4) TP FFN: 2 x (n-1)/n x bsh (as printed).
"""

import pytest

from cost_models import volumes as vol
from plans import Dispatch
from plans.catalog import load_cluster, load_model

B, S, N = 1, 8192, 8


def _wire_elements(transfers) -> float:
    return sum(t.wire_bytes for t in transfers) / 2   # bf16


@pytest.fixture(scope="module")
def model():
    return load_model("internal-352b")


def test_eq1_tp_attention(model):
    bsh = B * S * model.hidden
    assert _wire_elements(vol.tp_attention(model, B, S, N)) == pytest.approx(2 * bsh * 7 / 8)


def test_eq2_sp_attention_ratio_to_tp(model):
    m = model.gqa_ratio
    sp = _wire_elements(vol.ulysses_attention(model, B, S, N))
    tp = _wire_elements(vol.tp_attention(model, B, S, N))
    bsh = B * S * model.hidden
    assert sp == pytest.approx(bsh * 7 / 8 * (2 + 2 / m) / N)
    assert sp / tp == pytest.approx((1 + 1 / m) / N) == pytest.approx(0.15625)


def test_eq2_gqa_replication_above_kv_heads(model):
    # sp 16 > 8 KV heads: each rank receives one replicated KV head, so K and V are sent as
    # 16 heads of 128 (= q_dim / 2 each), not kv_dim = 1024.
    tokens = B * S / 16
    qkv, _ = vol.ulysses_attention(model, B, S, 16)
    assert qkv.buffer_bytes == tokens * (4096 + 2 * 16 * 128) * 2


def test_eq3_ep_all_to_all(model):
    k, tokens = model.top_k, B * S / N
    bsh_over_n = tokens * model.hidden
    a2a = _wire_elements(vol.ep_ffn(model, tokens, N, Dispatch.all_to_all))
    assert a2a == pytest.approx(2 * k / N * (B * S * model.hidden) * 7 / 8)
    # All-gather + reduce-scatter moves (n-1) x tokens x h each way: n/k times all-to-all.
    agrs = _wire_elements(vol.ep_ffn(model, tokens, N, Dispatch.allgather_reduce_scatter))
    assert agrs == pytest.approx(2 * 7 * bsh_over_n)
    assert agrs / a2a == pytest.approx(N / k)


def test_eq4_tp_ffn_equals_eq1(model):
    tokens = B * S / N
    ffn = _wire_elements(vol.tp_ffn(model, tokens, N))
    assert ffn == pytest.approx(2 * B * S * model.hidden * 7 / 8)
    assert ffn == pytest.approx(_wire_elements(vol.tp_attention(model, B, S, N)))


def test_scale_up_ratio_is_independent_of_k_and_h(model):
    # R = 1.5 h_ffn bw / peak x n/(n-1), bw = 200e9 x 0.65, peak = 989e12 x grouped_gemm.
    h800 = load_cluster("h800")
    r = vol.scale_up_ratio(model, h800, 8)
    peak = 989e12 * h800.efficiency.grouped_gemm
    assert r == pytest.approx(1.5 * 14336 * 130e9 / peak * 8 / 7)
    other = model.model_copy(update={"top_k": 1, "hidden": 2048})
    assert vol.scale_up_ratio(other, h800, 8) == r


# ---- EP across nodes, link by link (volumes.ep_link_shares) ----------------------------------


def _layout(ep: int, per_node: int):
    from cost_models import comm
    return comm.group_layout(ep, 1, per_node)


def test_flat_all_to_all_shares_by_link():
    # 32 ranks over 4 nodes of 8: each rank sends 1/32 of its copies to each rank, 7 of them
    # in its node, 24 elsewhere
    shares = vol.ep_link_shares(Dispatch.all_to_all, vol.Routing(32, 3), _layout(32, 8))
    assert shares == pytest.approx((7 / 32, 24 / 32))
    # inside one node nothing crosses the network
    assert vol.ep_link_shares(Dispatch.all_to_all, vol.Routing(32, 3),
                              _layout(8, 8)) == pytest.approx((7 / 8, 0.0))


def _brute_force_deepep(experts: int, top_k: int, ep: int, per_node: int,
                        groups: int = 1, per_token: int = 1) -> tuple[float, float]:
    """Every routing of a token on rank 0 enumerated, equally likely (with a group limit: the
    groups drawn first, then the experts among theirs): DeepEP's NVLink and network copies."""
    import itertools
    local = experts // ep
    group = experts // groups
    limited = 1 <= per_token < groups
    picks = []
    for chosen in (itertools.combinations(range(groups), per_token) if limited else [None]):
        pool = ([e for g in chosen for e in range(g * group, (g + 1) * group)]
                if limited else list(range(experts)))
        picks += [set(c) for c in itertools.combinations(pool, top_k)]
    nvlink = network = 0
    for experts_hit in picks:
        ranks = {e // local for e in experts_hit}
        nodes = {r // per_node for r in ranks}
        network += len(nodes - {0})
        # every destination rank gets one NVLink copy but the source and the landing ranks
        # (local index 0 of each node)
        nvlink += len({r for r in ranks if r % per_node != 0})
    return nvlink / len(picks) / top_k, network / len(picks) / top_k


def test_deepep_one_copy_per_node_by_hand():
    # 8 experts top-2, 4 ranks on 2 nodes of 2: a node holds 4 experts, a rank 2.
    # p_node = 1 - C(4,2)/C(8,2) = 22/28, p_rank = 1 - C(6,2)/C(8,2) = 13/28:
    # network (N - 1) p_node = 22/28 copies a token, NVLink (n - N) p_rank = 26/28; / k = 2
    shares = vol.ep_link_shares(Dispatch.deepep, vol.Routing(8, 2), _layout(4, 2))
    assert shares == pytest.approx((13 / 28, 11 / 28))
    assert shares == pytest.approx(_brute_force_deepep(8, 2, 4, 2))
    # flat: 1/4 over NVLink and 2/4 over the network
    assert vol.ep_link_shares(Dispatch.all_to_all, vol.Routing(8, 2),
                              _layout(4, 2)) == pytest.approx((1 / 4, 1 / 2))


def test_group_limited_deepep_by_hand():
    # 8 experts in 4 groups of 2, one group a token, top-2: a token's copies are one rank's
    # two experts (a rank is a group). p_rank = 1/4, a node (2 groups) is reached w.p. 1/2:
    # network 1/2 copy a token, NVLink 2 x 1/4; / k = 2
    routing = vol.Routing(8, 2, groups=4, groups_per_token=1)
    shares = vol.ep_link_shares(Dispatch.deepep, routing, _layout(4, 2))
    assert shares == pytest.approx((1 / 4, 1 / 4))
    assert shares == pytest.approx(_brute_force_deepep(8, 2, 4, 2, 4, 1))


@pytest.mark.parametrize("experts,top_k,ep,per_node,groups,per_token", [
    (16, 3, 8, 4, 1, 1), (16, 4, 8, 2, 4, 2), (16, 2, 16, 4, 2, 1), (16, 3, 4, 2, 8, 3),
    (12, 2, 6, 3, 3, 3),
])
def test_deepep_shares_match_enumeration(experts, top_k, ep, per_node, groups, per_token):
    routing = vol.Routing(experts, top_k, groups, per_token)
    assert vol.ep_link_shares(Dispatch.deepep, routing, _layout(ep, per_node)) == pytest.approx(
        _brute_force_deepep(experts, top_k, ep, per_node, groups, per_token))


def test_unaligned_groups_price_without_the_limit():
    # 12 experts in 3 groups of 4, 2 a token; a node of 6 experts holds a group and a half:
    # priced as unlimited routing, more network copies than the limit allows (an upper bound)
    layout = _layout(6, 3)
    limited = vol.ep_link_shares(Dispatch.deepep, vol.Routing(12, 2, 3, 2), layout)
    assert limited[1] == pytest.approx(vol.ep_link_shares(Dispatch.deepep, vol.Routing(12, 2),
                                                          layout)[1])
    exact = _brute_force_deepep(12, 2, 6, 3, 3, 2)
    assert limited[1] > exact[1]


def test_deepseek_v3_node_limited_routing():
    """DeepSeek-V3 (256 experts top-8, 8 groups, 4 a token) on EP64 over 8 H800 nodes: a
    node is one group, reached w.p. 4/8 x (1 - C(96, 8) / C(128, 8)); without the limit
    1 - C(224, 8) / C(256, 8). A flat all-to-all sends 7 of the 8 copies over the network."""
    from math import comb
    layout = _layout(64, 8)
    limited = vol.Routing(256, 8, groups=8, groups_per_token=4)
    p_node = 4 / 8 * (1 - comb(96, 8) / comb(128, 8))
    _, network = vol.ep_link_shares(Dispatch.deepep, limited, layout)
    assert network * 8 == pytest.approx(7 * p_node)      # 3.17 nodes a token besides its own
    assert 8 * p_node <= 4                                # at most 4 nodes, its own included
    _, free = vol.ep_link_shares(Dispatch.deepep, vol.Routing(256, 8), layout)
    assert free * 8 == pytest.approx(7 * (1 - comb(224, 8) / comb(256, 8)))
    flat = vol.ep_link_shares(Dispatch.all_to_all, limited, layout)
    assert flat[1] * 8 == pytest.approx(7) and network < free < flat[1]


def test_deepep_transfer_time_is_the_slower_link(h800):
    # 64 ranks over 8 nodes, 1 GB of routed copies: network share at 50 x 0.8 GB/s, NVLink
    # share at 200 x 0.65, beside each other, after a network and an NVLink latency
    m = load_model("deepseekmoe")
    t = vol.Transfer(vol.CommKind.ep_dispatch, vol.Collective.hierarchical_all_to_all, 1e9, 64,
                     routing=vol.Routing(256, 8))
    nvlink, network = vol.ep_link_shares(Dispatch.deepep, vol.Routing(256, 8), _layout(64, 8))
    assert vol.link_bytes(t, 8) == pytest.approx((nvlink * 1e9, network * 1e9))
    assert vol.transfer_s(t, h800) == pytest.approx(
        13e-6 + max(nvlink * 1e9 / 130e9, network * 1e9 / 40e9))
    # ep_ffn builds it from the model for deepep; the flat one for all_to_all
    send, back = vol.ep_ffn(m, 4096, 64, Dispatch.deepep)
    assert send.collective == back.collective == vol.Collective.hierarchical_all_to_all
    assert send.routing == vol.Routing(m.experts, m.top_k, m.expert_groups, m.groups_per_token)
    assert send.buffer_bytes == 4096 * m.top_k * m.hidden * 2
    flat, _ = vol.ep_ffn(m, 4096, 64, Dispatch.all_to_all)
    assert vol.transfer_s(send, load_cluster("h800", gpus=512)) < vol.transfer_s(
        flat, load_cluster("h800", gpus=512))
