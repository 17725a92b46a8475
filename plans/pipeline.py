"""The pipeline schedules as action lists (torch-free): what the runtime's interpreter
(runtime.parallel.pipeline.ActionSchedule) runs and the memory model's in-flight micro-batches
(cost_models.memory) count.

A schedule is a list of actions per stage (forward or backward of one model chunk on one
micro-batch). ``stage_actions`` generates Megatron-LM's orders (Narayanan et al., SC'21): model
chunk c of pp x vpp lives on stage c mod pp (plans.layout); 1F1B is the vpp = 1 case (pp -
stage - 1 warm-up forwards, then one forward and one backward alternately, then the remaining
backwards), interleaved 1F1B the vpp >= 2 case (Sec. 2.2). Every rank derives the same
lock-step timeline of all stages (``timeline``), so each send has its receive in the same
tick's batched isend/irecv on the peer (no send/send deadlock on NCCL or gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

from plans.layout import stage_of_chunk


@dataclass(frozen=True)
class Action:
    forward: bool
    chunk: int
    """Global model chunk (0 .. pp x vpp - 1)."""
    micro: int


@dataclass(frozen=True)
class Message:
    src: int
    """Source stage."""
    dst: int
    key: tuple[str, int, int]
    """("act", producing chunk, micro-batch) or ("grad", producing chunk, micro-batch)."""


def stage_actions(pp: int, vpp: int, m: int, stage: int) -> list[Action]:
    """Megatron-LM's order of one stage (megatron/core/pipeline_parallel/schedules.py):
    virtual micro-batch k runs local chunk (k mod pp x vpp) // pp (reversed for backward) on
    micro-batch (k // (pp x vpp)) x pp + k mod pp. Warm-up forwards: min(pp - stage - 1, M)
    for 1F1B (vpp = 1); (pp - stage - 1) x 2 + (vpp - 1) x pp for interleaved 1F1B (all of
    them when M = pp), then one forward and one backward alternately, then the remaining
    backwards. Interleaving needs M to be a multiple of pp (checked by the plan)."""
    total, group = m * vpp, pp * vpp

    def action(k: int, forward: bool) -> Action:
        local = (k % group) // pp
        if not forward:
            local = vpp - 1 - local
        return Action(forward, local * pp + stage, (k // group) * pp + k % pp)

    if vpp == 1:
        warmup = min(pp - stage - 1, m)
    else:
        warmup = total if m == pp else min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    order = [action(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(warmup + k, True), action(k, False)]
    order += [action(k, False) for k in range(total - warmup, total)]
    return order


def timeline(pp: int, vpp: int, m: int) -> list[tuple[dict[int, Action], list[Message]]]:
    """Lock-step timeline of every stage's actions: in each tick every stage runs its next
    action if the input it needs arrived in an earlier tick, then the tick's messages are
    exchanged. Every rank derives the same timeline, so each send has its receive in the same
    tick's batch on the peer (no send/send deadlock on NCCL or gloo)."""
    chunks = pp * vpp
    orders = [stage_actions(pp, vpp, m, s) for s in range(pp)]
    pos = [0] * pp
    have: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]
    ticks: list[tuple[dict[int, Action], list[Message]]] = []
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        actions: dict[int, Action] = {}
        for s in range(pp):
            if pos[s] == len(orders[s]):
                continue
            a = orders[s][pos[s]]
            need = (
                ("act", a.chunk - 1, a.micro) if a.forward and a.chunk > 0
                else ("grad", a.chunk + 1, a.micro) if not a.forward and a.chunk < chunks - 1
                else None
            )
            if need is None or need in have[s]:
                actions[s] = a
                pos[s] += 1
        if not actions:
            raise RuntimeError(f"pipeline order stalls at positions {pos}")
        messages = []
        for s, a in actions.items():
            if a.forward and a.chunk < chunks - 1:
                messages.append(Message(s, stage_of_chunk(a.chunk + 1, pp),
                                        ("act", a.chunk, a.micro)))
            elif not a.forward and a.chunk > 0:
                messages.append(Message(s, stage_of_chunk(a.chunk - 1, pp),
                                        ("grad", a.chunk, a.micro)))
        for msg in messages:
            have[msg.dst].add(msg.key)
        ticks.append((actions, messages))
    return ticks


def peak_in_flight_chunks(pp: int, vpp: int, m: int, stage: int) -> int:
    """The most model-chunk forwards ``stage`` holds whose backward has not run yet, over its
    action list (stage_actions): the activations it keeps at its peak, in chunks (each 1 / vpp
    of the stage). The warm-up forwards, and one more if a forward-backward pair follows
    them; every chunk forward when the warm-up takes them all."""
    total = m * vpp
    if vpp == 1:
        warmup = pp - stage - 1
    elif m == pp:
        return total
    else:
        warmup = (pp - stage - 1) * 2 + (vpp - 1) * pp
    return min(warmup + 1, total)
