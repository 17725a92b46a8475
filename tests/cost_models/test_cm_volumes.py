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
