"""The plans `moeplan search --runnable` picks for the fidelity suite's job (global batch
8 x 4096, bench/fidelity/fidelity_cases.py) on one and two H200s of the calibrated cluster
h200-runtime, for the three reduced-depth shapes: what a user of the planner trains. Written to
bench/gpu_plans/searched/ for campaign h200_steps, which measures their steps (held out:
chosen by the cost model before they were measured). A rerun after the cost model changes may
write other plans, to be measured again.

    python -m bench.steps.steps_searched        # imports the planner: run on the CPU machine
"""

from __future__ import annotations

import argparse
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

from bench.fidelity.fidelity_cases import TRAINING  # noqa: E402
from bench.memory.memory_cases import SHAPES, write_searched  # noqa: E402
from plans import Plan  # noqa: E402

OUT = HERE / "gpu_plans" / "searched"


def main(argv=None) -> None:
    # no options: -h describes the script and writes nothing
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    write_searched([(shape, gpus) for gpus in (1, 2) for shape in SHAPES], TRAINING,
                   lambda shape, gpus: OUT / f"{shape}_{gpus}gpu.json")
    # the 2-GPU plans at one sequence per micro-batch, for their bf16 parity with both ranks
    # on one GPU (each rank also runs the fp32 and bf16 one-rank references there)
    for shape in SHAPES:
        plan = Plan.model_validate_json((OUT / f"{shape}_2gpu.json").read_text())
        path = OUT / f"{shape}_2gpu_mbs1.json"
        path.write_text(plan.model_copy(update={"micro_batch_size": 1, "prediction": None})
                        .model_dump_json(indent=2) + "\n")
        print(f"{path.name}: {plan.summary()} at micro-batch 1")


if __name__ == "__main__":
    main()
