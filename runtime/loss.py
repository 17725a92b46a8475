"""The LM head and cross-entropy of the last stage (plan.cross_entropy).

``materialized``: logits = h W^T for the whole micro-batch, cast to fp32, F.cross_entropy; at
its backward peak it holds 12 bytes per logit (the saved fp32 log-probabilities, their gradient
and the logits' fp32 gradient): 55 GiB for 32k tokens of a 152k vocabulary.

``chunked``: the same sum over chunks of at most ``CHUNK_LOGITS / vocab`` tokens, with the
gradients computed in the forward (the loss is the end of the graph: its backward only scales
them), so one chunk's logits exist at a time and nothing of them is kept for backward. Kept
instead: the gradient of the hidden states (tokens x hidden, the parameter dtype) and of the
head's weight (vocab x hidden: summed in fp32 over several chunks, then scaled and cast to the
weight's dtype at the end of the forward). Same FLOPs as the materialized
loss (Liger-Kernel's fused linear cross-entropy computes it the same way). Each chunk's
memory-bound work is the plan's kernels' (runtime.kernels): eager, a pass per operation over
an fp32 copy of the chunk's logits and each chunk's weight gradient added in a pass of its own;
fused, one compiled region from the logits to their gradient and, on CUDA, the weight
gradient summed in fp32 inside its GEMM.

Under gradient-accumulation fusion the head's weight is marked (runtime.parallel.
grad_accumulation.in_gemm; plans.layout.accumulates_head_in_gemm: not where it is the
embedding's own weight): each chunk's weight-gradient GEMM adds its product, times the loss
scale, straight into the weight's main gradient (``add_product``: beta = 1, alpha = scale; an
fp32-output GEMM into an fp32 main gradient on CUDA), under either kernel set, and nothing of
vocab x hidden is allocated. The loss returns no gradient for the weight; its backward calls
``grad_ready`` for the gradient sync's hooks (runtime.parallel.data_parallel). This needs the
loss's backward started with gradient 1, since the main gradient already holds
scale x d(sum of losses)/dW from the forward: the trainer's pipeline schedule calls
``torch.autograd.backward`` on the scalar loss with no gradient (runtime.parallel.pipeline.
ActionSchedule.run: 1), and the backward checks it on the device (``torch._assert_async``,
no host wait).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from plans.layout import loss_chunk_tokens as chunk_tokens
from runtime.kernels import EAGER, KernelOps, add_product
from runtime.parallel.comm import all_gather_into, gather_sequence
from runtime.parallel.grad_accumulation import grad_ready, in_gemm, main_grad


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          scale: float, ops: KernelOps = EAGER) -> torch.Tensor:
    """scale x sum over tokens of cross_entropy(h W^T, labels): h [T, hidden], weight
    [vocab, hidden], labels [T]; each chunk's memory-bound work by ``ops`` (the plan's
    kernels: runtime.kernels.cross_entropy_grad, accumulate_matmul)."""
    return _LinearCrossEntropy.apply(h, weight, labels, None, scale,
                                     chunk_tokens(weight.shape[0]), ops, None)


def materialized_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """scale x sum over tokens of cross_entropy(logits, labels) on the whole logits in fp32."""
    return F.cross_entropy(logits.float(), labels, reduction="sum") * scale


# ---- a vocabulary split over ranks ----------------------------------------------------------


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary split over ``group`` (Megatron-LM's vocab-parallel
    embedding and LM head under tensor parallelism, runtime.parallel.tensor): rank ``index`` of
    ``parts`` holds rows [index x rows, (index + 1) x rows)."""

    group: dist.ProcessGroup
    index: int
    parts: int
    rows: int

    @property
    def first(self) -> int:
        return self.index * self.rows


def _shard_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab: VocabShard,
                         ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row losses (fp32) and the gradient of their sum for this rank's vocabulary columns
    (Megatron-LM's vocab-parallel cross-entropy): each shard's maximum, sum of exponentials and
    label logit, all-gathered over the group (3 numbers a row) and combined into the whole
    vocabulary's log-sum-exp, from which each rank's gradient follows."""
    top, total, target = ops.cross_entropy_partial(logits, labels, vocab.first)
    parts = logits.new_empty((vocab.parts * 3, logits.shape[0]), dtype=torch.float32)
    all_gather_into(parts, torch.stack([top, total, target]), group=vocab.group)
    parts = parts.view(vocab.parts, 3, -1)
    top_all = parts[:, 0].amax(0)
    lse = top_all + (parts[:, 1] * torch.exp(parts[:, 0] - top_all)).sum(0).log()
    return lse - parts[:, 2].sum(0), ops.cross_entropy_grad_from(logits, labels, vocab.first,
                                                                 lse)


class _LinearCrossEntropy(Function):
    """The chunked loss: the LM head and cross-entropy chunk by chunk with the gradients
    computed in the forward (``weight`` None: ``h`` are already the logits, one chunk).
    Without ``vocab``, each chunk's loss and gradient are ops.cross_entropy_grad's. Over a
    vocabulary split over ranks (``vocab``; ``h`` every token of the micro-batch, gathered
    along the sequence), each chunk's losses are combined over the group
    (_shard_cross_entropy); the value is the sum over ``own`` tokens (this rank's sequence
    shard: the group's values add up to the micro-batch's loss), the gradients those of every
    token's loss (the hidden states' a partial sum over the vocabulary shards, which the
    sequence gather's backward reduce-scatters). A ``weight`` marked ``in_gemm``: its
    gradient added into its main gradient in the forward (the module's docstring)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor,
                own: torch.Tensor | None, scale: float, chunk: int, ops: KernelOps,
                vocab: VocabShard | None) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_in = torch.empty_like(h)
        grad_w = None
        into = main_grad(weight) if weight is not None and in_gemm(weight) else None
        for start in range(0, h.shape[0], chunk):
            part = slice(start, start + chunk)
            # a chunk of the loss's own: the fused set writes its gradient over it (where h
            # are the logits, over their copy in the input's gradient, the gradient's place)
            logits = grad_in[part].copy_(h[part]) if weight is None else h[part] @ weight.t()
            # the chunk's losses and d(their sum) / d logits = softmax - one-hot
            if vocab is None:
                loss, grad = ops.cross_entropy_grad(logits, labels[part])
            else:
                losses, grad = _shard_cross_entropy(logits, labels[part], vocab, ops)
                loss = (losses * own[part]).sum()  # a product, not a mask: no host wait
            total += loss
            if weight is None:  # h are the logits: their gradient is the input's
                if grad is not logits:
                    logits.copy_(grad)
                continue
            torch.mm(grad, weight, out=grad_in[part])
            if into is not None:
                add_product(into, grad.t(), h[part], alpha=scale)
            else:
                grad_w = ops.accumulate_matmul(grad_w, grad.t(), h[part])
            del logits, grad  # the chunk's: freed before the next chunk's are made
        if grad_w is not None:
            # the head's weight gradient scaled and cast to the weight's dtype here, its sum
            # freed: backward only multiplies it by the loss's gradient (1 in training), in
            # place, so the sum's bytes are gone from the end of the forward on
            grad_w = grad_w.mul_(scale).to(weight.dtype)
        ctx.save_for_backward(grad_in, *([] if grad_w is None else [grad_w]))
        ctx.scale = scale
        ctx.param = weight if into is not None else None
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_in, *grad_w = ctx.saved_tensors
        g = grad_out * ctx.scale
        if ctx.param is not None:  # the weight's gradient is in its main gradient already
            torch._assert_async(grad_out == 1, "the chunked loss's backward must start with "
                                "gradient 1: its head weight's main gradient was added in "
                                "forward")
            grad_ready(ctx.param)
        w = grad_w[0].mul_(grad_out.to(grad_w[0].dtype)) if grad_w else None
        return grad_in * g.to(grad_in.dtype), w, None, None, None, None, None, None


def sharded_cross_entropy(out: torch.Tensor, labels: torch.Tensor, scale: float,
                          vocab: VocabShard, weight: torch.Tensor | None = None,
                          ops: KernelOps = EAGER) -> torch.Tensor:
    """scale x the summed cross-entropy of this rank's sequence shard under a vocabulary
    split over ``vocab.group``, with the gradients of the whole micro-batch's. ``labels``
    [b, s / n] is this rank's shard; ``out`` the final norm's output shard [b, s / n, h]
    (chunked loss: ``weight`` this rank's head rows, applied chunk by chunk) or the logits of
    every token over this rank's vocabulary columns [b, s, V / n] (materialized: one chunk)."""
    labels_all = gather_sequence(labels, vocab.group)
    b, s = labels_all.shape
    own = torch.zeros_like(labels_all, dtype=torch.bool)
    own[:, vocab.index * labels.shape[1]:(vocab.index + 1) * labels.shape[1]] = True
    if weight is None:
        h, chunk = out.flatten(0, 1), b * s
    else:
        h, chunk = gather_sequence(out, vocab.group).flatten(0, 1), chunk_tokens(weight.shape[0])
    return _LinearCrossEntropy.apply(h, weight, labels_all.flatten(), own.flatten(), scale,
                                     chunk, ops, vocab)
