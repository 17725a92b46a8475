"""Mixture-of-Experts FFN: router, dispatch, grouped expert GEMMs, combine.

The MoE module runs the four steps in order and hands token movement to a dispatcher object;
it never knows whether experts are local or spread over an EP group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from plans.enums import ExpertGemm
from runtime.kernels import EAGER, KernelOps, count_per_expert
from runtime.router import Scoring, route_scored, updated_expert_bias


@dataclass
class Routing:
    indices: torch.Tensor
    """[T, k] expert of each (token, slot); -1 where capacity dropped the slot."""
    weights: torch.Tensor
    """[T, k] combine weight of each slot (fp32, renormalised over the top-k)."""
    aux_loss: torch.Tensor
    """Load-balance loss of this layer (scalar)."""
    dropless: bool = True
    """No slot was dropped (no index is -1), so dispatch needs no device-to-host sync to
    filter them."""


State = TypeVar("State")
"""A dispatcher's own record of one dispatch (``None`` where it keeps none)."""


@dataclass
class DispatchHandle(Generic[State]):
    """What a dispatcher needs to undo its dispatch; ``extra`` is the dispatcher's own
    record (runtime.parallel.expert: ``AllToAllState``, ``SharedExpertsState``)."""

    slots: torch.Tensor
    """Flat (token * k + slot) index of each expert-input row, in expert order."""
    weights: torch.Tensor
    """[T', k] routing weights of the tokens the rows came from."""
    num_tokens: int
    top_k: int
    extra: State


class Dispatcher(Protocol):
    num_local_experts: int
    runs_shared: bool
    """Whether the dispatcher runs the layer's shared experts itself (expert TP: on the
    gathered tokens, their partial sums in the combine's reduce-scatter)."""

    def dispatch(
        self, tokens: torch.Tensor, routing: Routing
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Return expert-input rows grouped by local expert, rows per local expert, handle."""
        ...

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Weighted sum of the expert outputs back at each token: [T, h]."""
        ...


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


# ---- routing --------------------------------------------------------------------------------


def balance_loss(
    probs: torch.Tensor,
    indices: torch.Tensor,
    groups: int,
    reduce_stats: Callable[[torch.Tensor], torch.Tensor] = identity,
    record_counts: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """G x sum_g F_g P_g over G groups of contiguous experts (Switch Transformer for G = E;
    DeepSeek-V2 device-level loss when a group is one EP rank's experts). F_g is the fraction of
    routed slots that go to group g, P_g its summed mean router probability; both are summed
    over the ranks that share the micro-batch (``reduce_stats``) so the loss is that of the whole
    micro-batch. Balanced routing gives 1. ``record_counts`` receives the micro-batch's routed
    slots per expert (summed over those ranks)."""
    counts = count_per_expert(indices, probs.shape[1]).to(probs.dtype)
    return balance_from_stats(counts, probs.sum(0), probs.shape[0], indices.shape[1], groups,
                              reduce_stats, record_counts)


def balance_from_stats(
    counts: torch.Tensor,
    prob_sum: torch.Tensor,
    tokens: int,
    k: int,
    groups: int,
    reduce_stats: Callable[[torch.Tensor], torch.Tensor] = identity,
    record_counts: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """balance_loss from this rank's slots per expert and summed probabilities (the router's
    one pass, runtime.kernels.route)."""
    experts = counts.shape[0]
    # a fill on the device: torch.tensor(..., device=cuda) copies from pageable host memory, and
    # PyTorch waits for the stream after such a copy (one host sync per router call)
    n = prob_sum.new_full((1,), float(tokens))
    stats = reduce_stats(torch.cat([counts, prob_sum, n]))
    counts, prob_sum, total = stats[:experts], stats[experts : 2 * experts], stats[-1]
    if record_counts is not None:
        record_counts(counts.detach())
    f = (counts / (total * k)).view(groups, -1).sum(1)
    p = (prob_sum / total).view(groups, -1).sum(1)
    return groups * (f * p).sum()


def capacity_mask(indices: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """Keep the first ``capacity`` slots of every expert in token order (GShard/Switch rule)."""
    flat = indices.reshape(-1)
    one_hot = F.one_hot(flat, experts)
    position = (one_hot.cumsum(0) * one_hot).sum(1)
    return (position <= capacity).view_as(indices)


class Router(nn.Module):
    """Softmax router with top-k. The kept weights are renormalised to sum to one (Mixtral,
    Qwen3), or with ``pre_softmax`` kept as the softmax over all experts (DeepSeekMoE, top-1:
    Megatron-LM's --moe-router-pre-softmax). A ``scoring`` scores and chooses as
    runtime.router says (sigmoid, expert bias, group-limited routing, scaling); with an expert
    bias the router holds it in the fp32 buffer ``expert_bias`` (not trained, zero at the
    start, moved after every step by ``update_expert_biases``) and counts the routed slots per
    expert of its forwards since the last update (``step_slots``)."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        top_k: int,
        balance_groups: int,
        capacity_factor: float | None = None,
        pre_softmax: bool = False,
        ops: KernelOps = EAGER,
        scoring: Scoring | None = None,
    ):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.ops = ops
        self.scoring = scoring
        self.register_buffer("expert_bias", torch.zeros(experts)
                             if scoring is not None and scoring.expert_bias else None)
        self.pre_softmax = pre_softmax
        self.experts = experts
        self.top_k = top_k
        self.balance_groups = balance_groups
        self.capacity_factor = capacity_factor
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] = identity
        self.load: torch.Tensor | None = None
        """Since ``take_load``: (sum, max, count) over forwards of max / mean routed slots per
        expert; on the device, read once per step (``routing_skew``)."""
        self.step_slots: torch.Tensor | None = None
        """With an expert bias: this rank's routed slots per expert over the forwards since
        the last ``update_expert_biases`` (a forward rerun by recomputation counts again: every
        expert's slots twice, which the update's sign does not see)."""

    def _record_load(self, counts: torch.Tensor) -> None:
        ratio = counts.max() / counts.mean().clamp_min(1e-9)
        if self.load is None:
            self.load = torch.stack([ratio, ratio, torch.ones_like(ratio)])
        else:
            self.load = torch.stack([self.load[0] + ratio, torch.maximum(self.load[1], ratio),
                                     self.load[2] + 1])

    def take_load(self) -> torch.Tensor | None:
        load, self.load = self.load, None
        return load

    def forward(self, x: torch.Tensor) -> Routing:
        if self.scoring is None:
            weights, indices, counts, prob_sum = self.ops.route(self.gate(x), self.top_k,
                                                                not self.pre_softmax)
        else:
            weights, indices, counts, prob_sum = route_scored(
                self.gate(x), self.top_k, not self.pre_softmax, self.scoring, self.expert_bias)
            if self.expert_bias is not None and torch.is_grad_enabled():
                slots = counts.detach()
                self.step_slots = slots if self.step_slots is None else self.step_slots + slots
        aux = balance_from_stats(counts, prob_sum, x.shape[0], self.top_k, self.balance_groups,
                                 self.reduce_stats, self._record_load)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * x.shape[0] * self.top_k / self.experts)
            keep = capacity_mask(indices, self.experts, capacity)
            indices = torch.where(keep, indices, -1)
            weights = weights * keep
            return Routing(indices=indices, weights=weights, aux_loss=aux, dropless=False)
        return Routing(indices=indices, weights=weights, aux_loss=aux)


# ---- expert computation ---------------------------------------------------------------------


def start_host_copy(t: torch.Tensor) -> Callable[[], list]:
    """Start copying ``t`` to the host; the returned function waits for the copy alone and
    gives its values as a list. On CUDA the copy goes to pinned memory behind an event, so
    kernels queued after this call keep running while the host reads (a plain ``.tolist()``
    waits for everything queued before it returns)."""
    if not t.is_cuda:
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list:
        done.synchronize()
        return host.tolist()

    return read


class HostCounts:
    """Rows per expert on the device, and copied to the host without waiting
    (``start_host_copy``), read once when first needed. Read in the backward (the per-expert
    weight gradients of gradient-accumulation fusion), the GPU has long passed the copy; read
    in the forward, the host would wait for the GPU at every MoE layer. The eight-micro-batch
    Mixtral step reading them in the backward: 440.0 ms against its unfused twin's 467.0
    (bench/results/h200/train_step_mixtral2l_1gpu_gaf.json)."""

    def __init__(self, counts: torch.Tensor):
        self.device = counts
        self._read = start_host_copy(counts)
        self._host: list[int] | None = None

    def tolist(self) -> list[int]:
        if self._host is None:
            self._host = self._read()
        return self._host


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` grouped by expert times each expert's ``w[e]`` ([E, out, in], Linear
    layout): torch._grouped_mm on CUDA in bf16 (parameters and activations are bf16 there),
    an exact per-expert loop elsewhere."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    chunks = torch.split(x, counts.tolist(), dim=0)
    outs = [chunk @ w[e].transpose(0, 1) for e, chunk in enumerate(chunks)]
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w.shape[1])


def per_expert_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """grouped_mm as one matmul per expert (``counts`` on the host), each product written
    into its slice of one output."""
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(x[start:start + c], w[e].transpose(0, 1), out=out[start:start + c])
        start += c
    return out


def per_expert_weight_grad(g: torch.Tensor, x: torch.Tensor, counts: list[int],
                           like: torch.Tensor) -> torch.Tensor:
    """The gradient of per_expert_mm's weight ([E, out, in] as ``like``): g_e.T @ x_e per
    expert, written into its slice (zero for an expert without rows)."""
    grad = torch.empty_like(like)
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(g[start:start + c].transpose(0, 1), x[start:start + c], out=grad[e])
        else:
            grad[e].zero_()
        start += c
    return grad


def expert_product(gemm: ExpertGemm) -> Callable[[torch.Tensor, torch.Tensor, HostCounts],
                                                 torch.Tensor]:
    """The product of grouped rows with a stacked weight ([E, out, in]) as ``gemm`` runs it:
    grouped_mm over the counts on the device, or per_expert_mm over them on the host."""
    if gemm == ExpertGemm.per_expert:
        return lambda x, w, counts: per_expert_mm(x, w, counts.tolist())
    return lambda x, w, counts: grouped_mm(x, w, counts.device)


class _PerExpertMM(torch.autograd.Function):
    """per_expert_mm with its backward as per-expert matmuls too (the rows' gradient into
    slices of one tensor, the weight's into its experts' slices)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, counts: HostCounts) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        return per_expert_mm(x, w, counts.tolist())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        rows = ctx.counts.tolist()
        gx = per_expert_mm(g, w.transpose(-2, -1), rows) if ctx.needs_input_grad[0] else None
        gw = per_expert_weight_grad(g, x, rows, w) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def grouped_matmul(counts: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``GroupedExperts.matmul`` of ExpertGemm grouped: ``grouped_mm`` over ``counts``."""
    return lambda x, w: grouped_mm(x, w, counts)


def per_expert_matmul(counts: torch.Tensor
                      ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``GroupedExperts.matmul`` of ExpertGemm per_expert: per-expert matmuls forward and
    backward over the counts on the host (``HostCounts``, read at the first product)."""
    host = HostCounts(counts)
    return lambda x, w: _PerExpertMM.apply(x, w, host)


def activation_kept(swiglu: Callable, a: torch.Tensor, b: torch.Tensor,
                    fc2: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``GroupedExperts``' activation and fc2 as autograd keeps them: fc2's input (the
    activation's output) saved for backward."""
    return fc2(swiglu(a, b))


class GroupedExperts(nn.Module):
    """SwiGLU experts: fc2(silu(fc1 x) * fc3 x), weights stacked over the (local) experts.
    ``gemm`` says how the GEMMs run (plans.enums.ExpertGemm); ``matmul(counts)`` gives the
    product of grouped rows with a stacked weight: ``gemm``'s, unless the caller passes another
    (runtime.parallel.wrappers.AccumulatingExperts). ``activation(swiglu, a, b, fc2)`` runs
    the activation of fc1's and fc3's outputs and fc2 on it: ``activation_kept``, unless the
    caller passes another (runtime.parallel.wrappers.ActivationRecomputed)."""

    def __init__(self, experts: int, hidden: int, ffn_hidden: int, ops: KernelOps = EAGER,
                 gemm: ExpertGemm = ExpertGemm.grouped):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))
        self.ops = ops
        self.gemm = gemm
        self.matmul = per_expert_matmul if gemm == ExpertGemm.per_expert else grouped_matmul
        self.rows = 0
        """Routed rows these experts computed since ``take_rows`` (the rows tensor's shape, on
        the host: no device read). A recomputed forward counts again, on every rank alike."""

    def take_rows(self) -> int:
        rows, self.rows = self.rows, 0
        return rows

    def forward(self, x: torch.Tensor, counts: torch.Tensor, matmul: Callable | None = None,
                activation: Callable = activation_kept) -> torch.Tensor:
        self.rows += x.shape[0]
        mm = (matmul or self.matmul)(counts)
        return activation(self.ops.swiglu, mm(x, self.w1), mm(x, self.w3),
                          lambda h: mm(h, self.w2))


class FeedForward(nn.Module):
    """Dense SwiGLU (dense layers and shared experts)."""

    def __init__(self, hidden: int, ffn_hidden: int, ops: KernelOps = EAGER):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.swiglu(self.w1(x), self.w3(x)))


# ---- dispatch -------------------------------------------------------------------------------


def sort_by_expert(
    indices: torch.Tensor, experts: int, dropless: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot ids ordered by expert (stable, so token order inside an expert) and the number
    of slots per expert; slots with index < 0 (dropped, or not ours) are left out. With
    ``dropless`` (no index is < 0) nothing is filtered and nothing waits on the host."""
    flat = indices.reshape(-1)
    counts = count_per_expert(flat, experts)
    if dropless:
        return torch.argsort(flat, stable=True), counts
    slots = torch.nonzero(flat >= 0).squeeze(1)
    order = torch.argsort(flat[slots], stable=True)
    return slots[order], counts


class LocalDispatcher:
    """All experts on this rank (ep = 1): a local permutation."""

    runs_shared = False

    def __init__(self, num_experts: int, ops: KernelOps = EAGER):
        self.num_local_experts = num_experts
        self.ops = ops

    def dispatch(
        self, tokens: torch.Tensor, routing: Routing
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        k = routing.indices.shape[1]
        slots, counts = sort_by_expert(routing.indices, self.num_local_experts,
                                       routing.dropless)
        rows = self.ops.gather_rows(tokens, slots, k)
        handle = DispatchHandle(slots, routing.weights, tokens.shape[0], k, None)
        return rows, counts, handle

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return self.ops.weighted_scatter(
            expert_out, handle.slots, handle.weights, handle.num_tokens, handle.top_k
        )


class AuxLossGrad(torch.autograd.Function):
    """Identity on the activation whose backward also starts the aux loss's backward with
    gradient ``scale`` (Megatron's MoEAuxLossAutoScaler): the balance loss trains the router
    without being carried to the end of the pipeline."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full(ctx.aux_shape, ctx.scale, dtype=torch.float32), None


class MoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        experts: int,
        top_k: int,
        ffn_hidden: int,
        balance_groups: int,
        shared_experts: int = 0,
        shared_ffn_hidden: int = 0,
        capacity_factor: float | None = None,
        pre_softmax: bool = False,
        ops: KernelOps = EAGER,
        gemm: ExpertGemm = ExpertGemm.grouped,
        scoring: Scoring | None = None,
    ):
        super().__init__()
        self.router = Router(hidden, experts, top_k, balance_groups, capacity_factor, pre_softmax,
                             ops, scoring)
        self.experts = GroupedExperts(experts, hidden, ffn_hidden, ops, gemm)
        self.shared = (
            FeedForward(hidden, shared_experts * shared_ffn_hidden, ops) if shared_experts
            else None
        )
        self.ops = ops
        """The operator set the dispatchers installed by expert parallelism use too."""
        self.dispatcher: Dispatcher = LocalDispatcher(experts, ops)
        self.aux_loss_scale = 0.0
        """Gradient of the training loss with respect to this layer's balance loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        y = self.expert_ffn(tokens, routing)
        if self.training and self.aux_loss_scale:
            y = AuxLossGrad.apply(y, routing.aux_loss, self.aux_loss_scale)
        return y.view(shape)

    def expert_ffn(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Routed experts (dispatch, grouped GEMMs, combine) plus shared experts, in program
        order; an overlapped schedule (runtime.parallel.overlap) replaces it on the instance."""
        rows, counts, handle = self.dispatcher.dispatch(tokens, routing)
        out = self.experts(rows, counts)
        y = self.dispatcher.combine(out, handle)
        if self.shared is not None and not self.dispatcher.runs_shared:
            y = y + self.shared(tokens)
        return y


def update_expert_biases(layers: list[MoE], rate: float,
                         reduce: Callable[[torch.Tensor], torch.Tensor] = identity) -> None:
    """After a step: every expert bias of ``layers`` moved by runtime.router.
    updated_expert_bias from its router's ``step_slots``, summed by ``reduce`` (in one
    collective for all of them) over the ranks that route the other tokens of the step, then
    the counts restarted. Every rank of the group calls it with the same layers."""
    routers = [m.router for m in layers if m.router.expert_bias is not None]
    if not routers:
        return
    slots = torch.stack([r.expert_bias.new_zeros(r.experts) if r.step_slots is None
                         else r.step_slots.to(r.expert_bias.dtype) for r in routers])
    slots = reduce(slots)
    with torch.no_grad():
        for r, row in zip(routers, slots, strict=True):
            r.expert_bias.copy_(updated_expert_bias(r.expert_bias, row, rate))
            r.step_slots = None


def routing_skew(layers: list[MoE]) -> tuple[float, float] | None:
    """(mean, max) over the MoE layers' forwards since the last call of max / mean routed
    slots per expert in the router's micro-batch (TrainingSpec.routing_skew's measurement);
    one device-to-host read. None when no router ran (a stage without MoE layers)."""
    loads = [load for m in layers if (load := m.router.take_load()) is not None]
    if not loads:
        return None
    stats = torch.stack(loads)
    mean, high = (stats[:, 0].sum() / stats[:, 2].sum(), stats[:, 1].max())
    return tuple(torch.stack([mean, high]).tolist())
