"""The search space: which layouts and options a search may choose from, and their enumeration.

Enumeration rules (hard constraints only; the Plan's own invariants reject the rest):
- the attention group (sp, tp or cp) and expert TP (etp) stay inside the NVLink domain; an EP
  group is inside it or whole NVLink domains (a multiple of it: contiguous nodes, plans.layout),
  the all-to-all priced link by link (cost_models.volumes.ep_link_shares);
- pp divides the GPUs left after the attention group and is at most the layer count;
- micro-batches must fill the global batch; interleaving needs micro-batches divisible by pp;
- fp8 gradient sync only for fp8 training.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cache
from itertools import combinations

from planner.staging import least_layers
from plans import (
    EPFFN,
    TPFFN,
    ClusterSpec,
    CPAttention,
    CrossEntropy,
    Degrees,
    Dispatch,
    Kernels,
    ModelSpec,
    OptimizerSharding,
    Overlap,
    PipelineSchedule,
    Precision,
    Recompute,
    RecomputeModule,
    SpecError,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
)
from plans.enums import AttentionKind, Target
from plans.execution import (
    MOEPLAN_MODULES,
    TARGET_NAMES,
    Backend,
    executed_anywhere,
    executes,
)
from plans.operators import DEFAULT_MODULES


class FFNKind(StrEnum):
    ep = "ep"
    tp = "tp"


def _divisors(n: int) -> list[int]:
    """Ascending divisors of n, in O(sqrt n) (model and cluster sizes come from user files)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class Layout:
    """Everything that fixes the cost of one transformer layer and the mesh, less the options
    (dispatch, overlap, recompute and its modules, sync precision) searched on top of it."""

    degrees: Degrees
    attention: AttentionKind
    ffn: FFNKind
    micro_batch_size: int
    schedule: PipelineSchedule
    optimizer_sharding: OptimizerSharding = OptimizerSharding.zero1


Option = tuple[Dispatch | None, Overlap, Recompute, Precision, tuple[RecomputeModule, ...]]
"""A layout's option: dispatcher (None without an EP group), overlap level, recomputation,
gradient-sync precision and, under selective recomputation, its modules."""


RUNTIME_DISPATCHES = tuple(d for d in Dispatch if executes("ffn.dispatch", d))
"""The EP dispatchers moeplan's runtime runs (plans.execution): a default search's."""


def ep_degrees(experts: int, ranks: int, domain: int) -> list[int]:
    """EP group sizes for ``experts`` over ``ranks`` (dp x attention group) ranks: divisors of
    both, inside the NVLink domain or whole domains (contiguous nodes), ascending."""
    return [e for e in _divisors(ranks)
            if experts % e == 0 and (e <= domain or e % domain == 0)]


RUNNABLE_FIELDS = {
    "attention": "attention.kind", "ffn": "ffn.kind", "dispatch": "ffn.dispatch",
    "overlap": "overlap", "recompute": "recompute", "schedules": "schedule",
    "grad_sync": "grad_sync_precision", "cross_entropy": "cross_entropy",
    "optimizer_sharding": "optimizer_sharding",
}
"""SearchSpace option -> the plan field whose values it chooses."""

def module_sets(modules: frozenset[RecomputeModule]) -> tuple[tuple[RecomputeModule, ...], ...]:
    """Every non-empty set of ``modules``, the smaller first, each in RecomputeModule's order."""
    ordered = [m for m in RecomputeModule if m in modules]
    return tuple(s for n in range(1, len(ordered) + 1) for s in combinations(ordered, n))


SEARCHED_MODULES: dict[Target, tuple[tuple[RecomputeModule, ...], ...]] = {
    # moeplan's runtime reruns the attention core, the experts' activation, or both
    Target.moeplan: module_sets(MOEPLAN_MODULES),
    Target.megatron: (DEFAULT_MODULES,),
}
"""Per target, the module sets a search tries under selective recomputation
(Plan.recompute_modules), unless the space names its own."""

DEFAULT_OVERLAPS = tuple(o for o in Overlap if executed_anywhere("overlap", o))
"""The overlap levels a default search chooses from: those some target executes as written
(plans.execution); tile-fused overlap (inter_intra_op), which none does, only when asked
for by name."""


@dataclass(frozen=True)
class SearchSpace:
    """What a search may choose. Narrow it to what your runtime supports (e.g. overlap none)."""

    attention: tuple[AttentionKind, ...] = (AttentionKind.ulysses_sp, AttentionKind.tp)
    """Attention strategies. CP is left out by default: the runtime does not execute it (the
    paper rejects it for causal-mask imbalance); add it to compare predictions."""
    ffn: tuple[FFNKind, ...] = tuple(FFNKind)
    dispatch: tuple[Dispatch, ...] = RUNTIME_DISPATCHES
    """EP dispatchers; deepep (Megatron-Core's, plans.execution) only when asked for."""
    overlap: tuple[Overlap, ...] = DEFAULT_OVERLAPS
    recompute: tuple[Recompute, ...] = tuple(Recompute)
    recompute_modules: tuple[tuple[RecomputeModule, ...], ...] | None = None
    """The module sets selective recomputation is searched with; None: the target's
    (SEARCHED_MODULES)."""
    schedules: tuple[PipelineSchedule, ...] = tuple(PipelineSchedule)
    grad_sync: tuple[Precision, ...] = tuple(Precision)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_vpp: int = 4
    attention_degrees: tuple[int, ...] | None = None
    """Allowed sp/tp/cp degrees; None = every divisor of the NVLink domain."""
    expert_parallel_degrees: tuple[int, ...] | None = None
    """Allowed ep degrees for an EP FFN; None = every one ``ep_degrees`` gives."""
    expert_tp_degrees: tuple[int, ...] | None = None
    """Allowed etp degrees (1: whole experts, an EP FFN); None = any: for a TP FFN every
    divisor of the NVLink domain above 1."""
    pp: tuple[int, ...] | None = None
    """Allowed pipeline degrees; None = any that fits."""
    vpp_degrees: tuple[int, ...] | None = None
    """Allowed virtual-stage counts (1: the 1f1b schedule); None = 1 and 2 to max_vpp."""
    sp_degrees: tuple[int, ...] | None = None
    """Allowed Ulysses SP degrees (1: attention is not sequence-parallel); None = any."""
    tp_degrees: tuple[int, ...] | None = None
    """Allowed attention TP degrees (1: no TP attention); None = any."""
    cp_degrees: tuple[int, ...] | None = None
    """Allowed CP degrees (1: no CP); None = any."""
    ep_degrees: tuple[int, ...] | None = None
    """Allowed expert-parallel degrees (1: no EP); None = any dividing the experts."""
    optimizer_sharding: tuple[OptimizerSharding, ...] = (OptimizerSharding.zero1,)
    """Where the optimizer states live; ZeRO-1 alone by default (never slower at the same
    step, leaner), so it is only searched when asked."""
    grad_sync_overlap: bool = True
    """Every plan overlaps its DP gradient sync with the backward."""
    grad_accumulation_fusion: bool = True
    """Every plan fuses gradient accumulation into the weight-gradient GEMMs."""
    kernels: Kernels = Kernels.fused
    """The memory-bound operators every plan runs with: fused regions are never slower at
    the same memory (the cost model prices them at efficiency.fused_elementwise, a prior at
    least ``elementwise``'s until calibrated), so they are not searched, only narrowed."""
    cross_entropy: tuple[CrossEntropy, ...] = tuple(CrossEntropy)
    """Loss kinds a plan may use; the search takes the faster head that fits."""
    target: Target = Target.moeplan
    """The target the plans are for (Plan.target); ``for_target`` narrows the space to it."""

    def for_target(self, target: Target, backend: Backend = Backend.cuda_nccl) -> SearchSpace:
        """This space narrowed to what ``target`` executes as written (moeplan: on
        ``backend``; the capability table, plans.execution), its plans for that target, so
        every prediction is for the run the target will make (the search also skips plans
        breaking the target's rules across fields); SpecError naming the option when nothing
        is left of one."""
        who = TARGET_NAMES[target]
        kept: dict[str, tuple] = {}
        for option, field in RUNNABLE_FIELDS.items():
            values = tuple(v for v in getattr(self, option)
                           if executes(field, v, backend, target))
            if not values:
                undo = "drop --runnable" if target == Target.moeplan else "use another --target"
                raise SpecError(f"--{option.replace('_', '-')}: {who} runs none of "
                                f"{', '.join(map(str, getattr(self, option)))} as written "
                                f"(plans.execution: {field}); {undo} or allow others")
            kept[option] = values
        sync_overlap = self.grad_sync_overlap and executes("grad_sync_overlap", True, backend,
                                                           target)
        fusion = self.grad_accumulation_fusion and executes("grad_accumulation_fusion", True,
                                                            backend, target)
        if not executes("kernels", self.kernels, backend, target):
            other = next(k for k in Kernels if executes("kernels", k, backend, target))
            raise SpecError(f"--kernels: {who} does not run {self.kernels} kernels as written "
                            f"(plans.execution: kernels); use --kernels {other}")
        return replace(self, **kept, grad_sync_overlap=sync_overlap,
                       grad_accumulation_fusion=fusion, target=target)

    def runnable(self, backend: Backend = Backend.cuda_nccl) -> SearchSpace:
        """This space narrowed to what moeplan's runtime executes as written on ``backend``:
        ``for_target(Target.moeplan, backend)``, every prediction for the run `moeplan
        train` will make."""
        return self.for_target(Target.moeplan, backend)

    def layouts(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec
                ) -> Iterator[Layout]:
        domain = cluster.nvlink_domain
        for n in _divisors(domain):
            if self.attention_degrees is not None and n not in self.attention_degrees:
                continue
            for kind in self._attention_kinds(n):
                for pp in _divisors(cluster.gpus // n):
                    if pp > model.layers or (self.pp is not None and pp not in self.pp):
                        continue
                    dp = cluster.gpus // (n * pp)
                    yield from self._ffn_layouts(kind, n, pp, dp, model, training, domain)

    def admits(self, d: Degrees) -> bool:
        """Whether every degree of ``d`` is one its axis allows."""
        pins = ((self.pp, d.pp), (self.vpp_degrees, d.vpp), (self.sp_degrees, d.sp),
                (self.tp_degrees, d.tp), (self.cp_degrees, d.cp), (self.ep_degrees, d.ep),
                (self.expert_tp_degrees, d.etp))
        return all(allowed is None or degree in allowed for allowed, degree in pins)

    def _attention_kinds(self, n: int) -> tuple[AttentionKind, ...]:
        # with a group of one, every kind is the same plan: keep one
        if n == 1:
            return self.attention[:1]
        return self.attention

    def _ffn_layouts(self, kind: AttentionKind, n: int, pp: int, dp: int, model: ModelSpec,
                     training: TrainingSpec, domain: int) -> Iterator[Layout]:
        axes = {AttentionKind.ulysses_sp: "sp", AttentionKind.tp: "tp", AttentionKind.cp: "cp"}
        attn = {axes[kind]: n}
        inner = dp * n
        for ffn in self.ffn:
            if ffn == FFNKind.ep:
                groups = [e for e in ep_degrees(model.experts, inner, domain)
                          if self.expert_parallel_degrees is None
                          or e in self.expert_parallel_degrees]
                degree_sets = [dict(ep=e) for e in groups]
            else:
                allowed = [t for t in (self.expert_tp_degrees or _divisors(domain)) if t > 1]
                groups = [t for t in _divisors(domain)
                          if inner % t == 0 and t > 1 and t in allowed]
                degree_sets = [dict(etp=t) for t in groups]
            for ffn_degrees in degree_sets:
                for mbs in self.micro_batch_sizes:
                    if training.global_batch % (dp * mbs):
                        continue
                    micro_batches = training.global_batch // (dp * mbs)
                    for schedule, vpp in self._schedules(pp, micro_batches, model):
                        degrees = Degrees(pp=pp, vpp=vpp, dp=dp, **attn, **ffn_degrees)
                        if not self.admits(degrees):
                            continue
                        for sharding in self.optimizer_sharding:
                            yield Layout(degrees, kind, ffn, mbs, schedule, sharding)

    def _schedules(self, pp: int, micro_batches: int, model: ModelSpec
                   ) -> Iterator[tuple[PipelineSchedule, int]]:
        """The schedules and vpp whose chunks the model's layers can fill (staging)."""
        def fits(vpp: int) -> bool:
            return least_layers(pp, vpp, model.dense_layers) <= model.layers

        if PipelineSchedule.one_f_one_b in self.schedules and fits(1):
            yield PipelineSchedule.one_f_one_b, 1
        if PipelineSchedule.interleaved_1f1b in self.schedules and pp > 1:
            if micro_batches % pp == 0:
                for vpp in range(2, self.max_vpp + 1):
                    if fits(vpp):
                        yield PipelineSchedule.interleaved_1f1b, vpp

    def options(self, layout: Layout, training: TrainingSpec) -> tuple[Option, ...]:
        """The layout's options, in enumeration order (one tuple for the layouts that share
        them)."""
        return _options(self, layout.ffn == FFNKind.ep and layout.degrees.ep > 1,
                        training.precision == Precision.fp8)

    def layout_part(self) -> SearchSpace:
        """This space with the choices that its layouts do not depend on (a layout's options,
        the fields every plan of the space sets) at their defaults: spaces that differ only
        there list the same layouts."""
        return replace(self, **{f: _DEFAULTS[f] for f in _NOT_OF_LAYOUTS})


_NOT_OF_LAYOUTS = ("dispatch", "overlap", "recompute", "recompute_modules", "grad_sync",
                   "grad_sync_overlap",
                   "grad_accumulation_fusion", "kernels", "cross_entropy", "target")
"""The SearchSpace fields SearchSpace.layouts does not read."""
_DEFAULTS = {f: getattr(SearchSpace(), f) for f in _NOT_OF_LAYOUTS}


@cache
def _options(space: SearchSpace, dispatched: bool, fp8: bool) -> tuple[Option, ...]:
    """SearchSpace.options for a layout whose EP group dispatches (``dispatched``), under
    fp8 training or not."""
    dispatches: tuple[Dispatch | None, ...] = space.dispatch if dispatched else (None,)
    syncs = tuple(p for p in space.grad_sync if p != Precision.fp8 or fp8)
    selective = space.recompute_modules or SEARCHED_MODULES[space.target]
    return tuple((dispatch, overlap, recompute, sync, modules) for dispatch in dispatches
                 for overlap in space.overlap for recompute in space.recompute
                 for modules in (selective if recompute == Recompute.selective
                                 else (DEFAULT_MODULES,))
                 for sync in syncs)


@cache
def attention_strategy(kind: AttentionKind):
    """The attention strategy of ``kind`` (one immutable instance per kind)."""
    return {AttentionKind.ulysses_sp: UlyssesAttention(), AttentionKind.tp: TPAttention(),
            AttentionKind.cp: CPAttention()}[kind]


@cache
def ffn_strategy(kind: FFNKind, dispatch: Dispatch | None):
    """The FFN strategy of ``kind`` under ``dispatch`` (one immutable instance per pair)."""
    return EPFFN(dispatch=dispatch or Dispatch.all_to_all) if kind == FFNKind.ep else TPFFN()

