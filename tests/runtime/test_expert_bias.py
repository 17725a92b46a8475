"""The aux-loss-free expert bias (DeepSeek-V3 Sec. 2.1.2): the sign update after every step
moves the routing toward balance, several ranks move it as one rank does (the step's slots
summed over the stage), it stays in fp32 and it is checkpointed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dist_workers import expert_biases, make_plan, reference_trainer
from test_mla_router import MLA, SIGMOID_GROUPS
from test_parity import LOSS_RTOL

from plans import Dispatch
from runtime.moe import Router, update_expert_biases
from runtime.router import Scoring, updated_expert_bias

STEPS = 3


def test_the_update_is_the_sign_of_the_mean_minus_the_load():
    bias = torch.tensor([0.5, 0.0, -0.25, 0.0])
    slots = torch.tensor([7.0, 1.0, 2.0, 2.0])  # mean 3
    got = updated_expert_bias(bias, slots, 0.01)
    assert torch.equal(got, bias + torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    even = torch.full((4,), 5.0)
    assert torch.equal(updated_expert_bias(bias, even, 0.01), bias)
    # a common factor of the slots (ranks that count the same tokens) changes nothing
    assert torch.equal(updated_expert_bias(bias, 3 * slots, 0.01), got)


def _skewed_router() -> tuple[Router, torch.Tensor]:
    m = make_plan(spec_update=SIGMOID_GROUPS).model
    router = Router(m.hidden, m.experts, m.top_k, m.experts, scoring=Scoring.of(m))
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(256, m.hidden, generator=gen)
    with torch.no_grad():
        router.gate.weight.normal_(0.0, 0.02, generator=gen)
        router.gate.weight[0] += x.mean(0) * 4  # expert 0 scores high on every token
    return router, x


def _imbalance(router: Router, x: torch.Tensor) -> float:
    with torch.no_grad():
        indices = router(x).indices
    counts = torch.bincount(indices.flatten(), minlength=router.experts).float()
    return float(counts.max() / counts.mean())


def test_the_bias_moves_the_routing_toward_balance():
    router, x = _skewed_router()
    before = _imbalance(router, x)
    layer = SimpleNamespace(router=router)
    for _ in range(200):
        router(x)
        update_expert_biases([layer], 0.01)
    after = _imbalance(router, x)
    assert before > 2.5 and after < 1.5, (before, after)
    assert router.expert_bias[0] < 0 and router.step_slots is None


def test_forwards_without_gradient_do_not_count():
    router, x = _skewed_router()
    with torch.no_grad():
        router(x)
    assert router.step_slots is None
    router(x)
    assert float(router.step_slots.sum()) == x.shape[0] * router.top_k


def test_a_rate_of_zero_keeps_the_bias_at_zero():
    plan = make_plan(spec_update={**SIGMOID_GROUPS, "expert_bias_update_rate": 0.0})
    trainer = reference_trainer(plan)
    trainer.train_step(0)
    assert all(not b.any() for b in expert_biases(trainer).values())


def test_the_bias_stays_fp32_under_bf16_parameters():
    trainer = reference_trainer(make_plan(spec_update=SIGMOID_GROUPS), dtype="bf16")
    trainer.train_step(0)
    biases = expert_biases(trainer)
    assert biases and all(b.dtype == torch.float32 for b in biases.values())
    # one step of 0.001 each way, kept exactly enough to tell the experts apart
    step = torch.tensor(1e-3)
    assert all(((b == 0) | (b.abs() == step)).all() and b.any() for b in biases.values())


def test_the_bias_is_checkpointed(tmp_path):
    from runtime import checkpoint

    plan = make_plan(spec_update=SIGMOID_GROUPS)
    first = reference_trainer(plan)
    for s in range(2):
        first.train_step(s)
    path = checkpoint.save(first, tmp_path / "ck", 2)
    resumed = reference_trainer(plan)
    assert checkpoint.load(resumed, path) == 2
    want = expert_biases(first)
    got = expert_biases(resumed)
    assert want.keys() == got.keys() and any(b.any() for b in want.values())
    assert all(torch.equal(got[k], want[k]) for k in want)


A2A, AG = Dispatch.all_to_all, Dispatch.allgather_reduce_scatter
LAYOUTS = {
    "dp2_ep2_a2a": dict(dp=2, ep=2, dispatch=A2A, spec_update=SIGMOID_GROUPS),
    "sp2_ep2_allgather_mla": dict(sp=2, ep=2, dispatch=AG,
                                  spec_update={**MLA, **SIGMOID_GROUPS}),
    "pp2": dict(pp=2, stage_layers=(2, 2), spec_update=SIGMOID_GROUPS),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_move_the_bias_as_one_rank(pool2, layout):
    """Over several steps (each step's routing sees the bias the steps before moved): the
    same losses (1e-5) and, on every rank, exactly the one-rank reference's biases."""
    plan = make_plan(**LAYOUTS[layout])
    results = pool2.run("dist_workers", "losses_and_expert_biases", plan.model_dump_json(),
                        STEPS)
    ref = reference_trainer(plan)
    ref_losses = [ref.train_step(s).loss for s in range(STEPS)]
    want = expert_biases(ref)
    assert any(b.any() for b in want.values())
    seen = set()
    for rank, (losses, biases) in enumerate(results):
        for got, expect in zip(losses, ref_losses, strict=True):
            assert abs(got - expect) / abs(expect) < LOSS_RTOL, (rank, losses, ref_losses)
        for name, bias in biases.items():
            assert torch.equal(bias, want[name]), (rank, name, bias, want[name])
            seen.add(name)
    assert seen == set(want)
