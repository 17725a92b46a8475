"""Our plans for the whole-step peer benchmark held to torchtitan's memory: for each 1-GPU job
of bench/steps/peer_step_gpu.py, the fastest plan `moeplan search --runnable` ranks (the
card's calibrated cluster, global batch 8 x 4,096, the reduced-depth shapes of
bench/memory/memory_cases.py) whose predicted allocated peak is at most torchtitan's measured
one on the same job and card with its transformer blocks compiled, as its MoE recipes run them
(``peer_step_gpu --peer-compile model``: peer_step_{shape}_compiled.json in the card's
results). Both sides are held to one measure, torch.cuda.max_memory_allocated: the cost
model's peak less its allocator reserve (cost_models.memory.ALLOCATOR_RESERVE, what the
caching allocator holds beyond the live bytes). Written for ``peer_step_gpu --plans capped``
(H200) and ``--plans capped_h100``.

    python -m bench.steps.peer_plans [--card h100]   # imports the planner: the CPU machine
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

from bench.fidelity.fidelity_cases import TRAINING  # noqa: E402
from bench.memory.memory_cases import best_plan  # noqa: E402

CARDS = {"h200": ("h200-runtime", HERE / "results" / "h200" / "peer_steps",
                  HERE / "gpu_plans" / "peer_capped"),
         "h100": ("h100-runtime", HERE / "results" / "h100" / "peer_steps",
                  HERE / "gpu_plans" / "peer_capped_h100")}
"""Card -> its calibrated cluster, torchtitan's compiled steps on it, our plans' folder."""
JOBS = {"qwen4l": "qwen3-30b-a3b", "mixtral2l": "mixtral-8x7b", "deepseek4l": "deepseekmoe"}
"""Shape (bench/memory/memory_cases.SHAPES) -> its model's row in the peer step's result."""


def peer_peak_gib(shape: str, card: str = "h200") -> float:
    """torchtitan's measured peak GiB on ``shape``'s job on ``card``, its blocks compiled
    (peer_step_{shape}_compiled.json)."""
    path = CARDS[card][1] / f"peer_step_{shape}_compiled.json"
    peer = json.loads(path.read_text())["models"][JOBS[shape]]["peer"]
    if peer.get("status") != "ok":
        raise SystemExit(f"error: {path}: torchtitan's step did not run ({peer.get('reason')})")
    return float(peer["peak_memory_gib"])


SEARCH_SLACK = 1.05
"""The loosest of the search's memory caps over torchtitan's peak: room for the allocator
reserve, which the cost model prices at a few percent of a step's transients, so that every
plan whose allocated peak fits is searched."""
CAP_STEP_GIB = 0.1
"""The step between the search's caps (capped_plan)."""


def allocated_of(prediction) -> float:
    """A prediction's peak of allocated bytes, GiB: its peak less the allocator's reserve."""
    return prediction.peak_memory_gib - prediction.memory_gib["allocator_reserve"]


def allocated_gib(plan) -> float:
    """The plan's predicted peak of allocated bytes (``allocated_of`` its prediction)."""
    return allocated_of(plan.prediction)


def path_of(shape: str, gpus: int, card: str = "h200") -> Path:
    return CARDS[card][2] / f"{shape}_{gpus}gpu.json"


def capped_plan(shape: str, card: str = "h200"):
    """The fastest plan of ``shape``'s job on ``card`` whose allocated peak fits under
    torchtitan's (rounded down to 0.1 GiB), and that cap; None where none fits. The search
    caps a plan's whole peak and ranks each layout by its fastest option under that cap, so
    one search would hide a layout's leaner option behind a faster one whose peak fits the
    search's cap but whose allocated peak does not: it runs at every cap from the cap plus
    the slack down to the cap itself, CAP_STEP_GIB apart."""
    cap = math.floor(peer_peak_gib(shape, card) * 10) / 10  # never above
    steps = math.ceil(cap * (SEARCH_SLACK - 1) / CAP_STEP_GIB)
    found = [best_plan(shape, 1, TRAINING.model_copy(
                 update={"memory_cap_gib": cap + i * CAP_STEP_GIB}),
                 fits=lambda plan: allocated_gib(plan) <= cap, top=100,
                 cluster=CARDS[card][0]) for i in range(steps + 1)]
    found = [plan for plan in found if plan is not None]
    best = min(found, key=lambda plan: plan.prediction.step_time_s) if found else None
    return best, cap


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--card", choices=list(CARDS), default="h200")
    card = p.parse_args(argv).card
    picked = {shape: capped_plan(shape, card) for shape in JOBS}
    # every job searched before anything is written; a job with no plan under its cap keeps
    # no plan here (peer_step_gpu --plans capped then records it as skipped)
    for shape, (plan, cap) in picked.items():
        path = path_of(shape, 1, card)
        if plan is None:
            path.unlink(missing_ok=True)
            print(f"{path.name}: no plan fits under {cap:.1f} GiB")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(plan.model_dump_json(indent=2) + "\n")
        print(f"{path.name}:\n  {plan.summary()}\n  predicted "
              f"{plan.prediction.step_time_s * 1e3:.1f} ms, peak {allocated_gib(plan):.1f} GiB "
              f"allocated (cap {cap:.1f})")


if __name__ == "__main__":
    main()
