"""Pipeline parallelism: stage pruning from ``stage_layers`` and one interpreter
(``ActionSchedule``) of the schedules' action lists (plans.pipeline: 1F1B and interleaved 1F1B,
and the lock-step timeline every rank derives). Activations and their gradients travel in the
parameter dtype (Megatron's pipeline dtype). docs/architecture.md says why this runs on our own
interpreter rather than torch.distributed.pipelining's schedules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plans.layout import chunks_of_stage
from plans.pipeline import Message, timeline
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
