"""The plans of the memory suite (bench/memory/memory_suite.py): reduced-depth models of three
shapes, micro-batch 1 to 8, both dispatchers, recomputation none / selective / full, 1 and 2 GPUs,
Ulysses SP, DP, PP (1F1B and interleaved) and the TP baseline layout; selective recomputation
with the experts' activation (moe_act).

Shapes (full width, reduced depth; global batch 16 x 4096):
- Mixtral-8x7B, 2 layers: 8 experts top-2, expert FFN 14,336, vocabulary 32,000;
- Qwen3-30B-A3B, 4 layers: 128 experts top-8, expert FFN 768, vocabulary 151,936;
- DeepSeekMoE, 4 layers: 64 experts top-6, expert FFN 1,408, vocabulary 65,536.

Plans are built here (not searched): the suite measures the runtime, and its report holds each
measurement against the cost model of the tree it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from plans import (
    EPFFN,
    TPFFN,
    CrossEntropy,
    Degrees,
    Dispatch,
    ModelSpec,
    Overlap,
    PipelineSchedule,
    Plan,
    Precision,
    Recompute,
    RecomputeModule,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)

SHAPES = {"mixtral2l": ("mixtral-8x7b", 2), "qwen4l": ("qwen3-30b-a3b", 4),
          "deepseek4l": ("deepseekmoe", 4)}
TRAINING = TrainingSpec(global_batch=16, seq_len=4096)
CLUSTER = "h200-runtime"


ONE_GPU = Degrees()


def reduced(name: str, layers: int) -> ModelSpec:
    """The catalog model ``name`` at its full width and ``layers`` layers, named so."""
    full = catalog.load_model(name)
    return full.model_copy(update={"name": f"{full.name}-{layers}L", "layers": layers})


def best_plan(shape: str, gpus: int, training: TrainingSpec,
              fits: Callable[[Plan], bool] = lambda plan: True, top: int = 1,
              cluster: str = CLUSTER) -> Plan | None:
    """The fastest of the plans `moeplan search --runnable` ranks first (its ``top``) for
    ``shape`` on ``gpus`` GPUs of the calibrated ``cluster`` that ``fits``, None where none
    does; imports the planner, so it runs on the CPU machine."""
    from planner.search import search
    from planner.space import SearchSpace

    result = search(reduced(*SHAPES[shape]), catalog.load_cluster(cluster, gpus=gpus),
                    training, SearchSpace().runnable(), top=top)
    return next((ranked.plan for ranked in result.top if fits(ranked.plan)), None)


def write_searched(jobs: list[tuple[str, int]], training: TrainingSpec,
                   path_of: Callable[[str, int], Path]) -> None:
    """best_plan of every (shape, GPUs) job, which must exist, written as JSON to
    ``path_of(shape, gpus)``."""
    for shape, gpus in jobs:
        plan = best_plan(shape, gpus, training)
        if plan is None:
            raise SystemExit(f"error: no plan fits for {shape} on {gpus} GPUs")
        path = path_of(shape, gpus)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(plan.model_dump_json(indent=2) + "\n")
        print(f"{path.name}: {plan.summary()} predicted {plan.prediction.step_time_s * 1e3:.1f}"
              f" ms, peak {plan.prediction.peak_memory_gib:.1f} GiB")


def reduced_plan(shape: str, degrees: Degrees, mbs: int, recompute: Recompute,
                 dispatch: Dispatch, training: TrainingSpec, cluster: str, **kw) -> Plan:
    """A reduced-depth model of ``shape`` (SHAPES) under Ulysses SP attention and EP experts,
    no overlap, bf16 gradient sync; ``kw`` replaces any other plan field."""
    model = reduced(*SHAPES[shape])
    layers = model.layers
    chunks = degrees.pp * degrees.vpp
    base = dict(
        model=model, cluster=catalog.load_cluster(cluster, gpus=degrees.world),
        training=training, degrees=degrees, attention=UlyssesAttention(),
        ffn=EPFFN(dispatch=dispatch), stage_layers=(layers // chunks,) * chunks,
        micro_batch_size=mbs, overlap=Overlap.none, recompute=recompute,
        grad_sync_precision=Precision.bf16,
    )
    return Plan(**{**base, **kw})


def case(shape: str, degrees: Degrees = ONE_GPU, mbs: int = 1,
         recompute: Recompute = Recompute.none, dispatch: Dispatch = Dispatch.all_to_all,
         **kw) -> Callable[[], Plan]:
    """A memory-suite plan: the chunked loss unless ``kw`` says otherwise."""
    return lambda: reduced_plan(shape, degrees, mbs, recompute, dispatch, TRAINING, CLUSTER,
                                **{"cross_entropy": CrossEntropy.chunked, **kw})


AG = Dispatch.allgather_reduce_scatter
MATERIALIZED = CrossEntropy.materialized
SEL, FULL = Recompute.selective, Recompute.full
CORE_ATTN, MOE_ACT = RecomputeModule.core_attn, RecomputeModule.moe_act
INTERLEAVED = PipelineSchedule.interleaved_1f1b

CASES: dict[str, Callable[[], Plan]] = {
    # one GPU
    "qwen4l_1gpu_mbs1": case("qwen4l", mbs=1),
    "qwen4l_1gpu_mbs4": case("qwen4l", mbs=4),
    "qwen4l_1gpu_mbs8_sel": case("qwen4l", mbs=8, recompute=SEL),
    "qwen4l_1gpu_mbs8_full": case("qwen4l", mbs=8, recompute=FULL),
    "deepseek4l_1gpu_mbs2": case("deepseek4l", mbs=2),
    "deepseek4l_1gpu_mbs8": case("deepseek4l", mbs=8),
    "deepseek4l_1gpu_mbs4_sel": case("deepseek4l", mbs=4, recompute=SEL),
    # selective recomputation of the experts' activation (moe_act: runtime.parallel.recompute),
    # beside the attention core and alone
    "deepseek4l_1gpu_mbs2_sel_act": case("deepseek4l", mbs=2, recompute=SEL,
                                         recompute_modules=(CORE_ATTN, MOE_ACT)),
    "qwen4l_1gpu_mbs4_act": case("qwen4l", mbs=4, recompute=SEL, recompute_modules=(MOE_ACT,)),
    "mixtral2l_1gpu_mbs4": case("mixtral2l", mbs=4),
    "mixtral2l_1gpu_mbs8_full": case("mixtral2l", mbs=8, recompute=FULL),
    # the materialized loss (12 bytes per logit) beside the chunked one the cases run
    "qwen4l_1gpu_mbs4_materialized": case("qwen4l", mbs=4, cross_entropy=MATERIALIZED),
    "deepseek4l_1gpu_mbs8_materialized": case("deepseek4l", mbs=8, cross_entropy=MATERIALIZED),
    # two GPUs
    "qwen4l_sp2_ep2_a2a_mbs8_materialized": case("qwen4l", Degrees(sp=2, ep=2), mbs=8,
                                                 cross_entropy=MATERIALIZED),
    "qwen4l_dp2_ep2_mbs4": case("qwen4l", Degrees(dp=2, ep=2), mbs=4),
    "qwen4l_sp2_ep2_a2a_mbs8": case("qwen4l", Degrees(sp=2, ep=2), mbs=8),
    "qwen4l_sp2_ep2_ag_mbs8": case("qwen4l", Degrees(sp=2, ep=2), mbs=8, dispatch=AG),
    "qwen4l_pp2_mbs2": case("qwen4l", Degrees(pp=2), mbs=2),
    "qwen4l_pp2_vpp2_mbs2": case("qwen4l", Degrees(pp=2, vpp=2), mbs=2, schedule=INTERLEAVED),
    "deepseek4l_dp2_ep2_ag_mbs8_sel": case("deepseek4l", Degrees(dp=2, ep=2), mbs=8,
                                           recompute=SEL, dispatch=AG),
    "deepseek4l_sp2_ep2_a2a_mbs4": case("deepseek4l", Degrees(sp=2, ep=2), mbs=4),
    "deepseek4l_tp2_etp2_mbs4": case("deepseek4l", Degrees(tp=2, etp=2), mbs=4,
                                     attention=TPAttention(), ffn=TPFFN()),
    "mixtral2l_sp2_ep2_a2a_mbs2": case("mixtral2l", Degrees(sp=2, ep=2), mbs=2),
    "mixtral2l_dp2_ep2_mbs1_full": case("mixtral2l", Degrees(dp=2, ep=2), mbs=1, recompute=FULL),
}
