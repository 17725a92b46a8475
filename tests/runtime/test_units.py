"""Unit tests of the model pieces and of each collective building block."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.moe import (
    GroupedExperts,
    LocalDispatcher,
    Router,
    balance_loss,
    capacity_mask,
    grouped_mm,
)


def test_router_topk_and_renormalised_weights():
    torch.manual_seed(0)
    r = Router(8, 6, 2, balance_groups=6)
    x = torch.randn(10, 8)
    out = r(x)
    probs = torch.softmax(r.gate(x), -1)
    top = probs.topk(2, -1)
    assert torch.equal(out.indices, top.indices)
    torch.testing.assert_close(out.weights, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(10))


def test_balance_loss_is_one_when_balanced_and_groups_sum_experts():
    probs = torch.full((4, 4), 0.25)
    indices = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    for groups in (4, 2, 1):
        assert balance_loss(probs, indices, groups).item() == pytest.approx(1.0)
    probs = torch.softmax(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), -1)
    indices = probs.topk(2, -1).indices
    f = torch.bincount(indices.flatten(), minlength=4).float() / 10
    p = probs.mean(0)
    expect_groups = 2 * ((f[:2].sum() * p[:2].sum()) + (f[2:].sum() * p[2:].sum()))
    torch.testing.assert_close(balance_loss(probs, indices, 2), expect_groups)
    torch.testing.assert_close(balance_loss(probs, indices, 4), 4 * (f * p).sum())


def test_capacity_keeps_first_tokens_of_each_expert():
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    keep = capacity_mask(indices, 4, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    r = Router(4, 4, 2, balance_groups=4, capacity_factor=1.0)
    out = r(torch.randn(16, 4))
    cap = math.ceil(1.0 * 16 * 2 / 4)
    kept = out.indices[out.indices >= 0]
    assert torch.bincount(kept, minlength=4).max() <= cap
    assert (out.weights[out.indices < 0] == 0).all()


def test_grouped_mm_fallback_matches_row_by_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 4, generator=g)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 4, generator=g)
    expert = torch.repeat_interleave(torch.arange(3), counts)
    expect = torch.stack([w[e] @ x[i] for i, e in enumerate(expert.tolist())])
    torch.testing.assert_close(grouped_mm(x, w, counts), expect)


def test_local_dispatch_combine_matches_dense_moe():
    torch.manual_seed(0)
    experts, k, t, h = 4, 2, 7, 6
    ge = GroupedExperts(experts, h, 5)
    for p in ge.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(t, h)
    indices = torch.stack([torch.randperm(experts)[:k] for _ in range(t)])
    weights = torch.rand(t, k)
    from runtime.moe import Routing

    d = LocalDispatcher(experts)
    rows, counts, handle = d.dispatch(x, Routing(indices, weights, torch.zeros(())))
    y = d.combine(ge(rows, counts), handle)

    def expert(e, v):
        return ge.w2[e] @ (torch.nn.functional.silu(ge.w1[e] @ v) * (ge.w3[e] @ v))

    expect = torch.stack(
        [sum(weights[i, j] * expert(indices[i, j], x[i]) for j in range(k)) for i in range(t)]
    )
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)


def test_ulysses_all_to_all_round_trip(pool2):
    assert all(pool2.run("dist_workers", "ulysses_round_trip"))


@pytest.mark.parametrize("kind", ["all_to_all", "allgather_reduce_scatter"])
def test_dispatcher_matches_local_permutation(pool2, kind):
    assert all(pool2.run("dist_workers", "dispatcher_vs_local", kind))


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 4, 6), (1, 3, 2),
                                        (2, 1, 4), (4, 1, 3), (4, 1, 8), (1, 1, 3)])
def test_timeline_runs_every_chunk_once_in_megatron_order(pp, vpp, m):
    from runtime.parallel.pipeline import stage_actions, timeline

    ticks = timeline(pp, vpp, m)
    for stage in range(pp):
        order = stage_actions(pp, vpp, m, stage)
        assert [t[0][stage] for t in ticks if stage in t[0]] == order
        chunks = range(stage, pp * vpp, pp)
        for forward in (True, False):
            done = sorted((a.chunk, a.micro) for a in order if a.forward == forward)
            assert done == sorted((c, i) for c in chunks for i in range(m))
        # Megatron's warm-up forwards (1F1B: pp - stage - 1); the first backward follows one
        # more (steady) forward
        if vpp == 1:
            warmup = min(pp - stage - 1, m)
            assert [a.micro for a in order if a.forward] == list(range(m))
        else:
            warmup = vpp * m if m == pp else min((pp - stage - 1) * 2 + (vpp - 1) * pp, vpp * m)
        first_backward = next(i for i, a in enumerate(order) if not a.forward)
        assert first_backward == (warmup if warmup == vpp * m else warmup + 1)
    # a message is consumed no earlier than the tick after it is sent
    sent = {}
    for t, (actions, messages) in enumerate(ticks):
        for a in actions.values():
            need = ("act", a.chunk - 1, a.micro) if a.forward else ("grad", a.chunk + 1, a.micro)
            if need in sent:
                assert sent[need] < t
        for msg in messages:
            sent[msg.key] = t


def test_1f1b_is_the_vpp1_action_list():
    from runtime.parallel.pipeline import stage_actions

    def text(order):
        return " ".join(f"{'F' if a.forward else 'B'}{a.micro}" for a in order)

    assert text(stage_actions(2, 1, 4, 0)) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert text(stage_actions(2, 1, 4, 1)) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert text(stage_actions(3, 1, 2, 0)) == "F0 F1 B0 B1"
    assert {a.chunk for a in stage_actions(3, 1, 2, 1)} == {1}


@pytest.mark.parametrize("vpp", [1, 2])
def test_pipeline_schedule_times_forward_backward_and_its_communication(pool2, vpp):
    from dist_workers import make_plan

    plan = make_plan(pp=2, vpp=vpp, stage_layers=(1,) * 4 if vpp == 2 else (2, 2),
                     global_batch=4)
    for rank, c in enumerate(pool2.run("dist_workers", "step_components", plan.model_dump_json())):
        assert c["forward"] > 0 and c["backward"] > 0 and c["pipeline_comm"] > 0, (rank, c)
        inside = c["forward"] + c["backward"] + c["pipeline_comm"]
        assert inside <= c["forward_backward"] * 1.01, (rank, c)
