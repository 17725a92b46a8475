"""The plans of the fidelity suite: measured training steps the calibrated cost model is held
to (bench/fidelity/fidelity_report.py, docs/fidelity.md). None of them is used to fit the factors.

    python -m bench.fidelity.fidelity_cases        # writes bench/gpu_plans/fidelity/<case>.json

The memory suite's reduced-depth Mixtral-8x7B, Qwen3-30B-A3B and DeepSeekMoE
(bench/memory/memory_cases.py) at global batch 8 x 4096 over 1 and 2 H200s; the suite's
coverage is docs/fidelity.md's. Plans are built here, not searched, each as the runtime
executes it (the catalog's H200 cluster: the report prices each on the calibrated cluster).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from bench.memory.memory_cases import reduced_plan
from plans import (
    Degrees,
    Dispatch,
    Kernels,
    Overlap,
    PipelineSchedule,
    Plan,
    Recompute,
    TrainingSpec,
)

TRAINING = TrainingSpec(global_batch=8, seq_len=4096)
CLUSTER = "h200"
OUT = Path(__file__).resolve().parents[1] / "gpu_plans" / "fidelity"
ONE_GPU = Degrees()
A2A, AG = Dispatch.all_to_all, Dispatch.allgather_reduce_scatter
SEL, FULL = Recompute.selective, Recompute.full
INTERLEAVED = PipelineSchedule.interleaved_1f1b
INTER_OP = Overlap.inter_op


def case(shape: str, degrees: Degrees = ONE_GPU, mbs: int = 1,
         recompute: Recompute = Recompute.none, dispatch: Dispatch = A2A,
         **kw) -> Callable[[], Plan]:
    """A fidelity-suite plan: the memory suite's reduced models (memory_cases.reduced_plan) at
    this suite's batch, as the runtime executes them today (eager kernels)."""
    return lambda: reduced_plan(shape, degrees, mbs, recompute, dispatch, TRAINING, CLUSTER,
                                **{"kernels": Kernels.eager, **kw})


CASES: dict[str, Callable[[], Plan]] = {
    # one GPU
    "mixtral2l_1gpu_mbs1": case("mixtral2l"),
    "mixtral2l_1gpu_mbs2_full": case("mixtral2l", mbs=2, recompute=FULL),
    "qwen4l_1gpu_mbs1": case("qwen4l"),
    "qwen4l_1gpu_mbs4_sel": case("qwen4l", mbs=4, recompute=SEL),
    "deepseek4l_1gpu_mbs2": case("deepseek4l", mbs=2),
    "deepseek4l_1gpu_mbs4_full": case("deepseek4l", mbs=4, recompute=FULL),
    "deepseek4l_1gpu_mbs2_fused": case("deepseek4l", mbs=2, kernels=Kernels.fused),
    # two GPUs
    "mixtral2l_dp2_ep2_mbs1": case("mixtral2l", Degrees(dp=2, ep=2)),
    "mixtral2l_sp2_ep2_ag_mbs2": case("mixtral2l", Degrees(sp=2, ep=2), mbs=2, dispatch=AG),
    "mixtral2l_pp2_mbs1": case("mixtral2l", Degrees(pp=2)),
    "qwen4l_sp2_ep2_a2a_mbs2": case("qwen4l", Degrees(sp=2, ep=2), mbs=2),
    "qwen4l_sp2_ep2_ag_mbs2": case("qwen4l", Degrees(sp=2, ep=2), mbs=2, dispatch=AG),
    "qwen4l_dp2_ep2_a2a_mbs1_sel": case("qwen4l", Degrees(dp=2, ep=2), recompute=SEL),
    "qwen4l_pp2_mbs2": case("qwen4l", Degrees(pp=2), mbs=2),
    "deepseek4l_sp2_ep2_a2a_mbs4_full": case("deepseek4l", Degrees(sp=2, ep=2), mbs=4,
                                             recompute=FULL),
    "deepseek4l_dp2_ep2_ag_mbs2": case("deepseek4l", Degrees(dp=2, ep=2), mbs=2, dispatch=AG),
    "deepseek4l_pp2_vpp2_mbs1": case("deepseek4l", Degrees(pp=2, vpp=2),
                                     schedule=INTERLEAVED),
    # the overlapped MoE layer (two token chunks, dispatch and combine on a second stream)
    "mixtral2l_dp2_ep2_interop_mbs1": case("mixtral2l", Degrees(dp=2, ep=2), overlap=INTER_OP),
    "qwen4l_sp2_ep2_ag_interop_mbs2": case("qwen4l", Degrees(sp=2, ep=2), mbs=2, dispatch=AG,
                                           overlap=INTER_OP),
}
PROFILED = "mixtral2l_1gpu_mbs1"
"""The one suite plan whose profiled step calibration may read (the report's fit)."""


def plan_path(name: str) -> Path:
    return OUT / f"{name}.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    out = p.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    for name, build in CASES.items():
        (out / f"{name}.json").write_text(build().model_dump_json(indent=2) + "\n")
        print(out / f"{name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
