"""The fits of planner.calibrate recover known factors from measurements the cost model itself
generates with them (synthetic data, so the truth is known)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cost_models
from cost_models import comm
from planner.calibrate import (
    calibrate,
    fit_compute,
    fit_kernels,
    fit_links,
    fit_overlap,
    on,
    predicted_classes,
    with_efficiency,
)
from plans import catalog
from plans.execution import executed_plan
from plans.results import KernelRow, OverlapBench, Sweep, SweepOp, SweepRow, read
from plans.results import ProfileResult as Profile

MIB = 2**20
ROOT = Path(__file__).resolve().parents[2]
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


def _profile(ran, wall_extra_s: float = 0.0) -> Profile:
    """The kernel classes a profile of ``ran`` would report, as the cost model prices them:
    grouped GEMMs filed under gemm (picked out by name), the rest of the step memory-bound;
    its wall time the step's plus ``wall_extra_s`` the GPU waited on its host."""
    classes = predicted_classes(ran)
    step = cost_models.evaluate(ran).step_time_s
    grouped = KernelRow.model_validate({"name": "cutlass GroupProblemShape kernel",
                                        "class": "gemm", "s_per_step": classes["grouped_gemm"]})
    return Profile(step_wall_s=step + wall_extra_s,
                   class_s={"gemm": classes["gemm"] + classes["grouped_gemm"],
                            "attention": classes["attention"],
                            "elementwise": step - sum(classes.values())},
                   slowest=[grouped])


def test_a_fused_profile_fits_its_factors_from_kernel_time_not_wall_time():
    """with_fused_step: gemm, grouped_gemm and attention from the fused step's kernel classes,
    fused_elementwise from its memory-bound classes, so time the GPU waited on its host (wall
    beyond the kernels) moves no factor; the eager profiled step's residual then sets
    elementwise with those compute factors."""
    from planner.calibrate import Calibration, with_fused_step
    from plans import Kernels

    base = catalog.load_cluster("h200")
    truth = {"gemm": 0.7, "grouped_gemm": 0.6, "attention": 0.5, "fused_elementwise": 0.45,
             "elementwise": 0.2}
    eager = catalog.load_plan(PLAN)
    fused = eager.model_copy(update={"kernels": Kernels.fused})
    true_cluster = with_efficiency(base, **truth)
    fused_profile = _profile(executed_plan(on(fused, true_cluster)), wall_extra_s=0.03)
    eager_profile = _profile(executed_plan(on(eager, true_cluster)))
    fit = with_fused_step(Calibration(base, {}), fused_profile, fused,
                          (eager_profile, eager)).factors
    for name, value in truth.items():
        assert fit[name] == pytest.approx(value, rel=0.02), name


# ---- the micro-benchmark fits -------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from fidelity_fixture import TRUTH as FIXTURE_TRUTH  # noqa: E402
from fidelity_fixture import synthetic_sweep  # noqa: E402

KERNEL_FACTORS = ("gemm", "gemm_launch_us", "grouped_gemm", "grouped_gemm_half_rows",
                  "grouped_gemm_launch_us", "grouped_gemm_stream_tb_s", "attention",
                  "elementwise", "elementwise_launch_us")
TRUTH = {k: FIXTURE_TRUTH[k] for k in KERNEL_FACTORS}


def test_kernel_fits_recover_the_factors_and_the_grouped_gemm_curve():
    base = catalog.load_cluster("h200")
    fit = fit_kernels(synthetic_sweep(with_efficiency(base, **TRUTH)), base)
    assert set(fit) == set(TRUTH)
    for name in ("gemm", "grouped_gemm", "attention", "elementwise"):
        assert fit[name] == pytest.approx(TRUTH[name], rel=0.01), name
    assert fit["grouped_gemm_half_rows"] == pytest.approx(TRUTH["grouped_gemm_half_rows"],
                                                          rel=0.05)


def test_the_grouped_gemm_stream_is_fitted_where_it_bounds_the_small_rows():
    """With a flat size curve the small-row grouped GEMMs are bound by their operand stream
    (each row block re-reads its expert's weights): the fit recovers its rate and the curve
    stays flat."""
    base = catalog.load_cluster("h200")
    truth = {**TRUTH, "grouped_gemm_half_rows": 4.0, "grouped_gemm_stream_tb_s": 2.9}
    fit = fit_kernels(synthetic_sweep(with_efficiency(base, **truth)), base)
    assert fit["grouped_gemm_stream_tb_s"] == pytest.approx(2.9, rel=0.01)
    assert fit["grouped_gemm"] == pytest.approx(truth["grouped_gemm"], rel=0.01)
    assert fit["grouped_gemm_half_rows"] < 16
    for name in ("gemm_launch_us", "grouped_gemm_launch_us", "elementwise_launch_us"):
        assert fit[name] == pytest.approx(TRUTH[name], abs=1.0), name


def test_kernel_fits_under_noise_stay_near_the_truth():
    """A +-5% wobble on every row moves no factor by more than a few percent."""
    base = catalog.load_cluster("h200")
    fit = fit_kernels(synthetic_sweep(with_efficiency(base, **TRUTH), noise=0.05), base)
    for name in ("gemm", "grouped_gemm", "attention", "elementwise"):
        assert fit[name] == pytest.approx(TRUTH[name], rel=0.04), name
    assert fit["grouped_gemm_half_rows"] == pytest.approx(120, rel=0.3)
    for name in ("gemm_launch_us", "grouped_gemm_launch_us", "elementwise_launch_us"):
        assert fit[name] == pytest.approx(TRUTH[name], abs=5.0), name


def test_compute_kernels_are_fitted_to_their_device_time_layer_operators_to_one_call():
    """A row's device time (the host ahead) is what a step pays for a GEMM, grouped GEMM or
    attention kernel; the eager layer operators' one-call time holds the dispatch the eager
    step waits on. One-call times 30% above the device's leave the compute factors as the
    device times give them and move elementwise."""
    base = catalog.load_cluster("h200")
    sweep = synthetic_sweep(with_efficiency(base, **TRUTH))
    slow = Sweep(world=sweep.world, rows=[
        r.model_copy(update={"device_s": r.measured_s, "measured_s": 1.3 * r.measured_s})
        for r in sweep.rows])
    fit = fit_kernels(slow, base)
    for name in ("gemm", "grouped_gemm", "attention"):
        assert fit[name] == pytest.approx(TRUTH[name], rel=0.01), name
    assert fit["elementwise"] < 0.9 * TRUTH["elementwise"]


def test_a_curve_without_size_dependence_is_fitted_as_none():
    base = catalog.load_cluster("h200")
    flat = {**TRUTH, "grouped_gemm_half_rows": 0.0}
    fit = fit_kernels(synthetic_sweep(with_efficiency(base, **flat)), base)
    assert fit["grouped_gemm_half_rows"] < 2
    assert fit["grouped_gemm"] == pytest.approx(0.66, rel=0.01)


def test_with_micro_benchmarks_the_profiled_step_sets_only_elementwise():
    """The layer operators' micro-benchmarks say elementwise 0.09 and 20 us a kernel; the step
    ran its memory-bound operators at 0.2: the step sets elementwise, the fixed time held."""
    base = catalog.load_cluster("h200")
    truth = with_efficiency(base, **{**TRUTH, "elementwise": 0.2})
    plan = catalog.load_plan(PLAN)
    wall = cost_models.evaluate(executed_plan(on(plan, truth))).step_time_s
    profile = Profile(step_wall_s=wall, class_s={}, slowest=[])
    sweep = synthetic_sweep(with_efficiency(base, **TRUTH))
    cal = calibrate(profile, plan, base, "fitted", sweep)
    assert cal.factors["elementwise"] == pytest.approx(0.2, rel=0.02)
    assert cal.factors["elementwise_launch_us"] == pytest.approx(TRUTH["elementwise_launch_us"],
                                                                 abs=1.0)
    assert cal.factors["grouped_gemm"] == pytest.approx(TRUTH["grouped_gemm"], rel=0.01)


def _beside(rows: list[tuple[float, float, float]]) -> OverlapBench:
    return OverlapBench(world=2, rows=[
        {"compute_s": c, "nccl_s": n, "nccl_beside_compute_s": b} for c, n, b in rows])


def test_overlap_fit_is_the_share_of_the_collectives_time_that_running_beside_saved():
    assert fit_overlap(_beside([(10e-3, 2e-3, 10e-3)])) == pytest.approx(1.0)   # all hidden
    assert fit_overlap(_beside([(10e-3, 2e-3, 12e-3)])) == pytest.approx(0.0)   # none
    assert fit_overlap(_beside([(10e-3, 2e-3, 11e-3)])) == pytest.approx(0.5)
    # pooled over the shapes by the collectives' time: (1 + 0) / (2 + 2)
    assert fit_overlap(_beside([(10e-3, 2e-3, 11e-3), (5e-3, 2e-3, 7e-3)])) == pytest.approx(0.25)
    # together slower than one after the other: nothing hidden, never a negative share
    assert fit_overlap(_beside([(10e-3, 2e-3, 13e-3)])) == 0.0


def test_the_committed_h200_measurement_hid_nothing_and_inter_op_then_never_wins():
    bench = read(OverlapBench, ROOT / "bench/results/h200/copy_engine_x2.json", "overlap")
    assert fit_overlap(bench) == 0.0
    sweep = read(Sweep, ROOT / "bench/results/h200/fidelity/calibration_h200.json", "sweep")
    cal = calibrate(None, None, catalog.load_cluster("h200"), "H200-beside", sweep, bench)
    assert cal.cluster.efficiency.overlap == 0.0 == cal.factors["overlap"]
    plan = on(catalog.load_plan("bench/gpu_plans/fidelity/mixtral2l_dp2_ep2_interop_mbs1.json"),
              cal.cluster)
    serial = plan.model_copy(update={"overlap": "none"})
    # nothing hidden: the chunked layer costs what it costs serially, plus its chunking
    assert cost_models.evaluate(plan).step_time_s >= cost_models.evaluate(serial).step_time_s
    hiding = on(plan, with_efficiency(cal.cluster, overlap=0.9))
    assert cost_models.evaluate(hiding).step_time_s < cost_models.evaluate(plan).step_time_s
