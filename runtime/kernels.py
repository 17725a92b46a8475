"""The layers' memory-bound operators, as the plan's ``kernels`` says: eager PyTorch (one kernel
per operation) or fused (each operator one torch.compile region, its inputs read once and its
outputs written once; priced by cost_models.layer_graph at efficiency.fused_elementwise).

Both sets compute the same maths from the same functions below; the fused set compiles them.
The model picks its set when it is built (ModelOptions.kernels), so the model code knows no
parallelism and no compiler:

- rms_norm: fp32 statistics, output in the input's dtype;
- rotate_qk: RoPE on q and k from cos / sin tables the attention core caches per (sequence,
  head dim, device) in its buffers (rope_tables);
- swiglu: silu(a) x b;
- route: softmax, top-k, renormalisation and the balance statistics in one pass;
- gather_rows / weighted_scatter: the token permutation to expert order and back (fused, with
  every slot routed: gathers by the inverse permutation and a sum over each token's k rows,
  never an atomic index-add, bench/results/h200/kernels/fused_ops_*.json);
- cross_entropy_grad / accumulate_matmul: one chunk of the chunked loss (runtime.loss): the
  cross-entropy and its gradient over the chunk's logits (fused: written over the logits,
  which the loss owns), and the LM head's weight gradient summed over the chunks (fused, on
  CUDA: inside the GEMM, in fp32); cross_entropy_partial / cross_entropy_grad_from: the same
  over one shard of a vocabulary split over ranks, before and after the shards' log-sum-exp is
  combined;
- adamw_step: the optimizer's AdamW update of a flat fp32 master slice from its gradient in the
  gradient's own dtype, writing the updated weights in the parameter dtype in the same pass
  (runtime.parallel.optimizer; eager: torch's fused AdamW after a cast and before a copy).

Compiled regions are static-shaped (dynamic=False) where the shapes are the plan's (tokens,
hidden, heads); the expert-row count varies from step to step under expert parallelism and
capacity, so the regions taking expert rows mark that dimension dynamic instead of
recompiling for every count, and so do RMSNorm's (over its flattened rows: one region serves
the hidden-size and the per-head norms of every layout) and the chunked loss's (the last chunk
is ragged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plans.enums import Kernels

# ---- the operators ----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, returned in ``x``'s dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rope_tables(seq: int, dim: int, theta: float, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [seq, dim / 2] fp32, positions 0..seq-1."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of x [b, s, heads, d] by [s, d / 2] tables, in fp32,
    returned in ``x``'s dtype."""
    d = x.shape[-1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return rotate(q, cos, sin), rotate(k, cos, sin)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def count_per_expert(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """Slots per expert ([experts], int64); indices < 0 are not counted. A scatter-add, not
    torch.bincount, whose CUDA kernel reads the maximum index back to the host."""
    flat = indices.reshape(-1)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat.clamp_min(-1) + 1, torch.ones_like(flat))
    return counts[1:]


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top-k slots and their weights (renormalised to sum
    to one, or the softmax's with ``renormalize`` false), and this rank's balance statistics:
    slots per expert (in the probabilities' dtype) and summed probability per expert."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    counts = count_per_expert(indices, probs.shape[1]).to(probs.dtype)
    return weights, indices, counts, probs.sum(0)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with inv[perm[i]] = i."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


class _PermuteRows(torch.autograd.Function):
    """x[perm] for a permutation ``perm`` of x's rows. Its gradient is the inverse permutation's
    gather; autograd's for advanced indexing is an accumulating index_put (atomic adds, slow in
    bf16), which a permutation never needs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor | None
                ) -> torch.Tensor:
        ctx.save_for_backward(perm if inverse is None else inverse)
        ctx.inverted = inverse is not None
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        return grad.index_select(0, p if ctx.inverted else inverse_permutation(p)), None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor,
                 inverse: torch.Tensor | None = None) -> torch.Tensor:
    """x[perm] for a permutation of x's rows (``inverse``, when the caller has it, saves
    computing it in the backward)."""
    return _PermuteRows.apply(x, perm, inverse)


class _ExpandRows(torch.autograd.Function):
    """tokens[slots // k] where ``slots`` holds every one of the T k slot ids once (dropless
    routing): each token's row k times, in expert order. The gradient brings the k rows of each
    token back to slot order (the inverse permutation's gather) and sums them: no atomic
    index_add."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(slots)
        ctx.k = k
        return tokens.index_select(0, torch.div(slots, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slots,) = ctx.saved_tensors
        per_slot = grad.index_select(0, inverse_permutation(slots))
        return per_slot.view(-1, ctx.k, grad.shape[1]).sum(1), None, None


def _every_slot(slots: torch.Tensor, num_tokens: int, k: int) -> bool:
    """Whether ``slots`` (distinct flat slot ids) holds all num_tokens x k of them, i.e. is a
    permutation: dropless routing with every expert local (one rank, or all-to-all dispatch).
    Shapes only: no wait on the device."""
    return slots.numel() == num_tokens * k


def gather_rows(tokens: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    """The token row of every flat (token * k + slot) id: the permutation to expert order."""
    return tokens[torch.div(slots, k, rounding_mode="floor")]


def gather_every_slot(tokens: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    """gather_rows, its gradient without atomics when every slot is routed (_ExpandRows)."""
    if _every_slot(slots, tokens.shape[0], k):
        return _ExpandRows.apply(tokens, slots, k)
    return gather_rows(tokens, slots, k)


def weighted_scatter(
    rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, num_tokens: int, k: int
) -> torch.Tensor:
    """sum over slots of weight x row, back at each slot's token."""
    w = weights.reshape(-1)[slots].to(rows.dtype).unsqueeze(1)
    out = rows.new_zeros(num_tokens, rows.shape[1])
    return out.index_add(0, torch.div(slots, k, rounding_mode="floor"), rows * w)


def weighted_sum(per_slot: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """sum over each token's k slot rows (token-major) of weight x row."""
    rows = per_slot.view(-1, k, per_slot.shape[1])
    return (rows * weights.reshape(-1, k, 1).to(per_slot.dtype)).sum(1)


def index_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x[perm] by plain indexing (its gradient an accumulating index_put): the eager set's
    permute_rows; ``inverse`` is accepted for the fused set's signature and not needed here."""
    return x[perm]


def cross_entropy_grad(logits: torch.Tensor, labels: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over rows of cross_entropy(logits, labels) in fp32, and its gradient with
    respect to the logits (softmax - one-hot) in the logits' dtype: the memory-bound part of
    one chunk of the chunked loss. Eagerly in place on one fp32 copy (its cast, log-sum-exp,
    subtraction, exponential and cast back each a pass over the chunk)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    loss = (lse - x.gather(1, labels[:, None]).squeeze(1)).sum()
    grad = x.sub_(lse[:, None]).exp_()
    grad[torch.arange(labels.shape[0], device=x.device), labels] -= 1.0
    return loss, grad.to(logits.dtype)


def cross_entropy_grad_over(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """cross_entropy_grad's maths in the form one compiled region fuses, the gradient written
    over ``logits`` (a chunk the caller owns; returns the loss): the one-hot as a comparison
    inside the gradient's expression (not an indexed write into it), so the logits are read
    by the row reductions and once more by the pass that overwrites them, element by element,
    with the gradient in their dtype. No fp32 copy and no second chunk-sized tensor."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    loss = (lse - x.gather(1, labels[:, None]).squeeze(1)).sum()
    hit = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    logits.copy_((torch.exp(x - lse[:, None]) - hit.to(torch.float32)).to(logits.dtype))
    return loss


def cross_entropy_partial(logits: torch.Tensor, labels: torch.Tensor, first: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocabulary shard's part of cross_entropy_grad (its columns are the vocabulary's
    rows ``first`` onwards; runtime.loss combines the shards'): per row in fp32, the largest
    logit, the sum of exp(logit - that maximum), and the label's logit where the label is in
    the shard (0 elsewhere)."""
    x = logits.float()
    top = x.amax(-1)
    total = torch.exp(x - top[:, None]).sum(-1)
    local = labels - first
    inside = (local >= 0) & (local < x.shape[1])
    target = torch.where(inside, x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])
                         .squeeze(1), 0.0)
    return top, total, target


def cross_entropy_grad_from(logits: torch.Tensor, labels: torch.Tensor, first: int,
                            lse: torch.Tensor) -> torch.Tensor:
    """The gradient of cross_entropy_partial's shard (softmax - one-hot over its columns)
    from the whole vocabulary's log-sum-exp per row, in the logits' dtype."""
    x = logits.float()
    cols = torch.arange(x.shape[1], device=x.device)[None, :] + first
    grad = torch.exp(x - lse[:, None]) - (cols == labels[:, None]).to(torch.float32)
    return grad.to(logits.dtype)


def cross_entropy_grad_from_over(logits: torch.Tensor, labels: torch.Tensor, first: int,
                                 lse: torch.Tensor) -> torch.Tensor:
    """cross_entropy_grad_from written over ``logits`` (a chunk the caller owns), returned."""
    return logits.copy_(cross_entropy_grad_from(logits, labels, first, lse))


def _over(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
          ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """cross_entropy_grad's signature for a region that writes the gradient over the logits."""
    return lambda logits, labels: (fn(logits, labels), logits)


def accumulate_matmul(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor
                      ) -> torch.Tensor:
    """acc + a @ b: the LM head's weight gradient summed over the chunked loss's chunks. The
    first chunk's product as the GEMM writes it; from the second on, the sum in fp32, each
    product added in a pass of its own."""
    out = a @ b
    if acc is None:
        return out
    if acc.dtype != torch.float32:
        acc = acc.float()
    return acc.add_(out)


def add_product(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                alpha: float = 1.0) -> None:
    """``target += alpha a @ b`` inside the GEMM (cuBLAS with beta = 1): in the operands'
    dtype, or bf16 operands into an fp32 target on CUDA (``out_dtype``: cuBLAS sums in fp32);
    on CPU, which has no mixed-dtype addmm, the operands widened (the same sums, exact
    casts)."""
    if target.dtype == a.dtype:
        target.addmm_(a, b, alpha=alpha)
    elif target.is_cuda:
        torch.addmm(target, a, b, alpha=alpha, out_dtype=target.dtype, out=target)
    else:
        target.addmm_(a.to(target.dtype), b.to(target.dtype), alpha=alpha)


def accumulate_matmul_in_gemm(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor
                              ) -> torch.Tensor:
    """accumulate_matmul with the sum inside the GEMM on CUDA: every product in fp32 (the
    GEMM's fp32 output from bf16 inputs, ``out_dtype``), each later one added by the GEMM
    itself (add_product), so no product is written in bf16 and added in a pass of its own.
    Elsewhere (no fp32-output GEMM on CPU) accumulate_matmul."""
    if not a.is_cuda or a.dtype == torch.float32:
        return accumulate_matmul(acc, a, b)
    if acc is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    add_product(acc, a, b)
    return acc


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, out: torch.Tensor | None, step: torch.Tensor,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update in place (torch's fused AdamW formula, ``_fused_adamw_``): decoupled
    decay, moments, bias corrections from ``step`` (already counted), then ``out`` (the
    parameters, another dtype) gets the updated master. ``grad`` is read in its own dtype (a
    bf16 main gradient needs no fp32 copy)."""
    g = grad.float()
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias2_sqrt = (1 - beta2 ** step).sqrt()
    master.sub_(step_size * exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + eps))
    if out is not None:
        out.copy_(master)


def fused_adamw_step(cuda: bool) -> Callable[..., None]:
    """``adamw_step`` as one torch.compile region on CUDA: a single pass reading master,
    gradient and moments and writing them and the parameters; flat buffers of every bucket
    size share one graph (the length is dynamic). Elsewhere the same function eagerly (as
    torch's own fused AdamW is CUDA-only): on CPU a process runs many models, and each view,
    dtype and hyperparameter variant would be a recompilation of the one code object, up to
    dynamo's recompile limit (8), a hard failure under fullgraph."""
    if not cuda:
        return adamw_step
    compiled = torch.compile(adamw_step, fullgraph=True)

    def call(master, grad, exp_avg, exp_avg_sq, out, *scalars) -> None:
        for t in (master, grad, exp_avg, exp_avg_sq, out):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        compiled(master, grad, exp_avg, exp_avg_sq, out, *scalars)

    return call


# ---- the sets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelOps:
    """The implementation of each memory-bound operator a model is built with."""

    kind: Kernels
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotate_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    route: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    gather_rows: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    weighted_scatter: Callable[..., torch.Tensor]
    permute_rows: Callable[..., torch.Tensor]
    """x[perm] for a permutation of x's rows (the all-to-all dispatcher's regroup)."""
    cross_entropy_grad: Callable[[torch.Tensor, torch.Tensor],
                                 tuple[torch.Tensor, torch.Tensor]]
    """The loss and the gradient of a chunk of logits the caller owns: the fused set writes the
    gradient over the logits and returns them (cross_entropy_grad_from likewise)."""
    accumulate_matmul: Callable[..., torch.Tensor]
    cross_entropy_partial: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    cross_entropy_grad_from: Callable[..., torch.Tensor]
    """The chunked loss over a vocabulary split over ranks (runtime.loss.VocabShard)."""


EAGER = KernelOps(Kernels.eager, rms_norm, rotate_qk, swiglu, route, gather_rows,
                  weighted_scatter, index_rows, cross_entropy_grad, accumulate_matmul,
                  cross_entropy_partial, cross_entropy_grad_from)


def _static(fn: Callable) -> Callable:
    """One compiled region of fixed shapes (the plan's tokens, hidden size and heads)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _rows_dynamic(fn: Callable, *row_args: int) -> Callable:
    """One compiled region whose arguments ``row_args`` have a leading dimension of expert rows,
    which varies between steps (EP, capacity): marked dynamic, so one graph serves every
    count."""
    compiled = torch.compile(fn, fullgraph=True)

    def call(*args):
        for i in row_args:
            torch._dynamo.maybe_mark_dynamic(args[i], 0)
        return compiled(*args)

    return call


def _rowwise(fn: Callable) -> Callable:
    """A compiled region over the rows of its first argument's last dimension (RMSNorm): the
    leading dimensions flattened into one dynamic row count, so every call site (the block's
    norms over the hidden size, the per-head q and k norms over the head size, each layout's
    shards of them) shares one graph per width and dtype. Static shapes compiled one graph
    per call site and layout, and a process that builds several models (runtime/parity.py: the
    layout, then its bf16 and fp32 one-rank references) passed dynamo's recompile limit
    (8), a hard failure under fullgraph."""
    compiled = _rows_dynamic(fn, 0)

    def call(x: torch.Tensor, *args):
        return compiled(x.reshape(-1, x.shape[-1]), *args).view(x.shape)

    return call


def load_compiler() -> None:
    """The compiler's process-wide start-up, done once when a fused set is built: import
    inductor (and with it Triton, on CUDA) and compute its key of torch's own sources
    (torch._inductor.codecache.torch_key, a hash of every file of the torch package, part of
    every cache key). The first compiled region of a launch pays both otherwise, inside the
    first step and whether its graphs come from the cache or not: on the CPU machine 0.9 s of
    import and 0.25 s of hashing beside a relaunch's cache loads. The launch's time is the
    same; what the first step then measures is tracing and loading the compiled regions."""
    import torch._inductor.compile_fx  # noqa: F401  (imports inductor's lowering and codegen)
    from torch._inductor.codecache import torch_key

    torch_key()


def kernel_ops(kind: Kernels) -> KernelOps:
    """The operator set of ``kind``: EAGER, or the same functions compiled (the compiler
    loaded first, ``load_compiler``)."""
    if kind == Kernels.eager:
        return EAGER
    load_compiler()
    return KernelOps(
        Kernels.fused,
        rms_norm=_rowwise(rms_norm),
        rotate_qk=_static(rotate_qk),
        swiglu=_rows_dynamic(swiglu, 0, 1),
        # the router stays eager: its compiled region measured 2x slower forward + backward
        # (0.92 ms against 0.49 at Mixtral-8x7B shapes, 1.13 against 0.57 at Qwen3-30B-A3B's;
        # bench/kernels/fused_ops_gpu.py at 41dda38; git keeps bench/results/h200/overlap14/)
        route=route,
        gather_rows=_fused_gather_rows(),
        weighted_scatter=_fused_weighted_scatter(),
        permute_rows=permute_rows,
        # the chunk's rows: plans.layout.loss_chunk_tokens, fewer in the last chunk
        # both gradients written over the chunk's logits (runtime.loss owns every chunk)
        cross_entropy_grad=_over(_rows_dynamic(cross_entropy_grad_over, 0, 1)),
        accumulate_matmul=accumulate_matmul_in_gemm,
        cross_entropy_partial=_rows_dynamic(cross_entropy_partial, 0, 1),
        cross_entropy_grad_from=_rows_dynamic(cross_entropy_grad_from_over, 0, 1, 3),
    )


def _fused_gather_rows() -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """Every slot routed: _ExpandRows (one gather each way, no atomics, nothing left to fuse);
    a subset of the slots (all-gather dispatch, capacity): one compiled region."""
    subset = _rows_dynamic(gather_rows, 1)

    def call(tokens: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
        if _every_slot(slots, tokens.shape[0], k):
            return gather_every_slot(tokens, slots, k)
        return subset(tokens, slots, k)

    return call


def _fused_weighted_scatter() -> Callable[..., torch.Tensor]:
    """Every slot routed: the rows back to slot order by the inverse permutation (a gather each
    way), then the weighting and the sum over each token's k rows as one compiled region (the
    weighted rows never in memory); a subset of the slots: the index-add operator compiled."""
    subset = _rows_dynamic(weighted_scatter, 0, 1)
    weighted = _static(weighted_sum)

    def call(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, num_tokens: int,
             k: int) -> torch.Tensor:
        if _every_slot(slots, num_tokens, k):
            per_slot = permute_rows(rows, inverse_permutation(slots), slots)
            return weighted(per_slot, weights, k)
        return subset(rows, slots, weights, num_tokens, k)

    return call
