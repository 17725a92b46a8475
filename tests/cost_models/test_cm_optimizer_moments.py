"""Plan.optimizer_moments: Adam's moments in fp32 or bf16 (Megatron-Core's precision-aware
optimizer), validated, refused by moeplan's runtime, priced in memory and in the optimizer
step's bytes."""

from __future__ import annotations

import pytest

import cost_models
from cost_models.memory import memory_breakdown
from cost_models.params import stage_params
from plans import Optimizer, OptimizerSharding, Plan, Precision, Target
from plans.execution import UnsupportedFeature, check, refusals


def _plan(node_plan, **update) -> Plan:
    return node_plan("qwen3-30b-a3b", target=Target.megatron, stage_layers=(48,), **update)


def test_state_bytes_have_one_owner():
    assert Optimizer.adam.state_bytes(Precision.fp32) == 12 == Optimizer.adam.state_bytes_per_param
    assert Optimizer.adam.state_bytes(Precision.bf16) == 8
    assert Optimizer.sgd.state_bytes(Precision.bf16) == 4


def test_moments_are_validated_naming_the_field(node_plan):
    with pytest.raises(ValueError, match="optimizer_moments\n  Input should be"):
        Plan.model_validate({**_plan(node_plan).model_dump(), "optimizer_moments": "fp8"})


def test_bf16_moments_save_two_bytes_a_moment_of_the_shard_and_cost_less_step(node_plan):
    fp32, bf16 = _plan(node_plan), _plan(node_plan, optimizer_moments=Precision.bf16)
    shard = stage_params(fp32.model, fp32.degrees, fp32.stage_layers)[0].optimizer_shard(
        fp32.degrees, fp32.optimizer_sharding)
    a, b = (memory_breakdown(p).components_bytes["optimizer"] for p in (fp32, bf16))
    assert a - b == pytest.approx(2 * 2 * shard)
    ea, eb = cost_models.evaluate(fp32), cost_models.evaluate(bf16)
    assert eb.breakdown_s["optimizer"] < ea.breakdown_s["optimizer"]


def test_moeplan_refuses_bf16_moments_and_megatron_needs_the_distributed_optimizer(node_plan):
    plan = _plan(node_plan, optimizer_moments=Precision.bf16)
    moeplan = plan.model_copy(update={"target": Target.moeplan})
    with pytest.raises(UnsupportedFeature, match="^optimizer_moments: bf16 is not run by "
                                                 "target moeplan"):
        check(moeplan)
    assert not [r for r in refusals(plan, target=Target.megatron)
                if r.startswith("optimizer_moments")]
    whole = plan.model_copy(update={"optimizer_sharding": OptimizerSharding.none})
    assert any(r.startswith("optimizer_moments: bf16 is not run by target megatron")
               and "distributed optimizer" in r for r in refusals(whole, target=Target.megatron))
