"""What the runtime runs differently from a plan is said, and the cost model can price it."""

from __future__ import annotations

import subprocess
import sys

from dist_workers import make_plan

import cost_models
from plans import Overlap, Precision
from runtime.deviations import deviations, executed_plan


def test_a_searched_plan_lists_each_field_the_runtime_runs_differently():
    plan = make_plan(grad_sync_precision=Precision.fp8)  # overlap and sync overlap on
    found = {d.field: d for d in deviations(plan)}
    assert set(found) == {"overlap", "grad_sync_overlap", "grad_accumulation_fusion",
                          "training.precision"}
    assert found["overlap"].planned == "inter_intra_op" and found["overlap"].executed == "none"
    assert all(d.note().startswith(f"note: {d.field}: planned ") for d in found.values())


def test_a_plan_written_for_this_runtime_has_no_deviation():
    plan = make_plan().model_copy(update={"overlap": Overlap.none, "grad_sync_overlap": False,
                                          "grad_accumulation_fusion": False})
    assert deviations(plan) == []
    assert executed_plan(plan).model_dump(exclude={"prediction"}) == plan.model_dump(
        exclude={"prediction"})


def test_the_executed_plan_is_priced_slower_and_keeps_fp8_sync():
    plan = make_plan(sp=2, ep=2, grad_sync_precision=Precision.fp8)
    ran = executed_plan(plan)
    assert ran.training.precision == Precision.bf16 and ran.grad_sync_precision == Precision.fp8
    assert ran.overlap == Overlap.none and not ran.grad_sync_overlap
    assert cost_models.evaluate(ran).step_time_s > cost_models.evaluate(plan).step_time_s


def test_deviations_import_no_torch():
    # bench/gpu_fidelity.py prices runs with the cost model, which never imports torch
    code = "import runtime.deviations, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
