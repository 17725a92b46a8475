"""The fits of planner.calibrate recover known factors from measurements the cost model itself
generates with them (synthetic data, so the truth is known)."""

from __future__ import annotations

import pytest

import cost_models
from cost_models import comm
from planner.calibrate import (
    fit_compute,
    fit_links,
    on,
    predicted_classes,
    with_efficiency,
)
from plans import catalog
from plans.execution import executed_plan
from plans.results import KernelRow, Sweep, SweepOp, SweepRow
from plans.results import ProfileResult as Profile

MIB = 2**20
PLAN = "bench/gpu_plans/mixtral2l_1gpu.json"


def test_links_fit_recovers_latency_and_efficiencies():
    base = catalog.load_cluster("h200")
    truth = with_efficiency(base, nvlink=0.62, nvlink_all_to_all=0.74).model_copy(
        update={"node": base.node.model_copy(update={"nvlink_latency_us": 40.0})})
    layout = comm.group_layout(2, 1, base.node.gpus_per_node)
    rows = []
    for mib in (1, 4, 16, 64, 256, 512):
        size = mib * MIB
        # labels are for people: the fit reads op and bytes
        rows += [
            SweepRow(name="a", op=SweepOp.all_to_all, bytes=size,
                     measured_s=comm.all_to_all_s(size, layout, truth)),
            SweepRow(name="b", op=SweepOp.all_gather, bytes=size,
                     measured_s=comm.all_gather_s(size, layout, truth)),
            SweepRow(name="c", op=SweepOp.reduce_scatter, bytes=size,
                     measured_s=comm.reduce_scatter_s(size, layout, truth)),
        ]
    fit = fit_links(Sweep(world=2, rows=rows), base)
    assert fit["nvlink_latency_us"] == pytest.approx(40.0, abs=2)
    assert fit["nvlink"] == pytest.approx(0.62, abs=0.015)
    assert fit["nvlink_all_to_all"] == pytest.approx(0.74, abs=0.015)


def test_compute_fit_recovers_factors_from_a_step_priced_with_them():
    base = catalog.load_cluster("h200")
    truth = {"gemm": 0.7, "grouped_gemm": 0.6, "attention": 0.5, "elementwise": 0.2}
    plan = catalog.load_plan(PLAN)
    ran = executed_plan(on(plan, with_efficiency(base, **truth)))
    classes = predicted_classes(ran)  # the step's kernel times, as a profile would report them
    # grouped GEMM kernels are filed under gemm by class and picked out by name
    grouped = KernelRow.model_validate({"name": "cutlass GroupProblemShape kernel",
                                        "class": "gemm", "s_per_step": classes["grouped_gemm"]})
    profile = Profile(
        step_wall_s=cost_models.evaluate(ran).step_time_s,
        class_s={"gemm": classes["gemm"] + classes["grouped_gemm"],
                 "attention": classes["attention"]},
        slowest=[grouped],
    )
    fit = fit_compute(profile, plan, base)
    for name, value in truth.items():
        assert fit[name] == pytest.approx(value, rel=0.02), name


def test_a_fused_profile_fits_the_fused_factor_and_keeps_elementwise():
    """A step that ran kernels fused is priced at fused_elementwise (cost_models.layer_graph):
    calibrating it recovers that factor; elementwise (the residual adds) keeps the base's."""
    from plans import Kernels

    base = catalog.load_cluster("h200")
    truth = {"gemm": 0.7, "grouped_gemm": 0.6, "attention": 0.5, "fused_elementwise": 0.4}
    plan = catalog.load_plan(PLAN).model_copy(update={"kernels": Kernels.fused})
    ran = executed_plan(on(plan, with_efficiency(base, **truth)))
    classes = predicted_classes(ran)
    grouped = KernelRow.model_validate({"name": "cutlass GroupProblemShape kernel",
                                        "class": "gemm", "s_per_step": classes["grouped_gemm"]})
    profile = Profile(
        step_wall_s=cost_models.evaluate(ran).step_time_s,
        class_s={"gemm": classes["gemm"] + classes["grouped_gemm"],
                 "attention": classes["attention"]},
        slowest=[grouped],
    )
    fit = fit_compute(profile, plan, base)
    assert "elementwise" not in fit
    for name, value in truth.items():
        assert fit[name] == pytest.approx(value, rel=0.02), name
