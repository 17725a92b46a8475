"""Plan search: enumerate layouts and options, prune, split stages, rank by predicted throughput.

Exact branch and bound, deterministic:
1. For every layout (degrees, attention and FFN kind, micro-batch, schedule) build a Plan with an
   even stage split (the Plan invariants reject impossible layouts).
2. Lower-bound each layout's step time from the fastest layer time over its options and the
   pipeline formula (see _lower_bound).
3. Visit layouts in bound order until the bound passes the K-th best step time found. A
   layout first visited gets a tighter bound (_refined): the recomputation its memory forces
   (at a level whose leanest options do not fit, none do) and the gradient sync no backward
   hides; it goes back in line under that bound. Visited again, its options are evaluated (stage
   split, memory, cost model), skipping dominated ones.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import NamedTuple

from pydantic import ValidationError

import cost_models
from cost_models import Evaluation, StageCosts
from cost_models.evaluate import head_s
from cost_models.grad_sync import grad_sync
from cost_models.memory import grad_bytes_per_param, memory_capacity_bytes
from cost_models.params import StageParams, part_params
from cost_models.pipeline import (
    exposed_p2p_s,
    p2p_transfer_s,
    straggler_s,
)
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
    CrossEntropy,
    FFNStrategy,
    ModelSpec,
    OptimizerSharding,
    Overlap,
    Plan,
    Precision,
    Recompute,
    RecomputeModule,
    SpecError,
    TrainingSpec,
)
from plans.enums import Dispatch, Target
from plans.execution import ANY, RULES, as_target, executed_plan, refusals, rule_refusals
from plans.layout import moe_chunks
from plans.operators import DEFAULT_MODULES, LayerOperator, recomputed_operators

MAX_SEARCHES = 32
"""Most searches one command runs (`scale` GPU counts, `whatif` grid points): one search of a
large job takes seconds, so a longer list is refused before the first one starts."""


def check_searches(count: int, what: str) -> None:
    if count > MAX_SEARCHES:
        raise SpecError(f"{what}: {count} searches asked for, at most {MAX_SEARCHES} per command "
                        "(each re-plans the whole job); split the list")


# Options from the least memory to the most, for the first-pass memory check.
_LEAN_RECOMPUTE = tuple(reversed(Recompute))
_LEAN_SYNC = tuple(reversed(Precision))
_OVERLAP_STRENGTH = tuple(Overlap)
_SAME_TIME = 1e-9
"""Relative difference under which two predicted layer times are the same time."""


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
    """Candidates the Plan invariants or the target's rules across fields reject."""
    pruned_memory: int = 0
    """Candidates of visited layouts that do not fit even with the leanest options."""
    pruned_bound: int = 0
    """Candidates never visited because their lower bound passed the K-th best."""
    evaluated: int = 0
    dominated: int = 0
    """Candidates skipped because an evaluated option of the same layout is at least as fast
    and as lean (stronger overlap, lower sync precision, less recomputation that fits)."""
    feasible: int = 0
    """Evaluated candidates that fit in memory."""
    seconds: float = 0.0


@dataclass
class SearchResult:
    top: list[Ranked]
    baseline: Ranked | None
    """Megatron-Core's best plan for the job (``megatron_core_space``, searched)."""
    stats: SearchStats = field(default_factory=SearchStats)
    reference: Ranked | None = None
    """The paper's Megatron-LM layout at its best (``megatron_space``): the comparison
    MegaScale-MoE reports."""

    @property
    def best(self) -> Ranked | None:
        return self.top[0] if self.top else None

    @property
    def speedup(self) -> float | None:
        """Predicted step-time ratio baseline (Megatron-Core's best) / best."""
        return _ratio(self.baseline, self.best)

    @property
    def reference_speedup(self) -> float | None:
        """Predicted step-time ratio reference (the paper's Megatron-LM layout) / best."""
        return _ratio(self.reference, self.best)


def _ratio(slow: Ranked | None, fast: Ranked | None) -> float | None:
    if slow is None or fast is None:
        return None
    return slow.evaluation.step_time_s / fast.evaluation.step_time_s


BASELINE_LABEL = "Megatron-Core (searched)"
"""The baseline row: the best plan of the megatron target."""
REFERENCE_LABEL = "Megatron-LM (paper layout)"
"""The reference row: MegaScale-MoE's Megatron-LM comparison layout."""


def megatron_core_space(attention: tuple[AttentionKind, ...] = ()) -> SearchSpace:
    """Everything Megatron-Core executes as written (plans.execution's megatron column): the
    baseline's search. Its attention kinds: a default search's (Ulysses, which Megatron runs
    as a2a context parallelism, and TP) and ``attention``'s; ring context parallelism (cp)
    only when asked for, as in every search (the paper rejects it for its causal-mask
    imbalance, and its layouts would double the search's time)."""
    kinds = tuple(dict.fromkeys((*SearchSpace().attention, *attention)))
    return SearchSpace(attention=kinds).for_target(Target.megatron)


def megatron_space(model: ModelSpec, cluster: ClusterSpec) -> SearchSpace:
    """The paper's Megatron-LM layout (MegaScale-MoE's comparison), as Megatron-Core runs it:
    TP inside the node for attention and FFN (tp = etp = the node, at most 8, dividing the
    KV heads), PP and DP outside, fp32 gradient sync, no intra-layer overlap (DP and PP
    communication still overlap), its best micro-batch and schedule."""
    tp = max(t for t in range(1, min(8, cluster.nvlink_domain) + 1)
             if cluster.nvlink_domain % t == 0 and model.kv_heads % t == 0)
    return SearchSpace(
        attention=(AttentionKind.tp,),
        ffn=(FFNKind.tp,),
        overlap=(Overlap.none,),
        grad_sync=(Precision.fp32,),
        attention_degrees=(tp,),
        expert_tp_degrees=(tp,),
    ).for_target(Target.megatron)


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    space: SearchSpace | None = None,
    top: int = 5,
    with_baseline: bool = True,
    progress: Callable[[int, int], None] | None = None,
    session: Session | None = None,
) -> SearchResult:
    """Best `top` plans for the job, fastest first; with the baseline, Megatron-Core's best
    plan (searched over its column) and the paper's Megatron-LM layout (the reference).
    ``session``: what searches of one command share (Session), else the search's own."""
    with _collector_paused():
        return _search_all(model, cluster, training, space, top, with_baseline, progress,
                           session or Session())


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused, then restored as it was. A search allocates
    millions of small objects, many kept in the cost models' caches, and each full collection
    rescans them all: a quarter of the Internal-352B search's CPU time
    (tools/search_speed.py). Its values make no reference cycles worth collecting, so the
    objects alive at its end are frozen (gc.freeze) before the collector resumes: else its
    first collection, due at once, scans them all (70 ms after that search)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.enable()


def _search_all(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                space: SearchSpace | None, top: int, with_baseline: bool,
                progress: Callable[[int, int], None] | None, session: Session
                ) -> SearchResult:
    start = time.perf_counter()
    space = space or SearchSpace()
    stats = SearchStats()
    best = _search(model, cluster, training, space, top, stats, progress, session=session)
    baseline = reference = None
    if with_baseline:
        core = megatron_core_space(space.attention)
        found = best if space == core else _search(model, cluster, training, core, 1,
                                                   SearchStats(), None,
                                                   seeds=_as_run_by(best, Target.megatron),
                                                   session=session)
        baseline = found[0] if found else None
        paper = _search(model, cluster, training, megatron_space(model, cluster), 1,
                        SearchStats(), None, session=session)
        reference = paper[0] if paper else None
    stats.seconds = time.perf_counter() - start
    return SearchResult(best, baseline, stats, reference)


def _as_run_by(ranked: list[Ranked], target: Target) -> list[Ranked]:
    """The plans ``ranked`` as ``target`` runs them (plans.execution: its column's values),
    priced, where it runs them and they fit: plans of its space, so their step times bound
    its search's best from above (the same optimum, found with less of the space visited)."""
    out = []
    for r in ranked:
        plan = as_target(r.plan, target)
        if refusals(plan, target=target):
            continue
        candidate = evaluate_plan(executed_plan(plan, target=target))
        if candidate.evaluation.feasible:
            out.append(candidate)
    return out


def evaluate_plan(plan: Plan) -> Ranked:
    """Evaluate one plan and attach its prediction."""
    return _predicted(plan, cost_models.evaluate(plan))


def _predicted(plan: Plan, evaluation: Evaluation) -> Ranked:
    return Ranked(plan.model_copy(update={"prediction": evaluation.prediction()}), evaluation)


# ---- the search proper ------------------------------------------------------------------------


class _Entry(NamedTuple):
    """A layout in the search's line (a named tuple: a search makes one per layout and
    space)."""

    bound_s: float
    order: int
    plan: Plan
    options: list
    shape: tuple
    """The layout's layer shape: what its layer costs depend on (not pp, vpp or dp)."""
    fitting: frozenset[Recompute] | None = None
    """Once _refined: the recomputation levels that may fit (``bound_s`` is then _refined's
    and ``options`` the runnable ones)."""
    candidate: _Candidate | None = None
    """Where the entry comes from (None: a layout priced alone, as tests do)."""
    exact: bool = True
    """False while ``bound_s`` is only the pipeline floor of its bound (_pipeline_floor_s,
    which the cluster's speeds leave alone) and ``plan`` the candidate's even plan, maybe on
    another cluster of the session: it is bounded (_lower_bound) when it comes first."""


@dataclass(frozen=True, eq=False)
class _Candidate:
    """A layout of a space with its options, its layer shape and its even plan (None where
    the Plan invariants or the target's rules on the layout's own fields reject it)."""

    layout: Layout
    options: list
    shape: tuple
    plan: Plan | None


class Session:
    """What the searches of one command share where their jobs differ in the cluster's
    speeds alone (a what-if grid's points), for as long as it lives:

    - each space's layouts on a GPU count and NVLink domain, with their options and even
      plans: the Plan invariants read the cluster's GPU count alone, and no rule of
      plans.execution reads the cluster;
    - a layout's even plan at an option, validated once for every space (the baseline's
      too): the Plan invariants read none of the fields a space sets on all its plans
      (``_SPACE_FIELDS``);
    - each layout's runnable options (the target's rules) and the recomputation levels whose
      leanest options fit (_fitting_recomputes): the memory model reads the cluster's capacity
      alone (cost_models.memory.memory_capacity_bytes)."""

    def __init__(self) -> None:
        self._candidates: dict[tuple, list[_Candidate]] = {}
        self._layouts: dict[tuple, list[Layout]] = {}
        self._even: dict[tuple, Plan | None] = {}
        self._refinements: dict[tuple, tuple[list, frozenset[Recompute]]] = {}

    def candidates(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                   space: SearchSpace) -> list[_Candidate]:
        key = (model, training, space, cluster.gpus, cluster.nvlink_domain)
        if key not in self._candidates:
            self._candidates[key] = self._candidates_of(model, cluster, training, space)
        return self._candidates[key]

    def _candidates_of(self, model, cluster, training, space: SearchSpace
                       ) -> list[_Candidate]:
        out = []
        for layout in self._layouts_of(model, cluster, training, space):
            options = space.options(layout, training)
            plan = self._even_plan(model, cluster, training, layout, options[0], space)
            if plan is not None and RULES[space.target] and _layout_refused(plan,
                                                                            space.target):
                plan = None
            d = layout.degrees
            shape = (layout.attention, layout.ffn, layout.micro_batch_size, d.sp, d.tp, d.cp,
                     d.ep, d.etp)
            out.append(_Candidate(layout, options, shape, plan))
        return out

    def _layouts_of(self, model, cluster, training, space: SearchSpace) -> list[Layout]:
        """The space's layouts, listed once for the spaces that list the same ones (the
        baseline's and the search's: SearchSpace.layout_part)."""
        key = (model, training, cluster.gpus, cluster.nvlink_domain, space.layout_part())
        if key not in self._layouts:
            self._layouts[key] = list(space.layouts(model, cluster, training))
        return self._layouts[key]

    def _even_plan(self, model, cluster, training, layout: Layout, option,
                   space: SearchSpace) -> Plan | None:
        key = (model, training, cluster.gpus, layout, option)
        if key not in self._even:
            self._even[key] = _even_plan(model, cluster, training, layout, option, space)
        plan = self._even[key]
        if plan is None:
            return None
        update = {f: getattr(space, f) for f in _SPACE_FIELDS
                  if getattr(plan, f) != getattr(space, f)}
        if plan.cluster is not cluster:
            update["cluster"] = cluster
        return plan.model_copy(update=update) if update else plan

    def refinement(self, entry: _Entry, space: SearchSpace
                   ) -> tuple[list, frozenset[Recompute]]:
        """The entry's runnable options and the recomputation levels that may fit them."""
        plan = entry.plan
        if entry.candidate is None:  # a layout priced alone
            return _refinement(plan, entry.options, space)
        key = (entry.candidate, memory_capacity_bytes(plan.cluster, plan.training))
        if key not in self._refinements:
            self._refinements[key] = _refinement(plan, entry.options, space)
        return self._refinements[key]


def _refinement(plan: Plan, options: list, space: SearchSpace
                ) -> tuple[list, frozenset[Recompute]]:
    runnable = _runnable_options(plan, options, space.target)
    return runnable, _fitting_recomputes(plan, runnable, _leanest_loss(space.cross_entropy))


_OPTION_FIELDS = frozenset({"ffn.dispatch", "overlap", "recompute", "grad_sync_precision",
                            "recompute_modules"})
"""The plan fields a layout's options choose (SearchSpace.options)."""


_LAYOUT_RULE_FIELDS = {target: frozenset(r.field for r in rows) - _OPTION_FIELDS
                       for target, rows in RULES.items()}
"""Per target, the fields of its rules across fields that a layout's options leave alone."""


def _layout_refused(plan: Plan, target: Target) -> bool:
    """Whether the layout breaks one of the target's rules on a field its options leave
    alone (plans.execution.RULES): then every option does."""
    fields = _LAYOUT_RULE_FIELDS[target]
    return bool(fields) and bool(rule_refusals(plan, target, fields))


def _runnable_options(plan: Plan, options: list, target: Target) -> list:
    """The options of a layout whose plans keep the target's rules on the option fields;
    checked when the layout is visited (the bound, a minimum over more options, holds)."""
    rows = [r for r in RULES[target] if r.field in _OPTION_FIELDS]
    if not rows:
        return options

    def ruled(option) -> bool:  # a rule's row holds for one of this option's values
        values = dict(zip(("ffn.dispatch", "overlap", "recompute", "grad_sync_precision",
                           "recompute_modules"), option, strict=True))
        return any(r.value is ANY or r.value == values[r.field] for r in rows)

    return [o for o in options if not ruled(o)
            or not rule_refusals(_with_option(plan, o), target, _OPTION_FIELDS)]


def _search(model, cluster, training, space, top, stats, progress, exhaustive=False,
            seeds: list[Ranked] = (), session: Session | None = None) -> list[Ranked]:
    """The search proper; ``seeds``: plans of ``space`` already priced, whose step times
    bound the best from above from the start (a searched plan of the same time replaces
    one)."""
    session = session or Session()
    line, fastest = _entries(model, cluster, training, space, stats, progress, session)
    costs: dict[tuple, StageCosts] = {}
    kept: list[tuple[float, int, Ranked]] = []  # heap of the K best, slowest on top
    for i, seed in enumerate(sorted(seeds, key=lambda r: r.evaluation.step_time_s)[:top]):
        heapq.heappush(kept, (-seed.evaluation.step_time_s, -(2**62 + i), 0, seed))
    idx = 0  # layouts evaluated so far
    while line:
        _, _, entry = heapq.heappop(line)
        if len(kept) == top and (entry.bound_s > -kept[0][0] or (
                entry.bound_s == -kept[0][0] and entry.exact and not _seeded(kept[0]))):
            stats.pruned_bound += len(entry.options) + sum(len(e.options) for *_, e in line)
            break
        if not entry.exact:
            # its floor came first: its bound, no less, takes its place in line (the line's
            # order of bounds and ties is the one every entry bounded at once would give)
            bounded = _bounded(entry, cluster, fastest[entry.shape])
            heapq.heappush(line, (bounded.bound_s, bounded.order, bounded))
            continue
        if entry.fitting is None:
            refined = _refined(entry, space, costs, stats, session)
            if refined is not None:
                heapq.heappush(line, (refined.bound_s, refined.order, refined))
            continue
        _visit(entry, idx, space, top, stats, kept, exhaustive)
        idx += 1
    ordered = sorted(kept, key=lambda t: (-t[0], -t[1], -t[2]))
    return [r if r.plan.prediction is not None else _predicted(r.plan, r.evaluation)
            for *_, r in ordered]


def _entries(model, cluster, training, space, stats, progress, session: Session
             ) -> tuple[list[tuple], dict[tuple, StageCosts]]:
    """Every valid layout of ``space`` with its even plan and its options, in a heap by the
    pipeline floor of its lower bound (_lower_bound at the layer shape's fastest options,
    which come with it), then enumeration order."""
    candidates = session.candidates(model, cluster, training, space)
    stats.layouts += len(candidates)
    line = []
    fastest: dict[tuple, StageCosts] = {}
    work: dict[tuple, float] = {}  # _work_s at the shape's fastest costs
    for i, c in enumerate(candidates):
        if progress is not None and (i % 64 == 0 or i + 1 == len(candidates)):
            progress(i + 1, len(candidates))
        stats.candidates += len(c.options)
        if c.plan is None:
            stats.invalid += len(c.options)
            continue
        if c.shape not in fastest:
            fastest[c.shape] = _fastest_costs(_on(c.plan, cluster), c.options,
                                              space.cross_entropy)
            work[c.shape] = _work_s(model, fastest[c.shape])
        floor = _pipeline_floor_s(c.plan, work[c.shape])
        line.append((floor, i, _Entry(floor, i, c.plan, c.options, c.shape, candidate=c,
                                      exact=False)))
    heapq.heapify(line)
    return line, fastest


def _on(plan: Plan, cluster: ClusterSpec) -> Plan:
    return plan if plan.cluster is cluster else plan.model_copy(update={"cluster": cluster})


def _bounded(entry: _Entry, cluster: ClusterSpec, costs: StageCosts) -> _Entry:
    """An entry of _entries with its plan on ``cluster`` and its lower bound."""
    plan = _on(entry.plan, cluster)
    bound = _lower_bound(plan, costs)
    return _Entry(bound, entry.order, plan, entry.options, entry.shape,
                  candidate=entry.candidate)


def _refined(entry: _Entry, space: SearchSpace, costs: dict, stats: SearchStats,
             session: Session | None = None) -> _Entry | None:
    """``entry`` with its runnable options and a tighter bound: the least of _lower_bound over
    the recomputation levels whose leanest options fit (_fitting_recomputes), each at the
    fastest of its options (_fastest_costs), plus the gradient sync no backward hides
    (_exposed_sync_floor); None when no option runs or fits."""
    options, fitting = (session or Session()).refinement(entry, space)
    stats.invalid += len(entry.options) - len(options)
    if not fitting:
        stats.pruned_memory += len(options)
        return None
    floors = []
    for recompute in fitting:
        key = (entry.shape, recompute, frozenset(options))
        if key not in costs:
            costs[key] = _fastest_costs(entry.plan, options, space.cross_entropy, recompute)
        floors.append(_lower_bound(entry.plan, costs[key]))
    bound = max(entry.bound_s, min(floors) + _exposed_sync_floor(entry.plan, options))
    return _Entry(bound, entry.order, entry.plan, options, entry.shape, fitting,
                  entry.candidate)


def _visit(entry: _Entry, idx: int, space: SearchSpace, top: int, stats: SearchStats,
           kept: list, exhaustive: bool) -> None:
    """Evaluate a refined entry's options group by group, keeping the K best in ``kept``."""
    groups = _option_groups(entry.plan, entry.options, exhaustive)
    stats.dominated += len(entry.options) - sum(map(len, groups))
    fit = [[o for o in g if o[2] in entry.fitting] for g in groups]
    stats.pruned_memory += sum(map(len, groups)) - sum(map(len, fit))
    groups = [g for g in fit if g]
    # per dispatcher and overlap level, the lowest-precision sync's best bounds the others:
    # a higher precision needs at least as much recomputation and sync traffic, and saves
    # at most the optimizer step's cast (bounded here by the whole optimizer step)
    floor: dict = {}
    for group in groups:
        pair = group[0][:2]
        if not exhaustive and pair in floor and (
                floor[pair] is None
                or (len(kept) == top and floor[pair] >= -kept[0][0])):
            stats.dominated += len(group)
            continue
        ranked, tried = _best_of_group(entry.plan, group, space.cross_entropy)
        if not exhaustive and pair not in floor:
            floor[pair] = None if ranked is None else (
                ranked.evaluation.step_time_s - ranked.evaluation.breakdown_s["optimizer"])
        stats.evaluated += tried
        stats.dominated += len(group) - tried
        if ranked is None:
            continue
        stats.feasible += 1
        # ties go to the earlier layout, then the earlier option (feasible counts them)
        item = (-ranked.evaluation.step_time_s, -(idx * 1000 + len(kept)),
                -stats.feasible, ranked)
        if len(kept) < top:
            heapq.heappush(kept, item)
        elif item[0] > kept[0][0] or (item[0] == kept[0][0] and _seeded(kept[0])):
            heapq.heapreplace(kept, item)


def _seeded(item: tuple) -> bool:
    """Whether a kept item is a seed (their third key is 0, a searched plan's negative)."""
    return item[2] == 0


def _overlap_levels(plan: Plan, dispatch, overlaps, recompute: Recompute,
                    modules: tuple[RecomputeModule, ...] = DEFAULT_MODULES) -> list[Overlap]:
    """The overlap levels of ``overlaps`` worth searching for ``plan``'s layout under
    ``dispatch``, the fastest MoE layer first. Overlap changes a layer's time and, through its
    token chunks (plans.layout.moe_chunks), its memory: a level is dominated by another that is
    no slower and keeps no more chunks, judged at ``recompute``, the least recomputation
    searched, with ``modules`` (recomputation reruns the same operators under every level).
    Equal on both (a
    layer with nothing to overlap: expert TP, no EP), the weaker level is kept, so the plan
    says what runs. A stronger level is not always the faster: where communication beside
    compute hides little (efficiency.overlap), the chunks cost more than they hide."""

    def cost(o: Overlap) -> tuple[float, int]:
        q = _with_option(plan, (dispatch, o, recompute, plan.grad_sync_precision, modules))
        return cost_models.layer_timing(q).total_s, moe_chunks(o, q.ffn, q.degrees.ep)

    costs = {o: cost(o) for o in sorted(set(overlaps), key=_OVERLAP_STRENGTH.index)}

    def faster(a: float, b: float) -> bool:
        # levels that run the same layer are priced by graphs summed in another order: a
        # difference in the last bits is no speed-up (it named a 1-GPU plan ov:inter)
        return a < b and not math.isclose(a, b, rel_tol=_SAME_TIME)

    def dominated(o: Overlap) -> bool:
        (t, c), strength = costs[o], _OVERLAP_STRENGTH.index(o)
        return any(not faster(t, t2) and c2 <= c
                   and (faster(t2, t) or c2 < c or _OVERLAP_STRENGTH.index(o2) < strength)
                   for o2, (t2, c2) in costs.items() if o2 != o)

    kept = [o for o in costs if not dominated(o)]
    return sorted(kept, key=lambda o: (costs[o][0], _OVERLAP_STRENGTH.index(o)))


def _option_groups(plan: Plan, options: list, exhaustive: bool) -> list[list]:
    """Options of one layout in groups ordered fastest-first, where within a group an option
    that reruns every operator another reruns (_reruns) comes after it and is never faster
    (dominance): less recomputation is faster (more memory), so once an option fits, those
    rerunning all it reruns and more need no pricing (_best_of_group). Recomputation levels
    run none, selective (its module sets, the fewer operators first), full. The dispatcher,
    the overlap level (_overlap_levels: the dominated ones are left out) and the
    gradient-sync precision trade time against memory (a bf16 or fp8 sync keeps smaller
    buffers but its optimizer step casts the gradient slice to fp32), so each triple of them
    forms a group."""
    if exhaustive:
        return [[o] for o in options]
    groups = []
    syncs = sorted({o[3] for o in options}, key=_LEAN_SYNC.index)  # the leanest first
    for dispatch in dict.fromkeys(o[0] for o in options):
        mine = [o for o in options if o[0] == dispatch]
        least = min(mine, key=lambda o: len(_reruns(o)))
        for overlap in _overlap_levels(plan, dispatch, {o[1] for o in mine}, least[2],
                                       least[4]):
            for sync in syncs:
                group = [o for o in mine if o[1] == overlap and o[3] == sync]
                group.sort(key=lambda o: (-_LEAN_RECOMPUTE.index(o[2]), len(_reruns(o))))
                groups.append(group)
    return [g for g in groups if g]


def _reruns(option) -> frozenset[LayerOperator]:
    """The operators an option's recomputation reruns in backward."""
    return recomputed_operators(option[2], option[4])


def _best_of_group(plan: Plan, group: list, losses: tuple[CrossEntropy, ...]
                   ) -> tuple[Ranked | None, int]:
    """Evaluate a dominance group in order, skipping the options that rerun all a feasible
    one reruns; the fastest feasible option is its best, and the number priced."""
    best, tried, fitted = None, 0, []
    for option in group:
        reruns = _reruns(option)
        if any(f <= reruns for f in fitted):
            continue
        tried += 1
        ranked = _evaluate_option(plan, option, losses)
        if ranked is None:
            continue
        fitted.append(reruns)
        if best is None or ranked.evaluation.step_time_s < best.evaluation.step_time_s:
            best = ranked
    return best, tried


_SPACE_FIELDS = ("target", "kernels", "grad_sync_overlap", "grad_accumulation_fusion")
"""The plan fields a search space sets on all its plans (_even_plan)."""


def _even_plan(model, cluster, training, layout: Layout, option, space: SearchSpace
               ) -> Plan | None:
    chunks = layout.degrees.stages
    base, extra = divmod(model.layers, chunks)
    stage_layers = tuple(base + (1 if c < extra else 0) for c in range(chunks))
    dispatch, overlap, recompute, sync, modules = option
    try:
        return Plan(
            model=model, cluster=cluster, training=training, degrees=layout.degrees,
            attention=attention_strategy(layout.attention),
            ffn=ffn_strategy(layout.ffn, dispatch),
            stage_layers=stage_layers, micro_batch_size=layout.micro_batch_size,
            schedule=layout.schedule, overlap=overlap, recompute=recompute,
            recompute_modules=modules, grad_sync_precision=sync,
            grad_sync_overlap=space.grad_sync_overlap,
            grad_accumulation_fusion=space.grad_accumulation_fusion, kernels=space.kernels,
            target=space.target,
            optimizer_sharding=layout.optimizer_sharding,
        )
    except ValidationError:
        return None


def _with_option(plan: Plan, option, **more) -> Plan:
    """``plan`` with the option's values (and the fields ``more``), in one copy."""
    dispatch, overlap, recompute, sync, modules = option
    update = {"overlap": overlap, "recompute": recompute, "recompute_modules": modules,
              "grad_sync_precision": sync, **more}
    if dispatch is not None:
        update["ffn"] = _ffn_with(plan.ffn, dispatch)
    # model_copy skips validation: these fields are enums the option enumeration already
    # restricted to valid values (fp8 sync only with fp8 training).
    return plan.model_copy(update=update)


@lru_cache(maxsize=1024)
def _ffn_with(ffn: FFNStrategy, dispatch: Dispatch) -> FFNStrategy:
    """``ffn`` under ``dispatch``: one object per pair, so the cost models' caches find it by
    identity."""
    return ffn.model_copy(update={"dispatch": dispatch})


def _fitting_recomputes(plan: Plan, options, losses: tuple[CrossEntropy, ...]
                        ) -> frozenset[Recompute]:
    """The recomputation levels of ``options`` whose leanest options fit (the module set
    rerunning the most, the leanest sync precision and loss, any dispatcher, the first
    overlap level, the even stage split): at any other level no option does. No level is
    leanest everywhere: full recomputation back-propagates a whole recomputed layer, which can
    exceed what selective keeps when a stage holds one layer of one micro-batch
    (cost_models.memory)."""
    syncs = sorted({o[3] for o in options}, key=_LEAN_SYNC.index)
    dispatches = dict.fromkeys(o[0] for o in options)
    fitting = set()
    for recompute in {o[2] for o in options}:
        modules = max((o for o in options if o[2] == recompute),
                      key=lambda o: len(_reruns(o)))[4]
        for dispatch in dispatches:
            lean = _with_option(plan, (dispatch, options[0][1], recompute, syncs[0], modules),
                                cross_entropy=losses[0])
            if cost_models.memory_breakdown(lean).fits:
                fitting.add(recompute)
                break
    return frozenset(fitting)


def _least_recompute(options) -> Recompute:
    return max({o[2] for o in options}, key=_LEAN_RECOMPUTE.index)


def _fastest_costs(plan: Plan, options, losses: tuple[CrossEntropy, ...] = tuple(CrossEntropy),
                   recompute: Recompute | None = None) -> StageCosts:
    """Stage costs no option of a layout beats at ``recompute`` (by default the least
    recomputation of ``options``), over its module sets: each the least over the dispatchers
    and their overlap levels (_overlap_levels, judged as _option_groups judges them), at the
    sync precision whose gradients accumulate in the fewest bytes (_leanest_accumulation),
    under the faster loss (_loss_order)."""
    fastest = set()
    for d in dict.fromkeys(o[0] for o in options):
        mine = [o for o in options if o[0] == d]
        level = recompute or _least_recompute(mine)
        least = min(mine, key=lambda o: len(_reruns(o)))
        sync = _leanest_accumulation(o[3] for o in mine)
        modules = {o[4] for o in mine if o[2] == level} or {DEFAULT_MODULES}
        fastest |= {(d, overlap, level, sync, m) for m in modules
                    for overlap in _overlap_levels(plan, d, {o[1] for o in mine}, least[2],
                                                   least[4])}
    loss = {"cross_entropy": _loss_order(plan, losses)[0]}
    costs = [cost_models.stage_costs(_with_option(plan, o, **loss)) for o in fastest]
    return StageCosts(*(min(getattr(c, f) for c in costs) for f in _STAGE_COST_FIELDS))


_STAGE_COST_FIELDS = tuple(f.name for f in fields(StageCosts))


def _leanest_accumulation(syncs) -> Precision:
    """Of the sync precisions ``syncs``, the first whose gradients accumulate in the fewest
    bytes: the sync precision changes a plan's stage costs only through the bytes its
    gradient accumulation moves (cost_models.evaluate.stage_costs), which grow with
    grad_bytes_per_param, so its stage costs are the least in every field."""
    return min(syncs, key=grad_bytes_per_param)


def _exposed_sync_floor(plan: Plan, options) -> float:
    """Gradient-sync time no option of the layout can hide (cost_models.grad_sync.
    exposed_grad_sync_s): all of it without overlap, the ZeRO-1 parameter all-gather after the
    optimizer step with it; at the lowest sync precision, for the parameters of a stage with
    the fewest MoE layers the busiest must hold (the sync times grow with the bytes)."""
    sharded = plan.optimizer_sharding == OptimizerSharding.zero1
    if plan.grad_sync_overlap and not sharded:
        return 0.0
    d, m = plan.degrees, plan.model
    layers = math.ceil((m.layers - m.dense_ffn_layers) / d.pp)
    layer = part_params(m, d).moe_layer
    stage = StageParams(layers * layer.dense, layers * layer.expert)
    lowest = min({o[3] for o in options}, key=lambda p: p.bytes)
    sync = grad_sync(stage, d, plan.cluster, lowest)
    return sync.all_gather_s if plan.grad_sync_overlap else sync.total_s


def _lower_bound(plan: Plan, costs: StageCosts) -> float:
    """A step time no option of this layout can beat, from its fastest stage costs.

    Every stage time t_i sums its layers (plus embedding / head), so
    sum t >= W = MoE layers x layer + dense-FFN layers x dense layer + embedding + head and
    max t >= W / pp. The pipeline step is
    m max t + (sum t - max t) / vpp (cost_models.pipeline.step_s), at least
    m W / pp + W (1 - 1/pp) / vpp, plus the waits for stragglers (linear in that time,
    cost_models.pipeline.straggler_s) and the fill/drain transfers every split pays."""
    p2p = exposed_p2p_s(plan, p2p_transfer_s(plan))
    pipelined = _pipeline_floor_s(plan, _work_s(plan.model, costs))
    return pipelined + straggler_s(pipelined, plan) + p2p


def _work_s(model: ModelSpec, costs: StageCosts) -> float:
    """_lower_bound's W: every layer, the embedding and the head, at ``costs``."""
    dense = model.dense_ffn_layers
    return (model.layers - dense) * costs.layer_s + dense * costs.dense_layer_s \
        + costs.embedding_s + costs.head_s


def _pipeline_floor_s(plan: Plan, work_s: float) -> float:
    """_lower_bound's pipeline term, m W / pp + W (1 - 1/pp) / vpp: the plan's degrees and
    micro-batches, whatever its cluster. The bound adds non-negative terms to it, so it is
    never more than the bound, rounding included."""
    d, m = plan.degrees, plan.num_micro_batches
    return m * work_s / d.pp + work_s * (1 - 1 / d.pp) / d.vpp


def _leanest_loss(losses: tuple[CrossEntropy, ...]) -> tuple[CrossEntropy, ...]:
    """Of the loss kinds allowed, the one holding the fewest logits (the chunked one)."""
    return tuple(sorted(losses, key=lambda k: k != CrossEntropy.chunked))


def _loss_order(plan: Plan, losses: tuple[CrossEntropy, ...] = tuple(CrossEntropy)
                ) -> list[CrossEntropy]:
    """The loss kinds to try for ``plan``, the faster head first. The loss changes nothing
    but the last stage's head and its weight gradient's accumulation
    (cost_models.evaluate.head_s), so a head that is no slower gives a step that is no slower
    under every stage split: the first kind that fits is the best. The chunked loss is the
    leaner (it never holds the logits whole), so it comes first on a tie; it is the slower
    under eager kernels (a pass per operation and, without gradient-accumulation fusion, a
    weight-gradient add per chunk), often the faster under fused ones (one compiled region
    per chunk)."""
    # the chunked loss first on a tie (sorted is stable)
    return sorted(_leanest_loss(losses), key=lambda loss: head_s(plan, loss))


def split_stages(plan: Plan) -> Plan:
    """``plan`` with its layers split over the pipeline's chunks as the search splits them
    (planner.staging's optimum over the plan's stage costs)."""
    costs = cost_models.stage_costs(plan)
    m = plan.model
    # the leading dense layers sit in the first chunk; the layers after them, MoE and
    # interleaved dense (moe_layer_interval), are priced at their mean
    dense, body = m.dense_layers, m.layers - m.dense_layers
    interleaved = m.dense_ffn_layers - dense
    layer_s = (costs.layer_s * (body - interleaved) + costs.dense_layer_s * interleaved) / body
    split = split_layers(
        m.layers, plan.degrees.pp, plan.degrees.vpp,
        SplitCosts(layer_s, costs.embedding_s, costs.head_s,
                   dense * (costs.dense_layer_s - layer_s)),
        dense_layers=dense,
    )
    return plan.model_copy(update={"stage_layers": split})


def _evaluate_option(plan: Plan, option, losses: tuple[CrossEntropy, ...] = tuple(CrossEntropy)
                     ) -> Ranked | None:
    for loss in _loss_order(plan, losses):
        candidate = split_stages(_with_option(plan, option, cross_entropy=loss))
        if cost_models.memory_breakdown(candidate).fits:
            evaluation = cost_models.evaluate(candidate)
            # the prediction is attached to the plans the search returns (_search)
            return Ranked(candidate, evaluation) if evaluation.feasible else None
    return None

