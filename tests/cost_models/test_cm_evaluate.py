"""End to end: the paper's Internal-352B plan against its Megatron-LM baseline."""

import pytest

from cost_models import evaluate, memory_breakdown, stage_costs
from plans import Overlap, PipelineSchedule, Plan


def test_paper_plan_is_sane_and_beats_megatron(plan_352b, megatron_352b):
    ours, megatron = evaluate(plan_352b), evaluate(megatron_352b)
    assert 0.2 < ours.mfu < 0.6
    assert ours.feasible and ours.reason is None
    assert megatron.step_time_s > ours.step_time_s
    assert sum(ours.breakdown_s.values()) == pytest.approx(ours.step_time_s)
    assert ours.tokens_per_s == pytest.approx(720 * 8192 / ours.step_time_s)
    assert {"compute", "pipeline_bubble", "pp_p2p", "grad_sync", "recompute",
            "exposed_comm.sp_all_to_all", "exposed_comm.ep_dispatch"} <= set(ours.breakdown_s)
    assert "exposed_comm.tp_all_gather" in megatron.breakdown_s


def test_mfu_definition(plan_352b):
    ev = evaluate(plan_352b)
    flops = plan_352b.model.flops_per_token(8192) * 720 * 8192
    assert ev.mfu == pytest.approx(flops / (1440 * 989e12 * ev.step_time_s))


def test_prediction_round_trips_into_a_plan(plan_352b):
    ev = evaluate(plan_352b)
    pred = ev.prediction()
    assert pred.peak_memory_gib == pytest.approx(ev.memory.peak_bytes / 2**30)
    assert pred.breakdown_s == dict(ev.breakdown_s)
    with_pred = plan_352b.model_copy(update={"prediction": pred})
    assert Plan.model_validate(with_pred.model_dump()).prediction == pred


def test_bubble_and_stage_costs(plan_352b):
    ev, sc = evaluate(plan_352b), stage_costs(plan_352b)
    # Stage times: 4 layers each, the first adds the embedding, the last the head.
    stages = [4 * sc.layer_s] * 15
    stages[0] += sc.embedding_s
    stages[-1] += sc.head_s
    assert ev.breakdown_s["pipeline_bubble"] == pytest.approx(sum(stages) - max(stages))
    assert sc.layer_s == pytest.approx(ev.layer.total_s)
    assert memory_breakdown(plan_352b) == ev.memory


def test_interleaving_and_overlap_knobs(plan_352b):
    base = evaluate(plan_352b)
    inter = plan_352b.model_copy(update={
        "degrees": plan_352b.degrees.model_copy(update={"pp": 15, "vpp": 2}),
        "stage_layers": (2,) * 30, "schedule": PipelineSchedule.interleaved_1f1b})
    assert evaluate(inter).breakdown_s["pipeline_bubble"] < base.breakdown_s["pipeline_bubble"]
    serial = evaluate(plan_352b.model_copy(update={"overlap": Overlap.none}))
    assert serial.step_time_s > base.step_time_s
    unsynced = evaluate(plan_352b.model_copy(update={"grad_sync_overlap": False}))
    assert unsynced.breakdown_s["grad_sync"] > base.breakdown_s["grad_sync"]


def test_optimizer_step_prices_the_states_this_gpu_holds(plan_352b):
    """Replicated states: every GPU updates all its parameters, not its ZeRO-1 slice, so the
    optimizer step is slower by about the replication factor."""
    from plans import OptimizerSharding

    assert plan_352b.optimizer_sharding == OptimizerSharding.zero1
    full = plan_352b.model_copy(update={"optimizer_sharding": OptimizerSharding.none})
    sharded_s = evaluate(plan_352b).breakdown_s["optimizer"]
    full_s = evaluate(full).breakdown_s["optimizer"]
    d = plan_352b.degrees
    assert full_s > 2 * sharded_s and full_s <= d.dp * d.sp * d.cp * sharded_s * 1.01


def test_a_chunked_moe_layer_adds_its_expert_gradients_once_more(node_plan):
    """Inter-op chunks compute each expert weight gradient once per chunk: without
    accumulation fusion one more pass over the expert weights per micro-batch and MoE layer
    (read two bf16 gradients, write the sum), and one more expert gradient held in the MoE
    backward's working set; with fusion and experts whose GEMMs accumulate (Mixtral's one
    expert per rank) both are gone."""
    from cost_models.compute import memory_s
    from cost_models.params import part_params
    from plans import Recompute

    serial = node_plan(overlap=Overlap.none, recompute=Recompute.none,
                       grad_accumulation_fusion=False)
    chunked = serial.model_copy(update={"overlap": Overlap.inter_op})
    experts = part_params(serial.model, serial.degrees).moe_layer.expert
    layers = serial.model.layers - serial.model.dense_layers
    m = serial.num_micro_batches
    grow = (evaluate(chunked).breakdown_s["grad_accumulation"]
            - evaluate(serial).breakdown_s["grad_accumulation"])
    assert grow == pytest.approx(m * layers * memory_s(experts * 3 * 2, serial.cluster))
    fused = [p.model_copy(update={"grad_accumulation_fusion": True}) for p in (serial, chunked)]
    assert evaluate(fused[0]).breakdown_s["grad_accumulation"] == pytest.approx(
        evaluate(fused[1]).breakdown_s["grad_accumulation"])
    working = [memory_breakdown(p).components_bytes["activation_working"]
               for p in (serial, chunked)]
    assert working[1] - working[0] == pytest.approx(2 * experts)
    fused_working = [memory_breakdown(p).components_bytes["activation_working"] for p in fused]
    assert fused_working[1] == pytest.approx(fused_working[0])


@pytest.mark.parametrize("loss", ["materialized", "chunked"])
@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_fusion_leaves_separate_passes_to_the_edges_and_grouped_experts(node_plan, model,
                                                                        loss):
    """With gradient-accumulation fusion the blocks' dense weights accumulate in their GEMMs;
    the embedding and the materialized loss's LM head take a separate pass (the chunked
    loss's head weight goes into its main gradient in the loss's GEMMs: only the final norm
    is left), the routed experts too unless few and wide per rank
    (plans.layout.accumulates_experts_in_gemm: Mixtral's 1 of 14,336 per rank yes, Qwen3's
    16 of 768 no)."""
    from cost_models.compute import memory_s
    from cost_models.memory import grad_bytes_per_param
    from cost_models.params import experts_in_gemm, head_in_gemm, part_params
    from plans import CrossEntropy, Recompute

    kind = CrossEntropy(loss)
    plan = node_plan(model, recompute=Recompute.none, grad_accumulation_fusion=True,
                     cross_entropy=kind)
    unfused = evaluate(plan.model_copy(update={"grad_accumulation_fusion": False}))
    parts = part_params(plan.model, plan.degrees)
    layers = plan.model.layers - plan.model.dense_layers
    # read the bf16 gradient, read and write the main gradient
    per_param = memory_s(2 + 2 * grad_bytes_per_param(plan.grad_sync_precision), plan.cluster)
    assert head_in_gemm(plan, kind) == (kind == CrossEntropy.chunked)
    lm_head = parts.lm_head if kind == CrossEntropy.chunked else 0.0
    assert lm_head == 0.0 or lm_head == plan.model.vocab * plan.model.hidden
    edges = parts.embedding.dense + parts.head.dense - lm_head
    wide = model == "mixtral-8x7b"
    assert experts_in_gemm(plan) == wide
    expect = edges + (0.0 if wide else layers * parts.moe_layer.expert)
    got = evaluate(plan).breakdown_s["grad_accumulation"]
    assert got == pytest.approx(plan.num_micro_batches * expect * per_param)
    assert got < unfused.breakdown_s["grad_accumulation"]


def test_the_chunked_loss_into_the_main_gradient_is_priced_as_it_runs(node_plan):
    """Under gradient-accumulation fusion the chunked loss's GEMMs add the head's weight
    gradient into its main gradient: forward, every chunk's GEMM reads the main gradient
    (fp32 sync: 4 bytes an element) instead of the fp32 sum's adds; backward, no scaled
    cast; no separate pass (cost_models.pipeline.cross_entropy_s, evaluate.head_s). A head
    tied to the embedding on one stage keeps autograd's gradient; Megatron-Core's output layer
    (target megatron) accumulates in its backward GEMM under the fusion: no separate pass,
    its loss's passes as before."""
    from cost_models import pipeline as pl
    from cost_models.compute import memory_s
    from cost_models.evaluate import head_edge, head_s
    from cost_models.params import head_in_gemm
    from plans import CrossEntropy, Kernels, Recompute, Target
    from plans.layout import loss_chunks

    plan = node_plan("qwen3-30b-a3b", recompute=Recompute.none, grad_accumulation_fusion=True,
                     cross_entropy=CrossEntropy.chunked, kernels=Kernels.fused)
    m, c = plan.model, plan.cluster
    rows = 32768  # a micro-batch of several chunks
    chunks = loss_chunks(rows, m.vocab)
    assert chunks > 1
    weights = m.vocab * m.hidden
    fused = pl.cross_entropy_s(m, c, rows, 1, CrossEntropy.chunked, Kernels.fused, 4)
    alone = pl.cross_entropy_s(m, c, rows, 1, CrossEntropy.chunked, Kernels.fused)
    assert fused[1] == 0.0 and alone[1] == pytest.approx(memory_s(14 * weights, c))
    assert fused[0] - alone[0] == pytest.approx(memory_s(weights * (4 * chunks
                                                                    - 4 * (chunks - 1)), c))
    unfused = plan.model_copy(update={"grad_accumulation_fusion": False})
    assert head_edge(plan, CrossEntropy.chunked).total_s < head_edge(
        unfused, CrossEntropy.chunked).total_s
    assert head_s(plan, CrossEntropy.chunked) < head_s(unfused, CrossEntropy.chunked)
    megatron = plan.model_copy(update={"target": Target.megatron})
    assert head_in_gemm(megatron, CrossEntropy.materialized)
    assert not head_in_gemm(megatron.model_copy(update={"grad_accumulation_fusion": False}),
                            CrossEntropy.materialized)
    assert head_edge(megatron, CrossEntropy.materialized).total_s == head_edge(
        megatron.model_copy(update={"grad_accumulation_fusion": False}),
        CrossEntropy.materialized).total_s
    assert head_s(megatron, CrossEntropy.materialized) < head_s(
        megatron.model_copy(update={"grad_accumulation_fusion": False}),
        CrossEntropy.materialized)
    tied = plan.model_copy(update={"model": m.model_copy(update={"tied_embeddings": True})})
    assert not head_in_gemm(tied, CrossEntropy.chunked)
