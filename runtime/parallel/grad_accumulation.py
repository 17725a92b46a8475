"""Gradient-accumulation fusion (plan field ``grad_accumulation_fusion``): the weight-gradient
GEMMs add each micro-batch's gradient into the parameter's main gradient themselves (cuBLAS
with beta = 1), so no gradient tensor is written and no separate pass reads it back and adds
it. Megatron-LM's ``gradient_accumulation_fusion`` (its ``fused_weight_gradient_mlp_cuda``);
here ``addmm`` into ``param.main_grad`` (data_parallel.attach_main_grads), with ``out_dtype``
when the main gradient is fp32 and the GEMM's operands bf16.

Applied as a transform of the model after the parallel ones (``apply_grad_accumulation_fusion``,
runtime.parallel.parallelize):

- every ``nn.Linear`` of the transformer blocks (the attention projections, the router's gate,
  dense and shared-expert FFNs);
- the LM head where ``plans.layout.accumulates_head_in_gemm`` says so (the chunked loss, the
  head not the embedding's own weight): the chunked loss adds each chunk's weight gradient,
  times the loss scale, into the main gradient inside its GEMMs in the forward and calls
  ``grad_ready`` in its backward (runtime.loss). The materialized loss's head, and a head tied
  to the embedding on one stage (whose gradient, a scatter, arrives through autograd into the
  same parameter), keep autograd's gradient; so does the embedding;
- the routed experts where ``plans.layout.accumulates_experts_in_gemm`` says so (few wide
  experts per rank, or every expert GEMM per expert): their weight gradients as one matmul
  per expert (the forward and the rows' gradient as the experts' ExpertGemm runs them).
  Many narrow grouped experts keep autograd's grouped weight gradient, which a separate pass
  adds (``torch._grouped_mm`` has no accumulating form).

Such a GEMM's autograd function returns no gradient for its weight: its backward adds into
``main_grad`` and then calls ``grad_ready``, which runs the hooks the gradient sync put on the
parameter (``on_grad_ready``) where a post-accumulate hook would have run on a gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plans.enums import ExpertGemm
from plans.layout import accumulates_experts_in_gemm
from runtime.kernels import add_product
from runtime.model import Transformer
from runtime.moe import GroupedExperts, HostCounts, expert_product
from runtime.parallel.wrappers import (
    Accumulating,
    AccumulatingExperts,
    AccumulatingLinear,
    chain,
    replace,
)

IN_GEMM = "accumulates_in_gemm"
"""Attribute marking a parameter whose weight-gradient GEMM adds into its main gradient."""
_HOOKS = "grad_ready_hooks"


def in_gemm(p: torch.Tensor) -> bool:
    return getattr(p, IN_GEMM, False)


class _Handle:
    def __init__(self, p: torch.Tensor, fn: Callable):
        self.p, self.fn = p, fn

    def remove(self) -> None:
        hooks = getattr(self.p, _HOOKS, [])
        if self.fn in hooks:
            hooks.remove(self.fn)


def on_grad_ready(p: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> _Handle:
    """Run ``fn(p)`` each time a GEMM has added a micro-batch's gradient into ``p.main_grad``
    (what ``register_post_accumulate_grad_hook`` is for autograd's gradients)."""
    if not hasattr(p, _HOOKS):
        setattr(p, _HOOKS, [])
    getattr(p, _HOOKS).append(fn)
    return _Handle(p, fn)


def grad_ready(p: torch.Tensor) -> None:
    for fn in list(getattr(p, _HOOKS, ())):
        fn(p)


def main_grad(param: torch.Tensor) -> torch.Tensor:
    """The tensor the GEMM adds into: the main gradient the gradient sync attached, else (a
    model outside a trainer) ``.grad``, started at zero."""
    target = getattr(param, "main_grad", None)
    if target is None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        target = param.grad
    return target


class _LinearAccumulating(torch.autograd.Function):
    """``x @ W.T`` whose backward adds ``g.T @ x`` into W's main gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.param = weight
        return F.linear(x, weight.detach())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (x,), weight = ctx.saved_tensors, ctx.param
        gx = g @ weight.detach() if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            add_product(main_grad(weight), g.reshape(-1, g.shape[-1]).t(),
                         x.reshape(-1, x.shape[-1]))
            grad_ready(weight)
        return gx, None


def linear_accumulating(param: nn.Parameter, x: torch.Tensor) -> torch.Tensor:
    return _LinearAccumulating.apply(x, param)


class _ExpertsAccumulating(torch.autograd.Function):
    """Rows grouped by expert times each expert's ``w[e]`` ([E, out, in]) and the rows'
    gradient as ``product`` runs them (runtime.moe.expert_product: grouped GEMMs, or one
    matmul per expert); the weight gradient as one matmul per expert that adds
    ``g_e.T @ x_e`` into the expert's slice of the main gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, counts: HostCounts,
                product: Callable) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.counts, ctx.param, ctx.product = counts, weight, product
        return product(x, weight.detach(), counts)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (x,), w = ctx.saved_tensors, ctx.param.detach()
        gx = None
        if ctx.needs_input_grad[0]:  # g_e @ w[e]: the product with w[e].T
            gx = ctx.product(g, w.transpose(-2, -1), ctx.counts)
        if ctx.needs_input_grad[1]:
            target = main_grad(ctx.param)
            start = 0
            for e, c in enumerate(ctx.counts.tolist()):
                if c:
                    add_product(target[e], g[start:start + c].t(), x[start:start + c])
                start += c
            grad_ready(ctx.param)
        return gx, None, None, None


def accumulating_matmul(gemm: ExpertGemm) -> Callable:
    """``GroupedExperts.matmul``'s accumulating form for ``gemm``: its products forward and
    for the rows' gradient, and each weight's gradient added into its main gradient by
    per-expert GEMMs (the counts reach the host in the background, ``HostCounts``)."""
    product = expert_product(gemm)

    def matmul(counts: torch.Tensor):
        host = HostCounts(counts)

        def mm(x: torch.Tensor, w: nn.Parameter) -> torch.Tensor:
            return _ExpertsAccumulating.apply(x, w, host, product)
        return mm
    return matmul


def per_expert_accumulating(counts: torch.Tensor):
    """``accumulating_matmul`` of ExpertGemm grouped: grouped GEMMs forward and for the rows'
    gradient, per-expert accumulating weight gradients."""
    return accumulating_matmul(ExpertGemm.grouped)(counts)


def apply_grad_accumulation_fusion(model: Transformer, head: bool) -> None:
    """Route the weight gradients of the blocks' Linear layers, of the routed experts where
    ``accumulates_experts_in_gemm`` holds and, with ``head`` (plans.layout.
    accumulates_head_in_gemm), of this stage's LM head into their main gradients inside the
    GEMMs. The modules are wrapped (runtime.parallel.wrappers.Accumulating); ``mark_parameters``
    marks their parameters once the model is materialised (materialising replaces the
    parameter objects). The chunked loss reads the head's mark (runtime.loss); the wrapped
    head's own forward, which it does not run, is the accumulating Linear's."""
    for block in model.layers.values():
        fuse_accumulation(block)
    if head and model.output is not None:
        if model.tok_embeddings is not None and model.output.weight is model.tok_embeddings.weight:
            raise ValueError("grad_accumulation_fusion: a head tied to the embedding on one "
                             "stage keeps autograd's gradient (plans.layout."
                             "accumulates_head_in_gemm)")
        model.output = AccumulatingLinear(model.output, linear_accumulating)


def fuse_accumulation(root: nn.Module) -> None:
    """The transform on one module tree: a block, or one bare MoE layer
    (bench/layers/moe_layer_gpu.py --grad-accumulation-fusion)."""
    for name, module in list(root.named_modules()):
        if isinstance(module, nn.Linear):
            if module.bias is not None:
                raise ValueError(f"{type(module).__name__} with a bias: the runtime's "
                                 "Linear layers have none")
            replace(root, name, AccumulatingLinear(module, linear_accumulating))
        elif isinstance(module, GroupedExperts):
            local_experts, local_ffn, _ = module.w1.shape
            if accumulates_experts_in_gemm(True, local_experts, local_ffn, module.gemm):
                replace(root, name, AccumulatingExperts(module, accumulating_matmul(module.gemm)))


def mark_parameters(model: nn.Module) -> None:
    """Mark (``in_gemm``) the parameters of the modules ``apply_grad_accumulation_fusion``
    routed, for the gradient sync to attach (data_parallel.attach_main_grads)."""
    for module in model.modules():
        if any(isinstance(m, Accumulating) for m in chain(module)):
            for p in module.parameters(recurse=False):
                setattr(p, IN_GEMM, True)
