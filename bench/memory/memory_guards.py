"""The runtime's memory guards on a GPU, as a user meets them:

    python -m bench.memory.memory_guards --out bench/results/h200/memory/guards.json

1. a plan predicted above the GPU's free memory (bench/gpu_plans/memory/too_big_qwen4l_1gpu.json:
   254 GiB predicted) is refused before the first step: exit 2, one line;
2. the same refusal when another process holds most of the GPU and the plan's predicted peak
   (the searched 1-GPU Qwen3 plan) no longer fits beside it;
3. the searched 1-GPU Qwen3 plan trains 2 steps and ends well (exit 0).
Each case records the command's exit code and its stderr lines (a traceback would show there).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ROOT = HERE.parent

from bench._meta import write_result  # noqa: E402

PLANS = HERE / "gpu_plans" / "memory"
TRAIN = [sys.executable, "-m", "runtime.train", "--steps"]
HOG = """
import sys, time, torch
free, _ = torch.cuda.mem_get_info()
hold = torch.empty(int(free - 40 * 2**30), dtype=torch.uint8, device="cuda")
print("ready", flush=True)
sys.stdin.read()
"""


def run(cmd: list[str], timeout: float) -> dict:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    err = [line for line in r.stderr.splitlines() if "Warning" not in line and line.strip()]
    return {"cmd": " ".join(cmd[1:]), "exit": r.returncode, "stderr": err[-5:],
            "traceback": "Traceback" in r.stderr, "stdout": r.stdout.splitlines()[-3:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    searched = str(PLANS / "searched_qwen4l_1gpu.json")
    cases = {"predicted_above_the_gpu": run(
        [*TRAIN, "1", "--plan", str(PLANS / "too_big_qwen4l_1gpu.json")], 120)}
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        hog.stdout.readline()  # "ready": it holds all but 40 GiB
        cases["gpu_mostly_taken"] = run([*TRAIN, "1", "--plan", searched], 120)
    finally:
        hog.stdin.close()
        hog.wait(timeout=60)
    cases["searched_plan_trains"] = run([*TRAIN, "2", "--plan", searched], 300)
    expect = {"predicted_above_the_gpu": 2, "gpu_mostly_taken": 2, "searched_plan_trains": 0}
    for name, c in cases.items():
        c["expected_exit"] = expect[name]
        c["ok"] = c["exit"] == expect[name] and not c["traceback"]
        print(f"{name}: exit {c['exit']} ({'ok' if c['ok'] else 'UNEXPECTED'}): "
              f"{(c['stderr'] or c['stdout'] or [''])[-1][:200]}")
    write_result(args.out, {"cases": cases}, indent=1)
    return 0 if all(c["ok"] for c in cases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
