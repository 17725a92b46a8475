"""Data-parallel gradient synchronisation over each parameter's replication groups.

Which ranks hold copies of a parameter (paper Sec. 3): dense weights (attention under Ulysses,
norms, router, shared experts, dense FFN, embedding, LM head) are replicated over every rank of
a stage (dp x sp x cp); TP-sharded attention weights over dp; expert weights over edp (they are
sharded over ep). Tied embeddings split over pipeline stages are also summed between the first
and last stage. Each rank's loss is already divided by the global token count, so the sum of
the replicas' gradients is the gradient of the global mean loss.

Gradients are accumulated over the micro-batches into flat main-gradient buffers
(Megatron-LM DDP): fp32 for an fp32 sync, bf16 for a bf16 or fp8 sync when the parameters are
bf16 (``grad_dtype``), and synchronised from there.

Buckets and overlap (Megatron-LM DDP, Li et al. VLDB'20 for torch DDP): a replication group's
parameters are split, in reverse registration order (the order backward produces their
gradients), into buckets of about ``BUCKET_PARAMS`` parameters, each its own flat buffer. With
``grad_sync_overlap`` a bucket's collective is launched (``async_op``; NCCL runs it on the
group's own stream, gloo on its worker threads) from the post-accumulate hook of the last
micro-batch's backward as soon as every parameter of the bucket has accumulated its gradient,
and waited for before the optimizer; without it every bucket is synchronised after the whole
backward. The buckets, casts and quantisation are the same either way, so both give the same
bits. With ``grad_accumulation_fusion`` the weight-gradient GEMMs of the blocks' Linear layers
(and of few wide experts) add into the bucket themselves (runtime.parallel.grad_accumulation);
every other parameter's ``.grad`` is the view of its main gradient in the bucket (torch DDP's
``gradient_as_bucket_view``), so autograd adds each micro-batch's gradient into it. Without
fusion the gradient lands in its own tensor and a hook adds it into the bucket and frees it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from plans import MeshAxis, Precision
from plans.execution import GRAD_SYNC_BUCKET_PARAMS
from runtime.model import Shard, Transformer
from runtime.parallel.comm import all_gather_into, reduce_scatter_into
from runtime.parallel.grad_accumulation import in_gemm, on_grad_ready
from runtime.parallel.mesh import Mesh

SYNC_DTYPES = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16}
"""Wire dtypes of the plain collectives; fp8 uses the quantised collectives below."""

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite E4M3 value."""
FP8_BLOCK = 128
"""Elements sharing one fp32 scale: 1 x 128 tiles of the flat bucket (DeepSeek-V3's
fine-grained quantisation)."""


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 ``x`` (length a multiple of FP8_BLOCK) -> E4M3 payload [blocks, FP8_BLOCK]
    and one fp32 scale per block, amax / 448, so each block uses the full E4M3 range."""
    blocks = x.view(-1, FP8_BLOCK)
    scale = blocks.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    return (blocks / scale[:, None]).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale[..., None]).reshape(*scale.shape[:-1], -1)


def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % multiple))


Finish = Callable[[], torch.Tensor | None]
"""Waits for a launched collective and returns its result (or applies it in place)."""


def start_fp8_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup) -> Finish:
    """Launch ``fp8_all_reduce``; the returned call waits and returns the sum."""
    n, numel = dist.get_world_size(group), flat.numel()
    q, scale = quantize_fp8(_pad_to(flat.float(), FP8_BLOCK))
    wire = q.view(torch.uint8).reshape(-1)
    qs = wire.new_empty(n * wire.numel())
    scales = scale.new_empty(n * scale.numel())
    works = [all_gather_into(qs, wire, group=group, async_op=True),
             all_gather_into(scales, scale, group=group, async_op=True)]

    def finish() -> torch.Tensor:
        for w in works:
            w.wait()
        parts = dequantize_fp8(qs.view(FP8).view(n, -1, FP8_BLOCK), scales.view(n, -1))
        out = parts[0].clone()
        for r in range(1, n):
            out += parts[r]
        return out[:numel]

    return finish


def fp8_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of every rank's fp32 ``flat`` with FP8 communication and FP32 reduction (paper
    Sec. 5): quantise, all-gather payloads and scales, dequantise and add in rank order (every
    rank gets the same bits). Payloads travel as uint8 (collectives lack float8 support)."""
    return start_fp8_all_reduce(flat, group)()


def start_fp8_reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup) -> Finish:
    """Launch ``fp8_reduce_scatter``; the returned call waits and returns this rank's block."""
    n = dist.get_world_size(group)
    per_rank = flat.numel() // n
    rows = _pad_to(flat.float().view(n, per_rank), FP8_BLOCK)
    q, scale = quantize_fp8(rows.reshape(-1))
    q = q.view(n, -1).view(torch.uint8).contiguous()
    scale = scale.view(n, -1).contiguous()
    q_in, scale_in = torch.empty_like(q), torch.empty_like(scale)
    works = [dist.all_to_all_single(q_in, q, group=group, async_op=True),
             dist.all_to_all_single(scale_in, scale, group=group, async_op=True)]

    def finish() -> torch.Tensor:
        for w in works:
            w.wait()
        parts = dequantize_fp8(q_in.view(n, -1, FP8_BLOCK).view(FP8), scale_in)
        out = parts[0].clone()
        for r in range(1, n):
            out += parts[r]
        return out[:per_rank]

    return finish


def fp8_reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Rank r's block of the sum of every rank's fp32 ``flat`` (length divisible by the group
    size) with FP8 communication and FP32 reduction: each block is quantised separately,
    all-to-all sends block r to rank r, which dequantises and adds in rank order."""
    return start_fp8_reduce_scatter(flat, group)()


def replication_groups(
    model: Transformer, mesh: Mesh, shards: dict[str, Shard], expert_shards: set[str]
) -> dict[str, tuple[MeshAxis, ...]]:
    out: dict[str, tuple[MeshAxis, ...]] = {}
    for name, _ in model.named_parameters():
        if ".moe.experts." in name or name in expert_shards:  # shared experts split by etp
            groups: tuple[MeshAxis, ...] = (MeshAxis.edp,)
        elif name in shards and name not in expert_shards:
            groups = (MeshAxis.dp,)
        else:
            groups = (MeshAxis.stage,)
        tied = model.cfg.spec.tied_embeddings and model.init_key(name) == "tok_embeddings.weight"
        if tied and mesh.degrees.pp > 1:
            groups = (*groups, MeshAxis.embed)
        out[name] = groups
    return out


def grad_dtype(param_dtype: torch.dtype, precision: Precision) -> torch.dtype:
    """Main-gradient dtype (Megatron-LM DDP grad buffer): fp32 for an fp32 sync or fp32
    parameters, else bf16 (bf16 sync; fp8 sync quantises the bf16 buffer when it sends)."""
    if param_dtype == torch.float32 or precision == Precision.fp32:
        return torch.float32
    return torch.bfloat16


def _accumulate(p: torch.Tensor) -> None:
    p.main_grad.add_(p.grad)
    p.grad = None


PARAM_ALIGN = 64
"""Each parameter of a flat buffer starts at a multiple of 64 elements (Megatron-LM
ParamAndGradBuffer with the distributed optimizer), so parameter views stay aligned for GEMM
kernels (torch._grouped_mm needs 16-byte aligned operands)."""

def buffer_layout(params: list[nn.Parameter]) -> tuple[list[int], int]:
    """Start offset of each parameter in a flat buffer, and the elements it spans."""
    offsets, end = [], 0
    for p in params:
        start = -(-end // PARAM_ALIGN) * PARAM_ALIGN
        offsets.append(start)
        end = start + p.numel()
    return offsets, end


def split_buckets(names: list[str], params: dict[str, nn.Parameter],
                  bucket_params: int) -> list[list[str]]:
    """``names`` (in registration order) as buckets in reverse order, each closed once it
    holds ``bucket_params`` parameters (plans.execution.GRAD_SYNC_BUCKET_PARAMS: Megatron-LM
    DDP's default): the first bucket is the first whose gradients backward completes. A
    parameter is never split, so one larger than the size is a bucket of its own."""
    out: list[list[str]] = [[]]
    size = 0
    for name in reversed(names):
        if size >= bucket_params:
            out.append([])
            size = 0
        out[-1].append(name)
        size += params[name].numel()
    return out


def attach_main_grads(
    params: list[nn.Parameter], buffer: torch.Tensor, offsets: list[int], fused: bool
) -> list[nn.Parameter]:
    """Make each parameter's ``main_grad`` the view of ``buffer`` at its offset. A parameter
    whose GEMM adds into it (``in_gemm``) needs nothing more. Else fused (and the same dtype):
    ``.grad`` is that view, so autograd adds each micro-batch's gradient into the buffer in
    place; otherwise a post-accumulate hook adds each micro-batch's ``.grad`` into it and frees
    it (Megatron-LM ``param.main_grad``). Returns the parameters whose ``.grad`` is the view
    (``alias_grads`` re-establishes it after an optimizer has cleared it)."""
    aliased = []
    for p, offset in zip(params, offsets, strict=True):
        p.main_grad = buffer[offset : offset + p.numel()].view_as(p)
        if in_gemm(p):  # its GEMM adds into main_grad (runtime.parallel.grad_accumulation)
            continue
        if fused and p.dtype == buffer.dtype:
            p.grad = p.main_grad
            aliased.append(p)
        else:
            p.register_post_accumulate_grad_hook(_accumulate)
    return aliased


def alias_grads(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = p.main_grad


def start_all_reduce(
    buffer: torch.Tensor, group: dist.ProcessGroup, precision: Precision
) -> Callable[[], None]:
    """Launch the sum over ``group`` of ``buffer`` sent in ``precision``; the returned call
    waits and leaves the sum in ``buffer``."""
    if precision == Precision.fp8:
        fp8 = start_fp8_all_reduce(buffer, group)

        def finish_fp8() -> None:
            buffer.copy_(fp8())

        return finish_fp8
    wire = buffer.to(SYNC_DTYPES[precision])
    work = dist.all_reduce(wire, group=group, async_op=True)

    def finish() -> None:
        work.wait()
        if wire is not buffer:
            buffer.copy_(wire)

    return finish


def all_reduce_(
    buffer: torch.Tensor, group: dist.ProcessGroup, precision: Precision
) -> None:
    """In-place sum over ``group`` of ``buffer`` sent in ``precision``."""
    start_all_reduce(buffer, group, precision)()


def start_reduce_scatter(
    flat: torch.Tensor, group: dist.ProcessGroup, precision: Precision, fp32: bool = True
) -> Finish:
    """Launch ``reduce_scatter_sum``; the returned call waits and returns the block, in fp32
    (``fp32``) or as the wire dtype delivers it (fp8's sums are fp32)."""
    if precision == Precision.fp8:
        return start_fp8_reduce_scatter(flat, group)
    wire = flat.to(SYNC_DTYPES[precision])
    out = wire.new_empty(wire.numel() // dist.get_world_size(group))
    work = reduce_scatter_into(out, wire, group=group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out.float() if fp32 else out

    return finish


def reduce_scatter_sum(
    flat: torch.Tensor, group: dist.ProcessGroup, precision: Precision
) -> torch.Tensor:
    """This rank's block of the fp32 sum over ``group`` of ``flat`` sent in ``precision``."""
    return start_reduce_scatter(flat, group, precision)()


@dataclass
class _Launch:
    """One bucket's collective: ``start`` launches it and returns the call that waits."""

    lane: Hashable
    """The process group its (first) collective runs on: launches keep their order per lane."""
    start: Callable[[], Finish]
    params: int
    """Parameters whose last gradient the bucket waits for."""
    missing: int = 0
    finish: Finish | None = None


@dataclass
class BucketLauncher:
    """Launches bucket collectives, in a fixed order per process group on every rank.

    Overlapped: each parameter's post-accumulate hook counts its gradients of the step; at the
    ``micro_batches``-th (its last backward: one per micro-batch in every schedule, since each
    parameter lives in one model chunk) the bucket is one parameter closer to complete, and
    complete buckets are launched in bucket order per group, so every rank of a group issues
    the same collectives in the same order (a bucket completing early waits for its
    predecessors). ``finish`` launches what is left (all of it when not overlapped), in the
    same order, and waits for everything."""

    micro_batches: int
    overlap: bool
    launches: list[_Launch] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)
    next_of: dict[Hashable, int] = field(default_factory=dict)
    hooks: list = field(default_factory=list)
    """The post-accumulate hooks' handles (``close`` removes them)."""

    def add(self, params: list[nn.Parameter], lane: Hashable,
            start: Callable[[], Finish]) -> int:
        """Register a bucket; returns its index (``finish``'s results are in this order)."""
        index = len(self.launches)
        self.launches.append(_Launch(lane, start, len(params), len(params)))
        if self.overlap:
            for p in params:
                hook = self._hook(index)
                self.hooks.append(on_grad_ready(p, hook) if in_gemm(p)
                                  else p.register_post_accumulate_grad_hook(hook))
        return index

    def close(self) -> None:
        """Remove the hooks: each holds this launcher, whose launches hold the buckets, from a
        parameter, a cycle through torch's C++ tensors that Python's collector cannot free."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def counted(p: torch.Tensor) -> None:
            n = self.counts[id(p)] = self.counts.get(id(p), 0) + 1
            if n == self.micro_batches:
                self.launches[index].missing -= 1
                self._launch_ready(self.launches[index].lane)
        return counted

    def _lane(self, lane: Hashable) -> list[_Launch]:
        return [b for b in self.launches if b.lane == lane]

    def _launch_ready(self, lane: Hashable, every: bool = False) -> None:
        queue, i = self._lane(lane), self.next_of.get(lane, 0)
        while i < len(queue) and (every or queue[i].missing == 0):
            queue[i].finish = queue[i].start()
            i += 1
        self.next_of[lane] = i

    def reset(self) -> None:
        """Before a step's first backward: wait for anything still in flight, count anew."""
        for b in self.launches:
            if b.finish is not None:
                b.finish()
            b.finish, b.missing = None, b.params
        self.counts.clear()
        self.next_of.clear()

    def finish(self) -> list[torch.Tensor | None]:
        for lane in dict.fromkeys(b.lane for b in self.launches):
            self._launch_ready(lane, every=True)
        out = []
        for b in self.launches:
            out.append(b.finish())
            b.finish = None
        return out


class GradSync:
    """Main gradients of replicated parameters in flat buckets per replication-group sequence
    (``split_buckets``), all-reduced in place over each live group of the sequence: the first
    group's collective launched by ``launcher`` (overlapped with backward when it overlaps),
    the rest (the tied embedding's second group) after it."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        mesh: Mesh,
        groups: dict[str, tuple[MeshAxis, ...]],
        precision: Precision,
        dtype: torch.dtype,
        launcher: BucketLauncher,
        fused: bool,
        bucket_params: int = GRAD_SYNC_BUCKET_PARAMS,
    ):
        self.precision = precision
        self.mesh = mesh
        self.launcher = launcher
        members: dict[tuple[MeshAxis, ...], list[str]] = defaultdict(list)
        for name in params:
            members[groups[name]].append(name)
        self.buckets: list[tuple[tuple[MeshAxis, ...], torch.Tensor]] = []
        self.aliased: list[nn.Parameter] = []
        for group_seq, names in members.items():
            live = [pg for g in group_seq if (pg := mesh.groups.get(g)) is not None]
            for bucket in split_buckets(names, params, bucket_params):
                ps = [params[n] for n in bucket]
                offsets, end = buffer_layout(ps)
                buffer = torch.zeros(end, dtype=dtype, device=ps[0].device)
                self.aliased += attach_main_grads(ps, buffer, offsets, fused)
                self.buckets.append((group_seq, buffer))
                if live:
                    launcher.add(ps, live[0], self._starter(buffer, live))

    def _starter(self, buffer: torch.Tensor, live: list[dist.ProcessGroup]
                 ) -> Callable[[], Finish]:
        def start() -> Finish:
            first = start_all_reduce(buffer, live[0], self.precision)

            def finish() -> None:
                first()
                for pg in live[1:]:
                    all_reduce_(buffer, pg, self.precision)
            return finish
        return start

    def zero_(self) -> None:
        for _, buffer in self.buckets:
            buffer.zero_()
        alias_grads(self.aliased)
