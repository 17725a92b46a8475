"""Differentiable collectives. Each backward is the adjoint of its forward: all-to-all <->
the inverse all-to-all, all-gather <-> reduce-scatter (sum)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

ProcessGroup = dist.ProcessGroup

reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""dist.reduce_scatter_tensor and all_gather_into_tensor, renamed *_single in torch 2.13 (the
GPU machines run 2.11, which has only the old names)."""


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Rows ``in_splits[r]`` of ``x`` go to rank r; ``out_splits[r]`` rows come from rank r."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group=group)
    return out


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ctx.group), None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, ctx.group), None


def all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (backward: reduce-scatter of the sum)."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over ranks, rank r keeps the r-th block of dim 0 (backward: all-gather)."""
    return _ReduceScatter.apply(x, group)


def gather_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, s/n, ...] sequence shards -> [b, s, ...]."""
    return all_gather(x.transpose(0, 1), group).transpose(0, 1)


def scatter_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, s, ...] partial sums -> this rank's summed sequence shard [b, s/n, ...]."""
    return reduce_scatter(x.transpose(0, 1), group).transpose(0, 1)


class _SumIdentityBackward(Function):
    """All-reduce (sum) whose backward is the identity: for a value every rank of the group then
    uses identically (a replicated loss), each rank back-propagates only its own share and the
    later gradient all-reduce adds the shares."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_replicated(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _SumIdentityBackward.apply(x, group)


# ---- Ulysses layout changes ------------------------------------------------------------------


def _seq_to_head(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    b, s_local, heads, d = x.shape
    send = x.reshape(b, s_local, n, heads // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s_local, heads // n, d)


def _head_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    b, s, heads_local, d = x.shape
    send = x.reshape(b, n, s // n, heads_local, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * heads_local, d)


class _SeqToHead(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _HeadToSeq.apply(grad, ctx.group), None


class _HeadToSeq(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _SeqToHead.apply(grad, ctx.group), None


def seq_to_head(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Ulysses all-to-all: [b, s/n, H, d] sequence-sharded -> [b, s, H/n, d] head-sharded."""
    return _SeqToHead.apply(x, group)


def head_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Inverse Ulysses all-to-all: [b, s, H/n, d] -> [b, s/n, H, d]."""
    return _HeadToSeq.apply(x, group)
