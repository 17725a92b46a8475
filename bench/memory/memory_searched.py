"""The plans `moeplan search --runnable` picks for the memory issue's jobs: reduced-depth
Qwen3-30B-A3B and DeepSeekMoE shapes (4 layers), global batch 16 x 4096, on 1 and 2 H200s of the
calibrated cluster h200-runtime. Written to bench/gpu_plans/memory/ for bench/memory/memory_suite.py
(``--plan-files``), which checks on the device that they run without running out of memory and
records their peaks for bench/memory/memory_report.py (held out: chosen by the cost model before
they were measured). A rerun after the cost model changes may write other plans, to be
measured again.

    python -m bench.memory.memory_searched        # imports the planner: run on the CPU machine
"""

from __future__ import annotations

import argparse
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

from bench.memory.memory_cases import TRAINING, write_searched  # noqa: E402

OUT = HERE / "gpu_plans" / "memory"
JOBS = [(shape, gpus) for shape in ("qwen4l", "deepseek4l") for gpus in (1, 2)]


def main(argv=None) -> None:
    # no options: -h describes the script and writes nothing
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    write_searched(JOBS, TRAINING, lambda shape, gpus: OUT / f"searched_{shape}_{gpus}gpu.json")


if __name__ == "__main__":
    main()
