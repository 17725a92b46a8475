"""Calibration: a cluster's efficiency factors fitted to measurements of moeplan's runtime on
its GPUs, and the error table of the cost model against measured training steps.

Inputs are the benchmark JSON files: one profiled 1-GPU step (`moeplan profile`: device
seconds per kernel class), optionally the collective sweep of bench/calibrate_gpu.py, and
measured steps (bench/train_step.py). Every measured run is priced as the runtime executed it
(plans.execution). The factors:

- gemm, grouped_gemm, attention: the base factor x predicted / measured kernel time of that
  class over the profiled step;
- elementwise: what is left of the profiled step once everything else is priced (the step is
  T0 + E / elementwise, E the layers' memory-bound bytes at full bandwidth), solved for it;
  fused_elementwise instead when the profiled plan ran fused kernels (plan.kernels), whose
  fusable operators are then most of E;
- hbm: the median bandwidth the sweep's large copies achieved, over the GPU's peak;
- node.nvlink_latency_us, nvlink, nvlink_all_to_all: a latency + bytes / bandwidth fit (least
  squares on log time) of the all-gather / reduce-scatter and all-to-all sweeps.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

import cost_models
from cost_models import comm
from cost_models import pipeline as pl
from cost_models.layer import layer_key
from cost_models.layer_graph import OpKind, backward_graph, forward_graph
from plans import ClusterSpec, Kernels, Plan, SpecError, catalog
from plans.errors import describe
from plans.execution import deviations, executed_plan
from plans.results import ProfileResult, Sweep, SweepOp, TrainStepResult, read, read_log

GIB = 2**30
GROUPED = re.compile(r"grouped|GroupProblemShape|group_gemm", re.IGNORECASE)
"""CUTLASS grouped GEMM kernels are named after their GroupProblemShape."""
MEMORY_CLASSES = ("elementwise", "copy", "reduction_index_sort", "other")
COMPUTE_FACTORS = ("gemm", "grouped_gemm", "attention")


def with_efficiency(cluster: ClusterSpec, **factors: float) -> ClusterSpec:
    return cluster.model_copy(update={"efficiency": cluster.efficiency.model_copy(update=factors)})


def on(plan: Plan, cluster: ClusterSpec) -> Plan:
    """The plan's job (its GPU count) on ``cluster``'s hardware and factors."""
    return plan.model_copy(update={"cluster": catalog.resize(cluster, plan.cluster.gpus,
                                                             "--cluster")})


# ---- compute factors from a profiled step ---------------------------------------------------


def measured_classes(profile: ProfileResult) -> dict[str, float]:
    """Device seconds per step of grouped GEMMs, dense GEMMs, attention and memory-bound
    kernels; grouped GEMM kernels filed under GEMM are picked out by name."""
    classes = profile.class_s
    moved = sum(k.s_per_step for k in profile.slowest
                if GROUPED.search(k.name) and k.kind != "grouped_gemm")
    return {
        "grouped_gemm": classes.get("grouped_gemm", 0.0) + moved,
        "gemm": classes.get("gemm", 0.0) - moved,
        "attention": classes.get("attention", 0.0),
        "memory": sum(classes.get(c, 0.0) for c in MEMORY_CLASSES),
    }


def predicted_classes(plan: Plan) -> dict[str, float]:
    """Seconds per step of the cost model's GEMM, grouped GEMM and attention operators: the
    layers' forward and backward over every micro-batch, plus the LM head's GEMMs."""
    key = layer_key(plan)
    fwd = forward_graph(key)
    kinds = {OpKind.gemm: "gemm", OpKind.grouped_gemm: "grouped_gemm",
             OpKind.attention: "attention"}
    per_layer = dict.fromkeys(kinds.values(), 0.0)
    for graph in (fwd, backward_graph(fwd, key.recompute)):
        for _, data in graph.nodes(data=True):
            if (label := kinds.get(data["op"].kind)) is not None:
                per_layer[label] += data["duration_s"]
    m = plan.num_micro_batches
    out = {k: t * plan.model.layers * m for k, t in per_layer.items()}
    head = pl.head_gemm_s(plan.model, plan.cluster, pl.micro_batch_tokens(plan), plan.degrees.tp)
    out["gemm"] += sum(head) * m
    return out


def fit_compute(profile: ProfileResult, plan: Plan, base: ClusterSpec) -> dict[str, float]:
    if plan.degrees.world != 1:
        raise SpecError(f"--plan: calibrate on the 1-GPU plan that was profiled (no "
                        f"communication); this one runs on {plan.degrees.world} GPUs")
    wall = profile.step_wall_s
    plan = executed_plan(on(plan, base))
    meas, pred = measured_classes(profile), predicted_classes(plan)
    factors = {k: min(1.0, getattr(base.efficiency, k) * pred[k] / meas[k])
               for k in COMPUTE_FACTORS if meas[k] > 0 and pred[k] > 0}
    cluster = with_efficiency(base, **factors)

    # the memory-bound factor the plan's operators are priced at (cost_models.layer_graph)
    name = "fused_elementwise" if plan.kernels == Kernels.fused else "elementwise"

    def step(factor: float) -> float:
        priced = on(plan, with_efficiency(cluster, **{name: factor}))
        return cost_models.evaluate(priced).step_time_s

    ideal = step(0.5) - step(1.0)  # E: the layers' memory-bound bytes at full bandwidth
    rest = step(1.0) - ideal
    left = wall - rest
    factors[name] = min(1.0, ideal / left) if left > ideal else 1.0
    return factors


# ---- memory and link factors from the collective sweep --------------------------------------


def fit_hbm(sweep: Sweep, base: ClusterSpec) -> float | None:
    achieved = [r.achieved_tb_s for r in sweep.rows
                if r.op == SweepOp.copy and r.achieved_tb_s is not None]
    return min(1.0, statistics.median(achieved) / base.gpu.hbm_tb_s) if achieved else None


def fit_links(sweep: Sweep, base: ClusterSpec) -> dict[str, float]:
    """NVLink latency (us) and ring / all-to-all efficiencies that best fit the sweep."""
    if sweep.world > base.node.gpus_per_node:
        raise SpecError(f"--collectives: the sweep ran on {sweep.world} GPUs, more than one "
                        f"{base.name} node ({base.node.gpus_per_node}): NVLink only is fitted")
    layout = comm.group_layout(sweep.world, 1, base.node.gpus_per_node)
    model = {SweepOp.all_gather: comm.all_gather_s, SweepOp.reduce_scatter: comm.reduce_scatter_s,
             SweepOp.all_to_all: comm.all_to_all_s}
    timed = [(model[r.op], float(r.bytes), r.measured_s) for r in sweep.rows if r.op in model]
    if not timed:
        raise SpecError("--collectives: no all_gather / reduce_scatter / all_to_all rows")

    def error(latency_us: float, ring: float, a2a: float) -> float:
        c = with_efficiency(base, nvlink=ring, nvlink_all_to_all=a2a).model_copy(
            update={"node": base.node.model_copy(update={"nvlink_latency_us": latency_us})})
        return sum(math.log(fn(size, layout, c) / t) ** 2 for fn, size, t in timed)

    effs = [e / 100 for e in range(20, 101)]
    best = None
    for latency in range(0, 301, 2):
        ring = min(effs, key=lambda e, lat=latency: error(lat, e, 0.65))
        a2a = min(effs, key=lambda e, lat=latency, r=ring: error(lat, r, e))
        candidate = (error(latency, ring, a2a), latency, ring, a2a)
        best = candidate if best is None or candidate < best else best
    _, latency, ring, a2a = best
    return {"nvlink_latency_us": float(latency), "nvlink": ring, "nvlink_all_to_all": a2a}


@dataclass(frozen=True)
class Calibration:
    cluster: ClusterSpec
    factors: dict[str, float]
    """Each fitted value by name (efficiency fields, and nvlink_latency_us)."""


def calibrate(profile: ProfileResult, plan: Plan, base: ClusterSpec, name: str,
              sweep: Sweep | None = None) -> Calibration:
    factors = fit_compute(profile, plan, base)
    node = base.node
    if sweep is not None:
        if (hbm := fit_hbm(sweep, base)) is not None:
            factors["hbm"] = hbm
        factors.update(fit_links(sweep, base))
        node = node.model_copy(update={"nvlink_latency_us": factors["nvlink_latency_us"]})
    # three significant digits: a factor is a measurement, and a small one must stay above 0
    efficiency = {k: float(f"{v:.3g}") for k, v in factors.items() if k != "nvlink_latency_us"}
    cluster = with_efficiency(base, **efficiency)
    try:
        cluster = ClusterSpec.model_validate({**cluster.model_dump(), "name": name,
                                              "node": node.model_dump()})
    except ValidationError as e:
        raise SpecError(f"the calibrated cluster is not valid: {describe(e)}") from None
    return Calibration(cluster, factors)


# ---- the error table --------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    step_s: float
    mfu: float
    peak_gib: float
    components_s: dict[str, float]
    steps: int
    commit: str | None


def measured_run(path: Path, skip: int = 2) -> Measured:
    """A bench/train_step.py result (.json) or the runtime's per-step log (.jsonl, the first
    ``skip`` steps left out, medians of the rest)."""
    if path.suffix == ".json":
        r = read(TrainStepResult, path, "--runs")
        return Measured(r.step_time_s, r.mfu, max(r.peak_memory_gib_per_rank), r.components_s,
                        r.measured_steps, r.commit)
    steps = read_log(path, "--runs")
    if not steps:
        raise SpecError(f"--runs: {path} has no steps")
    steady = steps[skip:] or steps
    components: dict[str, list[float]] = {}
    for s in steady:
        for k, v in s.components_s.items():
            components.setdefault(k, []).append(v)
    return Measured(statistics.median(s.step_time_s for s in steady),
                    statistics.median(s.mfu for s in steady),
                    max(s.peak_memory_gib for s in steps),
                    {k: statistics.median(v) for k, v in components.items()}, len(steady), None)


def runs_with_plans(runs: Path, plans: Path) -> list[tuple[Path, Path]]:
    """(result, plan) pairs: train_step_<name>.json or train_<name>.jsonl under ``runs`` with
    <name>.json under ``plans``."""
    found = []
    for run in sorted([*runs.glob("train_step_*.json"), *runs.glob("train_*.jsonl")]):
        name = run.stem.removeprefix("train_step_").removeprefix("train_")
        if (plans / f"{name}.json").exists():
            found.append((run, plans / f"{name}.json"))
    return found


def fidelity_row(run: Path, plan_path: Path, cluster: ClusterSpec | None = None,
                 skip: int = 2) -> dict:
    """One measured run against the cost model's prediction for the plan as executed, on the
    plan's own cluster or on ``cluster`` (a calibrated spec of the same machines)."""
    m = measured_run(run, skip)
    plan = catalog.load_plan(plan_path)
    if cluster is not None:
        plan = on(plan, cluster)
    e = cost_models.evaluate(executed_plan(plan))
    return {
        "plan": plan_path.stem,
        "layout": plan.summary(),
        "evaluated_as_executed": [f"{d.field}={d.executed}" for d in deviations(plan)],
        "gpus": plan.cluster.gpus,
        "measured_step_s": m.step_s,
        "predicted_step_s": e.step_time_s,
        "step_error": e.step_time_s / m.step_s - 1,
        "measured_tokens_per_s": plan.training.tokens_per_step / m.step_s,
        "measured_mfu": m.mfu,
        "predicted_mfu": e.mfu,
        "measured_peak_gib": m.peak_gib,
        "predicted_peak_gib": e.memory.peak_bytes / GIB,
        "memory_error": e.memory.peak_bytes / GIB / m.peak_gib - 1,
        "measured_components_s": m.components_s,
        "predicted_components_s": dict(e.components_s),
        "predicted_breakdown_s": dict(e.breakdown_s),
        "steps_used": m.steps,
        "run": str(run),
        "run_commit": m.commit,
    }
