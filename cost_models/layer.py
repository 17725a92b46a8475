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
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from types import MappingProxyType

import networkx as nx

from cost_models.layer_graph import LayerKey, Op, OpKind, backward_graph, forward_graph
from cost_models.schedule import Stream, Task, list_schedule
from plans.enums import Target
from plans.layout import moe_chunks, ulysses_chunks
from plans.operators import LAYER_REGIONS, TIMER_OF
from plans.plan import Overlap, Plan, Recompute

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


def layer_key(plan: Plan, dense: bool = False) -> LayerKey:
    d = plan.degrees
    return LayerKey(
        plan.model, plan.cluster, plan.training.seq_len, plan.training.precision,
        plan.micro_batch_size, d.sp, d.tp, d.cp, d.ep, d.etp, plan.attention, plan.ffn,
        plan.recompute, dense, plan.kernels, plan.training.routing_skew, plan.recompute_modules,
    )


def _program(graph: nx.DiGraph) -> list[tuple[str, Op, tuple[str, ...]]]:
    """(name, op, predecessors) in topological order, ties in program order (Kahn's algorithm
    with a heap on the program index; networkx's lexicographical sort, hand-rolled for speed)."""
    nodes = graph.nodes
    preds = {n: tuple(graph.predecessors(n)) for n in graph}
    waiting = {n: len(p) for n, p in preds.items()}
    ready = [(nodes[n]["order"], n) for n, w in waiting.items() if not w]
    heapq.heapify(ready)
    out = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append((n, nodes[n]["op"], preds[n]))
        for s in graph.successors(n):
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(ready, (nodes[s]["order"], s))
    return out


def _tasks(graph: nx.DiGraph, program: list[tuple[str, Op, tuple[str, ...]]], overlap: Overlap,
           hidden_share: float) -> list[tuple[Task, Op]]:
    """Scheduler tasks in topological, then program, order; a collective may become a blocking
    task followed by a communication-stream task."""
    last_task: dict[str, int] = {}
    out: list[tuple[Task, Op]] = []

    def emit(op: Op, duration: float, streams: frozenset, preds: tuple[int, ...]) -> int:
        kind = op.comm.value if op.comm is not None else None
        first = op.side_stream and overlap == Overlap.inter_op
        out.append((Task(op.name, duration, streams, preds, kind, first), op))
        return len(out) - 1

    for name, op, pred_names in program:
        preds = tuple(last_task[p] for p in pred_names)
        if op.kind != OpKind.comm:
            last_task[name] = emit(op, op.duration_s, COMPUTE, preds)
        elif overlap == Overlap.none or (overlap == Overlap.inter_op and not op.side_stream):
            last_task[name] = emit(op, op.duration_s, BOTH, preds)
        elif overlap == Overlap.inter_intra_op and op.fuse_with in graph:
            partner = graph.nodes[op.fuse_with]["op"].duration_s
            exposed = min(op.duration_s,
                          max(0.0, op.duration_s - partner) + op.duration_s * op.fill_fraction)
            last_task[name] = emit(op, exposed, BOTH, preds)
        else:
            blocking = emit(op, (1 - hidden_share) * op.duration_s, BOTH, preds)
            last_task[name] = emit(op, hidden_share * op.duration_s, COMM, (blocking,))
    return out


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
    return _run(graph, _program(graph), overlap, hidden_share).time_s


def _run(graph: nx.DiGraph, program, overlap: Overlap, hidden_share: float) -> _Pass:
    pairs = _tasks(graph, program, overlap, hidden_share)
    sched = list_schedule([t for t, _ in pairs])
    compute = recompute = 0.0
    exposed: dict[str, float] = defaultdict(float)
    for (task, op), hidden_not in zip(pairs, sched.exposed_s, strict=True):
        if task.comm_kind is None:
            if op.recompute:
                recompute += task.duration_s
            else:
                compute += task.duration_s
        elif op.recompute:
            recompute += hidden_not
        else:
            exposed[task.comm_kind] += hidden_not
    return _Pass(sched.makespan_s, compute, recompute, dict(exposed), sched.critical_path)


def _forward_key(key: LayerKey) -> LayerKey:
    """The key of the layer's forward pass: its operators do not depend on the recomputation
    policy (backward_graph adds the reruns), so every policy shares one."""
    return key if key.recompute == Recompute.none else replace(key, recompute=Recompute.none)


@lru_cache(maxsize=4096)
def _forward_graph(key: LayerKey, overlap: Overlap) -> nx.DiGraph:
    """The forward graph of ``layer_graphs`` (``key`` from _forward_key)."""
    return forward_graph(key, moe_chunks(overlap, key.ffn, key.ep),
                         ulysses_chunks(overlap, key.attention, key.model, key.sp))


@lru_cache(maxsize=4096)
def layer_graphs(key: LayerKey, overlap: Overlap) -> tuple[nx.DiGraph, nx.DiGraph]:
    """Forward and backward graphs of the layer as ``overlap`` runs it: inter_op chunks the
    MoE part as the runtime does and runs gradients as autograd nodes."""
    inter = overlap == Overlap.inter_op
    fwd = _forward_graph(_forward_key(key), overlap)
    return fwd, backward_graph(fwd, key.recompute, autograd_nodes=inter,
                               modules=key.recompute_modules)


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
        graph = (layer_graphs(key, runs)[1] if backward
                 else _forward_graph(_forward_key(key), runs))
        program = _program(graph)
        # with no overlap everything runs back to back: its makespan is the sum of the
        # durations, known without scheduling; schedule it only if it could win
        if best is not None and policy == Overlap.none and sum(
                op.duration_s for _, op, _ in program) >= best.time_s:
            continue
        candidate = _run(graph, program, policy, hidden_share)
        if best is None or candidate.time_s < best.time_s:
            best = candidate
    return best


def _region_s(fwd: nx.DiGraph, bwd: nx.DiGraph) -> dict[str, float]:
    out = dict.fromkeys((k for c in LAYER_REGIONS for k in (c.value, f"{c.value}_bwd")), 0.0)
    for graph, backward in ((fwd, False), (bwd, True)):
        for _, op in graph.nodes(data="op"):
            region = TIMER_OF[op.operator]
            if region in LAYER_REGIONS:
                key = f"{region.value}_bwd" if backward and not op.recompute else region.value
                out[key] += op.duration_s
    return out


@lru_cache(maxsize=4096)
def _forward_pass(key: LayerKey, overlap: Overlap) -> _Pass:
    """The forward schedule of ``layer_timing_for`` (``key`` from _forward_key)."""
    return _best(key, overlap, backward=False)


@lru_cache(maxsize=4096)
def layer_timing_for(key: LayerKey, overlap: Overlap) -> LayerTiming:
    """Schedule the layer's graphs (built once per key and policy; the forward pass once for
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
        region_s=MappingProxyType(_region_s(*layer_graphs(key, overlap))),
    )


def layer_timing(plan: Plan, dense: bool = False) -> LayerTiming:
    """One MoE layer (or, with ``dense``, one dense-FFN layer) under ``plan``, as its target
    runs it (cost_models.megatron for Megatron-Core)."""
    if plan.target == Target.megatron:
        from cost_models import megatron  # it builds on this module

        return megatron.layer_timing(plan, dense)
    return layer_timing_for(layer_key(plan, dense), plan.overlap)
