"""Pipeline parallelism: stage pruning from ``stage_layers`` and a 1F1B schedule.

The schedule is Megatron-LM's non-interleaved 1F1B (Narayanan et al., SC'21): stage i runs
min(pp - i - 1, M) warm-up forwards, then alternates one forward and one backward, then drains
the remaining backwards. Activations and their gradients move with isend/irecv pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.metrics import Component, Timers
from runtime.model import Transformer
from runtime.parallel.mesh import Mesh


def stage_layer_ids(stage_layers: Sequence[int], stage: int) -> range:
    start = sum(stage_layers[:stage])
    return range(start, start + stage_layers[stage])


def apply_pipeline(model: Transformer, mesh: Mesh, stage_layers: Sequence[int]) -> None:
    """Keep this stage's layers; the embedding stays on the first stage, final norm and LM head
    on the last."""
    keep = {str(i) for i in stage_layer_ids(stage_layers, mesh.coords.pp)}
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
        forward_context: Callable,
        timers: Timers | None = None,
    ):
        self.model, self.mesh, self.loss_fn = model, mesh, loss_fn
        self.shape = activation_shape
        self.device = device
        self.forward_context = forward_context
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
            buf = torch.empty(self.shape, device=self.device, dtype=torch.float32)
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
        with self.forward_context():
            out = self.model(inp)
            if self.next is None:
                out = self.loss_fn(out, mb.labels)
            else:
                out = out.float()
        return inp, out

    def _backward(self, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None):
        torch.autograd.backward(out, grad_tensors=grad)
        return inp.grad if self.prev is not None else None

    def run(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        m = len(micro_batches)
        pp, stage = self.mesh.degrees.pp, self.mesh.coords.pp
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
