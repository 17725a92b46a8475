"""Our plans for the whole-step peer benchmark held to torchtitan's memory: for each 1-GPU job
of bench/steps/peer_step_gpu.py, the plan `moeplan search --runnable --memory-cap GIB` picks
(the calibrated cluster h200-runtime, global batch 8 x 4,096, the reduced-depth shapes of
bench/memory/memory_cases.py), GIB torchtitan's measured peak on the same job with its
transformer blocks compiled, as its MoE recipes run them (``peer_step_gpu --peer-compile
model``: torch.cuda.max_memory_allocated over its timed steps,
bench/results/h200/peer_steps/peer_step_{shape}_compiled.json), as a user holds a job to the
memory another trainer used. Written to bench/gpu_plans/peer_capped/ for ``peer_step_gpu
--plans capped``.

    python -m bench.steps.peer_plans        # imports the planner: run on the CPU machine
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

from bench.fidelity.fidelity_cases import TRAINING  # noqa: E402
from bench.memory.memory_cases import best_plan  # noqa: E402

OUT = HERE / "gpu_plans" / "peer_capped"
PEER_RESULTS = HERE / "results" / "h200" / "peer_steps"
JOBS = {"qwen4l": "qwen3-30b-a3b", "mixtral2l": "mixtral-8x7b", "deepseek4l": "deepseekmoe"}
"""Shape (bench/memory/memory_cases.SHAPES) -> its model's row in the peer step's result."""


def peer_peak_gib(shape: str) -> float:
    """torchtitan's measured peak GiB on ``shape``'s job, its blocks compiled
    (peer_step_{shape}_compiled.json)."""
    path = PEER_RESULTS / f"peer_step_{shape}_compiled.json"
    peer = json.loads(path.read_text())["models"][JOBS[shape]]["peer"]
    if peer.get("status") != "ok":
        raise SystemExit(f"error: {path}: torchtitan's step did not run ({peer.get('reason')})")
    return float(peer["peak_memory_gib"])


def path_of(shape: str, gpus: int) -> Path:
    return OUT / f"{shape}_{gpus}gpu.json"


def main(argv=None) -> None:
    # no options: -h describes the script and writes nothing
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    caps = {shape: math.floor(peer_peak_gib(shape) * 10) / 10 for shape in JOBS}  # never above
    plans = {shape: best_plan(shape, 1, TRAINING.model_copy(update={"memory_cap_gib": cap}))
             for shape, cap in caps.items()}
    # every job searched before anything is written; a job with no plan under its cap keeps
    # no plan here (peer_step_gpu --plans capped then records it as skipped)
    for shape, plan in plans.items():
        path = path_of(shape, 1)
        if plan is None:
            path.unlink(missing_ok=True)
            print(f"{path.name}: no plan fits under {caps[shape]:.1f} GiB")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(plan.model_dump_json(indent=2) + "\n")
        print(f"{path.name}: {plan.summary()} predicted {plan.prediction.step_time_s * 1e3:.1f}"
              f" ms, peak {plan.prediction.peak_memory_gib:.1f} GiB (cap {caps[shape]:.1f})")


if __name__ == "__main__":
    main()
