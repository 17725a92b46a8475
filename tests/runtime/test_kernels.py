"""plan.kernels fused: the compiled memory-bound operators (runtime.kernels) train the same
model as eager PyTorch, on one process and on two gloo ranks with expert parallelism (the
expert-row dimension varies there), within the parity tolerances (fp32 on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_workers import DTYPES, OPTIM, SEED, make_plan, reference_trainer
from test_parity import GRAD_RTOL, LOSS_RTOL, check_one_step

from plans import CrossEntropy, Dispatch, Kernels, OptimizerSharding, Precision, Recompute
from runtime.config import ModelConfig, ModelOptions
from runtime.data import SyntheticTokens
from runtime.kernels import EAGER, kernel_ops
from runtime.model import AttentionCore, Transformer
from runtime.trainer import build_trainer, model_options, reference_plan


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


@pytest.mark.parametrize("layout", [
    dict(dp=2, ep=2, dispatch=Dispatch.all_to_all, global_batch=2),
    dict(tp=2, ep=2, tp_attention=True, dispatch=Dispatch.allgather_reduce_scatter),
], ids=["dp2_ep2_a2a", "tp2_ep2_ag"])
def test_fused_ep2_matches_eager_reference(pool2, layout):
    """Fused kernels and the fused chunked loss on two ranks against the eager one-rank run
    with the materialized loss: the compiled permutations see a different row count on each
    rank and step; under TP attention each rank's loss covers its sequence shard."""
    fused = make_plan(kernels=Kernels.fused, **layout).model_copy(
        update={"cross_entropy": CrossEntropy.chunked})
    check_one_step(pool2, fused, reference=make_plan(**layout))


def test_fused_rms_norm_serves_every_call_site_in_one_graph_per_width_and_dtype():
    """The block's norms, the per-head q and k norms and each layout's shards of them share
    the fused RMSNorm: more distinct shapes than dynamo's recompile limit (8) in one process,
    as a parity run builds (the layout, then its bf16 and fp32 references), within the two
    graphs their widths need per dtype."""
    ops = kernel_ops(Kernels.fused)
    g = torch.Generator().manual_seed(0)
    shapes = [(1, s, h) for s in (6, 12) for h in (24,)] + \
        [(b, s, heads, 8) for b in (1, 2) for s in (6, 12) for heads in (1, 2, 4)]
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            x = torch.randn(*shape, generator=g).to(dtype)
            w = torch.randn(shape[-1], generator=g).to(dtype)
            torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), EAGER.rms_norm(x, w, 1e-6))
    assert len(shapes) * 2 > torch._dynamo.config.recompile_limit


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


@pytest.mark.parametrize("sharding", list(OptimizerSharding))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_adamw_follows_torch_adamw(sharding, dtype):
    """kernels fused: the optimizer step is one compiled pass (runtime.kernels.adamw_step)
    reading bf16 main gradients as they are and writing the weights. Same model operators
    (eager) on both sides, so the gradients are the same bits; one step of torch's AdamW and
    of the fused one agree to rounding (fp32 masters: a few ulps; bf16 weights: a rare
    rounding flip of one ulp). Later steps would amplify those: Adam's update of a near-zero
    gradient is about +-lr whatever its size."""
    plans = {k: make_plan(grad_sync_precision=Precision.bf16, optimizer_sharding=sharding,
                          kernels=k) for k in Kernels}
    weights = {}
    for kernels, plan in plans.items():
        ref = reference_plan(plan)
        t = ref.training
        trainer = build_trainer(
            ref, 0, 1, torch.device("cpu"), SEED,
            SyntheticTokens(t.global_batch, t.seq_len, ref.model.vocab, SEED),
            model_options(plans[Kernels.eager]), OPTIM, DTYPES[dtype])
        assert (trainer.optimizer.fused is not None) == (kernels == Kernels.fused)
        trainer.train_step(0)
        weights[kernels] = {n: p.detach().float() for n, p in trainer.model.named_parameters()}
    tol = 1e-6 if dtype == "fp32" else 2e-3
    for name, w in weights[Kernels.fused].items():
        assert _rel(w, weights[Kernels.eager][name]) < tol, name


def test_fused_adamw_zero1_loss_curve_follows_single_process(pool2):
    """The fused AdamW on ZeRO-1 shards over dp (the reduce-scattered slice read as the wire
    delivers it, the updated slice all-gathered into the parameters) trains as on one rank."""
    plan = make_plan(dp=2, ep=2, global_batch=4, kernels=Kernels.fused,
                     optimizer_sharding=OptimizerSharding.zero1)
    steps = 2
    curves = pool2.run("dist_workers", "loss_curve", plan.model_dump_json(), steps)
    ref = reference_trainer(plan)
    assert ref.optimizer.fused is not None
    expect = [ref.train_step(s).loss for s in range(steps)]
    for curve in curves:
        for got, want in zip(curve, expect, strict=True):
            assert abs(got - want) / want < LOSS_RTOL, (curve, expect)
    # the second step's loss is on another batch: it need not fall, but it must differ from
    # what the initial weights give there (the update ran)
    assert expect[1] != reference_trainer(plan).train_step(1).loss


def test_a_closed_trainer_leaves_no_process_groups_and_the_next_one_trains_alike(pool2):
    """Trainer.close unhooks the gradient sync from the parameters (the ZeRO-1 launcher's
    hooks kept the optimizer and its buffers alive: 24 GiB per earlier plan on an H200) and
    destroys the groups its mesh built; the next trainer builds its own and trains the same
    step."""
    plan = make_plan(dp=2, ep=2, global_batch=4, optimizer_sharding=OptimizerSharding.zero1)
    for rank_result in pool2.run("dist_workers", "closed_trainers", plan.model_dump_json(), 2):
        (first, left_first, kept_first), (second, left_second, kept_second) = rank_result
        assert left_first == left_second == 0
        assert not kept_first and not kept_second
        assert first == second


@pytest.mark.parametrize("every_slot", [True, False])
def test_the_fused_permutations_match_indexing_and_their_gradients(every_slot):
    """The fused set's token permutation: with every slot routed, gathers by the inverse
    permutation and a sum over each token's k rows instead of atomic index-adds; with a subset
    of the slots (all-gather dispatch, capacity), the index-add operator. Values and gradients
    equal the eager indexing's (float64), and gradcheck holds."""
    from runtime.kernels import (
        gather_every_slot,
        gather_rows,
        index_rows,
        inverse_permutation,
        permute_rows,
        weighted_scatter,
        weighted_sum,
    )

    g = torch.Generator().manual_seed(0)
    tokens_n, k, hidden, experts = 6, 3, 4, 5
    tokens = torch.randn(tokens_n, hidden, dtype=torch.float64, generator=g, requires_grad=True)
    weights = torch.rand(tokens_n, k, dtype=torch.float64, generator=g, requires_grad=True)
    indices = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens_n)])
    slots = torch.argsort(indices.reshape(-1), stable=True)
    if not every_slot:
        slots = slots[: slots.numel() - 4]

    def eager(t, w):
        rows = gather_rows(t, slots, k)
        return weighted_scatter(rows * 2 + 1, slots, w, tokens_n, k)

    def fused(t, w):
        rows = gather_every_slot(t, slots, k)
        if slots.numel() == tokens_n * k:
            per_slot = permute_rows(rows * 2 + 1, inverse_permutation(slots), slots)
            return weighted_sum(per_slot, w, k)
        return weighted_scatter(rows * 2 + 1, slots, w, tokens_n, k)

    assert torch.allclose(fused(tokens, weights), eager(tokens, weights))
    ge = torch.autograd.grad(eager(tokens, weights).square().sum(), (tokens, weights))
    gf = torch.autograd.grad(fused(tokens, weights).square().sum(), (tokens, weights))
    for a, b in zip(gf, ge, strict=True):
        assert torch.allclose(a, b)
    assert torch.autograd.gradcheck(fused, (tokens, weights))
    perm = torch.randperm(7, generator=g)
    x = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: permute_rows(v, perm), (x,))
    assert torch.equal(permute_rows(x, perm), index_rows(x, perm))


def test_a_fused_set_loads_the_compiler_before_the_first_step():
    """runtime.kernels.load_compiler: building the fused set imports inductor's compiler, so
    the first compiled region of a launch (cache hit or not) does not import it inside the
    first step; the eager set loads nothing."""
    import subprocess
    import sys

    probe = ("import sys\nfrom plans.enums import Kernels\nfrom runtime.kernels import kernel_ops\n"
             "kernel_ops(Kernels.eager)\nprint('torch._inductor.compile_fx' in sys.modules)\n"
             "kernel_ops(Kernels.fused)\nprint('torch._inductor.compile_fx' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def _saved_bytes(fn) -> dict[torch.dtype, int]:
    """Bytes of the distinct tensors autograd saves for backward while ``fn`` runs, by dtype."""
    seen: dict[tuple, tuple[torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))
        seen[key] = (t.dtype, t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    out: dict[torch.dtype, int] = {}
    for dtype, n in seen.values():
        out[dtype] = out.get(dtype, 0) + n
    return out


@pytest.mark.parametrize("kind", [Kernels.eager, Kernels.fused])
def test_combine_and_per_head_norm_keep_what_the_memory_model_counts(kind):
    """cost_models.memory: the combine keeps 4 k h bytes per token eagerly (the weighted rows'
    product and the index-add's source), 2 k h fused (the rows its compiled region weights);
    a per-head RMSNorm keeps 8 bytes per element eagerly (fp32 copies), fused 2 (one bf16
    copy) and 4 per head (the fp32 inverse norm)."""
    from cost_models.memory import norm_kept_bytes
    from runtime.moe import sort_by_expert

    ops = kernel_ops(kind)
    g = torch.Generator().manual_seed(0)
    tokens, k, h, experts = 64, 4, 32, 8
    indices = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    slots, _ = sort_by_expert(indices, experts, dropless=True)
    weights = torch.rand(tokens, k, generator=g, requires_grad=True)
    rows = torch.randn(tokens * k, h, generator=g, dtype=torch.bfloat16, requires_grad=True)
    expert_out = rows * 1  # the experts' output, not a leaf
    saved = _saved_bytes(lambda: ops.weighted_scatter(expert_out, slots, weights, tokens, k))
    combine = 2 * k * h if kind == Kernels.fused else 4 * k * h
    # beside the rows, at most the slots' weights in the rows' dtype (2 bytes each)
    assert combine * tokens <= saved[torch.bfloat16] <= (combine + 2 * k) * tokens
    heads, head_dim = 4, 16
    x = torch.randn(tokens, heads, head_dim, generator=g, dtype=torch.bfloat16,
                    requires_grad=True) * 1
    w = torch.ones(head_dim, requires_grad=True)
    saved = _saved_bytes(lambda: ops.rms_norm(x, w, 1e-6))
    kept = sum(saved.values()) - w.numel() * w.element_size()  # the norm's weight aside
    if kind == Kernels.fused:
        assert kept == norm_kept_bytes(heads * head_dim, heads, True) * tokens
    else:  # the model's 8 per element, beside which eager keeps each row's fp32 statistic
        assert 8 * heads * head_dim * tokens <= kept <= (8 * head_dim + 4) * heads * tokens
