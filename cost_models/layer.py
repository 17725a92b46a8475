"""One transformer layer's forward and backward time under a plan's overlap policy.

Communication is scheduled by ``plan.overlap`` (paper Sec. 4):
- none: every collective blocks compute (serial execution).
- inter_op: as runtime.parallel.overlap executes it: an EP layer's dispatch and combine run in
  ``plans.layout.moe_chunks`` token chunks on the communication stream beside independent
  compute (the other chunk's expert GEMMs, the shared experts), and Ulysses attention's
  all-to-alls in ``plans.layout.ulysses_chunks`` head groups beside the other group's core
  (runtime.parallel.attention); a share ``1 - efficiency.overlap`` of each still blocks
  compute (launch, synchronisation, contention). Gradients run as autograd nodes (a GEMM's
  data and weight gradients together). Every other collective (TP attention, expert TP)
  blocks.
- inter_intra_op: collectives fused with their GEMM at tile level expose only
  max(0, comm - gemm) plus the fill of one 128-row tile chunk (the paper's hand-scheduled
  layer, unchunked; not executed by this runtime, which runs it as inter_op).
A greedy list schedule can lose to a less overlapped one (Graham's scheduling anomalies: a
weight-gradient GEMM started early delays the critical path); a hand-scheduled layer (paper
Sec. 4.1) would not, so each pass keeps the fastest schedule of the policies up to its own.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import IntEnum
from functools import cached_property, lru_cache, partial
from types import MappingProxyType
from typing import NamedTuple

import networkx as nx

from cost_models.layer_graph import (
    Entries,
    LayerKey,
    OpKind,
    backward_entries,
    backward_steps,
    entries_of,
    experts_rule,
    forward_entries,
    graph_of,
    priced_on,
    waits_on_host,
)
from cost_models.params import pinned_expert_gemm
from cost_models.schedule import Stream, Task, TaskGraph, schedule, task_graph
from plans.enums import ExpertGemm, Target
from plans.layout import moe_chunks, tokens_per_rank, ulysses_chunks
from plans.operators import DEFAULT_MODULES, LAYER_REGIONS, TIMER_OF, LayerOperator
from plans.plan import EPFFN, Degrees, Overlap, Plan, Recompute, RecomputeModule
from plans.specs import ClusterSpec, NetworkSpec

BOTH = frozenset(Stream)
COMPUTE = frozenset({Stream.compute})
COMM = frozenset({Stream.comm})


@dataclass(frozen=True)
class LayerTiming:
    """Seconds of one layer for one micro-batch.

    fwd_s + bwd_s = compute_s + recompute_s + sum(exposed_comm_s.values())."""

    fwd_s: float
    bwd_s: float
    compute_s: float
    """Compute-stream time of forward and backward operators (reruns excluded)."""
    recompute_s: float
    """Compute time of recomputed operators plus the exposed time of recomputed collectives."""
    exposed_comm_s: Mapping[str, float]
    """Communication time no compute hid, by CommKind value (backward under the forward kind)."""
    critical_path: tuple[str, ...]
    """Operators on the critical path, forward then backward."""
    region_s: Mapping[str, float]
    """Operator seconds per layer region the runtime times (``plans.LAYER_REGIONS``, the
    operators ``plans.TIMER_OF`` puts in each), run back to back: forward under the
    component's name, backward under ``<component>_bwd``; reruns of recomputed operators
    count in the forward one (as the runtime's timers count them)."""

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


def layer_cluster(cluster: ClusterSpec, degrees: Degrees, dense: bool = False) -> ClusterSpec:
    """The part of ``cluster`` a layer's operators read: never the job's GPU count (set to one
    NVLink domain), and the scale-out network only where one of the layer's groups spans
    NVLink domains (its attention axes sp x tp x cp or, in an MoE layer, its expert axes
    ep x etp, innermost in the rank order: comm.group_layout); inside one, every collective
    moves over NVLink alone. Layers that differ only there share their graphs and schedules
    (a what-if over the network, a scaling study over GPU counts)."""
    d = degrees
    experts = 1 if dense else d.ep * d.etp
    return _projected(cluster, max(d.sp * d.tp * d.cp, experts) <= cluster.node.gpus_per_node)


@lru_cache(maxsize=256)
def _projected(cluster: ClusterSpec, in_one_domain: bool) -> ClusterSpec:
    """layer_cluster's projection: one object per cluster and case, so the layer caches find
    their keys' hashes kept, and one object for equal projections of different clusters (a
    what-if grid's points of one NVLink bandwidth), so their keys match by identity, not by
    comparing every nested spec."""
    update: dict = {"gpus": cluster.node.gpus_per_node}
    if in_one_domain:
        update["network"] = _NO_NETWORK
    return _one_of(cluster.model_copy(update=update))


@lru_cache(maxsize=256)
def _one_of(cluster: ClusterSpec) -> ClusterSpec:
    """The first of the equal clusters asked for."""
    return cluster


_NO_NETWORK = NetworkSpec(name="read by no layer inside one NVLink domain", nics_per_node=1,
                          nic_gb_s=1.0)


_DENSE_FFN = EPFFN()
"""The FFN strategy in every dense-FFN layer's key (layer_key)."""


def layer_key(plan: Plan, dense: bool = False) -> LayerKey:
    """The key of the plan's layer, on the part of the cluster it reads (layer_cluster). Its
    experts' path is resolved where the target fixes it (Megatron-Core's GroupedLinear:
    grouped) or the rule gives grouped at every chunk count (grouped unchunked: chunks only
    cut the rows per call), so layers that run alike share their graphs and schedules
    whichever target runs them. A dense-FFN layer reads neither the expert axes nor the FFN
    strategy (its FFN is split as attention is): its key holds none of them, so the layouts
    that differ there share it."""
    d, t = plan.degrees, plan.training
    ep, etp, ffn = (1, 1, _DENSE_FFN) if dense else (d.ep, d.etp, plan.ffn)
    gemm = None if dense else pinned_expert_gemm(plan)
    if gemm is None and not dense and experts_rule(
            plan.model, tokens_per_rank(plan.micro_batch_size, t.seq_len, d.sp * d.cp * d.tp),
            ffn, ep, etp, 1) == ExpertGemm.grouped:
        gemm = ExpertGemm.grouped
    return LayerKey(
        plan.model, layer_cluster(plan.cluster, d, dense), t.seq_len, t.precision,
        plan.micro_batch_size, d.sp, d.tp, d.cp, ep, etp, plan.attention, ffn, plan.recompute,
        dense, plan.kernels, t.routing_skew, plan.recompute_modules, gemm,
    )


class _Source(IntEnum):
    """Where a scheduler task's duration comes from (_Tasks)."""

    whole = 0
    """Its operator's duration."""
    blocking = 1
    """The share of an overlappable collective no compute hides, ``1 - hidden_share``."""
    hidden = 2
    """The rest of it, on the communication stream."""
    fused = 3
    """A collective fused with its GEMM at tile level: what the GEMM does not cover."""


class _Tasks(NamedTuple):
    """A pass's scheduler tasks under one overlap policy, without their durations (_tasks)."""

    graph: TaskGraph
    sources: tuple[tuple[int, _Source, int], ...]
    """Per task: its entry, where its duration comes from, the fused GEMM's entry (or -1)."""
    kinds: tuple[str | None, ...]
    """Per task: the CommKind value of a communication task."""
    recompute: tuple[bool, ...]
    """Per task: whether its operator is a rerun."""


_OpShape = tuple[str, tuple[str, ...], LayerOperator, OpKind, bool, bool, str | None,
                 str | None]
"""What a pass's scheduling and report read of an entry besides its durations: its name,
its predecessors' names, its operator and kind, whether it is a side-stream collective, a
rerun, its CommKind value and its fused GEMM."""


@dataclass(frozen=True, eq=False)
class _Structure:
    """A pass's structure: what scheduling it reads besides its operators' durations, the
    same for every layer of one layout shape, cluster and batch size alike (_structure). A
    value: equal to another of the same shape, hashed once."""

    shape: tuple[_OpShape, ...]
    digest: int
    """hash(shape)."""
    order: tuple[int, ...]
    """The entries in topological order, ties in program order."""
    preds: tuple[tuple[int, ...], ...]
    """Each entry's predecessors, by index."""
    tasks: Mapping[Overlap, _Tasks]
    """Its scheduler tasks under each overlap policy."""
    regions: tuple[tuple[int, str, str], ...]
    """The entries the runtime times (plans.TIMER_OF, plans.LAYER_REGIONS), in the node order
    of their networkx graph (layer_graph.graph_of: a node first named as a predecessor comes
    at that point): each with its region's name in a forward pass and in a backward one."""

    def __hash__(self) -> int:
        return self.digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Structure) and self.shape == other.shape


@dataclass(frozen=True, eq=False)
class _Compiled:
    """A pass: its structure, its operators' durations and its entries
    (cost_models.layer_graph), built when first read (a report's graphs)."""

    structure: _Structure
    durations: tuple[float, ...]
    """Each entry's operator's duration."""
    build: Callable[[], Entries]

    @cached_property
    def entries(self) -> Entries:
        return self.build()


@lru_cache(maxsize=4096)
def _structure(shape: tuple[_OpShape, ...]) -> _Structure:
    """The order, predecessors, tasks and regions of a pass, from each entry's shape (Kahn's
    algorithm with a heap on the program index)."""
    index = {n: i for i, (n, *_) in enumerate(shape)}
    preds = tuple(tuple(index[a] for a in after) for _, after, *_ in shape)
    succs: list[list[int]] = [[] for _ in shape]
    for i, p in enumerate(preds):
        for j in p:
            succs[j].append(i)
    waiting = [len(p) for p in preds]
    ready = [i for i, w in enumerate(waiting) if not w]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succs[i]:
            waiting[j] -= 1
            if not waiting[j]:
                heapq.heappush(ready, j)
    seen: dict[int, None] = {}
    for i, p in enumerate(preds):
        seen.setdefault(i)
        for j in p:
            seen.setdefault(j)
    regions = []
    for i in seen:
        _, _, operator, _, _, rerun, _, _ = shape[i]
        region = TIMER_OF[operator]
        if region in LAYER_REGIONS:
            regions.append((i, region.value, region.value if rerun else f"{region.value}_bwd"))
    order = tuple(order)
    tasks = {o: _tasks(shape, index, order, preds, o) for o in Overlap}
    return _Structure(shape, hash(shape), order, preds, MappingProxyType(tasks), tuple(regions))


def _tasks(shape: tuple[_OpShape, ...], index: Mapping[str, int], order: tuple[int, ...],
           preds: tuple[tuple[int, ...], ...], overlap: Overlap) -> _Tasks:
    """Scheduler tasks in topological, then program, order; a collective may become a blocking
    task followed by a communication-stream task."""
    last_task: dict[int, int] = {}
    out: list[Task] = []
    sources: list[tuple[int, _Source, int]] = []
    recompute: list[bool] = []

    def emit(i: int, source: _Source, streams: frozenset, after: tuple[int, ...],
             partner: int = -1) -> int:
        name, _, _, _, side, rerun, kind, _ = shape[i]
        first = side and overlap == Overlap.inter_op
        out.append(Task(name, 0.0, streams, after, kind, first))
        sources.append((i, source, partner))
        recompute.append(rerun)
        return len(out) - 1

    for i in order:
        _, _, _, kind, side, _, _, fuse_with = shape[i]
        after = tuple(last_task[j] for j in preds[i])
        if kind != OpKind.comm:
            last_task[i] = emit(i, _Source.whole, COMPUTE, after)
        elif overlap == Overlap.none or (overlap == Overlap.inter_op and not side):
            last_task[i] = emit(i, _Source.whole, BOTH, after)
        elif overlap == Overlap.inter_intra_op and fuse_with in index:
            last_task[i] = emit(i, _Source.fused, BOTH, after, index[fuse_with])
        else:
            blocking = emit(i, _Source.blocking, BOTH, after)
            last_task[i] = emit(i, _Source.hidden, COMM, (blocking,))
    return _Tasks(task_graph(out), tuple(sources), tuple(t.comm_kind for t in out),
                  tuple(recompute))


def _compile(entries: Entries) -> _Compiled:
    shape = tuple((op.name, after, op.operator, op.kind, op.side_stream, op.recompute,
                   op.comm.value if op.comm is not None else None, op.fuse_with)
                  for op, after in entries)
    return _Compiled(_structure(shape), tuple(op.duration_s for op, _ in entries),
                     lambda: entries)


class _Backward(NamedTuple):
    """A backward pass derived from its forward pass's structure (_backward_of)."""

    structure: _Structure
    sources: tuple[tuple[int, int], ...]
    """Per entry: its forward operator's index, which of its durations it takes
    (layer_graph.BackwardStep.duration)."""


@lru_cache(maxsize=4096)
def _backward_of(fwd: _Structure, policy: Recompute, autograd_nodes: bool,
                 modules: tuple[RecomputeModule, ...]) -> _Backward:
    """The structure of layer_graph.backward_entries of a forward pass of structure ``fwd``."""
    steps = backward_steps(tuple((name, operator, kind, fuse_with, after)
                                 for name, after, operator, kind, *_, fuse_with in fwd.shape),
                           policy, autograd_nodes, modules)
    shape = []
    for step in steps:
        _, _, operator, kind, side, _, comm, _ = fwd.shape[step.forward]
        shape.append((step.name, step.after, operator, kind, side, step.rerun, comm,
                      step.fuse_with))
    return _Backward(_structure(tuple(shape)),
                     tuple((step.forward, step.duration) for step in steps))


@dataclass(frozen=True)
class _Pass:
    time_s: float
    compute_s: float
    recompute_s: float
    exposed_s: dict[str, float]
    critical_path: tuple[str, ...]


def schedule_s(graph: nx.DiGraph, overlap: Overlap, hidden_share: float) -> float:
    """The two-stream makespan of ``graph`` (a layer's pass, or the operators of a part of it)
    under ``overlap``, a share ``hidden_share`` of each overlappable collective hidden."""
    return _run(_compile(entries_of(graph)), overlap, hidden_share).time_s


def _run(p: _Compiled, overlap: Overlap, hidden_share: float) -> _Pass:
    tasks = p.structure.tasks[overlap]
    d, blocking = p.durations, 1 - hidden_share
    durations = []
    for i, source, partner in tasks.sources:
        match source:
            case _Source.whole:
                durations.append(d[i])
            case _Source.blocking:
                durations.append(blocking * d[i])
            case _Source.hidden:
                durations.append(hidden_share * d[i])
            case _:
                durations.append(min(d[i], max(0.0, d[i] - d[partner])
                                     + d[i] * p.entries[i][0].fill_fraction))
    sched = schedule(tasks.graph, durations)
    compute = recompute = 0.0
    exposed: dict[str, float] = defaultdict(float)
    for duration, kind, rerun, hidden_not in zip(durations, tasks.kinds, tasks.recompute,
                                                 sched.exposed_s, strict=True):
        if kind is None:
            if rerun:
                recompute += duration
            else:
                compute += duration
        elif rerun:
            recompute += hidden_not
        else:
            exposed[kind] += hidden_not
    return _Pass(sched.makespan_s, compute, recompute, dict(exposed), sched.critical_path)


LAYER_TIMINGS_KEPT = 32768
"""Layer timings and forward schedules kept (a few kilobytes each; the passes' operators,
tens of kilobytes, are kept for 4096 keys): a what-if grid's 25 points of the Internal-352B
job price about 1,000 layer keys each, and the points of one NVLink bandwidth share those
inside one NVLink domain (layer_cluster), which a smaller cache would have dropped before the
next such point."""


def _forward_key(key: LayerKey) -> LayerKey:
    """The key of the layer's forward pass: its operators do not depend on the recomputation
    policy or its modules (backward_entries adds the reruns), so every policy shares one."""
    if key.recompute == Recompute.none and key.recompute_modules == DEFAULT_MODULES:
        return key
    return replace(key, recompute=Recompute.none, recompute_modules=DEFAULT_MODULES)


@lru_cache(maxsize=4096)
def _forward(key: LayerKey, overlap: Overlap) -> _Compiled:
    """The forward pass of ``layer_graphs`` (``key`` from _forward_key): built once on the
    part of the cluster its compute operators read (_compute_part) and its collectives priced
    on the key's cluster (layer_graph.priced_on), unless its host wait reads them."""
    if waits_on_host(key):
        return _built(key, overlap)
    built = _built(replace(key, cluster=_compute_part(key.cluster)), overlap)
    entries = priced_on(built.entries, key.cluster)
    return _Compiled(built.structure, tuple(op.duration_s for op, _ in entries),
                     lambda: entries)


@lru_cache(maxsize=4096)
def _built(key: LayerKey, overlap: Overlap) -> _Compiled:
    """The forward pass of ``key`` built on its cluster."""
    return _compile(forward_entries(key, moe_chunks(overlap, key.ffn, key.ep),
                                    ulysses_chunks(overlap, key.attention, key.model, key.sp)))


@lru_cache(maxsize=256)
def _compute_part(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` without its bandwidths (NVLink and network), which only the collectives
    read: the clusters that differ there share one object, so layers that differ only there
    share their forward passes' compute operators (_forward)."""
    node = cluster.node.model_copy(update={"nvlink_gb_s": 1.0, "nvlink_latency_us": 1.0})
    return _one_of(cluster.model_copy(update={"node": node, "network": _NO_NETWORK}))


@lru_cache(maxsize=4096)
def _backward(key: LayerKey, overlap: Overlap) -> _Compiled:
    """The backward pass of ``layer_graphs``: its structure derived once per forward pass's
    (_backward_of), its durations the forward operators'."""
    fwd = _forward(_forward_key(key), overlap)
    autograd_nodes = overlap == Overlap.inter_op
    derived = _backward_of(fwd.structure, key.recompute, autograd_nodes, key.recompute_modules)
    ops = fwd.entries
    durations = tuple(ops[i][0].duration_s if which == 0 else ops[i][0].bwd[which - 1]
                      for i, which in derived.sources)
    return _Compiled(derived.structure, durations,
                     partial(backward_entries, ops, key.recompute, autograd_nodes,
                             key.recompute_modules))


def layer_graphs(key: LayerKey, overlap: Overlap) -> tuple[nx.DiGraph, nx.DiGraph]:
    """Forward and backward graphs of the layer as ``overlap`` runs it: inter_op chunks the
    MoE part as the runtime does and runs gradients as autograd nodes."""
    return (graph_of(_forward(_forward_key(key), overlap).entries),
            graph_of(_backward(key, overlap).entries))


def _best(key: LayerKey, overlap: Overlap, backward: bool) -> _Pass:
    """The schedule of ``overlap``, or of a weaker policy when that one is faster: a greedy list
    schedule can lose to less overlap (see the module doc), a scheduler that can fall back
    would not. A weaker policy runs its own graph (inter_op its chunked layer), except that
    inter_op falls back to its chunked layer run serially, which is what the runtime would
    do: where chunking costs more than it hides (collective latency, smaller grouped GEMMs),
    inter_op is priced slower than none."""
    hidden_share = key.cluster.efficiency.overlap
    policies = list(Overlap)[: list(Overlap).index(overlap) + 1]
    best = None
    for policy in reversed(policies):
        runs = overlap if policy == Overlap.none else policy
        p = _backward(key, runs) if backward else _forward(_forward_key(key), runs)
        # with no overlap everything runs back to back: its makespan is the sum of the
        # durations, known without scheduling; schedule it only if it could win
        if best is not None and policy == Overlap.none and sum(
                p.durations[i] for i in p.structure.order) >= best.time_s:
            continue
        candidate = _run(p, policy, hidden_share)
        if best is None or candidate.time_s < best.time_s:
            best = candidate
    return best


def _region_s(fwd: _Compiled, bwd: _Compiled) -> dict[str, float]:
    out = dict.fromkeys((k for c in LAYER_REGIONS for k in (c.value, f"{c.value}_bwd")), 0.0)
    for i, region, _ in fwd.structure.regions:
        out[region] += fwd.durations[i]
    for i, _, region in bwd.structure.regions:
        out[region] += bwd.durations[i]
    return out


@lru_cache(maxsize=LAYER_TIMINGS_KEPT)
def _forward_pass(key: LayerKey, overlap: Overlap) -> _Pass:
    """The forward schedule of ``layer_timing_for`` (``key`` from _forward_key)."""
    return _best(key, overlap, backward=False)


@lru_cache(maxsize=LAYER_TIMINGS_KEPT)
def layer_timing_for(key: LayerKey, overlap: Overlap) -> LayerTiming:
    """Schedule the layer's passes (built once per key and policy; the forward pass once for
    every recomputation policy)."""
    fwd = _forward_pass(_forward_key(key), overlap)
    bwd = _best(key, overlap, backward=True)
    exposed = {k: fwd.exposed_s.get(k, 0.0) + bwd.exposed_s.get(k, 0.0)
               for k in sorted({*fwd.exposed_s, *bwd.exposed_s})}
    return LayerTiming(
        fwd_s=fwd.time_s,
        bwd_s=bwd.time_s,
        compute_s=fwd.compute_s + bwd.compute_s,
        recompute_s=fwd.recompute_s + bwd.recompute_s,
        exposed_comm_s=MappingProxyType(exposed),
        critical_path=fwd.critical_path + bwd.critical_path,
        region_s=MappingProxyType(_region_s(_forward(_forward_key(key), overlap),
                                            _backward(key, overlap))),
    )


def layer_timing(plan: Plan, dense: bool = False) -> LayerTiming:
    """One MoE layer (or, with ``dense``, one dense-FFN layer) under ``plan``, as its target
    runs it (cost_models.megatron for Megatron-Core)."""
    if plan.target == Target.megatron:
        from cost_models import megatron  # it builds on this module

        return megatron.layer_timing(plan, dense)
    return layer_timing_for(layer_key(plan, dense), plan.overlap)
