"""Gradient-accumulation fusion (runtime.parallel.grad_accumulation): GEMMs that add their
weight gradients into the main gradients give autograd's gradients, call the gradient sync's
hooks once per backward, and are applied to exactly the parameters the rule names."""

import pytest
import torch
import torch.nn.functional as F
from dist_workers import make_plan
from torch import nn

from plans import CrossEntropy, Kernels, OptimizerSharding, Precision
from plans.layout import PER_EXPERT_MAX_LOCAL_EXPERTS, PER_EXPERT_MIN_FFN
from runtime.moe import GroupedExperts, grouped_mm
from runtime.parallel.grad_accumulation import (
    apply_grad_accumulation_fusion,
    in_gemm,
    linear_accumulating,
    mark_parameters,
    on_grad_ready,
    per_expert_accumulating,
)

torch.manual_seed(0)


def _param(*shape):
    return nn.Parameter(torch.randn(*shape, dtype=torch.float64))


def test_a_linear_layer_adds_each_backward_into_its_main_gradient_and_calls_its_hooks():
    w = _param(5, 3)
    w.main_grad = torch.full_like(w, 0.5)
    calls = []
    on_grad_ready(w, calls.append)
    xs = [torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    gs = [torch.randn(2, 4, 5, dtype=torch.float64) for _ in range(2)]
    for x, g in zip(xs, gs, strict=True):
        linear_accumulating(w, x).backward(g)
    assert w.grad is None and calls == [w, w]
    ref_w = w.detach().clone().requires_grad_()
    for x, g in zip(xs, gs, strict=True):
        x_ref = x.detach().clone().requires_grad_()
        F.linear(x_ref, ref_w).backward(g)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.main_grad, 0.5 + ref_w.grad, rtol=0, atol=1e-12)


def test_per_expert_gemms_add_each_experts_gradient_into_its_slice():
    w = _param(4, 6, 3)  # [E, out, in]; expert 1 gets no rows
    w.main_grad = torch.zeros_like(w)
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(9, 6, dtype=torch.float64)
    hooks = []
    on_grad_ready(w, hooks.append)
    out = per_expert_accumulating(counts)(x, w)
    out.backward(g)
    ref_w, x_ref = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    ref = grouped_mm(x_ref, ref_w, counts)
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.main_grad, ref_w.grad, rtol=0, atol=1e-12)
    assert torch.count_nonzero(w.main_grad[1]) == 0 and w.grad is None and hooks == [w]


def test_a_swiglu_expert_layer_with_per_expert_gemms_matches_the_grouped_one():
    fused, plain = (GroupedExperts(3, 4, 8).double() for _ in range(2))
    with torch.no_grad():
        for a, b in zip(fused.parameters(), plain.parameters(), strict=True):
            a.copy_(torch.randn_like(a))
            b.copy_(a)
    for p in fused.parameters():
        p.main_grad = torch.zeros_like(p)
    fused.matmul = per_expert_accumulating
    counts = torch.tensor([2, 3, 1])
    x = torch.randn(6, 4, dtype=torch.float64)
    g = torch.randn(6, 4, dtype=torch.float64)
    fused(x, counts).backward(g)
    plain(x, counts).backward(g)
    for a, b in zip(fused.parameters(), plain.parameters(), strict=True):
        assert a.grad is None
        torch.testing.assert_close(a.main_grad, b.grad, rtol=0, atol=1e-12)


def _trainer_model(head: bool = False, **model):
    from runtime.model import Transformer
    from runtime.parallel.parallelize import parallelize
    from runtime.trainer import ModelConfig, model_options

    plan = make_plan()
    plan = plan.model_copy(update={"model": plan.model.model_copy(update=model)})
    with torch.device("meta"):
        m = Transformer(ModelConfig(plan.model, model_options(plan)))
    apply_grad_accumulation_fusion(m, head)
    m.to_empty(device="cpu")  # materialising replaces the parameter objects
    mark_parameters(m)
    return m, parallelize


@pytest.mark.parametrize("wide", [False, True])
def test_the_transform_marks_the_blocks_linear_weights_and_only_few_wide_experts(wide):
    ffn = PER_EXPERT_MIN_FFN if wide else PER_EXPERT_MIN_FFN // 2
    model, _ = _trainer_model(expert_ffn_hidden=ffn, hidden=16, experts=4)
    marked = {n for n, p in model.named_parameters() if in_gemm(p)}
    for name, _ in model.named_parameters():
        linear = name.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight",
                                "gate.weight"))
        expert = name.endswith(("experts.w1", "experts.w2", "experts.w3"))
        assert (name in marked) == (linear or (expert and wide)), name
    assert not any(n.startswith(("tok_embeddings", "output")) for n in marked)
    assert 4 <= PER_EXPERT_MAX_LOCAL_EXPERTS


def test_the_transform_marks_the_lm_head_where_the_rule_says_so_and_never_a_tied_one():
    from plans.catalog import load_model
    from plans.layout import accumulates_head_in_gemm

    model, _ = _trainer_model(head=True, hidden=16)
    marked = {n for n, p in model.named_parameters() if in_gemm(p)}
    assert "output.weight" in marked and "tok_embeddings.weight" not in marked
    untied, tied = load_model("tiny-moe"), load_model("tiny-moe-shared")
    assert tied.tied_embeddings and not untied.tied_embeddings
    chunked, materialized = CrossEntropy.chunked, CrossEntropy.materialized
    assert accumulates_head_in_gemm(True, chunked, untied, 1)
    assert accumulates_head_in_gemm(True, chunked, tied, 2)  # the last stage's own copy
    assert not accumulates_head_in_gemm(True, chunked, tied, 1)
    assert not accumulates_head_in_gemm(True, materialized, untied, 1)
    assert not accumulates_head_in_gemm(False, chunked, untied, 1)
    with pytest.raises(ValueError, match="tied to the embedding"):
        _trainer_model(head=True, tied_embeddings=True)


def _head_case(seed: int, tokens: int = 23, vocab: int = 50, hidden: int = 16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    return h, w, torch.randint(0, vocab, (tokens,), generator=g)


@pytest.mark.parametrize("kernels", ["eager", "fused"])
@pytest.mark.parametrize("chunk_logits", [7 * 50, 10**9])  # several chunks (ragged), or one
def test_the_chunked_loss_adds_the_heads_gradient_into_its_main_gradient(
        monkeypatch, chunk_logits, kernels):
    """A marked head weight: each micro-batch's forward adds scale x its weight gradient into
    the main gradient (started at 0.5), no autograd gradient for the weight, the hooks run once
    per backward; the main gradient then equals 0.5 + autograd's gradient of the same losses
    (the same loss on an unmarked weight, through autograd: its chunks' sum is fp32, so the
    two agree to fp32 rounding), and the loss and hidden states' gradients are the same."""
    from plans import Kernels, layout
    from runtime import loss
    from runtime.kernels import kernel_ops
    from runtime.parallel.grad_accumulation import IN_GEMM

    monkeypatch.setattr(layout, "CHUNK_LOGITS", chunk_logits)
    ops = kernel_ops(Kernels(kernels))
    micro = [_head_case(seed) for seed in (0, 1)]
    w = nn.Parameter(micro[0][1].clone())
    setattr(w, IN_GEMM, True)
    w.main_grad = torch.full_like(w, 0.5)
    calls = []
    on_grad_ready(w, calls.append)
    scale = 1 / 46
    ref_w = w.detach().clone().requires_grad_()
    for h, _, labels in micro:
        h, h_ref = h.clone().requires_grad_(), h.clone().requires_grad_()
        got = loss.chunked_cross_entropy(h, w, labels, scale, ops)
        got.backward()
        want = loss.chunked_cross_entropy(h_ref, ref_w, labels, scale, ops)
        want.backward()
        assert torch.equal(got, want) and torch.equal(h.grad, h_ref.grad)
    assert w.grad is None and calls == [w, w]
    torch.testing.assert_close(w.main_grad, 0.5 + ref_w.grad, rtol=1e-6, atol=1e-9)


def test_the_chunked_loss_into_the_main_gradient_refuses_another_upstream_gradient():
    """The main gradient holds scale x d(loss)/dW from the forward: a backward started with a
    gradient other than 1 (the trainer's is 1) is stopped, not silently wrong."""
    from runtime import loss
    from runtime.parallel.grad_accumulation import IN_GEMM

    h, w0, labels = _head_case(2)
    w = nn.Parameter(w0)
    setattr(w, IN_GEMM, True)
    w.main_grad = torch.zeros_like(w)
    out = loss.chunked_cross_entropy(h.requires_grad_(), w, labels, 1.0)
    with pytest.raises(RuntimeError, match="gradient 1"):
        (out * 3.0).backward()


def test_the_vocab_sharded_chunked_loss_adds_each_ranks_rows_into_its_main_gradient(pool2):
    """Two ranks, each holding half the head's rows (runtime.loss.sharded_cross_entropy,
    the chunked loss over a vocabulary split by TP): each rank's main gradient is its rows of
    autograd's gradient of the whole micro-batch's loss."""
    for ok in pool2.run("dist_workers", "sharded_head_into_main_grad"):
        assert ok


WIDE = {"expert_ffn_hidden": PER_EXPERT_MIN_FFN, "hidden": 32}
"""tiny-moe with experts wide enough for the per-expert GEMMs (4 experts, 2 per rank)."""


@pytest.mark.parametrize("layout", [
    dict(dp=2, ep=2, micro_batch_size=1),
    dict(dp=2, ep=2, micro_batch_size=1, cross_entropy=CrossEntropy.chunked),
    dict(dp=2, ep=2, micro_batch_size=1, cross_entropy=CrossEntropy.chunked,
         kernels=Kernels.fused, grad_sync_precision=Precision.bf16),
    dict(dp=2, ep=2, micro_batch_size=1, grad_sync_precision=Precision.bf16,
         optimizer_sharding=OptimizerSharding.zero1),
])
def test_fused_accumulation_with_wide_experts_matches_the_separate_pass(pool2, layout):
    """Two micro-batches per rank, so the second adds into a main gradient already holding the
    first: gradients after the sync, parameters after the optimizer and the next step's loss
    equal the unfused run's (the same sums, rounded in another order at most)."""
    plan = make_plan(global_batch=4, **layout)
    plan = plan.model_copy(update={"model": plan.model.model_copy(update=WIDE)})
    for serial, fused in pool2.run("dist_workers", "overlapped_and_serial_sync",
                                   plan.model_dump_json(), 10**9):
        assert fused["marked_experts"] and not serial["marked_experts"]
        chunked = plan.cross_entropy == CrossEntropy.chunked
        assert fused["marked_head"] == chunked and not serial["marked_head"]
        assert abs(fused["loss"] - serial["loss"]) <= 1e-6 * abs(serial["loss"])
        assert abs(fused["next_loss"] - serial["next_loss"]) <= 1e-5 * abs(serial["next_loss"])
        for kind in ("grads", "params"):
            for name, value in serial[kind].items():
                torch.testing.assert_close(fused[kind][name], value, rtol=1e-4, atol=1e-6,
                                           msg=f"{kind} {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's bf16 GEMMs")
@pytest.mark.parametrize("main_dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_bf16_gemms_accumulate_into_bf16_and_fp32_main_gradients(main_dtype):
    """bf16 operands into a bf16 main gradient (addmm_) or an fp32 one (addmm with out_dtype):
    within bf16 rounding of the fp32 reference, per Linear and per expert."""
    dev = torch.device("cuda")
    w = nn.Parameter(torch.randn(256, 128, device=dev, dtype=torch.bfloat16))
    e = nn.Parameter(torch.randn(4, 256, 128, device=dev, dtype=torch.bfloat16))
    for p in (w, e):
        p.main_grad = torch.zeros(p.shape, device=dev, dtype=main_dtype)
    counts = torch.tensor([100, 0, 200, 212], device=dev)
    x = torch.randn(512, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(512, 256, device=dev, dtype=torch.bfloat16)
    for _ in range(2):  # the second backward adds onto the first
        linear_accumulating(w, x).backward(g)
        per_expert_accumulating(counts)(x, e).backward(g)
    xf, gf = x.detach().float(), g.float()
    ref_w = 2 * gf.t() @ xf
    ref_e = torch.stack([2 * gf[s:s + c].t() @ xf[s:s + c] for s, c in
                         zip((0, 100, 100, 300), (100, 0, 200, 212), strict=True)])
    for got, want in ((w.main_grad, ref_w), (e.main_grad, ref_e)):
        assert got.dtype == main_dtype
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's bf16 GEMMs")
@pytest.mark.parametrize("kernels", ["eager", "fused"])
@pytest.mark.parametrize("main_dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_chunked_loss_adds_the_scaled_head_gradient_into_its_main_gradient(
        monkeypatch, main_dtype, kernels):
    """bf16 hidden states and head over several chunks, the scale as the GEMM's alpha, into a
    bf16 main gradient (addmm_) or an fp32 one (addmm with out_dtype): within bf16 rounding of
    the fp32 gradient the unmarked loss gives."""
    from plans import layout
    from runtime import loss
    from runtime.kernels import kernel_ops
    from runtime.parallel.grad_accumulation import IN_GEMM

    monkeypatch.setattr(layout, "CHUNK_LOGITS", 64 * 1000)  # 64 tokens a chunk
    dev, ops = torch.device("cuda"), kernel_ops(Kernels(kernels))
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(300, 256, generator=g, device=dev).bfloat16()
    w0 = torch.randn(1000, 256, generator=g, device=dev).bfloat16() * 0.05
    labels = torch.randint(0, 1000, (300,), generator=g, device=dev)
    scale = 1 / 300
    w = nn.Parameter(w0.clone())
    setattr(w, IN_GEMM, True)
    w.main_grad = torch.zeros(w.shape, device=dev, dtype=main_dtype)
    for _ in range(2):  # the second micro-batch adds onto the first
        loss.chunked_cross_entropy(h, w, labels, scale, ops).backward()
    ref = nn.Parameter(w0.float())
    loss.chunked_cross_entropy(h.float(), ref, labels, scale).backward()
    assert w.grad is None and w.main_grad.dtype == main_dtype
    torch.testing.assert_close(w.main_grad.float(), 2 * ref.grad, rtol=2e-2, atol=1e-4)
