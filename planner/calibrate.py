"""Calibration: a cluster's efficiency factors fitted to measurements of moeplan's runtime on
its GPUs, and the error table of the cost model against measured training steps.

Inputs are the benchmark JSON files: the micro-benchmark sweep of `moeplan sweep`
(runtime/sweep.py: kernels over shapes, the runtime's memory-bound layer operators, copies, NCCL
collectives; measurements only, row_seconds prices each row here), optionally one profiled
1-GPU step (`moeplan profile`: device seconds per kernel class), and measured steps
(bench/steps/train_step.py) to test against. Every measured run is priced as the runtime
executed it (plans.execution).

From a sweep with shaped kernel rows (fit_kernels; least squares on log time, every row the
cost model's prediction for the same shape):

- gemm, attention: one peak fraction each over the dense GEMMs, and over the runtime's
  attention core (RoPE, GQA expansion, SDPA) at catalog models' head shapes;
- grouped_gemm, grouped_gemm_half_rows and grouped_gemm_stream_tb_s: the curve of
  cost_models.compute.grouped_efficiency and the bandwidth of the operand stream that bounds
  small row blocks, over the grouped GEMMs (8..128 experts, 32..4096 rows per expert);
- the GEMM, grouped GEMM and attention rows at their device time where the sweep recorded it
  (DEVICE_TIMED), the layer operators at their one-call time;
- elementwise and elementwise_launch_us: the runtime's memory-bound layer operators priced at
  them (norms, residual adds, routing, SwiGLU; the eager token permutation has its own rate,
  gather_scatter, fitted by planner.dispatch_fit): each call is its eager kernels
  (cost_models.layer_graph.eager_launches) at a fixed time each plus its fused-kernel bytes at
  the factor, fitted like a GEMM's launch and peak (fit_launch);
  with a profiled step as well, elementwise is what is left of that step once the rest is
  priced instead, the fixed time held (the step's eager RoPE, casts and launch gaps, which no
  layer-operator row times, land there).

From a profiled step alone (sweeps without shaped kernel rows, as before the micro-benchmarks):

- gemm, grouped_gemm, attention: the base factor x predicted / measured kernel time of that
  class over the profiled step;
- elementwise: what is left of the profiled step once everything else is priced (the step is
  T0 + E / elementwise, E the layers' memory-bound bytes at full bandwidth), solved for it;
  fused_elementwise instead when the profiled plan ran fused kernels (plan.kernels), whose
  fusable operators are then most of E;
- with a profiled step of a kernels: fused plan as well (with_fused_step): gemm, grouped_gemm
  and attention from its kernel classes, elementwise again the eager step's residual with
  them, and fused_elementwise from its memory-bound kernel classes (fit_fused_memory: kernel
  time, not the step's wall time);
- hbm: the median bandwidth the sweep's large copies achieved, over the GPU's peak;
- node.nvlink_latency_us, nvlink, nvlink_all_to_all: a latency + bytes / bandwidth fit (least
  squares on log time) of the all-gather / reduce-scatter and all-to-all sweeps.

From a sweep of the runtime's EP dispatchers (`moeplan dispatch`), once every other factor is
fitted (with_dispatch): gather_scatter and each dispatcher's dispatch_floor_us, fitted by
planner.dispatch_fit on the calibrated cluster (its collectives and HBM price the rest).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import ValidationError

import cost_models
from cost_models import comm
from cost_models import compute as cc
from cost_models import pipeline as pl
from cost_models.layer import layer_key
from cost_models.layer_graph import (
    LayerKey,
    OpKind,
    attention_core_s,
    backward_graph,
    forward_graph,
)
from cost_models.memory import memory_breakdown
from planner import dispatch_fit
from plans import (
    EPFFN,
    ClusterSpec,
    CrossEntropy,
    Kernels,
    Plan,
    Precision,
    Recompute,
    SpecError,
    UlyssesAttention,
    catalog,
)
from plans.errors import describe
from plans.execution import executed_as_measured, measured_deviations
from plans.layout import ulysses_chunks
from plans.results import (
    THIS_RUNTIME,
    DispatchSweep,
    OverlapBench,
    ProfileResult,
    Result,
    RuntimeFacts,
    Sweep,
    SweepOp,
    SweepRow,
    TrainStepResult,
    read,
    read_log,
    recorded_deviations,
)

GIB = 2**30
CALIBRATED = {"kind": "measured", "note": "fitted by `moeplan calibrate` (the file's header)"}
"""The efficiency_source of a calibrated cluster."""
GROUPED = re.compile(r"grouped|GroupProblemShape|group_gemm", re.IGNORECASE)
"""CUTLASS grouped GEMM kernels are named after their GroupProblemShape."""
MEMORY_CLASSES = ("elementwise", "copy", "reduction_index_sort", "other")
COMPUTE_FACTORS = ("gemm", "grouped_gemm", "attention")


def factor_value(cluster: ClusterSpec, name: str) -> float:
    """``cluster``'s value of a factor named as Calibration.factors names it: node's
    nvlink_latency_us, an efficiency field, or dispatch_floor_us.<dispatcher>."""
    value = cluster.node if name == "nvlink_latency_us" else cluster.efficiency
    for part in name.split("."):
        value = getattr(value, part)
    return value


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
    for graph in (fwd, backward_graph(fwd, key.recompute, modules=key.recompute_modules)):
        for _, data in graph.nodes(data=True):
            if (label := kinds.get(data["op"].kind)) is not None:
                per_layer[label] += data["duration_s"]
    m = plan.num_micro_batches
    out = {k: t * plan.model.layers * m for k, t in per_layer.items()}
    head = pl.head_gemm_s(plan.model, plan.cluster, pl.micro_batch_tokens(plan), plan.degrees.tp)
    out["gemm"] += sum(head) * m
    return out


def compute_factors(profile: ProfileResult, plan: Plan, base: ClusterSpec) -> dict[str, float]:
    """gemm, grouped_gemm and attention from the profiled step's kernel classes: each base
    factor x predicted / measured seconds of its class."""
    executed = executed_as_measured(on(plan, base), recorded_deviations(profile))
    meas, pred = measured_classes(profile), predicted_classes(executed)
    return {k: min(1.0, getattr(base.efficiency, k) * pred[k] / meas[k])
            for k in COMPUTE_FACTORS if meas[k] > 0 and pred[k] > 0}


def fit_compute(profile: ProfileResult, plan: Plan, base: ClusterSpec) -> dict[str, float]:
    """gemm, grouped_gemm and attention from the profiled step's kernel classes, then
    elementwise from what is left of its wall time."""
    factors = compute_factors(profile, plan, base)
    factors[residual_factor(plan)] = fit_step_residual(profile, plan,
                                                       with_efficiency(base, **factors))
    return factors


# ---- memory and link factors from the collective sweep --------------------------------------


def fit_hbm(sweep: Sweep, base: ClusterSpec) -> float | None:
    """The median bandwidth of the sweep's copies (each reads and writes its buffer) over the
    GPU's peak."""
    full = with_efficiency(base, hbm=1.0)
    ratios = [cc.memory_s(2 * r.bytes, full) / r.measured_s for r in sweep.rows
              if r.op == SweepOp.copy and r.bytes is not None]
    return min(1.0, statistics.median(ratios)) if ratios else None


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


# ---- kernel factors from the micro-benchmarks -----------------------------------------------


def layer_op_s(model: str, tokens: int, op: str, cluster: ClusterSpec) -> float:
    """Forward + backward seconds of the cost model's memory-bound operator ``op`` in a layer
    of catalog model ``model`` over ``tokens`` tokens on one GPU (all experts local)."""
    key = LayerKey(catalog.load_model(model), cluster, tokens, Precision.bf16, 1, 1, 1, 1, 1, 1,
                   UlyssesAttention(), EPFFN(), Recompute.none, dense=False,
                   kernels=Kernels.eager)
    fwd = forward_graph(key)
    if op not in fwd or fwd.nodes[op]["kind"] != OpKind.memory:
        raise SpecError(f"--collectives: layer_op {op!r} is no memory-bound operator of the "
                        f"cost model's layer")
    return fwd.nodes[op]["duration_s"] + backward_graph(fwd, Recompute.none).nodes[
        f"{op}.bwd"]["duration_s"]


def _gemms(m: int, n: int, k: int, backward: bool) -> list[tuple[float, float, float]]:
    """The GEMMs of C = A B, and of its data and weight gradients when ``backward``."""
    return [(m, n, k), *(cc.backward_gemms(m, n, k) if backward else ())]


def row_seconds(row: SweepRow, cluster: ClusterSpec) -> float | None:
    """The cost model's seconds for what a sweep row timed; None for a row without its shape
    (a sweep that did not record it)."""
    sh, bf16 = row.shape, Precision.bf16
    match row.op:
        case SweepOp.gemm if sh:
            return sum(cc.gemm_s(*g, cluster, bf16)
                       for g in _gemms(sh["m"], sh["n"], sh["k"], row.backward))
        case SweepOp.grouped_mm if sh:
            # the forward and the data gradient are grouped over the rows, the weight
            # gradient over its reduction
            return sum(cc.grouped_gemm_s(sh["experts"], *g, cluster, bf16, over_rows=i < 2)
                       for i, g in enumerate(_gemms(sh["rows"], sh["n"], sh["k"],
                                                    row.backward)))
        case SweepOp.flash_attn if sh:
            flops = cc.attention_fwd_flops(sh["batch"], sh["seq"], sh["seq"], sh["heads"],
                                           sh["head_dim"], cc.CAUSAL_FRACTION)
            fwd = cc.flash_attention_fwd_s(flops, cluster)
            return fwd + (cc.flash_attention_bwd_s(flops, cluster, sh["head_dim"])
                          if row.backward else 0.0)
        case SweepOp.attention_core if sh:
            return attention_core_s(catalog.load_model(str(sh["model"])), int(sh["batch"]),
                                    int(sh["seq"]), int(sh["heads"]), int(sh["kv_heads"]),
                                    cluster, row.backward)
        case SweepOp.copy:
            return cc.memory_s(2 * row.bytes, cluster)
        case SweepOp.memory:
            return cc.memory_s(row.bytes, cluster)
        case SweepOp.head_loss if sh:
            model = catalog.load_model(str(sh["model"]))
            loss = CrossEntropy.chunked if sh.get("chunked") else CrossEntropy.materialized
            return pl.head_cost(model, cluster, int(sh["tokens"]), 1, loss).total_s
        case SweepOp.layer_op if sh and row.layer_op:
            return layer_op_s(str(sh["model"]), int(sh["tokens"]), row.layer_op, cluster)
        case SweepOp.all_to_all | SweepOp.all_gather | SweepOp.reduce_scatter:
            layout = comm.group_layout(cluster.gpus, 1, cluster.node.gpus_per_node)
            fn = {SweepOp.all_to_all: comm.all_to_all_s, SweepOp.all_gather: comm.all_gather_s,
                  SweepOp.reduce_scatter: comm.reduce_scatter_s}[row.op]
            return fn(row.bytes, layout, cluster)
    return None


def log_error(rows: Sequence[SweepRow], cluster: ClusterSpec) -> float:
    """Sum over rows of log(predicted / measured)^2."""
    return sum(math.log(row_seconds(r, cluster) / r.measured_s) ** 2 for r in rows)


def _golden(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-3
            ) -> float:
    """The minimum of a unimodal ``f`` on [lo, hi] (golden-section search)."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


MIN_FACTOR = 0.02
"""The lowest efficiency a fit may return (the search interval's lower end)."""
HALF_ROWS_GRID = (0, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096)
"""Half-points of the grouped GEMM curve tried before the golden-section refinement."""
GROUPED_HBM_GRID = (0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
"""Operand-stream rates of the grouped GEMM tried the same way, as fractions of the GPU's HBM
peak."""
GROUPED_ROUNDS = 4
"""The most rounds of fit_grouped's coordinate descent."""


def fit_peak(rows: Sequence[SweepRow], base: ClusterSpec, factor: str, **fixed: float) -> float:
    """The value of efficiency ``factor`` (others as ``fixed``) best fitting ``rows``."""
    return _golden(lambda e: log_error(rows, with_efficiency(base, **fixed, **{factor: e})),
                   MIN_FACTOR, 1.0)


def fit_launch(rows: Sequence[SweepRow], base: ClusterSpec, factor: str, launch: str,
               **fixed: float) -> dict[str, float]:
    """Efficiency ``factor`` and the fixed time per call ``launch`` (us) best fitting ``rows``
    (others as ``fixed``). A call's time is its launch plus its FLOPs at the peak fraction
    (cost_models.compute), so each row is n L + W / peak, n its calls and W its work at full
    peak, both read off the cost model: least squares of the relative error is linear in L and
    1 / peak and solved in closed form; the peak is then refined on log time with L fixed."""
    at = dict(fixed)
    full = with_efficiency(base, **at, **{factor: 1.0, launch: 0.0})
    per_us = with_efficiency(base, **at, **{factor: 1.0, launch: 1.0})
    work = [row_seconds(r, full) / r.measured_s for r in rows]
    calls = [(row_seconds(r, per_us) - row_seconds(r, full)) / r.measured_s for r in rows]
    # minimise sum (calls_i L + work_i x - 1)^2 over L >= 0, x = 1 / peak
    saa = sum(c * c for c in calls)
    sab = sum(c * w for c, w in zip(calls, work, strict=True))
    sbb = sum(w * w for w in work)
    sa, sb = sum(calls), sum(work)
    det = saa * sbb - sab * sab
    us = max(0.0, (sa * sbb - sb * sab) / det) if det > 0 else 0.0
    us = float(f"{us:.3g}")
    return {factor: fit_peak(rows, base, factor, **at, **{launch: us}), launch: us}


def fit_gemm(rows: Sequence[SweepRow], base: ClusterSpec) -> dict[str, float]:
    """gemm and gemm_launch_us over the dense GEMMs."""
    return fit_launch(rows, base, "gemm", "gemm_launch_us")


def _grid_golden(f: Callable[[float], float], grid: Sequence[float], tol: float) -> float:
    """The ``x`` minimising ``f``: the best point of ``grid``, then a golden-section refinement
    between its neighbours (kept only where it is better)."""
    errors = [f(x) for x in grid]
    i = min(range(len(errors)), key=errors.__getitem__)
    lo, hi = grid[max(0, i - 1)], grid[min(len(errors) - 1, i + 1)]
    if hi <= lo:
        return grid[i]
    x = _golden(f, lo, hi, tol=max(tol, (hi - lo) / 200))
    return grid[i] if errors[i] <= f(x) else x


def fit_grouped(rows: Sequence[SweepRow], base: ClusterSpec) -> dict[str, float]:
    """grouped_gemm, grouped_gemm_launch_us, grouped_gemm_half_rows and
    grouped_gemm_stream_tb_s: the operand stream's rate and the size curve's half-point each on
    a grid, refined between its neighbours; at each, the best launch time and peak."""
    def best(stream_tb_s: float, half: float) -> tuple[float, dict[str, float]]:
        at = {"grouped_gemm_half_rows": half, "grouped_gemm_stream_tb_s": stream_tb_s}
        fit = fit_launch(rows, base, "grouped_gemm", "grouped_gemm_launch_us", **at)
        return log_error(rows, with_efficiency(base, **fit, **at)), {**fit, **at}

    # coordinate descent from a copy's share of HBM peak: the half-point at the stream's share,
    # then the share at that half-point, until the half-point stays
    peak_tb_s = base.gpu.hbm_tb_s
    share, half = base.efficiency.hbm, None
    for _ in range(GROUPED_ROUNDS):
        was = half
        half = _grid_golden(lambda h, b=share: best(b * peak_tb_s, h)[0], HALF_ROWS_GRID, 0.5)
        share = _grid_golden(lambda b, h=half: best(b * peak_tb_s, h)[0], GROUPED_HBM_GRID, 0.002)
        if was is not None and abs(half - was) <= 0.5:
            break
    return best(float(f"{share * peak_tb_s:.3g}"), half)[1]


def fit_elementwise(rows: Sequence[SweepRow], base: ClusterSpec) -> dict[str, float]:
    """elementwise and elementwise_launch_us over the runtime's memory-bound layer operators
    priced at them (norms, residual adds, the router, SwiGLU; the eager token permutation has
    its own rate, gather_scatter, and is left out): each operator call is its eager kernels
    (cost_models.layer_graph.eager_launches) at a fixed time each plus its bytes at the
    factor, fitted as a GEMM's launch and peak are (fit_launch). Empty when no row is priced at
    elementwise."""
    full, half = with_efficiency(base, elementwise=1.0), with_efficiency(base, elementwise=0.5)
    priced = [r for r in rows if row_seconds(r, half) > row_seconds(r, full)]
    if not priced:
        return {}
    return fit_launch(priced, base, "elementwise", "elementwise_launch_us")


DEVICE_TIMED = (SweepOp.gemm, SweepOp.grouped_mm, SweepOp.flash_attn)
"""Kernels fitted to their device time where the sweep recorded it (SweepRow.device_s): a step
issues them with the host ahead, so the one-call time's PyTorch dispatch (tens of us for a
grouped GEMM) is not the step's. The memory-bound layer operators keep their one-call time:
the eager runtime's step waits on their dispatch."""


def shaped_rows(sweep: Sweep, op: SweepOp) -> list[SweepRow]:
    """The sweep's shaped rows of ``op`` at their one-call time (the host's dispatch in)."""
    return [r for r in sweep.rows if r.op == op and r.shape]


def on_device(row: SweepRow) -> SweepRow:
    """``row`` with its device time (SweepRow.device_s, recorded) as its time."""
    return row.model_copy(update={"measured_s": row.device_s})


def kernel_rows(sweep: Sweep, op: SweepOp) -> list[SweepRow]:
    """The sweep's shaped rows of ``op``, timed as a step runs them (DEVICE_TIMED)."""
    return [on_device(r) if op in DEVICE_TIMED and r.device_s else r
            for r in shaped_rows(sweep, op)]


def fit_kernels(sweep: Sweep, base: ClusterSpec) -> dict[str, float]:
    """Compute and layer memory-bound factors from the sweep's shaped rows (those it has)."""
    factors: dict[str, float] = {}
    if rows := kernel_rows(sweep, SweepOp.gemm):
        factors.update(fit_gemm(rows, base))
    if rows := kernel_rows(sweep, SweepOp.grouped_mm):
        factors.update(fit_grouped(rows, base))
    # FlashAttention alone (bare SDPA rows): the core's prologue (RoPE, GQA expansion) is its
    # own memory-bound operator (cost_models.layer_graph.ROPE_LAUNCHES), and the runtime's
    # attention_core rows check the two together
    if rows := kernel_rows(sweep, SweepOp.flash_attn):
        factors["attention"] = fit_peak(rows, base, "attention")
    if rows := kernel_rows(sweep, SweepOp.layer_op):
        factors.update(fit_elementwise(rows, base))
    return factors


def fit_overlap(bench: OverlapBench) -> float:
    """efficiency.overlap from NCCL beside the expert GEMMs (`moeplan overlap`, runtime/beside.py):
    the share of the collectives' time that running beside the GEMMs saved, pooled over the
    shapes, sum(compute + nccl - beside) / sum(nccl), within [0, 1]. Below 0 (together slower
    than one after the other: the collective's SMs and memory traffic slow the GEMMs) nothing
    was hidden, and the cost model's inter-operator schedule then prices its chunked layer run
    serially (cost_models.layer)."""
    saved = sum(r.compute_s + r.nccl_s - r.nccl_beside_compute_s for r in bench.rows)
    return min(1.0, max(0.0, saved / sum(r.nccl_s for r in bench.rows)))


def residual_factor(plan: Plan) -> str:
    """The memory-bound factor a plan's layer operators are priced at (cost_models.layer_graph):
    fused_elementwise when it ran fused kernels, else elementwise."""
    return "fused_elementwise" if plan.kernels == Kernels.fused else "elementwise"


def check_one_gpu(plan: Plan, option: str) -> None:
    """A profiled step calibrates only as a 1-GPU plan (no communication in its kernels)."""
    if plan.degrees.world != 1:
        raise SpecError(f"{option}: calibrate on the 1-GPU plan that was profiled (no "
                        f"communication); this one runs on {plan.degrees.world} GPUs")


def device_kind(gpu: str | None) -> str:
    """The kind of device a measurement names: torch.cuda.get_device_name's name ("NVIDIA
    H200"), "cpu" where none was recorded (runtime.provenance.metadata: torch saw no GPU)."""
    return gpu or "cpu"


def check_device(result: Result, option: str, base: ClusterSpec) -> None:
    """Factors fitted to one kind of device describe only that kind: a measurement fits a base
    cluster whose GPU model (``gpu.name`` up to its first "-": H200, A100, cpu) is a word of
    the device name the measurement recorded."""
    measured = device_kind(result.gpu)
    model = base.gpu.name.split("-")[0]
    if not re.search(rf"(?<![A-Za-z0-9]){re.escape(model)}(?![A-Za-z0-9])", measured, re.I):
        raise SpecError(f"{option}: measured on {measured}, but --base {base.name}'s GPU is "
                        f"{base.gpu.name}; calibrate against a base cluster of that device")


def solve_factor(plan: Plan, cluster: ClusterSpec, name: str, measured_s: float,
                 beside_s: float = 0.0) -> float:
    """The efficiency factor ``name`` at which the cost model's step time of ``plan`` on
    ``cluster``, less ``beside_s`` (seconds the measurement leaves out), is ``measured_s``:
    the step is T0 + E / factor, E the seconds of the work it prices at full rate."""

    def step(factor: float) -> float:
        return cost_models.evaluate(on(plan, with_efficiency(cluster, **{name: factor}))
                                    ).step_time_s

    ideal = step(0.5) - step(1.0)
    rest = step(1.0) - ideal - beside_s
    left = measured_s - rest
    return min(1.0, ideal / left) if left > ideal else 1.0


def fit_step_residual(profile: ProfileResult, plan: Plan, cluster: ClusterSpec) -> float:
    """The plan's memory-bound factor (residual_factor) such that the profiled 1-GPU step's wall
    time is what the cost model predicts with every other factor of ``cluster`` (the step is
    T0 + E / factor, E the layers' memory-bound bytes at full bandwidth)."""
    check_one_gpu(plan, "--plan")
    plan = executed_as_measured(on(plan, cluster), recorded_deviations(profile))
    return solve_factor(plan, cluster, residual_factor(plan), profile.step_wall_s)


@dataclass(frozen=True)
class Calibration:
    cluster: ClusterSpec
    factors: dict[str, float]
    """Each fitted value by name (efficiency fields, and nvlink_latency_us)."""


def fit_fused_memory(profile: ProfileResult, plan: Plan, cluster: ClusterSpec) -> float:
    """fused_elementwise such that the profiled 1-GPU step's memory-bound device seconds (its
    MEMORY_CLASSES) are what the cost model prices as memory-bound with every other factor of
    ``cluster``: the step less its GEMM, grouped GEMM and attention operators
    (predicted_classes) is M0 + B / fused_elementwise, B the fused regions' bytes at full
    bandwidth, M0 the rest (the residual adds, the router, the loss, the gradient
    accumulation, the optimizer), solved for it. Kernel time, not wall time: what the step
    loses to its host and the compute classes' own errors stay out of the factor."""
    check_one_gpu(plan, "--fused-plan")
    plan = executed_as_measured(on(plan, cluster), recorded_deviations(profile))
    return solve_factor(plan, cluster, "fused_elementwise", measured_classes(profile)["memory"],
                        beside_s=sum(predicted_classes(plan).values()))


def with_fused_step(cal: Calibration, profile: ProfileResult, plan: Plan,
                    eager: tuple[ProfileResult, Plan] | None = None) -> Calibration:
    """``cal`` with the factors of the fused runtime fitted to one profiled 1-GPU step of a
    ``kernels: fused`` plan, by kernel class: gemm, grouped_gemm and attention as
    compute_factors fits them (the GEMMs as they run beside the fused runtime's kernels),
    then fused_elementwise from its memory-bound classes (fit_fused_memory). With ``eager``,
    the eager profiled step ``cal`` was fitted on, elementwise (which prices the fused step's
    residual adds too) is first again what is left of that step (fit_step_residual), now with
    these compute factors."""
    if plan.kernels != Kernels.fused:
        raise SpecError("--fused-plan: the plan ran eager kernels; profile a kernels: fused "
                        "plan to fit fused_elementwise")

    def rounded(factors: dict[str, float]) -> dict[str, float]:
        return {k: float(f"{v:.3g}") for k, v in factors.items()}

    fitted = compute_factors(profile, plan, cal.cluster)
    cluster = with_efficiency(cal.cluster, **rounded(fitted))
    if eager is not None and residual_factor(eager[1]) == "elementwise":
        fitted["elementwise"] = fit_step_residual(*eager, cluster)
        cluster = with_efficiency(cluster, **rounded(fitted))
    fitted["fused_elementwise"] = fit_fused_memory(profile, plan, cluster)
    return Calibration(with_efficiency(cluster, **rounded(fitted)), {**cal.factors, **fitted})


def with_dispatch(cal: Calibration, sweep: DispatchSweep) -> Calibration:
    """``cal`` with the eager EP dispatch's factors fitted to ``sweep`` on its cluster
    (planner.dispatch_fit): gather_scatter, and dispatch_floor_us per dispatcher (named
    ``dispatch_floor_us.<dispatcher>`` among the factors)."""
    fit = dispatch_fit.fit_sweep(sweep, cal.cluster)
    floors = cal.cluster.efficiency.dispatch_floor_us.model_copy(
        update={d.value: us for d, us in fit.floors_us.items()})
    cluster = with_efficiency(cal.cluster, gather_scatter=fit.gather_scatter,
                              dispatch_floor_us=floors)
    fitted = {"gather_scatter": fit.gather_scatter,
              **{f"dispatch_floor_us.{d.value}": us for d, us in fit.floors_us.items()}}
    return Calibration(cluster, {**cal.factors, **fitted})


def calibrate(profile: ProfileResult | None, plan: Plan | None, base: ClusterSpec, name: str,
              sweep: Sweep | None = None, overlap: OverlapBench | None = None) -> Calibration:
    """Factors from the sweep's micro-benchmarks where it has them (fit_kernels), else from the
    profiled step (fit_compute); with both, the profiled step sets only elementwise. With
    ``overlap``, efficiency.overlap is what it measured (fit_overlap), before any residual is
    taken (a profiled step has no communication, so the order does not change the residual)."""
    kernels = fit_kernels(sweep, base) if sweep is not None else {}
    if profile is not None and plan is None:
        raise SpecError("--plan: the profiled 1-GPU plan is needed with a profile")
    if not kernels and profile is None:
        raise SpecError("--collectives: the sweep has no kernel micro-benchmarks; give a "
                        "profiled step too")
    factors = dict(kernels) if kernels or profile is None else fit_compute(profile, plan, base)
    node = base.node
    if sweep is not None:
        if (hbm := fit_hbm(sweep, base)) is not None:
            factors["hbm"] = hbm
        # a kernels-only sweep (one rank) leaves the links as they are
        if not kernels or any(r.op.collective for r in sweep.rows):
            factors.update(fit_links(sweep, base))
            node = node.model_copy(update={"nvlink_latency_us": factors["nvlink_latency_us"]})
    if overlap is not None:
        factors["overlap"] = fit_overlap(overlap)
    if profile is not None and kernels:
        # the profiled step's residual, with every factor the sweep gave (hbm prices its
        # optimizer step and loss)
        rest = {k: v for k, v in factors.items() if k != "nvlink_latency_us"}
        factors[residual_factor(plan)] = fit_step_residual(profile, plan,
                                                           with_efficiency(base, **rest))
    # three significant digits: a factor is a measurement, and a small one must stay above 0
    efficiency = {k: float(f"{v:.3g}") for k, v in factors.items() if k != "nvlink_latency_us"}
    cluster = with_efficiency(base, **efficiency)
    try:
        cluster = ClusterSpec.model_validate({**cluster.model_dump(), "name": name,
                                              "node": node.model_dump(),
                                              "efficiency_source": CALIBRATED})
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
    routing_skew: float | None = None
    """Max / mean routed tokens per expert the run logged (TrainingSpec.routing_skew's
    measurement); None where the run did not log it."""
    deviations: list[dict] | None = None
    """The plan fields the run executed differently (plans.execution.record); None where it
    did not record them."""
    facts: RuntimeFacts = THIS_RUNTIME
    """What its runtime executed that prices its peak (TrainStepResult.facts; a runtime log is
    this tree's runtime)."""
    head_groups: int | None = None
    """Head groups its Ulysses cores ran (TrainStepResult.ulysses_head_groups); None where the
    run did not record them (every Ulysses all-to-all blocked)."""


def measured_run(path: Path, skip: int = 2) -> Measured:
    """A bench/steps/train_step.py result (.json) or the runtime's per-step log (.jsonl, the first
    ``skip`` steps left out, medians of the rest)."""
    if path.suffix == ".json":
        r = read(TrainStepResult, path, "--runs")
        # the allocator's reserved peak where recorded (what the memory model predicts)
        peak = max(r.peak_reserved_gib_per_rank or r.peak_memory_gib_per_rank)
        return Measured(r.step_time_s, r.mfu, peak, r.components_s, r.measured_steps, r.commit,
                        r.routing_skew, recorded_deviations(r), r.facts,
                        r.ulysses_head_groups)
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
                    {k: statistics.median(v) for k, v in components.items()}, len(steady), None,
                    deviations=recorded_deviations(steps[0]))


def runs_with_plans(runs: Path, plans: Path) -> list[tuple[Path, Path]]:
    """(result, plan) pairs: train_step_<name>.json or train_<name>.jsonl under ``runs`` with
    <name>.json under ``plans``."""
    found = []
    for run in sorted([*runs.glob("train_step_*.json"), *runs.glob("train_*.jsonl")]):
        name = run.stem.removeprefix("train_step_").removeprefix("train_")
        if (plans / f"{name}.json").exists():
            found.append((run, plans / f"{name}.json"))
    return found


@dataclass(frozen=True)
class FidelityRow:
    """One measured run against the cost model's prediction for the plan as the run executed
    it (``fidelity_row``); errors are predicted over measured, minus one."""

    plan: str
    """The plan file's stem."""
    layout: str
    evaluated_as_executed: list[str]
    """``field=value`` of each plan field the run executed differently (plans.execution)."""
    gpus: int
    measured_step_s: float
    predicted_step_s: float
    step_error: float
    measured_tokens_per_s: float
    measured_mfu: float
    predicted_mfu: float
    measured_peak_gib: float
    predicted_peak_gib: float
    memory_error: float
    measured_components_s: dict[str, float]
    predicted_components_s: dict[str, float]
    predicted_breakdown_s: dict[str, float]
    steps_used: int
    run: str
    run_commit: str | None
    measured_skew: float | None
    priced_head_groups: int
    """Ulysses head groups the prediction prices."""
    run_head_groups: int | None
    """Those the run ran (None: not recorded, all blocking)."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FidelitySummary:
    """How a set of measured runs compares with the predictions (``fidelity_summary``)."""

    runs: int
    median_abs_step_error: float
    worst_abs_step_error: float
    slower: int
    """Runs predicted slower than measured."""
    faster: int
    lowest_memory_error: float
    """The most under-predicted peak (negative: below the measured)."""


def fidelity_summary(step_errors: Sequence[float],
                     memory_errors: Sequence[float]) -> FidelitySummary | None:
    """The summary of runs' step-time and peak-memory errors (FidelityRow.step_error,
    memory_error); None without a run."""
    if not step_errors:
        return None
    return FidelitySummary(
        len(step_errors), statistics.median(abs(e) for e in step_errors),
        max(abs(e) for e in step_errors), sum(e > 0 for e in step_errors),
        sum(e < 0 for e in step_errors), min(memory_errors))


def fidelity_row(run: Path, plan_path: Path, cluster: ClusterSpec | None = None,
                 skip: int = 2, measured_skew: bool = False) -> FidelityRow:
    """One measured run against the cost model's prediction for the plan as executed, on the
    plan's own cluster or on ``cluster`` (a calibrated spec of the same machines). With
    ``measured_skew`` the plan's ``training.routing_skew`` is the one the run logged: how
    unevenly the run's router loaded the experts is the workload's, like its batch."""
    m = measured_run(run, skip)
    plan = catalog.load_plan(plan_path)
    if cluster is not None:
        plan = on(plan, cluster)
    if measured_skew and m.routing_skew is not None:
        plan = plan.model_copy(update={"training": plan.training.model_copy(
            update={"routing_skew": max(1.0, m.routing_skew)})})
    ran = executed_as_measured(plan, m.deviations)
    e = cost_models.evaluate(ran)
    peak = memory_breakdown(ran, m.facts).peak_bytes / GIB
    return FidelityRow(
        plan=plan_path.stem,
        layout=plan.summary(),
        evaluated_as_executed=[f"{d.field}={d.executed}"
                               for d in measured_deviations(plan, m.deviations)],
        gpus=plan.cluster.gpus,
        measured_step_s=m.step_s,
        predicted_step_s=e.step_time_s,
        step_error=e.step_time_s / m.step_s - 1,
        measured_tokens_per_s=plan.training.tokens_per_step / m.step_s,
        measured_mfu=m.mfu,
        predicted_mfu=e.mfu,
        measured_peak_gib=m.peak_gib,
        predicted_peak_gib=peak,
        memory_error=peak / m.peak_gib - 1,
        measured_components_s=m.components_s,
        predicted_components_s=dict(e.components_s),
        predicted_breakdown_s=dict(e.breakdown_s),
        steps_used=m.steps,
        run=str(run),
        run_commit=m.commit,
        measured_skew=m.routing_skew,
        priced_head_groups=ulysses_chunks(ran.overlap, ran.attention, ran.model,
                                          ran.degrees.sp),
        run_head_groups=m.head_groups,
    )
