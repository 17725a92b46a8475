"""The kernel counts the cost model prices the eager runtime's memory-bound operators at
(cost_models.layer_graph.eager_launches, each at efficiency.elementwise_launch_us) are the
runtime's: every non-view ATen operation its eager code dispatches launches one kernel on a GPU,
so they are counted here, forward and backward, on the runtime's own functions."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cost_models.layer_graph import eager_launches
from plans import LayerOperator, catalog
from runtime.kernels import rms_norm, swiglu
from runtime.moe import Router

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
             "lift_fresh", "_local_scalar_dense"}
"""Operations that allocate or read back without launching a kernel (``lift_fresh``: a
Python scalar made a tensor, on a GPU a host-to-device copy)."""


class Kernels(TorchDispatchMode):
    """Counts the dispatched operations that launch a kernel (no views, no bare allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


def launches(forward, inputs, outputs=lambda out: (out,)) -> tuple[int, int]:
    """Kernels of ``forward()`` and of its backward into ``inputs`` from given output
    gradients (``outputs`` picks the differentiated outputs)."""
    with Kernels() as fwd:
        out = outputs(forward())
    grads = tuple(torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in out)
    with Kernels() as bwd:
        torch.autograd.grad(out, inputs, grads, allow_unused=True)
    return fwd.count, bwd.count


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)


def test_rms_norm_residual_and_swiglu():
    mixtral = catalog.load_model("mixtral-8x7b")
    x, y, w = bf16(16, 32), bf16(16, 32), bf16(32)
    assert launches(lambda: rms_norm(x, w, 1e-6), (x, w)) == eager_launches(
        LayerOperator.attn_norm, mixtral) == eager_launches(LayerOperator.ffn_norm, mixtral)
    assert launches(lambda: x + y, (x, y)) == eager_launches(LayerOperator.ffn_residual, mixtral)
    assert launches(lambda: swiglu(x, y), (x, y)) == eager_launches(
        LayerOperator.expert_swiglu, mixtral)


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseekmoe"])
def test_router(model):
    """The router without its gate GEMM, in a later micro-batch of the step (its load already
    logged once), backward through the routing weights and the balance loss."""
    m = catalog.load_model(model)
    router = Router(32, m.experts, m.top_k, 1, pre_softmax=m.router_pre_softmax)
    router.gate = torch.nn.Identity()
    logits = bf16(16, m.experts)
    router(logits.detach())
    counted = launches(lambda: router(logits), (logits,), lambda r: (r.weights, r.aux_loss))
    assert counted == eager_launches(LayerOperator.router_topk, m)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_attention_prologue(kv_heads):
    """RoPE on q and k with the tables computed at the call, then k and v repeated to q's heads
    when there are fewer (GQA): runtime.model.AttentionCore.prologue, eager."""
    from runtime.model import AttentionCore

    model = catalog.load_model("mixtral-8x7b").model_copy(
        update={"query_heads": 4, "kv_heads": kv_heads})
    core = AttentionCore(model.rope_theta)
    q, k, v = bf16(2, 16, 4, 8), bf16(2, 16, kv_heads, 8), bf16(2, 16, kv_heads, 8)
    counted = launches(lambda: core.prologue(q, k, v), (q, k, v), lambda out: out)
    assert counted == eager_launches(LayerOperator.rope, model)
