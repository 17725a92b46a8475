"""Selective recomputation's ``moe_act`` (runtime.parallel.recompute): the routed experts'
SwiGLU output is freed after fc2's forward and rerun in backward; the gradients are those of
the layer that keeps it, for every expert GEMM form, both kernel sets, and EP over two ranks."""

from __future__ import annotations

import copy
import dataclasses
import weakref

import pytest
import torch
from dist_workers import make_plan
from test_parity import check_one_step

from plans import Dispatch, Kernels, Overlap, Recompute, RecomputeModule
from plans.enums import ExpertGemm
from runtime.kernels import EAGER, kernel_ops
from runtime.moe import MoE
from runtime.parallel.grad_accumulation import accumulating_matmul
from runtime.parallel.wrappers import AccumulatingExperts, ActivationRecomputed

HIDDEN, EXPERTS, TOP_K, FFN, TOKENS = 16, 4, 2, 24, 40


def _layer(gemm: ExpertGemm, accumulating: bool, ops) -> MoE:
    torch.manual_seed(0)
    moe = MoE(HIDDEN, EXPERTS, TOP_K, FFN, EXPERTS, ops=ops, gemm=gemm)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if accumulating:  # gradient-accumulation fusion's experts (runtime.parallel.grad_accumulation)
        moe.experts = AccumulatingExperts(moe.experts, accumulating_matmul(gemm))
    return moe


def _grads(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}


CASES = [(g, acc) for g in ExpertGemm for acc in (False, True)]
IDS = [f"{g.value}{'_accumulating' if acc else ''}" for g, acc in CASES]


@pytest.mark.parametrize("gemm, accumulating", CASES, ids=IDS)
@pytest.mark.parametrize("kernels", [Kernels.eager, Kernels.fused])
def test_moe_act_gradients_equal_the_kept_activation(gemm, accumulating, kernels):
    ops = EAGER if kernels == Kernels.eager else kernel_ops(Kernels.fused)
    kept = _layer(gemm, accumulating, ops)
    rerun = copy.deepcopy(kept)
    rerun.experts = ActivationRecomputed(rerun.experts)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    gx, grads = _grads(kept, x)
    gx_rerun, grads_rerun = _grads(rerun, x)
    torch.testing.assert_close(gx_rerun, gx, rtol=1e-6, atol=1e-6)
    assert grads_rerun.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_rerun[name], g, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("gemm, accumulating", CASES, ids=IDS)
def test_moe_act_frees_the_activation_output_and_keeps_fc1_fc3s(gemm, accumulating):
    """Between forward and backward nothing holds the SwiGLU's output (fc2's input), which
    the kept activation's fc2 holds; the experts' saved tensors of live storage are the
    dispatched rows and fc1's and fc3's outputs, not SiLU's output either, which the eager
    activation keeps. Per routed row, in fp32 elements: hidden + 2 FFN kept, against
    hidden + 4 FFN (and the output, 1 FFN) for the kept activation."""
    rows = TOKENS * TOP_K

    def kept(experts_wrapper) -> tuple[int, bool]:
        outputs = []

        def swiglu(a, b):
            out = EAGER.swiglu(a, b)
            outputs.append(weakref.ref(out))
            return out

        moe = _layer(gemm, accumulating, dataclasses.replace(EAGER, swiglu=swiglu))
        if experts_wrapper is not None:
            moe.experts = experts_wrapper(moe.experts)
        x = torch.randn(rows, HIDDEN, requires_grad=True)
        counts = torch.tensor([rows // EXPERTS] * EXPERTS)
        weights = {p.untyped_storage().data_ptr() for p in moe.parameters()}
        storages: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in weights:
                storages[s.data_ptr()] = s
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = moe.experts(x, counts)
        alive = outputs[0]() is not None
        saved = sum(s.nbytes() for s in storages.values()) // 4
        out.sum().backward()  # the rerun feeds fc2's backward
        assert x.grad is not None and len(outputs) == (2 if experts_wrapper else 1)
        return saved, alive

    assert kept(None) == (rows * (HIDDEN + 4 * FFN), True)
    assert kept(ActivationRecomputed) == (rows * (HIDDEN + 2 * FFN), False)


def test_moe_act_runs_the_activation_twice_a_step():
    """Once in forward, once when fc2's backward needs its output: the activation's backward
    goes through that rerun, not a third run."""
    calls = []

    def counted(a, b):
        calls.append(a.shape)
        return EAGER.swiglu(a, b)

    moe = _layer(ExpertGemm.grouped, False, EAGER)
    moe.experts.ops = dataclasses.replace(EAGER, swiglu=counted)
    moe.experts = ActivationRecomputed(moe.experts)
    _grads(moe, torch.randn(TOKENS, HIDDEN))
    assert len(calls) == 2


@pytest.mark.parametrize("layout", [
    dict(dp=2, ep=2, dispatch=Dispatch.all_to_all),
    dict(dp=2, ep=2, dispatch=Dispatch.all_to_all, overlap=Overlap.inter_op),
    dict(dp=2, ep=2, dispatch=Dispatch.allgather_reduce_scatter),
    dict(tp=2, etp=2, tp_attention=True, tp_ffn=True),  # expert TP's dispatcher
    # a dense first layer (no experts: its attention core alone is recomputed)
    dict(model="tiny-moe-shared", pp=2, stage_layers=(1, 3), micro_batch_size=2,
         global_batch=8),
], ids=["ep2_a2a", "ep2_a2a_inter_op", "ep2_allgather", "tp2_etp2", "pp2_shared_mbs2"])
@pytest.mark.parametrize("modules", [(RecomputeModule.moe_act,),
                                     (RecomputeModule.core_attn, RecomputeModule.moe_act)],
                         ids=["act", "core_attn_act"])
def test_moe_act_on_two_ranks_matches_the_kept_reference(pool2, layout, modules):
    """moe_act under EP 2 (all-to-all, serial and the overlapped chunks; all-gather), expert
    TP and pipeline stages on two gloo ranks against the one-rank run that keeps every
    activation."""
    plan = make_plan(recompute=Recompute.selective, **layout).model_copy(
        update={"recompute_modules": modules})
    check_one_step(pool2, plan, reference=make_plan(**layout))
