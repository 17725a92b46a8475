"""Inter-operator overlap of the MoE layer (MegaScale-MoE Sec. 4), as a chunked schedule (run
by ``run_schedule``, which Ulysses in head groups shares: runtime.parallel.attention).

The router sees all of a micro-batch's tokens (so routing and the balance loss are the
unchunked layer's); the dispatcher then learns every chunk's expert order and row counts in one
exchange (``prepare``: its one wait on the host), and the tokens move in
``plans.layout.moe_chunks`` chunks along the token dimension. Each chunk runs the dispatcher's
phases (runtime.parallel.expert: pack, exchange, unpack, both ways) and its experts, each step
on a lane: the collectives alone on the communication lane, the permutations with the expert
GEMMs on the compute lane (Megatron-Core's fine-grained dispatch / combine pre- and
post-processing; the cost model, cost_models.layer_graph, prices the permutations on the compute
stream the same way). For two chunks the issue order (``COLLECTIVES_ALONE``) is

    Dp0 Dx0 Dp1 Dx1 [S] Du0 E0 Cp0 Cx0 Du1 E1 Cp1 Cx1 Cu0 Cu1

(D dispatch, C combine; p pack, x exchange, u unpack; E experts; S the shared experts): the
communication lane runs Dx0 Dx1 Cx0 Cx1, so chunk 1's dispatch moves beside chunk 0's
permutations and GEMMs (and the shared experts), and chunk 0's combine beside chunk 1's.
The permutations stay off the communication lane: with them it is busier than the GEMMs' lane
at Qwen3-30B-A3B's shape (13 ms against 9 ms in a traced step, docs/performance.md).

On CUDA the compute lane is the training stream and the communication lane a second stream; a
step on the other lane than its chunk's previous step waits for that step's event, and every
tensor a chunk carries into it is ``record_stream``-ed on its stream, so the caching allocator
never reuses memory a stream still reads. On CPU both lanes are the one thread and the schedule
is the serial computation in another order (the gloo tests check the numbers).

Backward: torch runs each operator's backward on the stream its forward ran on and makes a
stream wait for the gradients it consumes from another, so the collectives' gradients
(all-to-all back, or all-gather <-> reduce-scatter) run on the communication stream and the
permutations' and expert GEMMs' on the compute stream; the autograd engine issues ready nodes
latest-created first, so one chunk's collective gradients run beside the other chunk's expert
backward. What stays exposed: the first dispatch and the last combine of each direction, and
the collectives' share that contends with the GEMMs for the GPU (priced by
``efficiency.overlap``; cost_models.layer_graph builds the same chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
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
    """A chunk's steps, named for the MoE layer. Ulysses in head groups
    (runtime.parallel.attention.ChunkedUlyssesCore) runs the same chain: the all-to-all to head
    shards as the dispatch, the attention core as the experts, the all-to-all back as the
    combine."""

    dispatch_pack = "dispatch_pack"
    dispatch_exchange = "dispatch_exchange"
    dispatch_unpack = "dispatch_unpack"
    experts = "experts"
    combine_pack = "combine_pack"
    combine_exchange = "combine_exchange"
    combine_unpack = "combine_unpack"
    shared = "shared"


CHAIN = (Step.dispatch_pack, Step.dispatch_exchange, Step.dispatch_unpack, Step.experts,
         Step.combine_pack, Step.combine_exchange, Step.combine_unpack)
"""One chunk's steps, in the order its data flows."""


@dataclass(frozen=True)
class Schedule:
    """Where each step runs and in which order the chunks' steps are issued."""

    comm_steps: frozenset[Step]
    """Steps on the communication lane; the others run on the compute lane."""
    order: Callable[[int, bool], list[tuple[Step, int]]]
    """(chunks, shared experts) -> (step, chunk) in issue order."""

    def lane(self, step: Step) -> Lane:
        return Lane.comm if step in self.comm_steps else Lane.compute


def _collectives_alone_order(chunks: int, shared: bool) -> list[tuple[Step, int]]:
    """Chunk i + 1's dispatch is packed and sent before chunk i's experts, and chunk i's
    combine unpacked after chunk i + 1's is sent, so every collective but the first dispatch
    and the last combine has compute issued beside it."""
    order = [(Step.dispatch_pack, 0), (Step.dispatch_exchange, 0)]
    for i in range(chunks):
        if i + 1 < chunks:
            order += [(Step.dispatch_pack, i + 1), (Step.dispatch_exchange, i + 1)]
        if i == 0 and shared:
            order.append((Step.shared, 0))
        order += [(Step.dispatch_unpack, i), (Step.experts, i), (Step.combine_pack, i),
                  (Step.combine_exchange, i)]
        if i:
            order.append((Step.combine_unpack, i - 1))
    order.append((Step.combine_unpack, chunks - 1))
    return order


COLLECTIVES_ALONE = Schedule(frozenset({Step.dispatch_exchange, Step.combine_exchange}),
                             _collectives_alone_order)
"""The collectives alone on the communication lane, the permutations with the GEMMs (what
cost_models.layer_graph prices)."""


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
class Chunk:
    """One chunk's state as the schedule runs it."""

    inputs: dict[str, Any]
    """What the chunk starts from (every step may read it; kept alive on every lane)."""
    lane: Lane = Lane.compute
    """The lane of the chunk's last step; ``done`` marks its end there."""
    done: torch.cuda.Event | None = None
    values: dict[str, Any] = field(default_factory=dict)
    """What each step leaves for the next."""


def run_schedule(lanes: Lanes, schedule: Schedule, steps: Mapping[Step, Callable[[Chunk], None]],
                 chunks: list[Chunk], whole: Chunk | None = None) -> None:
    """Issue every chunk's steps in the schedule's order, each on its lane. A step on the other
    lane than its chunk's previous step waits for that step's end (an event marked only where
    the chunk changes lanes next, ``collect`` reading on the compute lane), and the chunk's
    tensors are kept alive for the new lane's stream: every tensor a lane reads was made on it
    or carried in at such a change. ``whole`` is the chunk the shared step reads (None: no
    shared step)."""
    order = schedule.order(len(chunks), whole is not None)
    keys = [-1 if step == Step.shared else i for step, i in order]
    # the lane each step's chunk runs on next (the compute lane after its last step)
    next_lane: list[Lane] = [Lane.compute] * len(order)
    following: dict[int, Lane] = {}
    for k in reversed(range(len(order))):
        next_lane[k] = following.get(keys[k], Lane.compute)
        following[keys[k]] = schedule.lane(order[k][0])
    for k, (step, i) in enumerate(order):
        c = whole if step == Step.shared else chunks[i]
        lane = schedule.lane(step)
        switch = lane != c.lane
        with lanes.enter(lane, c.done if switch else None,
                         (c.inputs, c.values) if switch else ()):
            steps[step](c)
        c.lane, c.done = lane, lanes.mark(lane) if next_lane[k] != lane else None


def collect(lanes: Lanes, chunks: list[Chunk], key: str) -> list[torch.Tensor]:
    """Every chunk's ``values[key]``, readable on the compute lane."""
    outs = []
    for c in chunks:
        switch = c.lane != Lane.compute
        with lanes.enter(Lane.compute, c.done if switch else None, c.values if switch else ()):
            outs.append(c.values[key])
    return outs


class ChunkedExpertFFN:
    """``MoE.expert_ffn`` as the chunked schedule above (installed on the instance)."""

    def __init__(self, moe: MoE, chunks: int):
        self.moe, self.chunks = moe, chunks
        self._lanes: Lanes | None = None
        self.steps: dict[Step, Callable[[Chunk], None]] = {
            Step.dispatch_pack: self._dispatch_pack, Step.dispatch_exchange: self._dispatch_x,
            Step.dispatch_unpack: self._dispatch_unpack, Step.experts: self._experts,
            Step.combine_pack: self._combine_pack, Step.combine_exchange: self._combine_x,
            Step.combine_unpack: self._combine_unpack, Step.shared: self._shared,
        }

    # each step reads what the chunk's previous step left in ``values`` (the dispatcher is read
    # when the step runs: expert parallelism installs it after this schedule)
    def _dispatch_pack(self, c: Chunk) -> None:
        c.values["moving"] = self.moe.dispatcher.send_pack(
            c.inputs["tokens"], c.inputs["routing"], c.inputs["prepared"])

    def _dispatch_x(self, c: Chunk) -> None:
        c.values["moving"] = self.moe.dispatcher.send_exchange(c.values.pop("moving"))

    def _dispatch_unpack(self, c: Chunk) -> None:
        rows, counts, handle = self.moe.dispatcher.send_unpack(c.values.pop("moving"))
        c.values.update(rows=rows, counts=counts, handle=handle)

    def _experts(self, c: Chunk) -> None:
        c.values["out"] = self.moe.experts(c.values.pop("rows"), c.values.pop("counts"))

    def _combine_pack(self, c: Chunk) -> None:
        c.values["moving"] = self.moe.dispatcher.combine_pack(c.values.pop("out"),
                                                              c.values.pop("handle"))

    def _combine_x(self, c: Chunk) -> None:
        c.values["moving"] = self.moe.dispatcher.combine_exchange(c.values.pop("moving"))

    def _combine_unpack(self, c: Chunk) -> None:
        c.values["y"] = self.moe.dispatcher.combine_unpack(c.values.pop("moving"))

    def _shared(self, c: Chunk) -> None:
        c.values["shared"] = self.moe.shared(c.inputs["tokens"])

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
        chunks = [Chunk({"tokens": t, "routing": r, "prepared": p}, Lane.compute, routed)
                  for t, r, p in zip(parts[0], routings, prepared, strict=True)]
        # the shared experts read every token
        whole = Chunk({"tokens": tokens}) if self.moe.shared is not None else None
        run_schedule(lanes, COLLECTIVES_ALONE, self.steps, chunks, whole)
        y = torch.cat(collect(lanes, chunks, "y"))
        return y + whole.values["shared"] if whole is not None else y


def apply_inter_op_overlap(moes: Iterable[MoE], chunks: int) -> None:
    """Run every MoE layer's experts in ``chunks`` overlapped token chunks (chunks > 1)."""
    if chunks == 1:
        return
    for moe in moes:
        moe.expert_ffn = ChunkedExpertFFN(moe, chunks)
