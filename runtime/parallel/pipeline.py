"""Pipeline parallelism: stage pruning from ``stage_layers`` and the 1F1B schedules.

``OneFOneB`` is Megatron-LM's non-interleaved 1F1B (Narayanan et al., SC'21): stage i runs
min(pp - i - 1, M) warm-up forwards, then alternates one forward and one backward, then drains
the remaining backwards. ``InterleavedOneFOneB`` is Megatron-LM's interleaved 1F1B (same paper,
Sec. 2.2): model chunk c of pp x vpp lives on stage c mod pp, and each stage runs its chunks'
forwards and backwards in Megatron's order (``interleaved_order``). Activations and their
gradients move with batched isend/irecv in the parameter dtype (Megatron's pipeline dtype).
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


class OneFOneB:
    """Runs forward and backward of every micro-batch of one step on this stage; returns the
    summed (already scaled) loss on the last stage, 0 elsewhere."""

    def __init__(
        self,
        model: Transformer,
        mesh: Mesh,
        loss_fn: LossFn,
        activation_shape: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        timers: Timers | None = None,
    ):
        self.model, self.mesh, self.loss_fn = model, mesh, loss_fn
        self.shape = activation_shape
        self.device, self.dtype = device, dtype
        self.timers = timers
        self.prev = None if mesh.first_stage else mesh.stage_peer(-1)
        self.next = None if mesh.last_stage else mesh.stage_peer(1)

    # ---- point-to-point ---------------------------------------------------------------------
    def _exchange(
        self, send: list[tuple[torch.Tensor, int]], recv_from: int | None
    ) -> torch.Tensor | None:
        if self.timers is not None:
            self.timers.start(Component.pipeline_comm)
        # one batch so NCCL groups the send and the receive (no send-send deadlock)
        ops, buf = [], None
        for tensor, peer in send:
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer))
        if recv_from is not None:
            buf = torch.empty(self.shape, device=self.device, dtype=self.dtype)
            ops.append(dist.P2POp(dist.irecv, buf, recv_from))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if self.timers is not None:
            self.timers.stop(Component.pipeline_comm)
        return buf

    # ---- compute ----------------------------------------------------------------------------
    def _forward(self, mb: MicroBatch, x: torch.Tensor | None):
        inp = mb.inputs if x is None else x.requires_grad_()
        timed = self.timers.region(Component.forward) if self.timers else contextlib.nullcontext()
        with timed:
            out = self.model(inp)
            if self.next is None:
                out = self.loss_fn(out, mb.labels)
        return inp, out

    def _backward(self, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None):
        timed = self.timers.region(Component.backward) if self.timers else contextlib.nullcontext()
        with timed:
            torch.autograd.backward(out, grad_tensors=grad)
        return inp.grad if self.prev is not None else None

    def run(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        m = len(micro_batches)
        pp, stage = self.mesh.degrees.pp, self.mesh.stage
        warmup = min(pp - stage - 1, m)
        total = torch.zeros((), device=self.device)
        inflight: list[tuple[torch.Tensor, torch.Tensor]] = []

        def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor:
            nonlocal total
            inp, out = self._forward(micro_batches[i], x)
            inflight.append((inp, out))
            if self.next is None:
                total = total + out.detach()
            return out

        def bwd(grad: torch.Tensor | None) -> torch.Tensor | None:
            inp, out = inflight.pop(0)
            return self._backward(inp, out, grad)

        recv_prev = (lambda: self._exchange([], self.prev)) if self.prev is not None else None
        for i in range(warmup):
            out = fwd(i, recv_prev() if recv_prev else None)
            self._exchange([(out.detach(), self.next)], None)
        steady = m - warmup
        x = recv_prev() if recv_prev and steady > 0 else None
        for j in range(steady):
            out = fwd(warmup + j, x)
            grad = None
            if self.next is not None:
                grad = self._exchange([(out.detach(), self.next)], self.next)
            dx = bwd(grad)
            last = j == steady - 1
            if self.prev is not None:
                x = self._exchange([(dx, self.prev)], None if last else self.prev)
        for _ in range(warmup):
            grad = self._exchange([], self.next)
            dx = bwd(grad)
            if self.prev is not None:
                self._exchange([(dx, self.prev)], None)
        return total


# ---- interleaved 1F1B ---------------------------------------------------------------------------


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


def interleaved_order(pp: int, vpp: int, m: int, stage: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B order of one stage (megatron/core/pipeline_parallel/
    schedules.py, forward_backward_pipelining_with_interleaving): virtual micro-batch k runs
    local chunk (k mod pp x vpp) // pp (reversed for backward) on micro-batch
    (k // (pp x vpp)) x pp + k mod pp; (pp - stage - 1) x 2 + (vpp - 1) x pp warm-up forwards
    (all of them when M = pp), then one forward and one backward alternately, then the
    remaining backwards. Needs M to be a multiple of pp (checked by the plan)."""
    total, group = m * vpp, pp * vpp

    def action(k: int, forward: bool) -> Action:
        local = (k % group) // pp
        if not forward:
            local = vpp - 1 - local
        return Action(forward, local * pp + stage, (k // group) * pp + k % pp)

    warmup = total if m == pp else min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    order = [action(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(warmup + k, True), action(k, False)]
    order += [action(k, False) for k in range(total - warmup, total)]
    return order


def interleaved_ticks(
    pp: int, vpp: int, m: int
) -> list[tuple[dict[int, Action], list[Message]]]:
    """Lock-step timeline of the interleaved schedule: in each tick every stage runs its next
    action if the input it needs arrived in an earlier tick, then the tick's messages are
    exchanged. Every rank derives the same timeline, so each send has its receive in the same
    tick's batch on the peer (no send/send deadlock on NCCL or gloo)."""
    chunks = pp * vpp
    orders = [interleaved_order(pp, vpp, m, s) for s in range(pp)]
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
            raise RuntimeError(f"interleaved 1F1B order stalls at positions {pos}")
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


class InterleavedOneFOneB:
    """Runs every chunk's forward and backward of one step on this stage in the interleaved
    order; returns the summed (already scaled) loss on the last stage, 0 elsewhere."""

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
        self.ticks = interleaved_ticks(d.pp, d.vpp, num_micro_batches)

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
