"""The eager dispatch's two cluster factors fitted to the dispatcher sweep, and the planner's
choice of dispatcher held against what measured faster.

The sweep (`moeplan dispatch`, runtime/dispatch_sweep.py; h200-runtime's is
bench/results/h200/moe_layer/dispatch_sweep_x2.json) times moeplan's two EP dispatchers as the
runtime runs them: dispatch and combine, forward and backward, over top-k, token counts, hidden
sizes and expert counts; every point is priced here. The cost model prices one
MoE layer's dispatch + combine (cost_models.layer_graph with ``kernels: eager``) as

    max(floor[dispatcher], collectives + permutation bytes / (HBM x gather_scatter))

where the permutation bytes are counted pass by pass (cost_models.dispatch) and the
collectives come from the cluster's collective model (fitted by `moeplan calibrate`, not here).
``gather_scatter`` is shared by the dispatchers; each has its floor. The fit minimises the sum
of squared relative errors over every point by a grid over ``gather_scatter`` (the floors are
then exact per dispatcher on their own grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from cost_models.evaluate import evaluate
from cost_models.layer import layer_key
from cost_models.layer_graph import DISPATCH_COMBINE_OPS, OpKind, forward_graph
from planner.space import RUNTIME_DISPATCHES
from plans import (
    EPFFN,
    ClusterSpec,
    Degrees,
    Dispatch,
    Kernels,
    ModelSpec,
    Overlap,
    Plan,
    Recompute,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)
from plans.notation import DISPATCH_KEYS
from plans.results import DispatchSweep, read

SHORT = {d: DISPATCH_KEYS[d] for d in RUNTIME_DISPATCHES}
"""The dispatchers moeplan's runtime runs and the sweep measures, by their names in it."""
MODEL = "mixtral-8x7b"
"""The catalog model whose other fields (heads, vocabulary) fill each measured shape (hidden,
experts and top-k come from the sweep)."""


def point_plan(model: ModelSpec, cluster: ClusterSpec, gpus: int, seq: int,
               dispatch: Dispatch) -> Plan:
    """One MoE layer on ``gpus`` GPUs with Ulysses SP = EP = gpus, micro-batch 1, as the runtime
    runs it (eager kernels, no overlap, no recomputation): the sweep's set-up."""
    return Plan(
        model=model.model_copy(update={"layers": 1, "dense_layers": 0}),
        cluster=catalog.resize(cluster, gpus, "--cluster"),
        training=TrainingSpec(global_batch=1, seq_len=seq), degrees=Degrees(sp=gpus, ep=gpus),
        attention=UlyssesAttention(), ffn=EPFFN(dispatch=dispatch), stage_layers=(1,),
        micro_batch_size=1, overlap=Overlap.none, recompute=Recompute.none,
        kernels=Kernels.eager,
    )


def dispatch_combine_s(plan: Plan) -> float:
    """The cost model's dispatch + combine of one layer, forward and backward, host wait
    included."""
    g = forward_graph(layer_key(plan))
    return sum(_fwd_bwd(g, name) for name in g
               if name in DISPATCH_COMBINE_OPS or g.nodes[name]["kind"] == OpKind.host)


def _fwd_bwd(g: nx.DiGraph, name: str) -> float:
    op = g.nodes[name]["op"]
    return op.duration_s + sum(op.bwd)


@dataclass(frozen=True)
class Point:
    """One measured (shape, top-k, dispatcher) of the sweep with its priced parts."""

    hidden: int
    experts: int
    tokens_per_rank: int
    top_k: int
    dispatch: Dispatch
    measured_s: float
    collectives_s: float
    """The cost model's collectives, forward and backward."""
    permutation_s: float
    """The permutation passes at the cluster's ``gather_scatter``."""
    gather_scatter: float

    def predicted_s(self, gather_scatter: float, floor_s: float) -> float:
        body = self.collectives_s + self.permutation_s * self.gather_scatter / gather_scatter
        return max(floor_s, body)


def points(sweep: DispatchSweep, cluster: ClusterSpec, model: ModelSpec) -> list[Point]:
    out = []
    for shape in sweep.configs:
        for row in shape.rows:
            spec = model.model_copy(update={"hidden": shape.hidden, "experts": shape.experts,
                                            "top_k": row.top_k})
            for d in SHORT:
                plan = point_plan(spec, cluster, sweep.world, shape.seq_len, d)
                g = forward_graph(layer_key(plan))
                names = [n for n in g if n in DISPATCH_COMBINE_OPS]
                comm = sum(_fwd_bwd(g, n) for n in names if g.nodes[n]["kind"] == OpKind.comm)
                perm = sum(_fwd_bwd(g, n) for n in names if g.nodes[n]["kind"] != OpKind.comm)
                out.append(Point(shape.hidden, shape.experts, shape.tokens_per_rank, row.top_k,
                                 d, row.of(d).measured.fwd_bwd_s, comm, perm,
                                 cluster.efficiency.gather_scatter))
    return out


@dataclass(frozen=True)
class DispatchFit:
    gather_scatter: float
    floors_us: dict[Dispatch, float]
    median_abs_error: float
    max_abs_error: float


def _sq_error(pts: list[Point], gs: float, floor_s: float) -> float:
    return sum((p.predicted_s(gs, floor_s) / p.measured_s - 1) ** 2 for p in pts)


def _best(pts: list[Point], gathers: list[float], floors: list[float]
          ) -> tuple[float, float, dict[Dispatch, float]]:
    """(error, gather_scatter, floors) of the best grid point: for each gather_scatter, each
    dispatcher's best floor (the dispatchers share only gather_scatter)."""
    by_dispatch = {d: [p for p in pts if p.dispatch == d] for d in SHORT}
    best: tuple[float, float, dict[Dispatch, float]] | None = None
    for gs in gathers:
        chosen, total = {}, 0.0
        for d, group in by_dispatch.items():
            err, floor = min((_sq_error(group, gs, f), f) for f in floors)
            chosen[d], total = floor, total + err
        if best is None or total < best[0]:
            best = (total, gs, chosen)
    assert best is not None
    return best


def fit(pts: list[Point]) -> DispatchFit:
    """Grid search, coarse then fine: gather_scatter over 0.02 .. 1 in steps of 0.01, floors
    over 0 .. the largest measurement in steps of 100 us; then steps of 0.001 and 5 us around
    the coarse optimum."""
    top = max(p.measured_s for p in pts)
    _, gs, floors = _best(pts, [i * 0.01 for i in range(2, 101)],
                          [i * 1e-4 for i in range(int(top / 1e-4) + 1)])
    lo = min(floors.values())
    span = max(floors.values()) - lo
    _, gs, floors = _best(pts, [max(0.001, gs + j * 0.001) for j in range(-10, 11)],
                          [max(0.0, lo + j * 5e-6) for j in range(-20, int(span / 5e-6) + 21)])
    errors = sorted(abs(p.predicted_s(gs, floors[p.dispatch]) / p.measured_s - 1) for p in pts)
    return DispatchFit(round(gs, 3), {d: round(f * 1e6, 1) for d, f in floors.items()},
                       errors[len(errors) // 2], errors[-1])


def fit_sweep(sweep: DispatchSweep, cluster: ClusterSpec) -> DispatchFit:
    """The fit of every point of ``sweep`` priced on ``cluster`` (its collectives and HBM)."""
    return fit(points(sweep, cluster, catalog.load_model(MODEL)))


@dataclass(frozen=True)
class Choice:
    """At one measured shape and top-k: the faster dispatcher measured and the one the cost
    model (so the planner) prefers."""

    hidden: int
    experts: int
    tokens_per_rank: int
    top_k: int
    measured: dict[Dispatch, float]
    predicted: dict[Dispatch, float]
    predicted_step: dict[Dispatch, float]

    @property
    def faster(self) -> Dispatch:
        return min(self.measured, key=self.measured.__getitem__)

    @property
    def pick(self) -> Dispatch:
        """The dispatcher whose plan the cost model prices faster: the search's ranking key."""
        return min(self.predicted_step, key=self.predicted_step.__getitem__)


def choices(sweep: DispatchSweep, cluster: ClusterSpec, model: ModelSpec) -> list[Choice]:
    out = []
    for shape in sweep.configs:
        for row in shape.rows:
            spec = model.model_copy(update={"hidden": shape.hidden, "experts": shape.experts,
                                            "top_k": row.top_k})
            plans = {d: point_plan(spec, cluster, sweep.world, shape.seq_len, d)
                     for d in SHORT}
            out.append(Choice(
                shape.hidden, shape.experts, shape.tokens_per_rank, row.top_k,
                {d: row.of(d).measured.fwd_bwd_s for d in SHORT},
                {d: dispatch_combine_s(p) for d, p in plans.items()},
                {d: evaluate(p).step_time_s for d, p in plans.items()},
            ))
    return out


def table(rows: list[Choice]) -> list[str]:
    """The comparison as Markdown lines (docs/dispatch.md)."""
    lines = ["| hidden | experts | tokens/rank | top-k | a2a measured | a2a predicted | "
             "ag+rs measured | ag+rs predicted | faster | planner |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for c in rows:
        a, g = Dispatch.all_to_all, Dispatch.allgather_reduce_scatter
        lines.append(
            f"| {c.hidden} | {c.experts} | {c.tokens_per_rank} | {c.top_k} | "
            f"{c.measured[a] * 1e3:.2f} ms | {c.predicted[a] * 1e3:.2f} ms | "
            f"{c.measured[g] * 1e3:.2f} ms | {c.predicted[g] * 1e3:.2f} ms | "
            f"{SHORT[c.faster]} | {SHORT[c.pick]} |")
    return lines


def relative_errors(rows: list[Choice]) -> list[float]:
    return [c.predicted[d] / c.measured[d] - 1 for c in rows for d in SHORT]


def load(path: Path) -> DispatchSweep:
    return read(DispatchSweep, path, "dispatch sweep")


def summary(rows: list[Choice]) -> dict[str, float]:
    errs = sorted(abs(e) for e in relative_errors(rows))
    signed = relative_errors(rows)
    return {
        "points": len(rows),
        "picks_equal_faster": sum(c.pick == c.faster for c in rows),
        "median_abs_error": errs[len(errs) // 2],
        "max_abs_error": errs[-1],
        "over": sum(e > 0 for e in signed),
        "under": sum(e < 0 for e in signed),
        "geomean_ratio": math.exp(sum(math.log(1 + e) for e in signed) / len(signed)),
    }
