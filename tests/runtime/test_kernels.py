"""plan.kernels fused: the compiled memory-bound operators (runtime.kernels) train the same
model as eager PyTorch, on one process and on two gloo ranks with expert parallelism (the
expert-row dimension varies there), within the parity tolerances (fp32 on CPU)."""

from __future__ import annotations

import dataclasses

import torch
from dist_workers import make_plan, reference_trainer
from test_parity import GRAD_RTOL, LOSS_RTOL, check_one_step

from plans import Dispatch, Kernels, Recompute
from runtime.config import ModelConfig, ModelOptions
from runtime.kernels import EAGER, kernel_ops
from runtime.model import AttentionCore, Transformer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def one_step(plan) -> tuple[float, dict[str, torch.Tensor]]:
    trainer = reference_trainer(plan)
    loss = trainer.forward_backward(0)
    trainer.sync_gradients()
    return loss, {k: g for k, (g, _) in trainer.local_gradients().items()}


def test_fused_model_matches_eager_on_one_process():
    """Every fused operator (norms, RoPE, SwiGLU, router, permutations), RoPE under selective
    recomputation. Small shapes: CPU compilation is most of this test's time."""
    layout = dict(recompute=Recompute.selective, global_batch=2)
    eager_loss, eager = one_step(make_plan(**layout))
    fused_loss, fused = one_step(make_plan(kernels=Kernels.fused, **layout))
    assert abs(fused_loss - eager_loss) / eager_loss < LOSS_RTOL, (fused_loss, eager_loss)
    assert fused.keys() == eager.keys()
    for name, grad in fused.items():
        assert _rel(grad, eager[name]) < GRAD_RTOL, (name, _rel(grad, eager[name]))


def test_fused_ep2_matches_eager_reference(pool2):
    """dp2 x ep2 with the all-to-all dispatcher and fused kernels against the eager one-rank
    run: the compiled permutations see a different row count on each rank and step."""
    layout = dict(dp=2, ep=2, dispatch=Dispatch.all_to_all, global_batch=2)
    check_one_step(pool2, make_plan(kernels=Kernels.fused, **layout),
                   reference=make_plan(**layout))


def test_the_plan_picks_the_operator_set():
    from plans.catalog import load_model

    spec = load_model("tiny-moe")
    eager = Transformer(ModelConfig(spec))
    fused = Transformer(ModelConfig(spec, ModelOptions(kernels=Kernels.fused)))
    assert eager.norm.ops is EAGER and fused.norm.ops.kind == Kernels.fused
    block = fused.layers["0"]
    assert block.moe.ops is fused.norm.ops is block.moe.dispatcher.ops
    assert kernel_ops(Kernels.eager) is EAGER


def test_rope_tables_are_cached_per_sequence_and_device():
    # the fused set's table cache over the eager functions (no compilation needed here)
    core = AttentionCore(10_000.0, dataclasses.replace(EAGER, kind=Kernels.fused))
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 1, 8)
    core._rope(q, k)
    first = core.rope_cos
    core._rope(q, k)
    assert core.rope_cos is first and first.shape == (6, 4)
    core._rope(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8))
    assert core.rope_cos.shape == (4, 4)
    assert "rope_cos" not in core.state_dict()
