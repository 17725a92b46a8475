"""The capability table (plans.execution) covers every plan field and value on every backend,
and its answers are what the launch check, the runnable search and the pricing of a run read."""

from __future__ import annotations

import typing
from enum import Enum

import pytest

import cost_models
from planner.space import RUNNABLE_FIELDS, SearchSpace
from plans import (
    EPFFN,
    TPFFN,
    CPAttention,
    Degrees,
    Kernels,
    ModelSpec,
    Optimizer,
    Overlap,
    Plan,
    Precision,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)
from plans.enums import Target
from plans.execution import (
    ANY,
    MODEL_FEATURES,
    NOT_EXECUTED,
    TABLE,
    Backend,
    ExportOnly,
    Support,
    UnsupportedFeature,
    check,
    deviations,
    executed_anywhere,
    executed_plan,
    executes,
    lookup,
    refusals,
)

from .test_plan import make


def fp8_plan():
    return make(training=TrainingSpec(global_batch=256, seq_len=4096, precision=Precision.fp8),
                grad_sync_precision=Precision.fp8)


def _values(annotation) -> list:
    """Every value a field of this annotation can hold (ANY for open ones)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return list(args)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return list(annotation)
    if annotation is bool:
        return [True, False]
    if len(args) == 1:  # X | None
        return _values(args[0])
    return [ANY]


def _schema_fields() -> list[tuple[str, list]]:
    out = []
    for name, info in Plan.model_fields.items():
        if name in NOT_EXECUTED:
            continue
        if name in ("attention", "ffn", "training"):
            kinds = {"attention": (UlyssesAttention, TPAttention, CPAttention),
                     "ffn": (EPFFN, TPFFN), "training": (TrainingSpec,)}[name]
            for kind in kinds:
                out += [(f"{name}.{sub}", _values(i.annotation))
                        for sub, i in kind.model_fields.items()]
        else:
            out.append((name, _values(info.annotation)))
        if name == "model":  # whether the model asks for dropout (plans.execution.plan_fields)
            out.append(("model.dropout", [False, True]))
            for feature in MODEL_FEATURES:
                annotation = ModelSpec.model_fields[feature].annotation
                values = list(annotation) if isinstance(annotation, type) and issubclass(
                    annotation, Enum) else [False, True]
                out.append((f"model.{feature}", values))
    return out


COLUMNS = [(Target.moeplan, b) for b in Backend] + [(Target.megatron, Backend.cuda_nccl),
                                                   (ExportOnly.torchtitan, Backend.cuda_nccl)]


@pytest.mark.parametrize("target,backend", COLUMNS)
def test_the_table_answers_for_every_field_and_value_of_the_schema(target, backend):
    fields = _schema_fields()
    assert {"overlap", "schedule", "attention.kind", "training.optimizer",
            "ffn.dispatch", "target"} <= {f for f, _ in fields}
    for field, values in fields:
        for value in values:
            row = lookup(field, value, backend, target)  # KeyError if the column lacks it
            assert row.target == target
            assert row.support in Support
            if row.support == Support.runs_as:
                assert row.runs is not None and row.reason, row
            if row.support == Support.refused:
                assert row.reason, row
    # and the table has no row for a field the schema does not have
    assert {r.field for r in TABLE} <= {f for f, _ in fields}


@pytest.mark.parametrize("backend", list(Backend))
def test_cp_attention_is_refused_at_launch_with_one_line_naming_the_field(backend):
    plan = make(attention=CPAttention(), degrees=Degrees(pp=4, dp=2, cp=8, ep=8))
    with pytest.raises(UnsupportedFeature) as e:
        check(plan, backend)
    line = str(e.value)
    assert line.startswith("attention.kind: cp ") and "\n" not in line
    assert "attention.zigzag" in " ".join(refusals(plan, backend))
    with pytest.raises(UnsupportedFeature):
        executed_plan(plan, backend)


def test_a_searched_plan_lists_each_field_the_runtime_runs_differently():
    found = {d.field: d for d in deviations(fp8_plan())}  # overlap and sync overlap on
    assert set(found) == {"overlap", "training.precision"}
    assert found["overlap"].planned == "inter_intra_op"
    assert found["overlap"].executed == "inter_op"
    assert all(d.note().startswith(f"note: {d.field}: planned ") for d in found.values())


def test_a_plan_written_for_this_runtime_has_no_deviation_on_gpus_and_fp32_on_cpus():
    plan = make(overlap=Overlap.none, grad_sync_overlap=False, grad_accumulation_fusion=False,
                kernels=Kernels.eager)
    assert deviations(plan) == []
    assert executed_plan(plan).model_dump(exclude={"prediction"}) == plan.model_dump(
        exclude={"prediction"})
    on_cpu = deviations(plan, Backend.cpu_gloo)
    assert [(d.field, d.executed) for d in on_cpu] == [("training.precision", "fp32")]
    assert executed_plan(plan, Backend.cpu_gloo).training.precision == Precision.fp32


def test_the_executed_plan_is_priced_slower_and_keeps_fp8_sync():
    plan = fp8_plan()
    ran = executed_plan(plan)
    assert ran.training.precision == Precision.bf16 and ran.grad_sync_precision == Precision.fp8
    assert ran.overlap == Overlap.inter_op and ran.grad_sync_overlap
    assert isinstance(ran.overlap, Overlap)
    assert ran.grad_accumulation_fusion
    assert cost_models.evaluate(ran).step_time_s > cost_models.evaluate(plan).step_time_s


def test_the_runnable_search_space_is_what_the_table_executes():
    full, runnable = SearchSpace(attention=tuple(SearchSpace.__dataclass_fields__[
        "attention"].default) + ("cp",)), SearchSpace().runnable()
    for option, field in RUNNABLE_FIELDS.items():
        expect = tuple(v for v in getattr(full, option) if executes(field, v))
        assert getattr(runnable, option) == expect, option
    assert runnable.overlap == (Overlap.none, Overlap.inter_op)
    assert runnable.grad_sync_overlap and runnable.grad_accumulation_fusion
    # fused kernels run on both backends (torch.compile: Triton on CUDA, C++ on CPU)
    for backend in Backend:
        assert executes("kernels", "fused", backend) and executes("kernels", "eager", backend)
        assert SearchSpace().runnable(backend).kernels == "fused"
    assert executes("training.precision", Precision.bf16)
    assert not executes("training.precision", Precision.fp8)
    assert executes("training.optimizer", Optimizer.adam)


def test_a_model_with_dropout_is_refused_naming_the_field():
    plan = make()
    dropout = plan.model_copy(update={"model": plan.model.model_copy(update={"dropout": 0.1})})
    for backend in Backend:
        check(plan, backend)
        with pytest.raises(UnsupportedFeature, match="^model.dropout: "):
            check(dropout, backend)


def test_a_measured_run_is_priced_by_what_it_recorded():
    """executed_as_measured: a result's recorded deviations, not today's table, say how its run
    executed the plan; a result without the record is read by today's table."""
    from plans.execution import executed_as_measured, measured_deviations, record

    plan = fp8_plan()  # inter+intra-op overlap, fp8 GEMMs, gradient-accumulation fusion
    assert plan.grad_accumulation_fusion
    now = record(plan, Backend.cuda_nccl)
    assert executed_as_measured(plan, now) == executed_plan(plan)
    assert executed_as_measured(plan, now).grad_accumulation_fusion
    older = [*now, {"field": "grad_accumulation_fusion", "planned": "true",
                    "executed": "false"}]
    ran = executed_as_measured(plan, older)
    assert ran.grad_accumulation_fusion is False and ran.overlap == Overlap.inter_op
    assert executed_as_measured(plan, None) == executed_plan(plan)
    assert measured_deviations(plan, None) == deviations(plan, Backend.cuda_nccl)
    assert {d.field for d in measured_deviations(plan, older)} == {d["field"] for d in older}


@pytest.mark.parametrize("backend", list(Backend))
def test_a_deepseek_v3_plan_is_refused_for_its_mtp_module_and_yarn_alone(backend):
    """moeplan's runtime runs MLA and sigmoid group-limited routing with the expert bias and
    the scaling factor; the multi-token prediction module and YaRN's angles are the fields it
    refuses, each in one line naming field, target and reason."""
    v3 = catalog.load_model("deepseek-v3")
    plan = make(model=v3, degrees=Degrees(pp=4, dp=2, sp=8, ep=8), ffn=EPFFN(),
                stage_layers=(16, 15, 15, 15))
    found = refusals(plan, backend)
    assert sorted(line.split(":")[0] for line in found) == ["model.mtp_layers",
                                                            "model.rope_scaling"]
    assert any("no multi-token prediction modules" in line for line in found)
    yarn = next(line for line in found if line.startswith("model.rope_scaling"))
    assert "target moeplan" in yarn and "plain RoPE angles" in yarn and "\n" not in yarn
    with pytest.raises(UnsupportedFeature, match="^model.(mtp_layers|rope_scaling): "):
        check(plan, backend)
    assert refusals(make(model=v3.model_copy(update={"mtp_layers": 0, "rope_scaling": None}),
                         degrees=Degrees(pp=4, dp=2, sp=8, ep=8), ffn=EPFFN(),
                         stage_layers=(16, 15, 15, 15)), backend) == []


def test_megatron_runs_each_field_by_its_flag_and_refuses_what_it_lacks():
    """Megatron-Core's column: every executed row names how (its flag), tile-fused overlap
    and fp8 gradient sync are refused in one line naming field, target and reason."""
    for row in TABLE:
        if row.target == Target.megatron and row.support == Support.executed:
            assert row.reason, row
    plan = as_megatron(fp8_plan())
    lines = refusals(plan, target=Target.megatron)
    assert [ln.split(":")[0] for ln in lines] == ["overlap", "grad_sync_precision"]
    assert lines[0].startswith("overlap: inter_intra_op is not run by target megatron "
                               "(Megatron-Core): ") and "\n" not in lines[0]
    with pytest.raises(UnsupportedFeature, match="^overlap: "):
        executed_plan(plan, target=Target.megatron)
    # moeplan's runtime refuses a megatron plan, and Megatron-Core a moeplan plan
    assert refusals(plan)[0].startswith("target: megatron ")
    assert refusals(fp8_plan(), target=Target.megatron)[0].startswith("target: moeplan ")
    assert not executed_anywhere("overlap", Overlap.inter_intra_op)
    assert executed_anywhere("overlap", Overlap.inter_op)


def test_megatron_runs_the_chunked_loss_materialized_and_eager_kernels_fused():
    plan = as_megatron(make(overlap=Overlap.none, kernels=Kernels.eager)).model_copy(
        update={"cross_entropy": "chunked"})
    found = {d.field: d.executed for d in deviations(plan, target=Target.megatron)}
    assert found == {"cross_entropy": "materialized", "kernels": "fused"}
    ran = executed_plan(plan, target=Target.megatron)
    assert ran.kernels == Kernels.fused and ran.cross_entropy == "materialized"


def test_megatron_ep_overlap_needs_its_conditions():
    """inter_op is Megatron-Core's --overlap-moe-expert-parallel-comm: EP, the alltoall
    dispatcher, no full recomputation, interleaving when pipelined (its config checks)."""
    from plans import Dispatch, Recompute
    from plans.execution import rule_refusals

    plan = as_megatron(make(overlap=Overlap.inter_op))
    assert plan.degrees.ep > 1 and plan.ffn.dispatch == Dispatch.all_to_all
    assert plan.degrees.pp > 1 and plan.degrees.vpp == 1
    assert "interleaved pipeline stages" in rule_refusals(plan, Target.megatron)[0]
    full = plan.model_copy(update={"recompute": Recompute.full})
    assert "recompute other than full" in rule_refusals(full, Target.megatron)[0]
    ag = plan.model_copy(update={"ffn": EPFFN(dispatch=Dispatch.allgather_reduce_scatter)})
    assert rule_refusals(ag, Target.megatron)[0].startswith("overlap: inter_op ")
    assert rule_refusals(plan.model_copy(update={"overlap": Overlap.none}),
                         Target.megatron) == []


def as_megatron(plan):
    from plans.execution import as_target

    return as_target(plan, Target.megatron)
