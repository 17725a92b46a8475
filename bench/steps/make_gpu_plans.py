"""Write the plans (bench/gpu_plans/) the GPU benchmarks run: a reduced Mixtral-8x7B
(2 layers, full width) on one and two H200s, in the layouts worth comparing; and, per node size
N (8 and 2), under bench/gpu_plans/xN/: Ulysses SP = EP = N with each dispatcher (for
bench/steps/parity_gpu.py), and with ``--search`` the best plan `moeplan search` finds for one node
of N H200s for the reduced model and the Megatron-style baseline it compares against (for
bench/steps/train_step.py: measured speedup against predicted). Plans are data: regenerate with
    python -m bench.steps.make_gpu_plans [--search]
``--search`` imports the planner (pulp / highspy): run it on the CPU machine. The search is
`moeplan search --runnable`'s (what this runtime executes: no overlap, the gradient sync overlapped,
no gradient-accumulation fusion) on the calibrated h200-runtime cluster; the baseline is
megatron_space's (TP = etp = the node, fp32 gradient sync), run the same way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.memory.memory_cases import reduced
from plans import (
    EPFFN,
    TPFFN,
    Degrees,
    Dispatch,
    Kernels,
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

OUT = Path(__file__).resolve().parents[1] / "gpu_plans"


def model(layers: int):
    return reduced("mixtral-8x7b", layers)


def plan(gpus: int, degrees: Degrees, layers: int = 2, **kw) -> Plan:
    chunks = degrees.pp * degrees.vpp
    base = dict(
        model=model(layers), cluster=catalog.load_cluster("h200", gpus=gpus),
        training=TrainingSpec(global_batch=8, seq_len=4096), degrees=degrees,
        attention=UlyssesAttention(), ffn=EPFFN(dispatch=Dispatch.all_to_all),
        stage_layers=(layers // chunks,) * chunks, micro_batch_size=1,
        overlap=Overlap.none, recompute=Recompute.none, grad_sync_precision=Precision.bf16,
        kernels=Kernels.eager,
        grad_sync_overlap=False, grad_accumulation_fusion=False,
    )
    return Plan(**{**base, **kw})


def with_gsync(p: Plan) -> Plan:
    """``p`` with the gradient sync overlapped with the last backward and the accumulation
    into the bucket views (campaign h200_steps_x2 runs both: NCCL beside a full-GPU GEMM has
    measured slower than serial on 2 H200s, so the overlap must earn its place)."""
    return p.model_copy(update={"grad_sync_overlap": True, "grad_accumulation_fusion": True})


PLANS = {
    "mixtral2l_1gpu": plan(1, Degrees()),
    "mixtral2l_1gpu_recompute_selective": plan(1, Degrees(), recompute=Recompute.selective),
    "mixtral2l_1gpu_recompute_full": plan(1, Degrees(), recompute=Recompute.full),
    "mixtral2l_1gpu_mbs2": plan(1, Degrees(), micro_batch_size=2),
    # the whole batch in one micro-batch: no gradient accumulation between micro-batches
    "mixtral2l_1gpu_mbs8": plan(1, Degrees(), micro_batch_size=8),
    "mixtral2l_dp2_ep2_mbs4": plan(2, Degrees(dp=2, ep=2), micro_batch_size=4),
    "mixtral2l_dp2_ep2_ag_mbs4": plan(2, Degrees(dp=2, ep=2), micro_batch_size=4,
                                      ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
    "mixtral2l_sp2_ep2_ag_mbs8": plan(2, Degrees(sp=2, ep=2), micro_batch_size=8,
                                      ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
    "mixtral2l_1gpu_fused": plan(1, Degrees(), kernels=Kernels.fused),
    # fused kernels with the whole batch in one micro-batch (issue 11's step targets)
    "mixtral2l_1gpu_mbs8_fused": plan(1, Degrees(), micro_batch_size=8, kernels=Kernels.fused),
    "mixtral2l_dp2_ep2_ag_mbs4_fused": plan(
        2, Degrees(dp=2, ep=2), micro_batch_size=4, kernels=Kernels.fused,
        ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
    "mixtral2l_sp2_ep2_ag_mbs8_fused": plan(
        2, Degrees(sp=2, ep=2), micro_batch_size=8, kernels=Kernels.fused,
        ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
    # fused kernels with the all-to-all dispatcher: every slot routed, so the permutation by
    # gathers and the regroup (runtime.kernels; its bf16 parity on 2 GPUs, campaign h200_steps_x2)
    "mixtral2l_dp2_ep2_fused": plan(2, Degrees(dp=2, ep=2), kernels=Kernels.fused),
    "mixtral2l_sp2_ep2_a2a": plan(2, Degrees(sp=2, ep=2)),
    "mixtral2l_sp2_ep2_ag": plan(2, Degrees(sp=2, ep=2),
                                 ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
    "mixtral2l_dp2_ep2": plan(2, Degrees(dp=2, ep=2)),
    "mixtral2l_tp2_ep2": plan(2, Degrees(tp=2, ep=2), attention=TPAttention()),
    "mixtral2l_pp2": plan(2, Degrees(pp=2)),
    "mixtral2l_tp2_etp2": plan(2, Degrees(tp=2, etp=2), attention=TPAttention(), ffn=TPFFN(),
                               grad_sync_precision=Precision.fp32),
    "mixtral4l_pp2_vpp2": plan(2, Degrees(pp=2, vpp=2), layers=4,
                               schedule=PipelineSchedule.interleaved_1f1b),
    "mixtral2l_sp2_ep2_fp8sync": plan(
        2, Degrees(sp=2, ep=2), grad_sync_precision=Precision.fp8,
        training=TrainingSpec(global_batch=8, seq_len=4096, precision=Precision.fp8)),
}
# every executed mechanism of issue 11 at once: fused kernels, the overlapped gradient sync and
# the inter-operator overlapped MoE layer; and the overlapped layer alone (eager, serial sync)
PLANS |= {f"{name}_all": with_gsync(PLANS[f"{name}_fused"]).model_copy(
    update={"overlap": Overlap.inter_op})
    for name in ("mixtral2l_dp2_ep2_ag_mbs4", "mixtral2l_sp2_ep2_ag_mbs8")}
PLANS["mixtral2l_dp2_ep2_interop"] = PLANS["mixtral2l_dp2_ep2"].model_copy(
    update={"overlap": Overlap.inter_op})
# Ulysses in head groups beside the chunked MoE layer (inter_op at sp 2: 4 KV heads a rank)
PLANS["mixtral2l_sp2_ep2_a2a_interop"] = PLANS["mixtral2l_sp2_ep2_a2a"].model_copy(
    update={"overlap": Overlap.inter_op})
# ... with the attention core rerun in each group, and with the whole layer rerun (the groups
# then run again inside the backward, on the stream of the node that needs them)
PLANS |= {f"mixtral2l_sp2_ep2_a2a_interop_{tag}": PLANS["mixtral2l_sp2_ep2_a2a_interop"]
          .model_copy(update={"recompute": r})
          for tag, r in (("sel", Recompute.selective), ("full", Recompute.full))}
PLANS |= {f"{name}_gsync": with_gsync(PLANS[name])
          for name in ("mixtral2l_dp2_ep2", "mixtral2l_sp2_ep2_a2a", "mixtral2l_dp2_ep2_mbs4",
                       "mixtral2l_sp2_ep2_ag_mbs8")}
# fused kernels with the overlapped gradient sync, serial MoE layer (campaign h200_steps_x2)
PLANS |= {f"{name}_fused_gsync": with_gsync(PLANS[f"{name}_fused"])
          for name in ("mixtral2l_dp2_ep2_ag_mbs4", "mixtral2l_sp2_ep2_ag_mbs8")}
# gradient-accumulation fusion (runtime.parallel.grad_accumulation) beside the same plans
# without: eight micro-batches of one sequence, and the whole batch in one with fused kernels
PLANS |= {f"{name}_gaf": PLANS[name].model_copy(update={"grad_accumulation_fusion": True})
          for name in ("mixtral2l_1gpu", "mixtral2l_1gpu_mbs8_fused")}


NODE_SIZES = (8, 2)
SEARCH_LAYERS = 2
SEARCH_TRAINING = TrainingSpec(global_batch=16, seq_len=8192)
SEARCH_CLUSTER = "h200-runtime"
"""H200 with the efficiency factors fitted to this runtime (moeplan calibrate)."""


def node_plans(n: int) -> dict[str, Plan]:
    """Ulysses SP = EP = n, both dispatchers (bf16 parity against the one-GPU reference)."""
    return {
        f"mixtral2l_sp{n}_ep{n}_a2a": plan(n, Degrees(sp=n, ep=n)),
        f"mixtral2l_sp{n}_ep{n}_ag": plan(n, Degrees(sp=n, ep=n),
                                          ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
    }


def searched_plans(n: int) -> tuple[dict[str, Plan], dict]:
    """The best plan `moeplan search --runnable` finds for one node of n H200s, priced with
    the factors calibrated to this runtime (catalog h200-runtime), and the Megatron-style
    baseline, with their predictions, and a summary."""
    from planner.search import search
    from planner.space import SearchSpace

    cluster = catalog.load_cluster(SEARCH_CLUSTER, gpus=n)
    result = search(model(SEARCH_LAYERS), cluster, SEARCH_TRAINING, SearchSpace().runnable(),
                    top=1)
    if result.best is None or result.baseline is None:
        raise SystemExit(f"error: no plan found for {n} GPUs")
    name = f"mixtral{SEARCH_LAYERS}l"
    found = {f"{name}_search_best": result.best.plan,
             f"{name}_megatron": result.baseline.plan}
    summary = {
        "model": model(SEARCH_LAYERS).name, "cluster": SEARCH_CLUSTER, "gpus": n,
        "training": SEARCH_TRAINING.model_dump(mode="json"),
        "space": "SearchSpace().runnable() (what the runtime executes: plans.execution); "
                 "baseline: planner.search.megatron_space, run the same way",
        "plans": {k: {"summary": p.summary(), "predicted_step_time_s": p.prediction.step_time_s,
                      "predicted_mfu": p.prediction.mfu,
                      "predicted_peak_memory_gib": p.prediction.peak_memory_gib}
                  for k, p in found.items()},
        "predicted_speedup": result.speedup,
        "stats": {"layouts": result.stats.layouts, "evaluated": result.stats.evaluated,
                  "feasible": result.stats.feasible},
    }
    return found, summary


def _write(directory: Path, plans: dict[str, Plan]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, p in plans.items():
        (directory / f"{name}.json").write_text(p.model_dump_json(indent=2) + "\n")
        print(f"{directory.name}/{name}", p.summary())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--search", action="store_true",
                    help="also write moeplan search's best plan and the Megatron baseline per "
                         "node size (imports the planner)")
    args = ap.parse_args(argv)
    _write(OUT, PLANS)
    for n in NODE_SIZES:
        _write(OUT / f"x{n}", node_plans(n))
        if args.search:
            found, summary = searched_plans(n)
            _write(OUT / f"x{n}", found)
            (OUT / f"x{n}" / "search.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(f"x{n}: predicted speedup {summary['predicted_speedup']:.3f}")


if __name__ == "__main__":
    main()
