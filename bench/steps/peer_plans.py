"""Our plans for the whole-step peer benchmark held to torchtitan's memory: for each 1-GPU job
of bench/steps/peer_step_gpu.py, the plan `moeplan search --runnable --memory-cap GIB` picks
(the calibrated cluster h200-runtime, global batch 8 x 4,096, the reduced-depth shapes of
bench/memory/memory_cases.py), GIB torchtitan's measured peak on the same job
(torch.cuda.max_memory_allocated over its timed steps, bench/results/h200/peer_steps/), as a
user holds a job to the memory another trainer used. Written to bench/gpu_plans/peer_capped/
for ``peer_step_gpu --plans capped``.

    python -m bench.steps.peer_plans        # imports the planner: run on the CPU machine
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

from bench.fidelity.fidelity_cases import TRAINING  # noqa: E402
from bench.memory.memory_cases import write_searched  # noqa: E402

OUT = HERE / "gpu_plans" / "peer_capped"
PEER_RESULTS = HERE / "results" / "h200" / "peer_steps"
JOBS = {"qwen4l": "qwen3-30b-a3b", "mixtral2l": "mixtral-8x7b", "deepseek4l": "deepseekmoe"}
"""Shape (bench/memory/memory_cases.SHAPES) -> its model's row in the peer step's result."""


def peer_peak_gib(shape: str) -> float:
    """torchtitan's measured peak GiB on ``shape``'s job (peer_step_{shape}.json)."""
    path = PEER_RESULTS / f"peer_step_{shape}.json"
    peer = json.loads(path.read_text())["models"][JOBS[shape]]["peer"]
    if peer.get("status") != "ok":
        raise SystemExit(f"error: {path}: torchtitan's step did not run ({peer.get('reason')})")
    return float(peer["peak_memory_gib"])


def path_of(shape: str, gpus: int) -> Path:
    return OUT / f"{shape}_{gpus}gpu.json"


def main(argv=None) -> None:
    # no options: -h describes the script and writes nothing
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    for shape in JOBS:
        cap = math.floor(peer_peak_gib(shape) * 10) / 10  # never above the peer's peak
        training = TRAINING.model_copy(update={"memory_cap_gib": cap})
        write_searched([(shape, 1)], training, path_of)


if __name__ == "__main__":
    main()
