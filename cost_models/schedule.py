"""Two-stream list scheduler for one layer's operator DAG.

Tasks run on the compute stream, the communication stream, or both at once (a *blocking*
task: communication that compute may not run beside). Each step starts the ready task that can
start earliest once its predecessors are done and its streams are free; ties go to a task marked
``first``, then to the task with the longest remaining path (bottom level, the classic
list-scheduling priority), then to program order, so a collective on the critical path starts
before a weight-gradient GEMM that can hide it.
Exposed communication is the time a communication task runs while no compute task does.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class Stream(StrEnum):
    compute = "compute"
    comm = "comm"


class Task(NamedTuple):
    name: str
    """The operator this task belongs to (several tasks may share one)."""
    duration_s: float
    streams: frozenset[Stream]
    preds: tuple[int, ...]
    """Indices of tasks that must finish first (all earlier in the list)."""
    comm_kind: str | None = None
    """Set on communication tasks: the kind their exposed time is reported under."""
    first: bool = False
    """Wins a tie on start time against tasks without it: a collective issued on its own
    stream starts beside the compute issued with it rather than after it."""


@dataclass(frozen=True)
class Schedule:
    makespan_s: float
    start_s: tuple[float, ...]
    exposed_s: tuple[float, ...]
    """Per task: for communication, the time no compute ran beside it; 0 for compute."""
    critical_path: tuple[str, ...]


def _uncovered(start: float, end: float, busy: Sequence[tuple[float, float]],
               ends: Sequence[float]) -> float:
    """Length of [start, end) not covered by the disjoint sorted intervals ``busy`` (``ends``:
    their ends, sorted with them)."""
    covered = 0.0
    for i in range(bisect_right(ends, start), len(busy)):
        b0, b1 = busy[i]
        if b0 >= end:
            break
        covered += min(end, b1) - max(start, b0)
    return (end - start) - covered


class TaskGraph(NamedTuple):
    """The structure of a list of tasks, without their durations: what list_schedule reads
    of them besides the durations, so that one structure is scheduled at many durations
    (cost_models.layer builds it once per layer pass's structure and overlap policy)."""

    names: tuple[str, ...]
    lanes: tuple[tuple[int, ...], ...]
    """Each task's streams as the scheduler's lanes (_LANES)."""
    preds: tuple[tuple[int, ...], ...]
    successors: tuple[tuple[int, ...], ...]
    comm: tuple[bool, ...]
    """Whether the task is communication (has a comm_kind)."""
    later: tuple[bool, ...]
    """``not first``: the first part of a task's rank."""
    compute_only: bool
    """Every task holds the compute stream."""
    edges: tuple[tuple[int, int], ...]
    """(task, predecessor) from the last task to the first: the bottom levels' order."""
    computing: tuple[int, ...]
    """The tasks on the compute stream alone."""


def task_graph(tasks: Sequence[Task]) -> TaskGraph:
    successors: list[list[int]] = [[] for _ in tasks]
    for i, t in enumerate(tasks):
        for p in t.preds:
            successors[p].append(i)
    lanes = tuple(_LANES[t.streams] for t in tasks)
    return TaskGraph(tuple(t.name for t in tasks), lanes, tuple(t.preds for t in tasks),
                     tuple(map(tuple, successors)),
                     tuple(t.comm_kind is not None for t in tasks),
                     tuple(not t.first for t in tasks),
                     all(lane[0] == 0 for lane in lanes),
                     tuple((i, p) for i in reversed(range(len(tasks))) for p in tasks[i].preds),
                     tuple(i for i, lane in enumerate(lanes) if lane == _COMPUTE_LANE))


def list_schedule(tasks: Sequence[Task]) -> Schedule:
    return schedule(task_graph(tasks), [t.duration_s for t in tasks])


def schedule(graph: TaskGraph, durations: Sequence[float]) -> Schedule:
    """The list schedule of ``graph``'s tasks at ``durations`` (the module's rule)."""
    n = len(durations)
    lanes, preds, successors = graph.lanes, graph.preds, graph.successors
    start = [0.0] * n
    finish = [0.0] * n
    cause: list[int | None] = [None] * n
    free = [0.0] * len(Stream)
    last_on: list[int | None] = [None] * len(Stream)
    waiting = [len(p) for p in preds]
    level = list(durations)  # the longest path from each task's start to the graph's end
    for i, p in graph.edges:
        if durations[p] + level[i] > level[p]:
            level[p] = durations[p] + level[i]
    # among tasks that can start at the same time: first, then the longest remaining path,
    # then program order (the least key)
    rank = [(later, -lv, i) for i, (later, lv) in enumerate(zip(graph.later, level, strict=True))]
    # once a task is ready its predecessors are done: when the last of them finished, and which
    after = [0.0] * n
    after_cause: list[int | None] = [None] * n
    ready = [i for i in range(n) if not waiting[i]]

    if graph.compute_only:
        # every task holds the compute stream: they run back to back, each ready task could
        # start when the last one ends, so the rank alone picks the next
        heap = [rank[i] for i in ready]
        heapq.heapify(heap)
        ready.clear()
        now, last = 0.0, None
        while heap:
            i = heapq.heappop(heap)[2]
            start[i], cause[i] = now, last if now > after[i] else after_cause[i]
            finish[i] = now = now + durations[i]
            last = i
            for j in successors[i]:  # the successors i was the last wait of
                waiting[j] -= 1
                if not waiting[j]:
                    after[j], after_cause[j] = _last_finished(preds[j], finish)
                    heapq.heappush(heap, rank[j])
    while ready:
        best = best_cause = None
        best_start = 0.0
        for i in ready:
            at, why = after[i], after_cause[i]
            for s in lanes[i]:
                if free[s] > at:
                    at, why = free[s], last_on[s]
            if best is None or at < best_start or (at == best_start and rank[i] < rank[best]):
                best, best_start, best_cause = i, at, why
        start[best] = best_start
        finish[best] = end = best_start + durations[best]
        cause[best] = best_cause
        ready.remove(best)
        for j in successors[best]:  # the successors best was the last wait of
            waiting[j] -= 1
            if not waiting[j]:
                after[j], after_cause[j] = _last_finished(preds[j], finish)
                ready.append(j)
        for s in lanes[best]:
            free[s] = end
            last_on[s] = best
    compute_busy = sorted((start[i], finish[i]) for i in graph.computing)
    busy_ends = [b1 for _, b1 in compute_busy]
    exposed = tuple(
        _uncovered(start[i], finish[i], compute_busy, busy_ends) if comm else 0.0
        for i, comm in enumerate(graph.comm)
    )
    makespan = max(finish, default=0.0)
    return Schedule(makespan, tuple(start), exposed,
                    _critical_path(graph.names, finish, cause))


def _last_finished(preds: Sequence[int], finish: Sequence[float]) -> tuple[float, int | None]:
    """When the last of a ready task's predecessors finished, and which one (the first of
    equals; 0 and None without predecessors)."""
    at, why = 0.0, None
    for p in preds:
        if finish[p] > at:
            at, why = finish[p], p
    return at, why


_COMPUTE_LANE = (0,)
_LANES = {frozenset({Stream.compute}): _COMPUTE_LANE, frozenset({Stream.comm}): (1,),
          frozenset(Stream): (0, 1)}
"""A task's streams as the indices of the scheduler's lanes, the compute stream first."""


def _critical_path(
    names: Sequence[str], finish: Sequence[float], cause: Sequence[int | None]
) -> tuple[str, ...]:
    """Operators on the chain of start-determining tasks ending at the last one to finish."""
    if not names:
        return ()
    i: int | None = max(range(len(names)), key=lambda j: (finish[j], j))
    out: list[str] = []
    while i is not None:
        if not out or out[-1] != names[i]:
            out.append(names[i])
        i = cause[i]
    return tuple(reversed(out))
