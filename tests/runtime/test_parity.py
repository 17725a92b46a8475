"""Parallel layouts reproduce the one-rank reference: loss and every gradient after one step
(fp32 on CPU), and the loss curve over several steps."""

from __future__ import annotations

import pytest
import torch
from dist_workers import make_plan, reference_trainer

from plans import (
    CrossEntropy,
    Dispatch,
    Optimizer,
    OptimizerSharding,
    Overlap,
    Precision,
    Recompute,
)
from plans.layout import INTER_OP_CHUNKS

A2A, AG = Dispatch.all_to_all, Dispatch.allgather_reduce_scatter
INTER = Overlap.inter_op

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def heads(query: int, kv: int, dim: int, **more) -> dict:
    """Model fields for another attention shape (tiny-moe has one KV head a rank at sp = 2,
    too few to split into head groups)."""
    return {"query_heads": query, "kv_heads": kv, "head_dim": dim, **more}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_one_step(pool, plan, grad_rtol: float = GRAD_RTOL, reference=None) -> None:
    """``plan`` on the pool's ranks against the one-rank run of ``reference`` (``plan``'s own
    by default)."""
    results = pool.run("dist_workers", "one_step_gradients", plan.model_dump_json())
    ref = reference_trainer(reference or plan)
    ref_loss = ref.forward_backward(0)
    ref.sync_gradients()
    ref_grads = {k: g for k, (g, _) in ref.local_gradients().items()}
    seen = set()
    for rank, (loss, grads) in enumerate(results):
        assert abs(loss - ref_loss) / abs(ref_loss) < LOSS_RTOL, (rank, loss, ref_loss)
        for name, (grad, shard) in grads.items():
            expect = shard.take(ref_grads[name]) if shard else ref_grads[name]
            assert grad.shape == expect.shape, (rank, name)
            assert _rel(grad, expect) < grad_rtol, (rank, name, _rel(grad, expect))
            seen.add(name)
    assert seen == set(ref_grads), set(ref_grads) ^ seen


TWO = {
    "sp2": dict(sp=2),
    "ep2_a2a": dict(dp=2, ep=2, dispatch=A2A),
    "ep2_allgather": dict(dp=2, ep=2, dispatch=AG),
    "sp2_ep2_allgather": dict(sp=2, ep=2, dispatch=AG),
    "pp2": dict(pp=2, stage_layers=(2, 2), global_batch=4),
    "dp2": dict(dp=2),
    "tp2": dict(tp=2, tp_attention=True),
    # Megatron-LM's TP beyond attention (runtime.parallel.tensor): the vocabulary (a tied
    # embedding and head) and the dense FFN split over the tp ranks, both losses
    "tp2_shared_tied": dict(model="tiny-moe-shared", tp=2, tp_attention=True),
    "tp2_shared_tied_chunked": dict(model="tiny-moe-shared", tp=2, tp_attention=True,
                                    cross_entropy=CrossEntropy.chunked, micro_batch_size=2),
    "pp2_shared_tied": dict(model="tiny-moe-shared", pp=2, stage_layers=(1, 3)),
    # the chunked loss adding the head's gradient into its main gradient (grad_accumulation_
    # fusion, plans.layout.accumulates_head_in_gemm): over vocabulary shards, and on the last
    # stage of a tied vocabulary split over pp
    "tp2_chunked": dict(tp=2, tp_attention=True, cross_entropy=CrossEntropy.chunked,
                        micro_batch_size=2),
    "pp2_shared_tied_chunked": dict(model="tiny-moe-shared", pp=2, stage_layers=(1, 3),
                                    cross_entropy=CrossEntropy.chunked),
    "sp2_ep2_full_recompute": dict(sp=2, ep=2, recompute=Recompute.full),
    "pp2_vpp2_interleaved": dict(pp=2, vpp=2, stage_layers=(1, 1, 1, 1), global_batch=4),
    "pp2_vpp2_interleaved_tied_m2": dict(
        model="tiny-moe-shared", pp=2, vpp=2, stage_layers=(2, 0, 1, 1), global_batch=2,
        recompute=Recompute.full,
    ),
    "tp2_etp2_megatron": dict(tp=2, etp=2, tp_attention=True, tp_ffn=True),
    # ... with the shared experts split by etp too, a dense layer and a tied vocabulary
    "tp2_etp2_megatron_shared_tied": dict(model="tiny-moe-shared", tp=2, etp=2,
                                          tp_attention=True, tp_ffn=True),
    "dp2_etp2": dict(model="tiny-moe-shared", dp=2, etp=2, tp_ffn=True),
    # inter-operator overlap: the chunked MoE schedule (runtime.parallel.overlap) against the
    # serial one-rank reference
    "ep2_a2a_inter_op": dict(dp=2, ep=2, dispatch=A2A, overlap=INTER),
    "ep2_allgather_inter_op": dict(dp=2, ep=2, dispatch=AG, overlap=INTER),
    "sp2_ep2_shared_a2a_inter_op": dict(model="tiny-moe-shared", sp=2, ep=2, overlap=INTER),
    "sp2_ep2_allgather_full_recompute_inter_op": dict(
        sp=2, ep=2, dispatch=AG, recompute=Recompute.full, overlap=INTER, micro_batch_size=2),
    # ... and Ulysses in overlapped head groups (runtime.parallel.attention.ChunkedUlyssesCore):
    # 8 query and 4 KV heads, 2 KV heads a rank, one a group; with QK norm and the core rerun
    "sp2_ep2_a2a_inter_op_head_groups": dict(sp=2, ep=2, overlap=INTER,
                                             spec_update=heads(8, 4, 8, qk_norm=True)),
    "sp2_inter_op_head_groups_mha_selective_mbs2": dict(
        model="tiny-moe-shared", sp=2, overlap=INTER, spec_update=heads(8, 8, 8),
        recompute=Recompute.selective, micro_batch_size=2),
    "pp2_selective_recompute_mbs2": dict(
        pp=2, stage_layers=(3, 1), recompute=Recompute.selective, micro_batch_size=2,
        global_batch=8,
    ),
}

FOUR = {
    "sp2_ep2_dp2": dict(sp=2, dp=2, ep=2),
    "sp2_ep4_dp2_allgather_inter_op": dict(sp=2, dp=2, ep=4, dispatch=AG, overlap=INTER),
    "sp2_ep4_dp2_allgather": dict(sp=2, dp=2, ep=4, dispatch=AG),
    "sp4_ep4_inter_op_head_groups_kv_replicated": dict(
        sp=4, ep=4, overlap=INTER, spec_update=heads(16, 2, 4), dispatch=AG),
    "sp4_inter_op_head_groups_full_recompute": dict(
        sp=4, overlap=INTER, spec_update=heads(16, 8, 4), recompute=Recompute.full),
    "pp2_sp2_ep2": dict(pp=2, sp=2, ep=2, stage_layers=(2, 2)),
    "sp4_kv_replicated_ep4": dict(sp=4, ep=4),
    "pp2_dp2_shared_ep2": dict(
        model="tiny-moe-shared", pp=2, dp=2, ep=2, stage_layers=(2, 2), micro_batch_size=1
    ),
    "tp2_dp2_ep4": dict(tp=2, dp=2, ep=4, tp_attention=True),
    "pp2_tp2_ep2": dict(pp=2, tp=2, ep=2, tp_attention=True, stage_layers=(2, 2)),
    "pp2_tp2_shared_tied_chunked": dict(model="tiny-moe-shared", pp=2, tp=2, tp_attention=True,
                                        stage_layers=(1, 3), cross_entropy=CrossEntropy.chunked),
    "pp2_vpp2_sp2_ep2": dict(pp=2, vpp=2, sp=2, ep=2, stage_layers=(1, 1, 1, 1)),
    "tp2_dp2_etp4": dict(tp=2, dp=2, etp=4, tp_attention=True, tp_ffn=True),
    "pp2_tp2_etp2_vpp2": dict(
        pp=2, vpp=2, tp=2, etp=2, tp_attention=True, tp_ffn=True, stage_layers=(1, 1, 1, 1)
    ),
}


@pytest.mark.parametrize("layout", TWO)
def test_two_ranks_match_reference(pool2, layout):
    check_one_step(pool2, make_plan(**TWO[layout]))


@pytest.mark.parametrize("overlap", list(Overlap))
@pytest.mark.parametrize("layout", [dict(dp=2, ep=2), dict(tp=2, etp=2, tp_attention=True,
                                                           tp_ffn=True)], ids=["ep2", "etp2"])
def test_the_chunked_moe_schedule_runs_where_the_plan_overlaps_ep(pool2, overlap, layout):
    """inter_op (and inter_intra_op, which runs as inter_op) chunks EP layers; expert TP and
    overlap none keep the serial layer (plans.layout.moe_chunks)."""
    plan = make_plan(overlap=overlap, **layout)
    chunks = pool2.run("dist_workers", "chunked_moe_layers", plan.model_dump_json())
    overlapped = overlap != Overlap.none and "ep" in layout
    assert chunks == [[INTER_OP_CHUNKS if overlapped else 1] * plan.model.layers] * 2


@pytest.mark.parametrize("overlap", list(Overlap))
@pytest.mark.parametrize("shape, groups", [((8, 4, 8), INTER_OP_CHUNKS), ((4, 2, 16), 1)],
                         ids=["2kv_a_rank", "1kv_a_rank"])
def test_ulysses_runs_in_head_groups_where_the_plan_overlaps(pool2, overlap, shape, groups):
    """inter_op (and inter_intra_op, run as inter_op) moves Ulysses heads in groups where every
    rank's KV heads split into them (plans.layout.ulysses_chunks); overlap none blocks."""
    plan = make_plan(sp=2, overlap=overlap, spec_update=heads(*shape))
    got = pool2.run("dist_workers", "ulysses_head_groups", plan.model_dump_json())
    assert got == [[groups if overlap != Overlap.none else 1] * plan.model.layers] * 2


@pytest.mark.parametrize("layout", FOUR)
def test_four_ranks_match_reference(pool4, layout):
    check_one_step(pool4, make_plan(**FOUR[layout]))


def test_bf16_gradient_sync_is_close(pool2):
    """bf16 all-reduce rounds each gradient to 8 mantissa bits: relative error ~ 2^-8."""
    check_one_step(pool2, make_plan(sp=2, ep=2, grad_sync_precision=Precision.bf16), 1e-2)


FP8_GRAD_RTOL = 0.08
"""E4M3 keeps 3 mantissa bits: round-to-nearest errs by at most 2^-4 of a value, RMS
2^-4 / sqrt(3) = 3.6%; the tensor-norm error of a sum of quantised replicas is below that, and
blocks whose values sit far under their amax lose a little more to subnormals. 8% is about twice
the RMS bound; a sync that dropped or doubled a replica errs by 50% or more."""


def test_fp8_gradient_sync_is_close(pool2):
    check_one_step(pool2, make_plan(dp=2, ep=2, grad_sync_precision=Precision.fp8),
                   FP8_GRAD_RTOL)


def test_fp8_reduce_scatter_and_all_reduce_match_fp32(pool2):
    """The quantised collectives against fp32 sums of the same tensors, and exactly equal on
    every rank for the all-reduce."""
    errors = pool2.run("dist_workers", "fp8_collectives")
    for err_ar, err_rs, same in errors:
        assert err_ar < 0.05 and err_rs < 0.05 and same, errors


@pytest.mark.parametrize(
    "layout, zero1",
    [
        (dict(pp=2, sp=2, ep=2, stage_layers=(2, 2)), False),
        (dict(sp=2, dp=2, ep=2), True),
        (dict(model="tiny-moe-shared", pp=2, dp=2, ep=2, stage_layers=(2, 2)), True),
        (dict(pp=2, vpp=2, dp=2, ep=2, stage_layers=(1, 1, 1, 1)), True),
        (dict(tp=2, dp=2, etp=2, tp_attention=True, tp_ffn=True), True),
    ],
    ids=["pp2_sp2_ep2", "zero1_sp2_dp2_ep2", "zero1_pp2_dp2_tied", "zero1_pp2_vpp2_dp2",
         "zero1_tp2_dp2_etp2"],
)
def test_loss_curve_follows_reference(pool4, layout, zero1):
    sharding = OptimizerSharding.zero1 if zero1 else OptimizerSharding.none
    plan = make_plan(global_batch=4, optimizer_sharding=sharding, **layout)
    steps = 6
    curve = pool4.run("dist_workers", "loss_curve", plan.model_dump_json(), steps)
    ref = reference_trainer(plan)
    expect = [ref.train_step(s).loss for s in range(steps)]
    for rank_curve in curve:
        for got, want in zip(rank_curve, expect, strict=True):
            assert abs(got - want) / want < 1e-4, (rank_curve, expect)
    assert expect[-1] < expect[0]


@pytest.mark.parametrize("sharding", list(OptimizerSharding))
def test_sgd_loss_curve_follows_reference(pool2, sharding):
    """training.optimizer sgd runs SGD (not AdamW) on every layout: the curve equals the
    one-rank SGD run and differs from the AdamW one."""
    plan = make_plan(global_batch=4, dp=2, ep=2, optimizer=Optimizer.sgd,
                     optimizer_sharding=sharding)
    steps = 4
    curves = pool2.run("dist_workers", "loss_curve", plan.model_dump_json(), steps)
    ref = reference_trainer(plan)
    expect = [ref.train_step(s).loss for s in range(steps)]
    adam = reference_trainer(make_plan(global_batch=4, dp=2, ep=2))
    adam_curve = [adam.train_step(s).loss for s in range(steps)]
    for curve in curves:
        for got, want in zip(curve, expect, strict=True):
            assert abs(got - want) / want < 1e-5, (curve, expect)
    assert abs(adam_curve[-1] - expect[-1]) / expect[-1] > 1e-4, (adam_curve, expect)



OVERLAP_TWO = {
    "dp2_tied": dict(model="tiny-moe-shared", dp=2),
    "dp2_zero1": dict(dp=2, optimizer_sharding=OptimizerSharding.zero1),
    "dp2_bf16": dict(dp=2, grad_sync_precision=Precision.bf16),
    "dp2_ep2_fp8_zero1": dict(dp=2, ep=2, grad_sync_precision=Precision.fp8,
                              optimizer_sharding=OptimizerSharding.zero1),
}
OVERLAP_FOUR = {
    "sp2_dp2_ep2": dict(sp=2, dp=2, ep=2),
    "sp2_dp2_ep2_zero1_bf16": dict(sp=2, dp=2, ep=2, grad_sync_precision=Precision.bf16,
                                   optimizer_sharding=OptimizerSharding.zero1),
    "pp2_vpp2_dp2_tied_zero1": dict(model="tiny-moe-shared", pp=2, vpp=2, dp=2,
                                    stage_layers=(2, 0, 1, 1),
                                    optimizer_sharding=OptimizerSharding.zero1),
}
OVERLAP_BUCKET_PARAMS = 6000
"""Several buckets per layer of the tiny models (about 12k dense parameters a layer)."""


def check_overlap_matches_serial(pool, layout: dict) -> None:
    """grad_sync_overlap + grad_accumulation_fusion against the sync after the backward and
    the separate accumulation pass: the same buckets, casts and quantisation, so the same
    bits; and every bucket with a collective was launched during the backward (in a pipeline:
    each chunk's last backward)."""
    plan = make_plan(global_batch=4, **layout)
    for serial, overlapped in pool.run("dist_workers", "overlapped_and_serial_sync",
                                       plan.model_dump_json(), OVERLAP_BUCKET_PARAMS):
        assert serial["launched"] == 0 and serial["buckets"] > 1, serial["buckets"]
        assert overlapped["launched"] == overlapped["buckets"] == serial["buckets"]
        assert overlapped["loss"] == serial["loss"]
        assert overlapped["next_loss"] == serial["next_loss"]
        for kind in ("grads", "params"):
            for name, value in serial[kind].items():
                assert torch.equal(overlapped[kind][name], value), (kind, name)


@pytest.mark.parametrize("layout", OVERLAP_TWO)
def test_overlapped_sync_matches_serial_two_ranks(pool2, layout):
    check_overlap_matches_serial(pool2, OVERLAP_TWO[layout])


@pytest.mark.parametrize("layout", OVERLAP_FOUR)
def test_overlapped_sync_matches_serial_four_ranks(pool4, layout):
    check_overlap_matches_serial(pool4, OVERLAP_FOUR[layout])
