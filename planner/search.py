"""Plan search: enumerate layouts and options, prune, split stages, rank by predicted throughput.

Exact branch and bound, deterministic:
1. For every layout (degrees, attention and FFN kind, micro-batch, schedule) build a Plan with an
   even stage split (the Plan invariants reject impossible layouts) and check memory with the
   leanest options; a layout that cannot fit that way cannot fit at all.
2. Lower-bound each layout's step time: the slowest stage processes every micro-batch in turn,
   so step >= micro-batches x (layers / pp) x the fastest layer time over its options.
3. Visit layouts in bound order; evaluate every option of a layout (ILP stage split, memory,
   cost model) until the bound passes the K-th best step time found.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

import cost_models
from cost_models import Evaluation
from planner.space import (
    AttentionKind,
    FFNKind,
    Layout,
    SearchSpace,
    attention_strategy,
    ffn_strategy,
)
from planner.staging import SplitCosts, split_layers
from plans import (
    ClusterSpec,
    ModelSpec,
    Overlap,
    Plan,
    Precision,
    Recompute,
    TrainingSpec,
)

# Options that need the least memory, for the first-pass memory check.
_LEANEST = (Recompute.full, Precision.fp8, Precision.bf16, Precision.fp32)


@dataclass(frozen=True)
class Ranked:
    plan: Plan
    """With its prediction filled in."""
    evaluation: Evaluation


@dataclass
class SearchStats:
    layouts: int = 0
    candidates: int = 0
    """Layouts x options enumerated."""
    invalid: int = 0
    """Layouts the Plan invariants reject."""
    pruned_memory: int = 0
    """Candidates of layouts that do not fit even with the leanest options."""
    pruned_bound: int = 0
    """Candidates never evaluated because their lower bound passed the K-th best."""
    evaluated: int = 0
    feasible: int = 0
    """Evaluated candidates that fit in memory."""
    seconds: float = 0.0


@dataclass
class SearchResult:
    top: list[Ranked]
    baseline: Ranked | None
    stats: SearchStats = field(default_factory=SearchStats)

    @property
    def best(self) -> Ranked | None:
        return self.top[0] if self.top else None

    @property
    def speedup(self) -> float | None:
        """Predicted step-time ratio baseline / best."""
        if self.best is None or self.baseline is None:
            return None
        return self.baseline.evaluation.step_time_s / self.best.evaluation.step_time_s


def megatron_space(cluster: ClusterSpec) -> SearchSpace:
    """The layout a Megatron-LM user would run: TP inside the node for attention and FFN
    (tp = etp = the node, at most 8), PP and DP outside, fp32 gradient sync, no intra-layer
    overlap (DP and PP communication still overlap), its best micro-batch and schedule."""
    tp = min(8, cluster.nvlink_domain)
    return SearchSpace(
        attention=(AttentionKind.tp,),
        ffn=(FFNKind.tp,),
        overlap=(Overlap.none,),
        grad_sync=(Precision.fp32,),
        attention_degrees=(tp,),
        expert_tp_degrees=(tp,),
    )


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    space: SearchSpace | None = None,
    top: int = 5,
    with_baseline: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> SearchResult:
    """Best `top` plans for the job, fastest first, and the Megatron-style baseline."""
    start = time.perf_counter()
    space = space or SearchSpace()
    stats = SearchStats()
    best = _search(model, cluster, training, space, top, stats, progress)
    baseline = None
    if with_baseline:
        found = _search(model, cluster, training, megatron_space(cluster), 1, SearchStats(), None)
        baseline = found[0] if found else None
    stats.seconds = time.perf_counter() - start
    return SearchResult(best, baseline, stats)


def evaluate_plan(plan: Plan) -> Ranked:
    """Evaluate one plan and attach its prediction."""
    evaluation = cost_models.evaluate(plan)
    return Ranked(plan.model_copy(update={"prediction": evaluation.prediction()}), evaluation)


# ---- the search proper ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    bound_s: float
    order: int
    layout: Layout
    plan: Plan


def _search(model, cluster, training, space, top, stats, progress) -> list[Ranked]:
    layouts = list(space.layouts(model, cluster, training))
    stats.layouts += len(layouts)
    entries: list[_Entry] = []
    for i, layout in enumerate(layouts):
        if progress is not None:
            progress(i + 1, len(layouts))
        options = list(space.options(layout, training))
        stats.candidates += len(options)
        plan = _even_plan(model, cluster, training, layout, options[0])
        if plan is None:
            stats.invalid += len(options)
            continue
        if not _fits_leanest(plan, space, options):
            stats.pruned_memory += len(options)
            continue
        entries.append(_Entry(_lower_bound(plan, options), i, layout, plan))

    entries.sort(key=lambda e: (e.bound_s, e.order))
    kept: list[tuple[float, int, Ranked]] = []  # max-heap on step time via negation
    counter = 0
    for idx, entry in enumerate(entries):
        options = list(space.options(entry.layout, training))
        if len(kept) == top and entry.bound_s >= -kept[0][0]:
            stats.pruned_bound += sum(len(list(space.options(e.layout, training)))
                                      for e in entries[idx:])
            break
        for option in options:
            ranked = _evaluate_option(entry.plan, option)
            stats.evaluated += 1
            if ranked is None:
                continue
            stats.feasible += 1
            counter += 1
            item = (-ranked.evaluation.step_time_s, -counter, ranked)
            if len(kept) < top:
                heapq.heappush(kept, item)
            elif item[0] > kept[0][0]:
                heapq.heapreplace(kept, item)
    ordered = sorted(kept, key=lambda t: (-t[0], -t[1]))
    return [r for _, _, r in ordered]


def _even_plan(model, cluster, training, layout: Layout, option) -> Plan | None:
    chunks = layout.degrees.stages
    base, extra = divmod(model.layers, chunks)
    stage_layers = tuple(base + (1 if c < extra else 0) for c in range(chunks))
    dispatch, overlap, recompute, sync = option
    try:
        return Plan(
            model=model, cluster=cluster, training=training, degrees=layout.degrees,
            attention=attention_strategy(layout.attention),
            ffn=ffn_strategy(layout.ffn, dispatch),
            stage_layers=stage_layers, micro_batch_size=layout.micro_batch_size,
            schedule=layout.schedule, overlap=overlap, recompute=recompute,
            grad_sync_precision=sync,
        )
    except ValidationError:
        return None


def _with_option(plan: Plan, option) -> Plan:
    dispatch, overlap, recompute, sync = option
    update = {"overlap": overlap, "recompute": recompute, "grad_sync_precision": sync}
    if dispatch is not None:
        update["ffn"] = plan.ffn.model_copy(update={"dispatch": dispatch})
    # model_copy skips validation: these fields are enums the option enumeration already
    # restricted to valid values (fp8 sync only with fp8 training).
    return plan.model_copy(update=update)


def _fits_leanest(plan: Plan, space: SearchSpace, options) -> bool:
    recomputes = sorted({o[2] for o in options}, key=_LEANEST.index)
    syncs = sorted({o[3] for o in options}, key=_LEANEST.index)
    dispatches = {o[0] for o in options}
    for dispatch in dispatches:
        lean = _with_option(plan, (dispatch, options[0][1], recomputes[0], syncs[0]))
        if cost_models.memory_breakdown(lean).fits:
            return True
    return False


def _lower_bound(plan: Plan, options) -> float:
    """micro-batches x (layers / pp) x fastest per-layer time among the options."""
    layer_s = min(cost_models.stage_costs(_with_option(plan, o)).layer_s for o in
                  {(d, ov, rc, options[0][3]) for d, ov, rc, _ in options})
    return plan.num_micro_batches * plan.model.layers / plan.degrees.pp * layer_s


def _evaluate_option(plan: Plan, option) -> Ranked | None:
    candidate = _with_option(plan, option)
    costs = cost_models.stage_costs(candidate)
    dense = candidate.model.dense_layers
    split = split_layers(
        candidate.model.layers, candidate.degrees.pp, candidate.degrees.vpp,
        SplitCosts(costs.layer_s, costs.embedding_s, costs.head_s,
                   dense * (costs.dense_layer_s - costs.layer_s)),
        dense_layers=dense,
    )
    candidate = candidate.model_copy(update={"stage_layers": split})
    if not cost_models.memory_breakdown(candidate).fits:
        return None
    ranked = evaluate_plan(candidate)
    return ranked if ranked.evaluation.feasible else None

