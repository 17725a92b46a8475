"""Inter-operator overlap of the MoE layer (MegaScale-MoE Sec. 4), as a chunked schedule.

The router sees all of a micro-batch's tokens (so routing and the balance loss are the
unchunked layer's); the dispatcher then learns every chunk's expert order and row counts in one
exchange (``prepare``), and the tokens move in ``plans.layout.moe_chunks`` chunks along the
token dimension. Each chunk runs three stages, each on a lane:

    dispatch (communication lane) -> experts (compute lane) -> combine (communication lane)

issued in the order D0 [shared] E0 D1 C0 E1 C1 (``stage_order``), so chunk 1's dispatch runs
beside chunk 0's expert GEMMs and chunk 0's combine beside chunk 1's (the shared experts, when
the model has them, beside chunk 0's dispatch). Every expert GEMM is issued before the next
dispatch, whose host work (the all-gather dispatcher's row filter) may wait on the GPU.

On CUDA the compute lane is the training stream and the communication lane a second stream; a
stage on the other lane than its chunk's previous stage waits for that stage's event, and every
tensor a chunk carries into it is ``record_stream``-ed on its stream, so the caching allocator
never reuses memory a stream still reads. On CPU both lanes are the one thread and the schedule
is the serial computation in another order (the gloo tests check the numbers).

Backward: torch runs each operator's backward on the stream its forward ran on and makes a
stream wait for the gradients it consumes from another, so the combine and dispatch gradients
(all-to-all back, or all-gather <-> reduce-scatter) run on the communication stream and the
expert GEMMs' data and weight gradients on the compute stream. The autograd engine issues ready
nodes latest-created first, i.e. C1' E1' C0' D1' E0' D0': chunk 0's combine gradient runs beside
chunk 1's expert backward, and chunk 1's dispatch gradient beside chunk 0's. What stays exposed:
the first dispatch and the last combine of each direction, and the collectives' share that
contends with the GEMMs for the GPU (priced by ``efficiency.overlap``; cost_models.layer_graph
builds the same chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import Any

import torch

from runtime.moe import MoE, Routing


class Lane(StrEnum):
    compute = "compute"
    comm = "comm"


class Step(StrEnum):
    dispatch = "dispatch"
    experts = "experts"
    combine = "combine"
    shared = "shared"


LANE = {Step.dispatch: Lane.comm, Step.experts: Lane.compute, Step.combine: Lane.comm,
        Step.shared: Lane.compute}
"""The lane each step runs on: token movement (and its permutations) on the communication
lane, GEMMs on the compute lane."""


def stage_order(chunks: int, shared: bool) -> list[tuple[Step, int]]:
    """(step, chunk) in issue order: the software pipeline D0 [S] E0 D1 C0 E1 D2 C1 ... ."""
    order = [(Step.dispatch, 0)]
    if shared:
        order.append((Step.shared, 0))
    for i in range(chunks):
        order.append((Step.experts, i))
        if i + 1 < chunks:
            order.append((Step.dispatch, i + 1))
        order.append((Step.combine, i))
    return order


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (tensors, sequences, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from _tensors(getattr(obj, f.name))


class Lanes:
    """The two lanes on one device: CUDA streams, or nothing on CPU. The compute lane is the
    stream current at the first forward (the training stream); a later call from another
    stream (full recomputation runs the forward again inside the backward, on the stream of
    the node that needs it) is joined to it (``call``), so every stage reruns on the stream it
    first ran on and the recomputed tensors are read where they were made."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.comm = torch.cuda.Stream(device) if self.cuda else None

    def stream(self, lane: Lane) -> torch.cuda.Stream | None:
        return self.comm if lane == Lane.comm else self.compute

    @contextmanager
    def call(self, inputs: Any) -> Iterator[list[torch.Tensor]]:
        """Run the body on the compute lane after the caller's stream; the caller's stream
        waits for it at the end, and the tensors the body appends to the yielded list are kept
        alive for the caller's stream."""
        outputs: list[torch.Tensor] = []
        if not self.cuda:
            yield outputs
            return
        caller = torch.cuda.current_stream()
        if caller == self.compute:
            yield outputs
            return
        self.compute.wait_stream(caller)
        for t in _tensors(inputs):
            t.record_stream(self.compute)
        with torch.cuda.stream(self.compute):
            yield outputs
        caller.wait_stream(self.compute)
        for t in outputs:
            t.record_stream(caller)

    def enter(self, lane: Lane, after: torch.cuda.Event | None, carried: Any):
        """Context running work on ``lane``: it waits for ``after`` (an event of the other
        lane) and keeps ``carried``'s tensors alive for its stream."""
        stream = self.stream(lane)
        if stream is None:
            return nullcontext()
        if after is not None:
            stream.wait_event(after)
        for t in _tensors(carried):
            if t.is_cuda:
                t.record_stream(stream)
        return torch.cuda.stream(stream)

    def mark(self, lane: Lane) -> torch.cuda.Event | None:
        """An event at the end of the work issued so far on ``lane`` (None on CPU)."""
        stream = self.stream(lane)
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event


@dataclass
class _Chunk:
    tokens: torch.Tensor
    routing: Routing
    prepared: Any
    lane: Lane = Lane.compute
    """The lane of the chunk's last stage; ``done`` marks its end there."""
    done: torch.cuda.Event | None = None
    values: dict[str, Any] = field(default_factory=dict)


class ChunkedExpertFFN:
    """``MoE.expert_ffn`` as the chunked schedule above (installed on the instance)."""

    def __init__(self, moe: MoE, chunks: int):
        self.moe, self.chunks = moe, chunks
        self._lanes: Lanes | None = None
        self.steps: dict[Step, Callable[[_Chunk], None]] = {
            Step.dispatch: self._dispatch, Step.experts: self._experts,
            Step.combine: self._combine, Step.shared: self._shared,
        }

    def _dispatch(self, c: _Chunk) -> None:
        rows, counts, handle = self.moe.dispatcher.send(c.tokens, c.routing, c.prepared)
        c.values.update(rows=rows, counts=counts, handle=handle)

    def _experts(self, c: _Chunk) -> None:
        c.values["out"] = self.moe.experts(c.values.pop("rows"), c.values.pop("counts"))

    def _combine(self, c: _Chunk) -> None:
        c.values["y"] = self.moe.dispatcher.combine(c.values.pop("out"), c.values.pop("handle"))

    def _shared(self, c: _Chunk) -> None:
        c.values["shared"] = self.moe.shared(c.tokens)

    def lanes(self, device: torch.device) -> Lanes:
        if self._lanes is None:
            self._lanes = Lanes(device)
        return self._lanes

    def __call__(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        lanes = self.lanes(tokens.device)
        with lanes.call((tokens, routing)) as outputs:
            outputs.append(self._run(lanes, tokens, routing))
        return outputs[0]

    def _run(self, lanes: Lanes, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        parts = [torch.tensor_split(t, self.chunks) for t in (tokens, routing.indices,
                                                             routing.weights)]
        routings = [Routing(i, w, routing.aux_loss, routing.dropless)
                    for i, w in zip(parts[1], parts[2], strict=True)]
        prepared = self.moe.dispatcher.prepare(routings)
        routed = lanes.mark(Lane.compute)  # the router and prepare, which every chunk reads
        chunks = [_Chunk(t, r, p, Lane.compute, routed)
                  for t, r, p in zip(parts[0], routings, prepared, strict=True)]
        whole = _Chunk(tokens, routing, None)  # the shared experts read every token
        for step, i in stage_order(self.chunks, self.moe.shared is not None):
            c = whole if step == Step.shared else chunks[i]
            lane = LANE[step]
            after = c.done if lane != c.lane else None
            with lanes.enter(lane, after, (c.tokens, c.routing, c.prepared, c.values)):
                self.steps[step](c)
            c.lane, c.done = lane, lanes.mark(lane)
        outs = []
        for c in chunks:
            with lanes.enter(Lane.compute, c.done if c.lane != Lane.compute else None,
                             c.values):
                outs.append(c.values["y"])
        y = torch.cat(outs)
        return y + whole.values["shared"] if self.moe.shared is not None else y


def apply_inter_op_overlap(moes: Iterable[MoE], chunks: int) -> None:
    """Run every MoE layer's experts in ``chunks`` overlapped token chunks (chunks > 1)."""
    if chunks == 1:
        return
    for moe in moes:
        moe.expert_ffn = ChunkedExpertFFN(moe, chunks)
