"""Pipeline parallelism: stage pruning from ``stage_layers`` and the schedules as action lists.

A schedule is a list of actions per stage (forward or backward of one model chunk on one
micro-batch), and one interpreter (``ActionSchedule``) runs any such list. ``stage_actions``
generates Megatron-LM's orders (Narayanan et al., SC'21): model chunk c of pp x vpp lives on
stage c mod pp (plans.layout); 1F1B is the vpp = 1 case (pp - stage - 1 warm-up forwards, then
one forward and one backward alternately, then the remaining backwards), interleaved 1F1B the
vpp >= 2 case (Sec. 2.2). Every rank derives the same lock-step timeline of all stages
(``timeline``), so each send has its receive in the same tick's batched isend/irecv on the
peer (no send/send deadlock on NCCL or gloo). Activations and their gradients travel in the
parameter dtype (Megatron's pipeline dtype). docs/architecture.md says why this runs on our own
interpreter rather than torch.distributed.pipelining's schedules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plans.layout import chunks_of_stage, stage_of_chunk
from runtime.metrics import Component, Timers
from runtime.model import Transformer
from runtime.parallel.mesh import Mesh


def stage_layer_ids(stage_layers: Sequence[int], stage: int) -> range:
    start = sum(stage_layers[:stage])
    return range(start, start + stage_layers[stage])


def apply_pipeline(model: Transformer, mesh: Mesh, stage_layers: Sequence[int]) -> None:
    """Keep the layers of this stage's chunks (chunk c on stage c mod pp); the embedding stays
    on the first stage (chunk 0), final norm and LM head on the last (chunk pp x vpp - 1)."""
    keep = {
        str(i)
        for c in chunks_of_stage(mesh.stage, mesh.degrees)
        for i in stage_layer_ids(stage_layers, c)
    }
    for lid in list(model.layers.keys()):
        if lid not in keep:
            del model.layers[lid]
    if not mesh.first_stage:
        model.tok_embeddings = None
    if not mesh.last_stage:
        model.norm = None
        model.output = None


@dataclass
class MicroBatch:
    inputs: torch.Tensor
    """[mbs, s_local] token ids of this rank's sequence shard."""
    labels: torch.Tensor


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---- actions and their timeline ----------------------------------------------------------------


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


class ActionSchedule:
    """Runs this stage's actions of one step (``timeline``: 1F1B or interleaved 1F1B) and
    returns the summed (already scaled) loss on the last stage, 0 elsewhere. Forward and
    backward compute and the waits of the point-to-point exchanges are timed
    (Component.forward, backward, pipeline_comm)."""

    def __init__(
        self,
        model: Transformer,
        mesh: Mesh,
        loss_fn: LossFn,
        activation_shape: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        stage_layers: Sequence[int],
        num_micro_batches: int,
        timers: Timers | None = None,
    ):
        self.model, self.mesh, self.loss_fn = model, mesh, loss_fn
        self.shape, self.device, self.dtype = activation_shape, device, dtype
        self.timers = timers
        self.stage_layers = tuple(stage_layers)
        d = mesh.degrees
        self.chunks = d.pp * d.vpp
        self.ticks = timeline(d.pp, d.vpp, num_micro_batches)

    def _peer(self, stage: int) -> int:
        return self.mesh.stage_peer(stage - self.mesh.stage)

    def _exchange(
        self, messages: list[Message], outgoing: torch.Tensor | None, inbox: dict
    ) -> None:
        me = self.mesh.stage
        ops = []
        for msg in messages:
            if msg.src == me and msg.dst == me:
                inbox[msg.key] = outgoing
            elif msg.src == me:
                ops.append(dist.P2POp(dist.isend, outgoing.contiguous(), self._peer(msg.dst)))
            elif msg.dst == me:
                buf = torch.empty(self.shape, device=self.device, dtype=self.dtype)
                inbox[msg.key] = buf
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(msg.src)))
        if not ops:
            return
        if self.timers is not None:
            self.timers.start(Component.pipeline_comm)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if self.timers is not None:
            self.timers.stop(Component.pipeline_comm)

    def _region(self, c: Component):
        return self.timers.region(c) if self.timers is not None else contextlib.nullcontext()

    def run(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        me = self.mesh.stage
        last = self.chunks - 1
        total = torch.zeros((), device=self.device)
        inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for actions, messages in self.ticks:
            a = actions.get(me)
            outgoing = None
            if a is not None and a.forward:
                mb = micro_batches[a.micro]
                inp = mb.inputs if a.chunk == 0 else inbox.pop(("act", a.chunk - 1, a.micro))
                if a.chunk > 0:
                    inp.requires_grad_()
                with self._region(Component.forward):
                    out = self.model.forward_chunk(
                        inp, stage_layer_ids(self.stage_layers, a.chunk),
                        embed=a.chunk == 0, head=a.chunk == last,
                    )
                    if a.chunk == last:
                        out = self.loss_fn(out, mb.labels)
                stash[(a.chunk, a.micro)] = (inp, out)
                if a.chunk == last:
                    total = total + out.detach()
                else:
                    outgoing = out.detach()
            elif a is not None:
                inp, out = stash.pop((a.chunk, a.micro))
                grad = None if a.chunk == last else inbox.pop(("grad", a.chunk + 1, a.micro))
                with self._region(Component.backward):
                    torch.autograd.backward(out, grad_tensors=grad)
                outgoing = inp.grad if a.chunk > 0 else None
            self._exchange(messages, outgoing, inbox)
        return total
