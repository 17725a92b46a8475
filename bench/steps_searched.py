"""The plans `moeplan search --runnable` picks for the fidelity suite's job (global batch
8 x 4096, bench/fidelity_cases.py) on one H200 of the calibrated cluster h200-runtime, for the
three reduced-depth shapes: what a user of the planner trains. Written to
bench/gpu_plans/searched/ for campaign h200_searched_1gpu, which measures their steps and
profiles them (held out: chosen by the cost model before they were measured). A rerun after
the cost model changes may write other plans, to be measured again.

    python bench/steps_searched.py        # imports the planner: run on the CPU machine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from fidelity_cases import TRAINING  # noqa: E402
from memory_cases import SHAPES, write_searched  # noqa: E402

OUT = HERE / "gpu_plans" / "searched"


def main(argv=None) -> None:
    # no options: -h describes the script and writes nothing
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    write_searched([(shape, 1) for shape in SHAPES], TRAINING,
                   lambda shape, gpus: OUT / f"{shape}_{gpus}gpu.json")


if __name__ == "__main__":
    main()
