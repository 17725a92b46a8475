"""What the runtime runs differently from a plan is said, and the cost model can price it."""

from __future__ import annotations

import cost_models
from plans import Overlap, Precision, TrainingSpec
from plans.execution import deviations, executed_plan

from .test_plan import make


def fp8_plan():
    return make(training=TrainingSpec(global_batch=256, seq_len=4096, precision=Precision.fp8),
                grad_sync_precision=Precision.fp8)


def test_a_searched_plan_lists_each_field_the_runtime_runs_differently():
    found = {d.field: d for d in deviations(fp8_plan())}  # overlap and sync overlap on
    assert set(found) == {"overlap", "grad_sync_overlap", "grad_accumulation_fusion",
                          "training.precision"}
    assert found["overlap"].planned == "inter_intra_op" and found["overlap"].executed == "none"
    assert all(d.note().startswith(f"note: {d.field}: planned ") for d in found.values())


def test_a_plan_written_for_this_runtime_has_no_deviation():
    plan = make(overlap=Overlap.none, grad_sync_overlap=False, grad_accumulation_fusion=False)
    assert deviations(plan) == []
    assert executed_plan(plan).model_dump(exclude={"prediction"}) == plan.model_dump(
        exclude={"prediction"})


def test_the_executed_plan_is_priced_slower_and_keeps_fp8_sync():
    plan = fp8_plan()
    ran = executed_plan(plan)
    assert ran.training.precision == Precision.bf16 and ran.grad_sync_precision == Precision.fp8
    assert ran.overlap == Overlap.none and not ran.grad_sync_overlap
    assert not ran.grad_accumulation_fusion
    assert cost_models.evaluate(ran).step_time_s > cost_models.evaluate(plan).step_time_s
