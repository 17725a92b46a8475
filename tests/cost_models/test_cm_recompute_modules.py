"""Plan.recompute_modules: validated, refused by moeplan's runtime beyond the attention core
and the experts' activation,
priced in memory (what each module discards, cost_models.megatron.kept_bytes_per_token) and
in time (the modules' operators rerun in the backward graph)."""

from __future__ import annotations

import pytest

import cost_models
from cost_models import megatron
from cost_models.layer import layer_key, layer_timing_for
from cost_models.memory import EP_LOAD, memory_breakdown
from plans import Overlap, Plan, Recompute, RecomputeModule, SpecError, Target, catalog
from plans.execution import UnsupportedFeature, check, refusals
from plans.operators import MODULE_OPERATORS, RECOMPUTED, LayerOperator, recomputed_operators

M = RecomputeModule


def _plan(node_plan, name="qwen3-30b-a3b", modules=(M.core_attn,), **update) -> Plan:
    m = catalog.load_model(name)
    return node_plan(name, target=Target.megatron, overlap=Overlap.none,
                     recompute=Recompute.selective, recompute_modules=modules,
                     stage_layers=(m.layers,), **update)


def test_modules_are_validated_naming_the_field(node_plan):
    with pytest.raises(ValueError, match="recompute_modules: modules are for recompute "
                                         "selective, got recompute none"):
        Plan.model_validate({**_plan(node_plan).model_dump(), "recompute": "none",
                             "recompute_modules": ["moe_act"]})
    with pytest.raises(ValueError, match="recompute_modules: give each module once"):
        Plan.model_validate({**_plan(node_plan).model_dump(),
                             "recompute_modules": ["moe_act", "moe_act"]})
    with pytest.raises(ValueError, match="recompute_modules"):
        Plan.model_validate({**_plan(node_plan).model_dump(),
                             "recompute_modules": ["attention"]})


def test_the_default_module_is_the_selective_set_and_each_module_its_operators():
    assert recomputed_operators(Recompute.selective) == RECOMPUTED[Recompute.selective]
    assert recomputed_operators(Recompute.full, (M.core_attn,)) == frozenset(LayerOperator)
    assert recomputed_operators(Recompute.selective, (M.moe_act, M.layernorm)) == frozenset(
        {LayerOperator.expert_swiglu, LayerOperator.attn_norm, LayerOperator.ffn_norm})
    assert set(MODULE_OPERATORS) == set(M)


def test_moeplan_refuses_modules_beyond_the_attention_core_and_experts_activation(node_plan):
    plan = _plan(node_plan, modules=(M.core_attn, M.layernorm)).model_copy(
        update={"target": Target.moeplan})
    assert refusals(plan) == [
        "recompute_modules: core_attn, layernorm is not run by target moeplan (its runtime on "
        "cuda_nccl): selective recomputation reruns the attention core (core_attn) and the "
        "experts' activation (moe_act) only, not layernorm (a Megatron-Core module: target "
        "megatron)"]
    with pytest.raises(UnsupportedFeature, match="^recompute_modules: "):
        check(plan)
    for modules in ((M.core_attn,), (M.moe_act,), (M.core_attn, M.moe_act)):
        check(plan.model_copy(update={"recompute_modules": modules}))
    assert not [r for r in refusals(_plan(node_plan, modules=(M.moe_act,)), target=Target.megatron)
                if r.startswith("recompute_modules")]
    no_mla = _plan(node_plan, modules=(M.mla_up_proj,))
    assert any(r.startswith("recompute_modules: ") and "no MLA" in r
               for r in refusals(no_mla, target=Target.megatron))
    assert issubclass(UnsupportedFeature, SpecError)


def test_each_module_drops_what_it_discards():
    """Bytes per token of one layer, module by module, against the kept tensors by hand."""
    qwen, v3 = catalog.load_model("qwen3-30b-a3b"), catalog.load_model("deepseek-v3")
    from plans import Degrees, Precision

    d = Degrees(dp=8, ep=8)

    def kept(m, modules, dense=False, precision=Precision.bf16):
        return megatron.kept_bytes_per_token(m, d, precision, Recompute.selective, dense,
                                             modules)

    core = kept(qwen, (M.core_attn,))
    assert kept(qwen, (M.core_attn, M.moe_act)) == pytest.approx(
        core - qwen.top_k * EP_LOAD * 2.0 * qwen.expert_ffn_hidden)
    assert kept(qwen, (M.core_attn, M.layernorm)) == core
    assert kept(qwen, (M.moe,)) == pytest.approx(
        kept(qwen, (M.core_attn,)) + 4.0 * qwen.query_heads
        - (megatron.ROUTER_DTYPE_BYTES * (qwen.hidden + 3 * qwen.experts) + qwen.experts
           + qwen.top_k * EP_LOAD * (2.0 * qwen.hidden + 6.0 * qwen.expert_ffn_hidden
                                     + megatron.ROUTED_WEIGHT_BYTES)) + 2.0 * qwen.hidden)
    assert kept(v3, (M.mla_up_proj,)) == pytest.approx(
        kept(v3, (M.core_attn,)) + 4.0 * v3.query_heads - 2.0 * (v3.q_dim + 2 * v3.kv_dim))
    s = v3.shared_experts * v3.shared_expert_ffn_hidden
    assert kept(v3, (M.core_attn, M.shared_experts)) == pytest.approx(
        kept(v3, (M.core_attn,)) - 2.0 * v3.hidden - 6.0 * s)
    fp8 = kept(qwen, (M.core_attn, M.moe_act), precision=Precision.fp8)
    assert fp8 == pytest.approx(kept(qwen, (M.core_attn,), precision=Precision.fp8)
                                - qwen.top_k * EP_LOAD * 1.0 * qwen.expert_ffn_hidden)
    assert kept(v3, (M.core_attn, M.mlp), dense=True) == pytest.approx(
        kept(v3, (M.core_attn,), dense=True) - 6.0 * v3.dense_ffn_hidden)


def test_recomputed_modules_cost_time_and_save_memory(node_plan):
    base = _plan(node_plan)
    act = _plan(node_plan, modules=(M.core_attn, M.moe_act))
    t0, t1 = (layer_timing_for(layer_key(p), Overlap.none) for p in (base, act))
    assert t1.recompute_s > t0.recompute_s
    e0, e1 = cost_models.evaluate(base), cost_models.evaluate(act)
    assert e1.step_time_s > e0.step_time_s
    assert (memory_breakdown(act).components_bytes["activations"]
            < memory_breakdown(base).components_bytes["activations"])


@pytest.mark.parametrize("kernels, dropped", [("eager", 4.0), ("fused", 2.0)])
@pytest.mark.parametrize("layout", ["1gpu", "ep2_a2a", "ep2_allgather", "etp2"])
def test_moe_act_drops_the_experts_activation_output_on_moeplans_runtime(kernels, dropped,
                                                                          layout):
    """moeplan's runtime under moe_act keeps fc1's and fc3's outputs and drops the SwiGLU's
    output (fc2's input, 2 bytes per routed row and FFN column) and, eagerly, SiLU's (2 more):
    the bytes tests/runtime/test_recompute_act.py sees kept; the rest of the layer alike."""
    from cost_models.memory import layer_activation_terms
    from plans import EPFFN, TPFFN, Degrees, Dispatch, Kernels

    m = catalog.load_model("deepseekmoe")
    d, ffn = {"1gpu": (Degrees(), EPFFN()),
              "ep2_a2a": (Degrees(dp=2, ep=2), EPFFN(dispatch=Dispatch.all_to_all)),
              "ep2_allgather": (Degrees(dp=2, ep=2),
                                EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
              "etp2": (Degrees(tp=2, etp=2), TPFFN())}[layout]
    tokens, k, f = 4096, m.top_k, m.expert_ffn_hidden
    rows = k * (EP_LOAD if d.ep > 1 else 1.0)

    def terms(modules):
        return layer_activation_terms(m, tokens, d, ffn, Recompute.selective, False, 1,
                                      Kernels(kernels), modules=modules)

    core, act = terms((M.core_attn,)), terms((M.core_attn, M.moe_act))
    assert act.keys() == core.keys()
    assert act["expert_rows"] == pytest.approx(core["expert_rows"] - dropped * rows * f * tokens)
    assert {n: b for n, b in act.items() if n != "expert_rows"} == {
        n: b for n, b in core.items() if n != "expert_rows"}
    only_act = terms((M.moe_act,))
    assert only_act["attention_core"] > core["attention_core"]
    assert only_act["expert_rows"] == act["expert_rows"]
