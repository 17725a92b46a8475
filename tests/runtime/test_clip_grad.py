"""Global-norm gradient clipping (OptimizerConfig.clip_grad, --clip-grad) on parallel layouts
equals the one-rank reference's: the norm counts every shard once and every replica once, the
clipped gradients and the next step (SGD: the clipped update) agree."""

from __future__ import annotations

import math

import pytest
import torch
from dist_workers import OPTIM, clipped_run, make_plan, reference_trainer

from plans import Optimizer, OptimizerSharding
from runtime.parallel.optimizer import OptimizerConfig

ZERO1 = OptimizerSharding.zero1
LAYOUTS = {
    "tp2_dp2_ep4": dict(tp=2, dp=2, ep=4, tp_attention=True),
    "pp2_tp2_shared_tied": dict(model="tiny-moe-shared", pp=2, tp=2, tp_attention=True,
                                stage_layers=(1, 3)),
    "zero1_tp2_dp2_etp2": dict(tp=2, dp=2, etp=2, tp_attention=True, tp_ffn=True,
                               optimizer_sharding=ZERO1),
    "zero1_pp2_dp2_shared_ep2_tied": dict(model="tiny-moe-shared", pp=2, dp=2, ep=2,
                                          stage_layers=(2, 2), optimizer_sharding=ZERO1),
}


def _reference(plan, max_norm: float):
    ref = reference_trainer(plan, optim=OptimizerConfig(lr=OPTIM.lr, clip_grad=max_norm))
    return clipped_run(ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clipped_gradients_match_one_rank(pool4, layout):
    plan = make_plan(global_batch=4, optimizer=Optimizer.sgd, **LAYOUTS[layout])
    unclipped, *_ = _reference(plan, 1e9)
    max_norm = unclipped / 4  # clipping scales the gradients by about 1/4
    ref_norm, ref_grads, ref_loss, ref_next_norm = _reference(plan, max_norm)
    assert math.isclose(ref_norm, unclipped, rel_tol=1e-6)
    zero1 = plan.optimizer_sharding == ZERO1
    for norm, grads, loss, next_norm in pool4.run("dist_workers", "clipped_step",
                                                  plan.model_dump_json(), max_norm):
        assert math.isclose(norm, ref_norm, rel_tol=1e-5), (norm, ref_norm)
        assert math.isclose(next_norm, ref_next_norm, rel_tol=1e-4), (next_norm, ref_next_norm)
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), (loss, ref_loss)
        if zero1:  # the main gradients are this rank's own sums (reduce-scattered in place)
            continue
        for name, (grad, shard) in grads.items():
            want = ref_grads[name][0]
            want = shard.take(want) if shard else want
            assert torch.allclose(grad, want, rtol=1e-4, atol=1e-7), name


def test_the_clipped_norm_is_the_limit():
    """After clipping, the gradients' global norm is max_norm; a norm below it is untouched."""
    plan = make_plan(global_batch=4)
    unclipped, *_ = _reference(plan, 1e9)
    ref = reference_trainer(plan, optim=OptimizerConfig(clip_grad=unclipped / 2))
    ref.forward_backward(0)
    ref.sync_gradients()
    assert math.isclose(ref.clip_gradients(), unclipped, rel_tol=1e-6)
    clipped = math.sqrt(sum(float(g.square().sum()) for g, _ in
                            ref.local_gradients().values()))
    assert math.isclose(clipped, unclipped / 2, rel_tol=1e-5)
    # a limit above the norm leaves the gradients as they are
    _, grads, *_ = _reference(plan, unclipped * 2)
    same = math.sqrt(sum(float(g.square().sum()) for g, _ in grads.values()))
    assert math.isclose(same, unclipped, rel_tol=1e-5)
