"""The LM head and cross-entropy of the last stage (plan.cross_entropy).

``materialized``: logits = h W^T for the whole micro-batch, cast to fp32, F.cross_entropy; at
its backward peak it holds 12 bytes per logit (the saved fp32 log-probabilities, their gradient
and the logits' fp32 gradient): 55 GiB for 32k tokens of a 152k vocabulary.

``chunked``: the same sum over chunks of at most ``CHUNK_LOGITS / vocab`` tokens, with the
gradients computed in the forward (the loss is the end of the graph: its backward only scales
them), so one chunk's logits exist at a time and nothing of them is kept for backward. Kept
instead: the gradient of the hidden states (tokens x hidden, the parameter dtype) and of the
head's weight (vocab x hidden: summed in fp32 over several chunks; eager kernels keep one
chunk's as the GEMM writes it). Same FLOPs as the materialized
loss (Liger-Kernel's fused linear cross-entropy computes it the same way). Each chunk's
memory-bound work is the plan's kernels' (runtime.kernels): eager, a pass per operation over
an fp32 copy of the chunk's logits and each chunk's weight gradient added in a pass of its own;
fused, one compiled region from the logits to their gradient and, on CUDA, the weight
gradient summed in fp32 inside its GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function

from plans.layout import loss_chunk_tokens as chunk_tokens
from runtime.kernels import EAGER, KernelOps


class _ChunkedLinearCrossEntropy(Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: float,
                chunk: int, ops: KernelOps) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = None
        for start in range(0, h.shape[0], chunk):
            hc, yc = h[start:start + chunk], labels[start:start + chunk]
            # the chunk's losses and d(their sum) / d logits = softmax - one-hot
            loss, grad = ops.cross_entropy_grad(hc @ weight.t(), yc)
            total += loss
            torch.mm(grad, weight, out=grad_h[start:start + chunk])
            grad_w = ops.accumulate_matmul(grad_w, grad.t(), hc)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.scale, ctx.weight_dtype = scale, weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        g = grad_out * ctx.scale
        return (grad_h * g.to(grad_h.dtype), (grad_w * g.to(grad_w.dtype)).to(ctx.weight_dtype),
                None, None, None, None)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          scale: float, ops: KernelOps = EAGER) -> torch.Tensor:
    """scale x sum over tokens of cross_entropy(h W^T, labels): h [T, hidden], weight
    [vocab, hidden], labels [T]; each chunk's memory-bound work by ``ops`` (the plan's
    kernels: runtime.kernels.cross_entropy_grad, accumulate_matmul)."""
    return _ChunkedLinearCrossEntropy.apply(h, weight, labels, scale,
                                            chunk_tokens(weight.shape[0]), ops)


def materialized_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """scale x sum over tokens of cross_entropy(logits, labels) on the whole logits in fp32."""
    return F.cross_entropy(logits.float(), labels, reduction="sum") * scale
