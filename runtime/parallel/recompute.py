"""The routed experts' activation recomputed in backward (selective recomputation's module
``moe_act``, plans.operators.MODULE_OPERATORS: the operator ``expert_swiglu``).

The SwiGLU's output is fc2's input, which fc2's backward reads for its weight gradient. Here
the activation runs without an autograd graph, keeping only its inputs (fc1's and fc3's
outputs), and fc2 runs under saved-tensor hooks that save, in place of its input (or of a view
of it), only where in the input the saved tensor lies: once fc2's forward returns, nothing
holds the activation's output and its memory is free. When fc2's backward unpacks its input,
the activation runs again, with a graph, from the kept inputs, and fc2 reads the rerun's
output; the activation's own backward then goes through that rerun's graph, so the activation
runs twice a step, and nothing is copied. Megatron-Core's ``--recompute-modules moe_act``
keeps the same tensors (its CheckpointWithoutOutput, megatron/core/tensor_parallel/random.py,
frees the output's storage after fc2's forward and copies the rerun into it when fc2's output
gradient arrives).

Generic in how the experts' GEMMs run (runtime.moe.GroupedExperts' ``matmul``: grouped,
per expert, accumulating into the main gradients; each saves the activation's output or views
of it) and in the activation's kernels (eager or compiled).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Rerun:
    """One forward's activation: its function and node, and once rerun in backward, the rerun's
    output and the detached inputs its graph starts from."""

    def __init__(self, fn: Activation):
        self.fn = fn
        self.node: torch.autograd.graph.Node | None = None
        """The activation's autograd node, which keeps its inputs."""
        self.graph: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def output(self) -> torch.Tensor:
        """The activation's output, rerun from the inputs its node keeps at the first call."""
        if self.graph is None:
            with torch.enable_grad():
                inputs = tuple(t.detach().requires_grad_() for t in self.node.saved_tensors)
                self.graph = (self.fn(*inputs), inputs)
        return self.graph[0]


class _ActivationWithoutGraph(torch.autograd.Function):
    """``fn(a, b)`` keeping ``a`` and ``b`` and nothing else; its backward runs through the
    graph of the rerun (``_Rerun.output``), made when fc2's backward read it."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, rerun: _Rerun) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.rerun = rerun
        return rerun.fn(a, b).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, inputs = ctx.rerun.output(), ctx.rerun.graph[1]
        ctx.rerun.graph = None
        ga, gb = torch.autograd.grad(out, inputs, grad)
        return ga, gb, None


def activation_recomputed(fn: Activation, a: torch.Tensor, b: torch.Tensor,
                          fc2: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fc2(fn(a, b))`` keeping neither ``fn``'s output nor its graph: rerun from ``a`` and
    ``b`` when fc2's backward reads it (the module doc). runtime.moe.GroupedExperts'
    ``activation``; without autograd, the plain product."""
    if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return fc2(fn(a, b))
    rerun = _Rerun(fn)
    h = _ActivationWithoutGraph.apply(a, b, rerun)
    rerun.node = h.grad_fn
    # the hooks live as long as what they saved: they hold no reference to h
    where = h.untyped_storage().data_ptr() if h.numel() else None

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == where:  # h or a view of it
            return t.storage_offset(), t.size(), t.stride()
        return t

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        offset, size, stride = saved
        return rerun.output().detach().as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fc2(h)
