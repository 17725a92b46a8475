"""Hold the cost model against published large runs, each evaluated as its published plan.

    python bench/at_scale.py          # writes bench/results/at_scale.json

Runs (the configurations as published; what a source leaves open is named in ``assumed``):

- Megatron-Core MoE, Mixtral-8x7B on 64 H100: TP1 EP8 PP4 VPP8, micro-batch 1, global batch
  256, sequence 4096, bf16: 468 TFLOP/s per GPU (Megatron-Core MoE documentation, "With MCore
  v0.9, we've achieved ... 468 TFLOPS for Mixtral 8X7B bf16 training"; the mapping from its
  README's performance table). Megatron counts FLOPs with ``num_floating_point_operations`` of
  that release, which does not halve causal attention; the published rate is converted to
  tokens/s with that formula (``megatron_flops_per_token``) and compared in tokens/s.
- MegaScale-MoE, Internal-352B on 1,440 H800 (arXiv 2505.11432, abstract and Sec. 6; layout
  from Sec. 3 and 6: Ulysses SP 8 and EP 8 in the node, PP 15 of 4 layers, DP 12; selective
  rematerialisation, inter- and intra-operator overlap, bf16 parameter sync; global batch 720
  of 8,192 tokens): 1.41M tokens/s.
- Megatron-LM on the same job: 1.88x less (the paper's MFU ratio, the same job, so the same
  ratio of throughputs); compared as the predicted speedup.

No efficiency factor is fitted here: every run is priced on its catalog cluster with the
catalog's defaults. The check is a documented residual, not a target the model was tuned to
(docs/fidelity_at_scale.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from _meta import write  # noqa: E402

import cost_models  # noqa: E402
from plans import (  # noqa: E402
    EPFFN,
    TPFFN,
    Degrees,
    Dispatch,
    Kernels,
    ModelSpec,
    Overlap,
    PipelineSchedule,
    Plan,
    Precision,
    Recompute,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)

TARGET = 0.25
"""Issue 12: each published number within 25%."""
MEGATRON_TFLOPS = 468.0
MEGASCALE_TOKENS_S = 1.41e6
MEGASCALE_SPEEDUP = 1.88


def megatron_flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (core_r0.9) per token: 12 L h^2 x
    [(1 + kv/q heads + s/h) x q_dim/h + f/h x k x 3/2 (SwiGLU) + V / (2 L h)]; attention is
    counted in full (no causal halving), the router not at all."""
    h, L = m.hidden, m.layers
    attention = (1 + m.kv_heads / m.query_heads + seq_len / h) * m.q_dim / h
    mlp = m.expert_ffn_hidden / h * m.top_k * 1.5
    logits = m.vocab / (2 * L * h)
    return 12 * L * h * h * (attention + mlp + logits)


def published_plan(model: str, cluster: str, gpus: int, training: TrainingSpec,
                   degrees: Degrees, **fields) -> Plan:
    """The run's layout with an even split of layers over its pp x vpp chunks; fused
    memory-bound kernels, as Megatron-Core's and MegaScale-MoE's are."""
    m = catalog.load_model(model)
    chunks = degrees.pp * degrees.vpp
    return Plan(model=m, cluster=catalog.load_cluster(cluster, gpus=gpus), training=training,
                degrees=degrees, stage_layers=(m.layers // chunks,) * chunks,
                kernels=Kernels.fused, **fields)


def least_recompute_that_fits(plan: Plan) -> Plan:
    """Where a run does not publish its recomputation: the least that fits the planner's
    memory margin (full recomputation when nothing fits)."""
    for policy in Recompute:
        candidate = plan.model_copy(update={"recompute": policy})
        if cost_models.evaluate(candidate).feasible:
            return candidate
    return plan.model_copy(update={"recompute": Recompute.full})


def mixtral_megatron() -> Plan:
    plan = published_plan(
        "mixtral-8x7b", "h100", 64, TrainingSpec(global_batch=256, seq_len=4096),
        Degrees(pp=4, vpp=8, dp=16, ep=8), attention=UlyssesAttention(),
        ffn=EPFFN(dispatch=Dispatch.all_to_all), micro_batch_size=1,
        schedule=PipelineSchedule.interleaved_1f1b, overlap=Overlap.none,
        grad_sync_precision=Precision.fp32)
    return least_recompute_that_fits(plan)


JOB_352B = TrainingSpec(global_batch=720, seq_len=8192)


def megascale_352b() -> Plan:
    return published_plan(
        "internal-352b", "h800", 1440, JOB_352B, Degrees(pp=15, dp=12, sp=8, ep=8),
        attention=UlyssesAttention(), ffn=EPFFN(dispatch=Dispatch.all_to_all),
        micro_batch_size=1, overlap=Overlap.inter_intra_op, recompute=Recompute.selective,
        grad_sync_precision=Precision.bf16)


def megatron_352b() -> Plan:
    plan = published_plan(
        "internal-352b", "h800", 1440, JOB_352B, Degrees(pp=15, dp=12, tp=8, etp=8),
        attention=TPAttention(), ffn=TPFFN(), micro_batch_size=1, overlap=Overlap.none,
        grad_sync_precision=Precision.fp32)
    return least_recompute_that_fits(plan)


def _plan_row(plan: Plan) -> dict:
    e = cost_models.evaluate(plan)
    return {"notation": plan.summary(), "cluster": plan.cluster.name, "gpus": plan.cluster.gpus,
            "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
            "fits": e.feasible, "breakdown_s": dict(e.breakdown_s)}


def _skew_to_match(plan: Plan, tokens_per_s: float) -> float | None:
    """The routing skew (TrainingSpec.routing_skew) that alone would bring the prediction
    down to ``tokens_per_s``; None if even every token on one expert would not."""
    def predicted(skew: float) -> float:
        training = plan.training.model_copy(update={"routing_skew": skew})
        return cost_models.evaluate(plan.model_copy(update={"training": training})).tokens_per_s

    lo, hi = 1.0, float(plan.model.experts)
    if predicted(lo) <= tokens_per_s:
        return 1.0
    if predicted(hi) > tokens_per_s:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) > tokens_per_s else (lo, mid)
    return round(hi, 3)


def _by_recompute(plan: Plan, published: float) -> dict[str, dict]:
    """An unpublished recomputation's weight: the prediction under each policy."""
    out = {}
    for policy in Recompute:
        e = cost_models.evaluate(plan.model_copy(update={"recompute": policy}))
        out[policy.value] = {"tokens_per_s": e.tokens_per_s, "error": e.tokens_per_s / published
                             - 1, "fits": e.feasible}
    return out


def check(name: str, published: float, predicted: float, unit: str, source: str,
          assumed: list[str], plans: dict[str, dict], skew_to_match: float | None = None,
          by_recompute: dict[str, dict] | None = None) -> dict:
    error = predicted / published - 1
    return {"name": name, "unit": unit, "published": published, "predicted": predicted,
            "error": error, "within_target": abs(error) <= TARGET, "source": source,
            "assumed": assumed, "plans": plans, "routing_skew_to_match": skew_to_match,
            "by_recompute": by_recompute}


def results() -> dict:
    mixtral = mixtral_megatron()
    m = mixtral.model
    per_gpu_flops = megatron_flops_per_token(m, mixtral.training.seq_len)
    published_tokens = MEGATRON_TFLOPS * 1e12 * mixtral.cluster.gpus / per_gpu_flops
    mixtral_row = _plan_row(mixtral)
    ours, theirs = _plan_row(megascale_352b()), _plan_row(megatron_352b())
    checks = [
        check("Megatron-Core Mixtral-8x7B, 64 H100", published_tokens,
              mixtral_row["tokens_per_s"], "tokens/s (468 TFLOP/s per GPU in Megatron's count)",
              "Megatron-Core MoE documentation (MCore v0.9): 468 TFLOP/s per GPU, TP1 EP8 PP4 "
              "VPP8, micro-batch 1, global batch 256, sequence 4096, bf16",
              ["all-to-all dispatcher (Megatron-Core's recommended one for EP)",
               "no EP communication overlap (added in MCore v0.14), DP gradient reduce and "
               "parameter gather overlapped, gradient-accumulation fusion, distributed "
               "optimizer, fp32 gradient reduction (Megatron's default)",
               f"recomputation not published: the least that fits ({mixtral.recompute.value})",
               f"Megatron's FLOPs per token {per_gpu_flops:.4g} (no causal halving) convert "
               f"the rate to tokens/s; the cost model counts {m.flops_per_token(4096):.4g}"],
              {"published": mixtral_row},
              _skew_to_match(mixtral, published_tokens),
              _by_recompute(mixtral, published_tokens)),
        check("MegaScale-MoE Internal-352B, 1,440 H800", MEGASCALE_TOKENS_S,
              ours["tokens_per_s"], "tokens/s",
              "MegaScale-MoE (arXiv 2505.11432), abstract and Sec. 6",
              ["micro-batch 1 and the 1F1B schedule (4 layers per stage: no interleaving)",
               "all-to-all dispatch (top-3 <= EP 8, the paper's rule)",
               "network: 8 x 400 Gb/s per node (the paper does not state its NICs)"],
              {"megascale": ours},
              _skew_to_match(megascale_352b(), MEGASCALE_TOKENS_S)),
        check("MegaScale-MoE over Megatron-LM, Internal-352B", MEGASCALE_SPEEDUP,
              theirs["step_time_s"] / ours["step_time_s"], "speedup (MFU ratio)",
              "MegaScale-MoE (arXiv 2505.11432), abstract: 1.88x MFU over Megatron-LM",
              ["Megatron-LM: TP 8 for attention and experts, the same PP 15 and DP 12, fp32 "
               "gradient sync, no intra-layer overlap",
               f"its recomputation not published: the least that fits "
               f"({megatron_352b().recompute.value})"],
              {"megascale": ours, "megatron": theirs}),
    ]
    return {"benchmark": "published large runs against the cost model (issue 12 item 4)",
            "target_abs_error": TARGET, "checks": checks,
            "all_within_target": all(c["within_target"] for c in checks)}


def main() -> None:
    doc = results()
    path = write("at_scale", doc)
    for c in doc["checks"]:
        mark = "ok" if c["within_target"] else "MISS"
        print(f"{c['name']:48s} published {c['published']:>12,.4g} predicted "
              f"{c['predicted']:>12,.4g} {c['error']:+6.1%} {mark}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
