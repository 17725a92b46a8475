"""Memory per GPU: the runtime's allocations term by term, held to the H200 measurements of the
memory suite; ZeRO-1 states; feasibility."""

import json
from pathlib import Path

import pytest

from cost_models import memory_breakdown
from cost_models.memory import in_flight_micro_batches, layer_activation_bytes
from cost_models.params import stage_params
from plans import Degrees, Plan, Recompute
from plans.catalog import load_model

GIB = 2**30


MEASURED = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200" / "memory"


def _measured(case: str) -> tuple[Plan, dict]:
    doc = json.loads((MEASURED / f"memory_{case}.json").read_text())
    return Plan.model_validate(doc["plan"]), doc["ranks"][0]


@pytest.mark.parametrize("case", ["qwen4l_1gpu_mbs4", "deepseek4l_1gpu_mbs2",
                                  "mixtral2l_1gpu_mbs4", "qwen4l_1gpu_mbs8_sel",
                                  "qwen4l_1gpu_mbs8_full", "deepseek4l_tp2_etp2_mbs4"])
def test_layer_terms_match_the_bytes_each_layer_kept_on_h200(case):
    # module_kept_bytes: allocated after minus before each layer's forward of the first
    # micro-batch on H200 (bench/memory/memory_suite.py); one MoE layer of the plan's stage
    plan, rank = _measured(case)
    d, t = plan.degrees, plan.training
    tokens = plan.micro_batch_size * t.seq_len / (d.sp * d.cp * d.tp)
    predicted = layer_activation_bytes(plan.model, tokens, d, plan.ffn, plan.recompute, False,
                                       plan.micro_batch_size, plan.kernels,
                                       plan.grad_accumulation_fusion)
    measured = rank["module_kept_bytes"]["layers.0"]
    assert predicted == pytest.approx(measured, rel=0.03)


def test_ep_layer_terms_bracket_the_ranks_measured_layers():
    # with EP the rows a rank keeps follow its routed load: the model's EP_LOAD covers the
    # stage's mean on every rank, the balanced share (load 1) sits between the ranks
    plan, _ = _measured("qwen4l_sp2_ep2_a2a_mbs8")
    doc = json.loads((MEASURED / "memory_qwen4l_sp2_ep2_a2a_mbs8.json").read_text())
    d = plan.degrees
    tokens = plan.micro_batch_size * plan.training.seq_len / d.sp
    predicted = layer_activation_bytes(plan.model, tokens, d, plan.ffn, plan.recompute, False,
                                       plan.micro_batch_size, plan.kernels,
                                       plan.grad_accumulation_fusion)
    for rank in doc["ranks"]:
        layers = [v for k, v in rank["module_kept_bytes"].items() if k.count(".") == 1]
        assert sum(layers) / len(layers) <= predicted


def test_every_plan_of_the_memory_suite_meets_the_target():
    # the committed suite (docs/memory.md): within 10% of the measured peak reserved bytes,
    # never more than 3% below
    from bench.memory import memory_report

    rows = memory_report.rows()
    assert len(rows) >= 19
    worst = min(rows, key=lambda r: r["error"]), max(rows, key=lambda r: r["error"])
    assert all(memory_report.meets(r) for r in rows), worst


def test_the_loss_peak_per_cross_entropy_kind():
    # materialized, the loss keeps 12 bytes per logit at its backward peak: a 150k vocabulary
    # at 32k tokens is 55 GiB on its own (the old model counted 4); chunked, it keeps the
    # gradients of the hidden states and, without gradient-accumulation fusion, of the head's
    # weight (its fp32 sum, eagerly one chunk's GEMM output beside it), plus one chunk's
    # logits; with fusion the head's weight gradient is in its main gradient (``grads``)
    from plans import CrossEntropy
    from plans.enums import CHUNK_LOGITS

    plan, _ = _measured("qwen4l_1gpu_mbs8_full")
    assert plan.cross_entropy == CrossEntropy.chunked and plan.grad_accumulation_fusion
    tokens, v, h = 32768, 151936, 2048
    chunked = memory_breakdown(plan).components_bytes["logits"]
    assert chunked == pytest.approx(2 * tokens * h + 10 * CHUNK_LOGITS + 12 * tokens * h)
    unfused = plan.model_copy(update={"grad_accumulation_fusion": False})
    assert memory_breakdown(unfused).components_bytes["logits"] == pytest.approx(
        2 * tokens * h + 6 * v * h + 10 * CHUNK_LOGITS + 12 * tokens * h)
    # the main gradients hold the same bytes either way
    assert memory_breakdown(unfused).components_bytes["grads"] == \
        memory_breakdown(plan).components_bytes["grads"]
    materialized = plan.model_copy(update={"cross_entropy": CrossEntropy.materialized})
    assert memory_breakdown(materialized).components_bytes["logits"] == pytest.approx(
        12 * tokens * v + 12 * tokens * h)


def test_fused_layer_and_loss_terms_by_hand():
    # Qwen3-30B-A3B (h 2048, 32 + 4 heads of 128, 128 experts of ffn 768, top-8), fused
    # kernels, one GPU, mbs 8: the compiled norms keep one bf16 copy and each row's fp32
    # inverse norm, the compiled combine only the rows it weights (2 k h, not eager's 4 k h)
    from cost_models.memory import layer_activation_terms
    from plans import Kernels

    plan, _ = _measured("searched_qwen4l_1gpu")
    fused = plan.model_copy(update={"kernels": Kernels.fused})
    tokens, h, f, k = 32768, 2048, 768, 8
    terms = layer_activation_terms(fused.model, tokens, fused.degrees, fused.ffn,
                                   Recompute.none, False, 8, Kernels.fused)
    per_token = {name: b / tokens for name, b in terms.items()}
    assert per_token == pytest.approx({
        "norms": 2 * (2 * h + 4),
        "qk_norm": 2 * (4096 + 512) + 4 * (32 + 4),
        "attention_core": 4 * 4096 + 2 * 4096 + 4 * 32 + 2 * 4096,
        "router": 4 * 128 + 12 * k,
        "expert_rows": k * (2 * h + 6 * f) + k * 2 * h,
        "layer_output": 2 * h,
    })
    eager = layer_activation_terms(plan.model, tokens, plan.degrees, plan.ffn,
                                   Recompute.none, False, 8, Kernels.eager)
    assert eager["expert_rows"] / tokens == pytest.approx(k * (2 * h + 8 * f) + k * 4 * h)
    assert eager["qk_norm"] / tokens == pytest.approx(8 * (4096 + 512))
    # the chunked loss with the fused final norm (2 h + 4) and the embedding's output (2 h):
    # the head's fp32 weight-gradient sum and its bf16 cast at the end of the forward (6 V h),
    # more than the sum over the chunks (4 V h) beside one chunk's bf16 logits, which the
    # compiled region overwrites with their gradient (2 bytes a logit)
    from plans.enums import CHUNK_LOGITS

    v = 151936
    assert 4 * v * h + 2 * CHUNK_LOGITS < 6 * v * h
    assert memory_breakdown(fused).components_bytes["logits"] == pytest.approx(
        2 * tokens * h + 6 * v * h + (2 * h + 4 + 2 * h) * tokens)


def test_in_flight_micro_batches():
    assert in_flight_micro_batches(0, 15, 1, 60) == 15
    assert in_flight_micro_batches(14, 15, 1, 60) == 1
    assert in_flight_micro_batches(0, 15, 1, 4) == 4
    # Interleaved, p = 4, v = 2: 2 x 3 + 1 x 4 + 1 = 11 chunk forwards = 5.5 stages'
    # worth = p (1 + (p - 1)/(p v)) (Korthikanti et al. 2022, Sec. 4.2.3).
    assert in_flight_micro_batches(0, 4, 2, 16) == pytest.approx(4 * (1 + 3 / 8))


def test_stage_params_sum_to_the_model():
    for name in ("internal-352b", "tiny-moe-shared"):
        m = load_model(name)
        whole = stage_params(m, Degrees(), (m.layers,))
        assert whole[0].total == m.total_params
    m = load_model("internal-352b")
    split = stage_params(m, Degrees(pp=15, dp=12, sp=8, ep=8), (4,) * 15)
    # Experts split 8 ways, attention replicated, untied head on the last stage.
    assert split[1].expert == 4 * 4 * m.expert_params
    assert split[0].dense - split[1].dense == m.vocab * m.hidden


def test_352b_breakdown_by_hand(plan_352b):
    mem = memory_breakdown(plan_352b)
    assert mem.fits and mem.stage == 0
    p = stage_params(plan_352b.model, plan_352b.degrees, plan_352b.stage_layers)[0]
    c = mem.components_bytes
    assert c["params"] == 2 * p.total
    assert c["grads"] == 2 * p.total          # bf16 sync keeps bf16 main grads
    assert c["optimizer"] == pytest.approx(12 * (p.dense / 96 + p.expert / 12))
    # per token (1024 per rank), selective: norms 2 x 10 h; q, k, v and the core's output
    # 2 (q_dim + 2 kv_dim) + 2 q_dim; router 4 E + 12 k; expert rows k (2 h + 8 F) x EP load
    # 1.1 + 4 k h; the shared expert's SwiGLU intermediates 8 F; layer output 2 h; 4 layers
    # x 15 micro-batches in flight on stage 0
    h, q, kv, f, k = 4096, 4096, 1024, 14336, 3
    per_token = (20 * h + 2 * (q + 2 * kv) + 2 * q + 4 * 32 + 12 * k
                 + k * (2 * h + 8 * f) * 1.1 + 4 * k * h + 8 * f + 2 * h)
    assert c["activations"] == pytest.approx(15 * 4 * per_token * 1024)
    assert mem.capacity_bytes == pytest.approx(80 * GIB * 0.92)


def test_full_recompute_and_fp32_grads_change_memory(plan_352b):
    sel = memory_breakdown(plan_352b)
    full = memory_breakdown(plan_352b.model_copy(update={"recompute": Recompute.full}))
    none = memory_breakdown(plan_352b.model_copy(update={"recompute": Recompute.none}))
    assert full.components_bytes["activations"] < sel.components_bytes["activations"]
    # selective reruns the attention core (runtime.parallel.parallelize.apply_recompute):
    # it saves the core's kept tensors, 8 q_dim + 4 heads + 2 q_dim (Ulysses), for q, k, v and
    # the output, 2 (q_dim + 2 kv_dim) + 2 q_dim, per token of each layer in flight
    saved = (8 * 4096 + 4 * 32 + 2 * 4096) - (2 * (4096 + 2 * 1024) + 2 * 4096)
    assert none.components_bytes["activations"] - sel.components_bytes["activations"] == (
        pytest.approx(60 * 1024 * saved))
    fp32 = memory_breakdown(plan_352b.model_copy(update={"grad_sync_precision": "fp32"}))
    assert fp32.components_bytes["grads"] == 2 * sel.components_bytes["grads"]


def test_over_hbm_is_infeasible_with_numbers(plan_352b):
    from cost_models import evaluate

    big = plan_352b.model_copy(update={"micro_batch_size": 6, "recompute": Recompute.none})
    ev = evaluate(big)
    assert not ev.feasible and not ev.memory.fits
    peak = ev.memory.peak_bytes / GIB
    assert ev.reason == f"peak memory {peak:.1f} GiB > usable 73.6 GiB on stage 0"


def test_runs_whose_eager_step_cast_every_gradient_at_once_are_priced_so():
    # a result measured with eager_step_in_buckets false (plans.results.MEASURED_UNDER): the
    # 1-GPU Mixtral plan's peak was set by the fp32 copies of all its gradients
    from cost_models.memory import optimizer_step_workspace
    from cost_models.params import largest_param, stage_params_of
    from plans.catalog import load_plan

    plan = load_plan(Path(__file__).resolve().parents[2] / "bench" / "gpu_plans" / "fidelity"
                     / "mixtral2l_1gpu_mbs1.json")
    (stage,) = stage_params_of(plan)
    d, m = plan.degrees, plan.model
    bucket = 40_000_000 + largest_param(m, d)
    # one of a layer's three [E, F, h] expert weights, above the embedding
    assert largest_param(m, d) == m.experts * m.expert_ffn_hidden * m.hidden > m.vocab * m.hidden
    whole = optimizer_step_workspace(m, d, stage, plan.optimizer_sharding, 2, False, False)
    assert optimizer_step_workspace(m, d, stage, plan.optimizer_sharding, 2, False) == 4 * bucket
    assert whole == 4 * stage.total
    from plans.results import RuntimeFacts

    before = memory_breakdown(plan, RuntimeFacts(eager_step_in_buckets=False))
    now = memory_breakdown(plan)
    assert before.components_bytes["optimizer_step_workspace"] == whole
    assert before.peak_bytes - now.peak_bytes > 5 * GIB


@pytest.mark.parametrize("pp, vpp, m", [(4, 1, 8), (4, 1, 2), (4, 2, 8), (4, 2, 4), (3, 3, 6)])
def test_in_flight_micro_batches_are_the_schedules_warm_up(pp, vpp, m):
    """The stage's action list (plans.pipeline) holds at most this many chunk forwards whose
    backward has not run: 1F1B's pp - stage; interleaved, Megatron-LM's warm-up plus one, or
    every chunk when m = pp."""
    for stage in range(pp):
        if vpp == 1:
            chunks = min(pp - stage, m)
        elif m == pp:
            chunks = m * vpp
        else:
            chunks = min(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, m * vpp)
        assert in_flight_micro_batches(stage, pp, vpp, m) == chunks / vpp


def test_in_flight_micro_batches_fall_stage_by_stage():
    # cost_models.memory._memory skips a stage like the one before it: it never holds more
    for pp in range(1, 17):
        for vpp in range(1, 5):
            for m in sorted({1, pp, 2 * pp, 3 * pp + 1, 64}):
                held = [in_flight_micro_batches(i, pp, vpp, m) for i in range(pp)]
                assert held == sorted(held, reverse=True)


def test_runs_of_a_loss_that_kept_the_heads_gradient_and_its_logits_are_priced_so():
    # results measured before the loss wrote its gradient over the logits and added the head's
    # gradient into its main gradient (plans.results.RuntimeFacts; a result that states
    # neither): the fp32 sum over the chunks beside a chunk's logits and their gradient, or
    # the sum and its cast at the end of the forward
    from cost_models.memory import GRAD_BESIDE_LOGITS, loss_bytes
    from plans import Kernels
    from plans.enums import CHUNK_LOGITS
    from plans.results import RESULT_DEFAULTS, RuntimeFacts

    plan, _ = _measured("searched_qwen4l_1gpu")
    fused = plan.model_copy(update={"kernels": Kernels.fused})
    m, tokens = fused.model, 32768
    v, h = m.vocab, m.hidden
    old = RuntimeFacts.of({})
    assert not old.loss_grad_over_logits and not old.head_grad_in_main_grad
    assert not RESULT_DEFAULTS["head_grad_in_main_grad"]
    now = loss_bytes(m, tokens, fused.cross_entropy, Kernels.fused, head_in_gemm=True)
    then = loss_bytes(m, tokens, fused.cross_entropy, Kernels.fused, head_in_gemm=False,
                      grad_over_logits=False)
    chunk = min(tokens * v, CHUNK_LOGITS)
    assert now - then == pytest.approx(
        2 * chunk - max((2 + GRAD_BESIDE_LOGITS) * chunk + 4 * v * h, 6 * v * h))
    assert memory_breakdown(fused, old).peak_bytes > memory_breakdown(fused).peak_bytes
