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
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from plans import MeshAxis, Precision
from runtime.model import Shard, Transformer
from runtime.parallel.comm import all_gather_into, reduce_scatter_into
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


def fp8_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of every rank's fp32 ``flat`` with FP8 communication and FP32 reduction (paper
    Sec. 5): quantise, all-gather payloads and scales, dequantise and add in rank order (every
    rank gets the same bits). Payloads travel as uint8 (collectives lack float8 support)."""
    n, numel = dist.get_world_size(group), flat.numel()
    q, scale = quantize_fp8(_pad_to(flat.float(), FP8_BLOCK))
    wire = q.view(torch.uint8).reshape(-1)
    qs = wire.new_empty(n * wire.numel())
    all_gather_into(qs, wire, group=group)
    scales = scale.new_empty(n * scale.numel())
    all_gather_into(scales, scale, group=group)
    parts = dequantize_fp8(qs.view(FP8).view(n, -1, FP8_BLOCK), scales.view(n, -1))
    out = parts[0].clone()
    for r in range(1, n):
        out += parts[r]
    return out[:numel]


def fp8_reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Rank r's block of the sum of every rank's fp32 ``flat`` (length divisible by the group
    size) with FP8 communication and FP32 reduction: each block is quantised separately,
    all-to-all sends block r to rank r, which dequantises and adds in rank order."""
    n = dist.get_world_size(group)
    per_rank = flat.numel() // n
    rows = _pad_to(flat.float().view(n, per_rank), FP8_BLOCK)
    q, scale = quantize_fp8(rows.reshape(-1))
    q = q.view(n, -1).view(torch.uint8).contiguous()
    scale = scale.view(n, -1).contiguous()
    q_in, scale_in = torch.empty_like(q), torch.empty_like(scale)
    dist.all_to_all_single(q_in, q, group=group)
    dist.all_to_all_single(scale_in, scale, group=group)
    parts = dequantize_fp8(q_in.view(n, -1, FP8_BLOCK).view(FP8), scale_in)
    out = parts[0].clone()
    for r in range(1, n):
        out += parts[r]
    return out[:per_rank]


def replication_groups(
    model: Transformer, mesh: Mesh, shards: dict[str, Shard], expert_shards: set[str]
) -> dict[str, tuple[MeshAxis, ...]]:
    out: dict[str, tuple[MeshAxis, ...]] = {}
    for name, _ in model.named_parameters():
        if ".moe.experts." in name:
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


def attach_main_grads(
    params: list[nn.Parameter], buffer: torch.Tensor, offsets: list[int]
) -> None:
    """Make each parameter's ``main_grad`` the view of ``buffer`` at its offset and add every
    micro-batch's gradient into it as soon as autograd has accumulated it (Megatron-LM
    ``param.main_grad`` with a post-accumulate hook; ``.grad`` is freed at once)."""
    for p, offset in zip(params, offsets, strict=True):
        p.main_grad = buffer[offset : offset + p.numel()].view_as(p)
        p.register_post_accumulate_grad_hook(_accumulate)


def all_reduce_(
    buffer: torch.Tensor, group: dist.ProcessGroup, precision: Precision
) -> None:
    """In-place sum over ``group`` of ``buffer`` sent in ``precision``."""
    if precision == Precision.fp8:
        buffer.copy_(fp8_all_reduce(buffer, group))
        return
    wire = buffer.to(SYNC_DTYPES[precision])
    dist.all_reduce(wire, group=group)
    if wire is not buffer:
        buffer.copy_(wire)


def reduce_scatter_sum(
    flat: torch.Tensor, group: dist.ProcessGroup, precision: Precision
) -> torch.Tensor:
    """This rank's block of the fp32 sum over ``group`` of ``flat`` sent in ``precision``."""
    if precision == Precision.fp8:
        return fp8_reduce_scatter(flat, group)
    wire = flat.to(SYNC_DTYPES[precision])
    out = wire.new_empty(wire.numel() // dist.get_world_size(group))
    reduce_scatter_into(out, wire, group=group)
    return out.float()


class GradSync:
    """Main gradients of replicated parameters in one flat buffer per replication-group
    sequence, all-reduced in place over each live group of the sequence."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        mesh: Mesh,
        groups: dict[str, tuple[MeshAxis, ...]],
        precision: Precision,
        dtype: torch.dtype,
    ):
        self.precision = precision
        self.mesh = mesh
        # one flat bucket per (group sequence); parameters in name order on every replica
        members: dict[tuple[MeshAxis, ...], list[nn.Parameter]] = defaultdict(list)
        for name in sorted(params):
            members[groups[name]].append(params[name])
        self.buckets: list[tuple[tuple[MeshAxis, ...], torch.Tensor]] = []
        for group_seq, ps in members.items():
            offsets, end = buffer_layout(ps)
            buffer = torch.zeros(end, dtype=dtype, device=ps[0].device)
            attach_main_grads(ps, buffer, offsets)
            self.buckets.append((group_seq, buffer))

    def zero_(self) -> None:
        for _, buffer in self.buckets:
            buffer.zero_()

    @torch.no_grad()
    def __call__(self) -> None:
        for group_seq, buffer in self.buckets:
            for g in group_seq:
                if (pg := self.mesh.groups.get(g)) is not None:
                    all_reduce_(buffer, pg, self.precision)
