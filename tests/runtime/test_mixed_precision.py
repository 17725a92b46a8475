"""Mixed precision as on CUDA, forced on CPU with bf16 parameters: bytes of parameters, main
gradients and optimizer states per rank equal the cost model's (2 B, 4 or 2 B, 12 B per
parameter of the ZeRO-1 shard), and parallel layouts follow the one-rank bf16 run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_workers import OPTIM, make_plan, reference_trainer
from test_parity import A2A, AG, _rel

from cost_models.memory import memory_breakdown, optimizer_step_workspace
from cost_models.params import largest_param, stage_params_of
from plans import Optimizer, OptimizerSharding, Precision

ZERO1, NONE = OptimizerSharding.zero1, OptimizerSharding.none

BF16_LOSS_RTOL = 1e-2
"""bf16 keeps 8 mantissa bits (2^-8 = 0.4% per rounding); a layout changes the order of the
sums and roundings in every layer. Measured: at most 1.2e-3 over six steps."""
BF16_GRAD_RTOL = 2e-2
"""Gradients pass through every layer's rounded activations backwards. Measured: 0.3%; a
missing (50%) or doubled (100%) replica is far above."""

MEMORY_CASES = {
    "dp2_zero1_fp32_sync": (dict(dp=2), True),
    "sp2_ep2_zero1_bf16_sync": (dict(sp=2, ep=2, grad_sync_precision=Precision.bf16), True),
    "dp2_ep2_zero1_fp8_sync": (dict(dp=2, ep=2, grad_sync_precision=Precision.fp8), True),
    "dp2_replicated_fp32_sync": (dict(dp=2), False),
}


def test_state_bytes_match_cost_model(pool2):
    plans = {k: make_plan(**layout, optimizer_sharding=ZERO1 if zero1 else NONE)
             for k, (layout, zero1) in MEMORY_CASES.items()}
    cases = [plan.model_dump_json() for plan in plans.values()]
    results = pool2.run("dist_workers", "state_bytes", cases)
    for i, (name, (_, zero1)) in enumerate(MEMORY_CASES.items()):
        plan = plans[name]
        model = memory_breakdown(plan).components_bytes
        grad_bytes = 4 if plan.grad_sync_precision == Precision.fp32 else 2
        for rank, per_rank in enumerate(results):
            got = per_rank[i]
            numel = got["numel"]
            assert got["param_dtypes"] == {"torch.bfloat16"}, (name, got)
            assert got["grad_dtypes"] == {"torch.float32" if grad_bytes == 4 else
                                          "torch.bfloat16"}, (name, got)
            assert got["no_separate_grads"], name
            assert got["aligned"], name  # 64-element starts in the ZeRO-1 parameter buffers
            assert got["params"] == 2 * numel == model["params"], (name, rank, got, model)
            assert got["grads"] == grad_bytes * numel == model["grads"], (name, rank, got)
            # ZeRO-1 shards over each parameter's replicas; replicated AdamW keeps it all
            # ZeRO-1 shards over each parameter's replicas; unsharded keeps it all
            assert got["optimizer"] == model["optimizer"], (name, rank, got, model)
            if not zero1:
                assert got["optimizer"] == 12 * numel


def test_single_process_state_bytes():
    plan = make_plan(grad_sync_precision=Precision.bf16)
    trainer = reference_trainer(plan, "bf16")
    trainer.train_step(0)
    numel = sum(p.numel() for p in trainer.model.parameters())
    assert trainer.state_bytes() == {"params": 2 * numel, "grads": 2 * numel,
                                     "optimizer": 12 * numel}


@pytest.mark.parametrize("sharding", list(OptimizerSharding))
def test_sgd_keeps_only_fp32_masters_as_the_cost_model_prices(sharding):
    plan = make_plan(grad_sync_precision=Precision.bf16, optimizer=Optimizer.sgd,
                     optimizer_sharding=sharding)
    trainer = reference_trainer(plan, "bf16")
    trainer.train_step(0)
    numel = sum(p.numel() for p in trainer.model.parameters())
    assert trainer.state_bytes()["optimizer"] == 4 * numel
    assert memory_breakdown(plan).components_bytes["optimizer"] == 4 * numel


@pytest.mark.parametrize("sharding", list(OptimizerSharding))
def test_eager_step_casts_one_bucket_at_a_time(sharding):
    """The eager AdamW casts bf16 main gradients to fp32 and steps them a bucket at a time: no
    optimizer call sees more fp32 gradients than a bucket (its size plus its largest
    parameter, cost_models.memory.optimizer_step_workspace), and the weights are the ones of a
    single step over everything."""
    plan = make_plan(grad_sync_precision=Precision.bf16, optimizer_sharding=sharding)
    bucket = 3000
    pieces = reference_trainer(plan, "bf16", dataclasses.replace(OPTIM, bucket_params=bucket))
    whole = reference_trainer(plan, "bf16", dataclasses.replace(OPTIM, bucket_params=10**9))
    seen: list[int] = []
    for trainer, log in ((pieces, seen), (whole, [])):
        opt = trainer.optimizer.opt
        step = opt.step

        def counting(step=step, opt=opt, log=log):
            log.append(sum(p.numel() for g in opt.param_groups for p in g["params"]
                           if p.grad is not None))
            return step()

        opt.step = counting
        for s in range(2):
            trainer.train_step(s)
    total = sum(p.numel() for p in pieces.model.parameters())
    largest = max(p.numel() for p in pieces.model.parameters())
    assert len(seen) > 2 and max(seen) <= bucket + largest < total, (seen, total)
    assert sum(seen) == 2 * total  # every parameter stepped once per step
    for (name, a), b in zip(pieces.model.named_parameters(), whole.model.parameters(),
                            strict=True):
        assert torch.equal(a, b), name
    # the cost model's largest parameter bounds the runtime's; at 40M per bucket this model
    # is one bucket
    (stage,) = stage_params_of(plan)
    assert largest <= largest_param(plan.model, plan.degrees)
    assert optimizer_step_workspace(plan.model, plan.degrees, stage, sharding, 2,
                                    False) == 4 * total


@pytest.mark.parametrize("sharding", list(OptimizerSharding))
def test_sgd_step_is_plain_sgd_with_weight_decay(sharding):
    """w <- w - lr (g + wd w) on matrices, w - lr g on vectors (fp32: exact to rounding)."""
    from dist_workers import OPTIM

    plan = make_plan(optimizer=Optimizer.sgd, optimizer_sharding=sharding)
    trainer = reference_trainer(plan)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.forward_backward(0)
    trainer.sync_gradients()
    grads = {n: p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer_step()
    for name, p in trainer.model.named_parameters():
        wd = OPTIM.weight_decay if p.ndim >= 2 else 0.0
        expect = before[name] - OPTIM.lr * (grads[name] + wd * before[name])
        assert torch.allclose(p.detach(), expect, rtol=1e-6, atol=1e-7), name
        assert not torch.equal(p.detach(), before[name]), name


def test_bf16_one_step_matches_single_process(pool2):
    plan = make_plan(sp=2, ep=2, dispatch=A2A)
    results = pool2.run("dist_workers", "one_step_gradients", plan.model_dump_json(), "bf16")
    ref = reference_trainer(plan, "bf16")
    ref_loss = ref.forward_backward(0)
    ref_grads = {k: g for k, (g, _) in ref.local_gradients().items()}
    worst = 0.0
    for loss, grads in results:
        assert abs(loss - ref_loss) / ref_loss < BF16_LOSS_RTOL, (loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for name, (grad, shard) in grads.items():
            expect = shard.take(ref_grads[name]) if shard else ref_grads[name]
            worst = max(worst, _rel(grad, expect))
    assert worst < BF16_GRAD_RTOL, worst


@pytest.mark.parametrize("layout", [dict(dp=2, grad_sync_precision=Precision.bf16),
                                    dict(sp=2, ep=2, dispatch=AG)], ids=["dp2_bf16", "sp2_ep2"])
def test_bf16_zero1_loss_curve_follows_single_process(pool2, layout):
    plan = make_plan(global_batch=4, **layout)
    steps = 6
    plan = plan.model_copy(update={"optimizer_sharding": ZERO1})
    curves = pool2.run("dist_workers", "loss_curve", plan.model_dump_json(), steps, "bf16")
    ref = reference_trainer(plan, "bf16")
    expect = [ref.train_step(s).loss for s in range(steps)]
    for curve in curves:
        for got, want in zip(curve, expect, strict=True):
            assert abs(got - want) / want < BF16_LOSS_RTOL, (curve, expect)
    assert expect[-1] < expect[0]


def test_bf16_zero1_resume_is_exact(pool2, tmp_path):
    """The checkpoint holds bf16 parameters, fp32 master slices and fp32 AdamW moments; a
    resumed run repeats the uninterrupted one bit for bit."""
    results = pool2.run("dist_workers", "resume_is_exact", str(tmp_path / "ck"), "bf16")
    for full, resumed, kinds in results:
        assert full == resumed, (full, resumed)
        assert kinds == {"model": {"torch.bfloat16"}, "master": {"torch.float32"},
                         "moments": {"torch.float32"}}, kinds


@pytest.mark.parametrize("fused", [False, True])
def test_buffer_layout_starts_parameters_at_64_elements(fused):
    """Unfused: each micro-batch's .grad is added into the buffer and freed; fused: .grad is
    the buffer's view, accumulated in place by autograd. The same sums either way."""
    from torch import nn

    from runtime.parallel.data_parallel import attach_main_grads, buffer_layout

    ps = [nn.Parameter(torch.zeros(n)) for n in (3, 64, 65)]
    offsets, end = buffer_layout(ps)
    assert (offsets, end) == ([0, 64, 128], 193)
    buffer = torch.zeros(end)
    aliased = attach_main_grads(ps, buffer, offsets, fused)
    assert aliased == (ps if fused else [])
    for _ in range(2):  # two micro-batches accumulate
        sum((p * (i + 1)).sum() for i, p in enumerate(ps)).backward()
    for p in ps:
        if fused:
            assert p.grad.data_ptr() == p.main_grad.data_ptr()
        else:
            assert p.grad is None
    for i, (p, offset) in enumerate(zip(ps, offsets, strict=True)):
        expect = torch.full((p.numel(),), 2.0 * (i + 1))
        assert torch.equal(buffer[offset : offset + p.numel()], expect)
    assert buffer[3:64].eq(0).all()  # the alignment gap after the first parameter
