"""Unit tests of the model pieces and of each collective building block."""

from __future__ import annotations

import math

import pytest
import torch

from plans.enums import ExpertGemm
from runtime.moe import (
    GroupedExperts,
    LocalDispatcher,
    MoE,
    Router,
    balance_loss,
    capacity_mask,
    grouped_mm,
    routing_skew,
)


def test_router_topk_and_renormalised_weights():
    torch.manual_seed(0)
    r = Router(8, 6, 2, balance_groups=6)
    x = torch.randn(10, 8)
    out = r(x)
    probs = torch.softmax(r.gate(x), -1)
    top = probs.topk(2, -1)
    assert torch.equal(out.indices, top.indices)
    torch.testing.assert_close(out.weights, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(10))


def test_balance_loss_is_one_when_balanced_and_groups_sum_experts():
    probs = torch.full((4, 4), 0.25)
    indices = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    for groups in (4, 2, 1):
        assert balance_loss(probs, indices, groups).item() == pytest.approx(1.0)
    probs = torch.softmax(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), -1)
    indices = probs.topk(2, -1).indices
    f = torch.bincount(indices.flatten(), minlength=4).float() / 10
    p = probs.mean(0)
    expect_groups = 2 * ((f[:2].sum() * p[:2].sum()) + (f[2:].sum() * p[2:].sum()))
    torch.testing.assert_close(balance_loss(probs, indices, 2), expect_groups)
    torch.testing.assert_close(balance_loss(probs, indices, 4), 4 * (f * p).sum())


def test_capacity_keeps_first_tokens_of_each_expert():
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    keep = capacity_mask(indices, 4, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    r = Router(4, 4, 2, balance_groups=4, capacity_factor=1.0)
    out = r(torch.randn(16, 4))
    cap = math.ceil(1.0 * 16 * 2 / 4)
    kept = out.indices[out.indices >= 0]
    assert torch.bincount(kept, minlength=4).max() <= cap
    assert (out.weights[out.indices < 0] == 0).all()


def test_grouped_mm_fallback_matches_row_by_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 4, generator=g)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 4, generator=g)
    expert = torch.repeat_interleave(torch.arange(3), counts)
    expect = torch.stack([w[e] @ x[i] for i, e in enumerate(expert.tolist())])
    torch.testing.assert_close(grouped_mm(x, w, counts), expect)


def _expert_pair(gemm: ExpertGemm) -> tuple[GroupedExperts, GroupedExperts]:
    """``gemm``'s experts and grouped ones with the same fp64 weights."""
    torch.manual_seed(0)
    other, grouped = GroupedExperts(4, 6, 5, gemm=gemm), GroupedExperts(4, 6, 5)
    with torch.no_grad():
        for a, b in zip(other.parameters(), grouped.parameters(), strict=True):
            b.copy_(torch.randn_like(b))
            a.copy_(b)
    return other.double(), grouped.double()


@pytest.mark.parametrize("gemm", list(ExpertGemm))
def test_every_expert_gemm_gives_the_grouped_outputs_and_gradients(gemm):
    """plans.enums.ExpertGemm: the paths compute one function (an expert without rows too)."""
    other, grouped = _expert_pair(gemm)
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(9, 6, dtype=torch.float64)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = other(x, counts), grouped(x_ref, counts)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    for a, b in zip(other.parameters(), grouped.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    assert torch.count_nonzero(other.w1.grad[1]) == 0


@pytest.mark.parametrize("gemm", [ExpertGemm.grouped, ExpertGemm.per_expert])
def test_accumulating_expert_gemms_add_the_grouped_gradients_into_main_gradients(gemm):
    """Gradient-accumulation fusion over each ExpertGemm that accumulates in the GEMM
    (plans.layout.accumulates_experts_in_gemm): two backwards add into the main gradients."""
    from runtime.parallel.grad_accumulation import accumulating_matmul

    other, grouped = _expert_pair(gemm)
    for p in other.parameters():
        p.main_grad = torch.zeros_like(p)
    other.matmul = accumulating_matmul(gemm)
    counts = torch.tensor([1, 3, 0, 2])
    for _ in range(2):
        x, g = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
        other(x, counts).backward(g)
        grouped(x, counts).backward(g)
    for a, b in zip(other.parameters(), grouped.parameters(), strict=True):
        assert a.grad is None
        torch.testing.assert_close(a.main_grad, b.grad, rtol=0, atol=1e-12)


def test_the_expert_gemm_option_reaches_every_moe_layer_and_trains_alike():
    """ModelOptions.expert_gemm builds every layer's experts with it; the model's logits and
    gradients are the grouped model's."""
    from plans.catalog import load_model
    from runtime.config import ModelConfig, ModelOptions
    from runtime.model import Transformer, init_weights

    spec = load_model("tiny-moe")
    tokens = torch.randint(0, spec.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for gemm in ExpertGemm:
        with torch.device("meta"):
            model = Transformer(ModelConfig(spec, ModelOptions(expert_gemm=gemm)))
        init_weights(model, 0, {}, torch.device("cpu"), torch.float64)
        assert {m.experts.gemm for m in model.moe_layers()} == {gemm}
        model.head_logits = True
        logits = model(tokens)
        logits.square().mean().backward()
        results[gemm] = (logits.detach(), {k: p.grad for k, p in model.named_parameters()})
    ref_logits, ref_grads = results[ExpertGemm.grouped]
    for logits, grads in results.values():
        torch.testing.assert_close(logits, ref_logits, rtol=1e-12, atol=1e-12)
        for k, g in grads.items():
            torch.testing.assert_close(g, ref_grads[k], rtol=1e-10, atol=1e-12)


def test_local_dispatch_combine_matches_dense_moe():
    torch.manual_seed(0)
    experts, k, t, h = 4, 2, 7, 6
    ge = GroupedExperts(experts, h, 5)
    for p in ge.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(t, h)
    indices = torch.stack([torch.randperm(experts)[:k] for _ in range(t)])
    weights = torch.rand(t, k)
    from runtime.moe import Routing

    d = LocalDispatcher(experts)
    rows, counts, handle = d.dispatch(x, Routing(indices, weights, torch.zeros(())))
    y = d.combine(ge(rows, counts), handle)

    def expert(e, v):
        return ge.w2[e] @ (torch.nn.functional.silu(ge.w1[e] @ v) * (ge.w3[e] @ v))

    expect = torch.stack(
        [sum(weights[i, j] * expert(indices[i, j], x[i]) for j in range(k)) for i in range(t)]
    )
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)


def test_ulysses_all_to_all_round_trip(pool2):
    assert all(pool2.run("dist_workers", "ulysses_round_trip"))


@pytest.mark.parametrize("dropped", [False, True], ids=["dropless", "capacity_dropped"])
@pytest.mark.parametrize("kind", ["all_to_all", "allgather_reduce_scatter"])
def test_dispatcher_matches_local_permutation(pool2, kind, dropped):
    assert all(pool2.run("dist_workers", "dispatcher_vs_local", kind, dropped))


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 4, 6), (1, 3, 2),
                                        (2, 1, 4), (4, 1, 3), (4, 1, 8), (1, 1, 3)])
def test_timeline_runs_every_chunk_once_in_megatron_order(pp, vpp, m):
    from plans.pipeline import stage_actions, timeline

    ticks = timeline(pp, vpp, m)
    for stage in range(pp):
        order = stage_actions(pp, vpp, m, stage)
        assert [t[0][stage] for t in ticks if stage in t[0]] == order
        chunks = range(stage, pp * vpp, pp)
        for forward in (True, False):
            done = sorted((a.chunk, a.micro) for a in order if a.forward == forward)
            assert done == sorted((c, i) for c in chunks for i in range(m))
        # Megatron's warm-up forwards (1F1B: pp - stage - 1); the first backward follows one
        # more (steady) forward
        if vpp == 1:
            warmup = min(pp - stage - 1, m)
            assert [a.micro for a in order if a.forward] == list(range(m))
        else:
            warmup = vpp * m if m == pp else min((pp - stage - 1) * 2 + (vpp - 1) * pp, vpp * m)
        first_backward = next(i for i, a in enumerate(order) if not a.forward)
        assert first_backward == (warmup if warmup == vpp * m else warmup + 1)
    # a message is consumed no earlier than the tick after it is sent
    sent = {}
    for t, (actions, messages) in enumerate(ticks):
        for a in actions.values():
            need = ("act", a.chunk - 1, a.micro) if a.forward else ("grad", a.chunk + 1, a.micro)
            if need in sent:
                assert sent[need] < t
        for msg in messages:
            sent[msg.key] = t


def test_model_spec_fields_reach_the_model():
    """RoPE base, norm epsilon, QK norm and pre-softmax routing come from the ModelSpec."""
    from plans import catalog
    from runtime.config import ModelConfig
    from runtime.model import Transformer

    spec = catalog.load_model("tiny-moe-shared").model_copy(
        update={"rope_theta": 5e5, "norm_eps": 1e-5})
    block = Transformer(ModelConfig(spec)).layers["1"]
    assert block.attention.core.rope_theta == 5e5
    assert block.attention_norm.eps == 1e-5
    assert block.attention.q_norm.weight.shape == (spec.head_dim,)
    assert block.moe.router.pre_softmax
    plain = Transformer(ModelConfig(catalog.load_model("tiny-moe"))).layers["0"]
    assert plain.attention.q_norm is None and not plain.moe.router.pre_softmax


def test_pre_softmax_router_keeps_the_softmax_weights():
    from runtime.moe import Router

    torch.manual_seed(0)
    x = torch.randn(16, 8)
    for pre in (False, True):
        router = Router(8, 4, 2, 4, pre_softmax=pre)
        torch.nn.init.normal_(router.gate.weight)
        w = router(x).weights
        probs = torch.softmax(router.gate(x), -1).topk(2, -1).values
        expected = probs if pre else probs / probs.sum(-1, keepdim=True)
        torch.testing.assert_close(w, expected)


def _linear_ce_grads(fn, h, w, labels):
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    loss = fn(h, w, labels)
    (loss * 3.0).backward()  # a non-unit upstream gradient reaches both paths alike
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("kernels", ["eager", "fused"])
@pytest.mark.parametrize("chunk_logits", [7 * 50, 10**9])  # several chunks (ragged), or one
def test_chunked_cross_entropy_matches_the_materialized_loss(monkeypatch, chunk_logits,
                                                             kernels):
    # fused: each chunk's softmax and gradient one compiled region (inductor's C++ backend
    # here), its rows dynamic (the last chunk is ragged)
    from plans import Kernels, layout
    from runtime import loss
    from runtime.kernels import kernel_ops

    monkeypatch.setattr(layout, "CHUNK_LOGITS", chunk_logits)
    ops = kernel_ops(Kernels(kernels))
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(23, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (23,), generator=g)
    scale = 1 / 23
    chunked = _linear_ce_grads(
        lambda a, b, y: loss.chunked_cross_entropy(a, b, y, scale, ops), h, w, labels)
    reference = _linear_ce_grads(
        lambda a, b, y: loss.materialized_cross_entropy(a @ b.t(), y, scale), h, w, labels)
    for got, want in zip(chunked, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_loss_gradient_is_written_over_the_chunks_logits():
    # the chunk costs its logits' bytes alone (cost_models.memory.CHUNK_BYTES_PER_LOGIT)
    from plans import Kernels
    from runtime.kernels import EAGER, kernel_ops

    ops = kernel_ops(Kernels.fused)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 40, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 40, (9,), generator=g)
    want_loss, want_grad = EAGER.cross_entropy_grad(logits.clone(), labels)
    loss, grad = ops.cross_entropy_grad(logits, labels)
    assert grad.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)
    shard = torch.randn(9, 40, generator=g).to(torch.bfloat16)
    lse = torch.logsumexp(shard.float(), -1)
    want = EAGER.cross_entropy_grad_from(shard.clone(), labels, 0, lse)
    got = ops.cross_entropy_grad_from(shard, labels, 0, lse)
    assert got.data_ptr() == shard.data_ptr()
    torch.testing.assert_close(got, want)


def test_trainer_losses_agree_between_cross_entropy_kinds():
    # one fp32 training step on CPU: the same loss and main gradients either way
    from dist_workers import make_plan

    from plans import CrossEntropy
    from runtime.data import SyntheticTokens
    from runtime.trainer import build_trainer

    base = make_plan(micro_batch_size=2)
    results = []
    for kind in CrossEntropy:
        plan = base.model_copy(update={"cross_entropy": kind})
        t = plan.training
        data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, 0)
        trainer = build_trainer(plan, 0, 1, torch.device("cpu"), 0, data)
        loss = trainer.forward_backward(0)
        grads = {k: g for k, (g, _) in trainer.local_gradients().items()}
        results.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], rtol=1e-4, atol=1e-6)


def test_1f1b_is_the_vpp1_action_list():
    from plans.pipeline import stage_actions

    def text(order):
        return " ".join(f"{'F' if a.forward else 'B'}{a.micro}" for a in order)

    assert text(stage_actions(2, 1, 4, 0)) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert text(stage_actions(2, 1, 4, 1)) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert text(stage_actions(3, 1, 2, 0)) == "F0 F1 B0 B1"
    assert {a.chunk for a in stage_actions(3, 1, 2, 1)} == {1}


@pytest.mark.parametrize("vpp", [1, 2])
def test_pipeline_schedule_times_forward_backward_and_its_communication(pool2, vpp):
    from dist_workers import make_plan

    plan = make_plan(pp=2, vpp=vpp, stage_layers=(1,) * 4 if vpp == 2 else (2, 2),
                     global_batch=4)
    for rank, c in enumerate(pool2.run("dist_workers", "step_components", plan.model_dump_json())):
        assert c["forward"] > 0 and c["backward"] > 0 and c["pipeline_comm"] > 0, (rank, c)
        inside = c["forward"] + c["backward"] + c["pipeline_comm"]
        assert inside <= c["forward_backward"] * 1.01, (rank, c)


@pytest.mark.parametrize("chunk_logits", [7 * 50, 10**9])
def test_chunked_cross_entropy_in_bf16_stays_near_the_fp32_loss(monkeypatch, chunk_logits):
    # the CUDA dtypes on CPU: bf16 hidden states and weights, one chunk or several
    from plans import layout
    from runtime import loss

    monkeypatch.setattr(layout, "CHUNK_LOGITS", chunk_logits)
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(23, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (23,), generator=g)
    reference = _linear_ce_grads(
        lambda a, b, y: loss.materialized_cross_entropy(a @ b.t(), y, 1.0), h, w, labels)
    got = _linear_ce_grads(lambda a, b, y: loss.chunked_cross_entropy(a, b, y, 1.0),
                           h.bfloat16(), w.bfloat16(), labels)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=0.05, atol=0.1)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_recompute_wraps_exactly_the_modules_of_the_recomputed_operators(policy):
    """The runtime checkpoints the modules running plans.RECOMPUTED[policy], the set the cost
    model prices: the attention cores for selective, whole layers for full."""
    from plans import RECOMPUTED, LayerOperator, Recompute, catalog
    from runtime.config import ModelConfig
    from runtime.model import AttentionCore, Transformer, TransformerBlock
    from runtime.parallel.parallelize import apply_recompute
    from runtime.parallel.wrappers import Recomputed

    model = Transformer(ModelConfig(catalog.load_model("tiny-moe-shared")))
    names = [n for n, _ in model.named_parameters()]
    apply_recompute(model, RECOMPUTED[Recompute(policy)])
    wrapped = {type(m.inner) for m in model.modules() if isinstance(m, Recomputed)}
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys
    assert wrapped == {"none": set(), "selective": {AttentionCore},
                       "full": {TransformerBlock}}[policy]
    with pytest.raises(ValueError, match="expert_fc2"):
        apply_recompute(model, frozenset({LayerOperator.expert_fc2}))


def test_moe_act_wraps_every_layers_experts_beside_the_attention_cores():
    """selective with modules core_attn and moe_act: the attention cores checkpointed, the
    routed experts (under gradient-accumulation fusion, its accumulating form) rerun their
    activation (runtime.parallel.recompute); parameter names unchanged."""
    from plans import Recompute, RecomputeModule, catalog
    from plans.enums import ExpertGemm
    from plans.operators import recomputed_operators
    from runtime.config import ModelConfig, ModelOptions
    from runtime.model import AttentionCore, Transformer
    from runtime.moe import GroupedExperts
    from runtime.parallel.grad_accumulation import apply_grad_accumulation_fusion
    from runtime.parallel.parallelize import apply_recompute
    from runtime.parallel.wrappers import (
        AccumulatingExperts,
        ActivationRecomputed,
        Recomputed,
        plain,
    )

    for fuse in (False, True):  # per-expert GEMMs accumulate under the fusion
        model = Transformer(ModelConfig(catalog.load_model("tiny-moe-shared"),
                                        ModelOptions(expert_gemm=ExpertGemm.per_expert)))
        names = [n for n, _ in model.named_parameters()]
        if fuse:
            apply_grad_accumulation_fusion(model, head=False)
        apply_recompute(model, recomputed_operators(
            Recompute.selective, (RecomputeModule.core_attn, RecomputeModule.moe_act)))
        assert [n for n, _ in model.named_parameters()] == names
        for block in model.layers.values():
            assert isinstance(block.attention.core, Recomputed)
            assert isinstance(block.attention.core.inner, AttentionCore)
            if block.moe is not None:
                assert isinstance(block.moe.experts, ActivationRecomputed)
                assert isinstance(plain(block.moe.experts), GroupedExperts)
                assert isinstance(block.moe.experts.inner, AccumulatingExperts) == fuse


def test_every_timer_region_of_a_step_is_a_plans_component(pool2):
    """The regions a step opens are plans.COMPONENT_KEYS, and it reports every one of them."""
    from dist_workers import make_plan

    from plans import COMPONENT_KEYS, LAYER_REGIONS

    plan = make_plan(sp=2, ep=2, recompute="selective")
    for opened, components in pool2.run("dist_workers", "step_regions", plan.model_dump_json()):
        assert set(opened) <= set(COMPONENT_KEYS)
        assert {c.value for c in LAYER_REGIONS} <= set(opened)
        assert set(components) == set(COMPONENT_KEYS)


@pytest.mark.parametrize("kind", ["all_to_all", "allgather_reduce_scatter"])
@pytest.mark.parametrize("capacity_factor, shared", [(None, True), (1.0, False)])
def test_chunked_moe_matches_the_serial_layer(pool2, kind, capacity_factor, shared):
    assert all(pool2.run("dist_workers", "chunked_vs_serial", kind, capacity_factor, shared))


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_the_overlap_schedule_is_a_software_pipeline(chunks, shared):
    """The schedule issues every chunk's steps once and in data-flow order (CHAIN), sends chunk
    i + 1's dispatch before chunk i's experts and unpacks chunk i's combine after chunk i + 1's
    is sent, so each collective but the first and the last has compute issued beside it, with
    the collectives alone on the communication lane."""
    from runtime.parallel.overlap import CHAIN, COLLECTIVES_ALONE, Lane, Step

    schedule = COLLECTIVES_ALONE
    order = schedule.order(chunks, shared)
    routed = [(s, i) for s, i in order if s != Step.shared]
    assert sorted(routed) == sorted((s, i) for s in CHAIN for i in range(chunks))
    at = {stage: n for n, stage in enumerate(order)}
    for i in range(chunks):
        assert [at[s, i] for s in CHAIN] == sorted(at[s, i] for s in CHAIN)
    assert [s for s, _ in order].count(Step.shared) == int(shared)
    assert schedule.lane(Step.experts) == schedule.lane(Step.shared) == Lane.compute
    for i in range(chunks - 1):
        assert at[Step.dispatch_exchange, i + 1] < at[Step.experts, i]
        assert at[Step.combine_exchange, i + 1] < at[Step.combine_unpack, i]
    assert {s for s in Step if COLLECTIVES_ALONE.lane(s) == Lane.comm} == {
        Step.dispatch_exchange, Step.combine_exchange}


def test_routing_skew_is_max_over_mean_slots_per_expert_read_once():
    """The router records max / mean routed slots per expert on the device each forward;
    routing_skew reads (mean, max) over layers and forwards once, then starts again."""
    moe = MoE(hidden=4, experts=4, top_k=1, ffn_hidden=8, balance_groups=4)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0] = 10.0  # a positive first feature picks expert 0
    hot = torch.zeros(8, 4)
    hot[:, 0] = 1.0  # every token to expert 0: max / mean = 8 / 2 = 4
    assert routing_skew([moe]) is None
    moe.router(hot)
    load = moe.router.take_load()
    assert load.tolist() == [4.0, 4.0, 1.0]
    moe.router._record_load(torch.tensor([2.0, 2.0, 2.0, 2.0]))  # balanced: 1
    moe.router(hot)
    assert routing_skew([moe]) == pytest.approx((2.5, 4.0))
    assert routing_skew([moe]) is None


@pytest.mark.parametrize(("mbs", "gemm"), [(8, ExpertGemm.per_expert), (1, ExpertGemm.grouped)])
def test_the_trainer_builds_the_experts_on_the_path_the_rule_picks(mbs, gemm):
    """runtime.trainer.model_options: the experts' path is plans.layout.expert_gemm's for the
    plan's layout (Mixtral-8x7B's 8,192 rows per expert at micro-batch 8, 1,024 at 1), the
    path the cost model prices (cost_models.params.expert_gemm_of); every MoE layer has it."""
    from cost_models.params import expert_gemm_of
    from plans import Degrees, Plan, TrainingSpec
    from plans.catalog import load_cluster, load_model
    from runtime.config import ModelConfig
    from runtime.model import Transformer
    from runtime.trainer import model_options

    model = load_model("mixtral-8x7b").model_copy(update={"layers": 2})
    plan = Plan(model=model, cluster=load_cluster("h200").with_gpus(1),
                training=TrainingSpec(global_batch=8, seq_len=4096), degrees=Degrees(),
                stage_layers=(2,), micro_batch_size=mbs)
    options = model_options(plan)
    assert options.expert_gemm == gemm == expert_gemm_of(plan)
    with torch.device("meta"):
        built = Transformer(ModelConfig(model, options))
    assert {m.experts.gemm for m in built.moe_layers()} == {gemm}


def test_the_trainer_builds_the_experts_on_the_path_a_plan_names():
    """Plan.expert_gemm, when set, is the path the trainer builds (and the cost model prices):
    the micro-batch-8 Mixtral plan pinned grouped builds grouped experts."""
    from cost_models.params import expert_gemm_of
    from plans import Degrees, Plan, TrainingSpec
    from plans.catalog import load_cluster, load_model
    from runtime.trainer import model_options

    model = load_model("mixtral-8x7b").model_copy(update={"layers": 2})
    plan = Plan(model=model, cluster=load_cluster("h200").with_gpus(1),
                training=TrainingSpec(global_batch=8, seq_len=4096), degrees=Degrees(),
                stage_layers=(2,), micro_batch_size=8, expert_gemm=ExpertGemm.grouped)
    assert model_options(plan).expert_gemm == ExpertGemm.grouped == expert_gemm_of(plan)
