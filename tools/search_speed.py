"""Time the whole search for Internal-352B on 1,440 H800 GPUs (global batch 720, seq 8192).

Target (issue 2): under 2 s on one core. Runs the search in a fresh process per repeat (cold
caches, including the stage-split ILP cache), pinned to one core where the OS allows it.

    python -m tools.search_speed [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench._meta import write

ONE_RUN = """
import json, time
t0 = time.perf_counter()
from plans import TrainingSpec, catalog
from planner.search import search
t1 = time.perf_counter()
r = search(catalog.load_model("internal-352b"), catalog.load_cluster("h800", gpus=1440),
           TrainingSpec(global_batch=720, seq_len=8192))
t2 = time.perf_counter()
b = r.best.evaluation
print(json.dumps({"import_s": t1 - t0, "search_s": t2 - t1, "candidates": r.stats.candidates,
                  "evaluated": r.stats.evaluated, "feasible": r.stats.feasible,
                  "best": r.best.plan.summary(), "best_step_s": b.step_time_s, "best_mfu": b.mfu,
                  "speedup_vs_megatron": r.speedup}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = Path(__file__).parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in range(args.repeats):
        cmd = [sys.executable, "-c", ONE_RUN]
        if hasattr(os, "sched_setaffinity"):
            cmd = ["taskset", "-c", "0", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=root, env=env)
        runs.append(json.loads(out.stdout))
    best = min(r["search_s"] for r in runs)
    path = write("search_speed", {
        "benchmark": "search Internal-352B on 1440 x H800, global batch 720, seq 8192",
        "target_s": 2.0,
        "search_s_min": best,
        "search_s_all": [r["search_s"] for r in runs],
        "import_s": min(r["import_s"] for r in runs),
        "cores": 1,
        "result": runs[0],
    })
    print(json.dumps(json.loads(path.read_text()), indent=2))


if __name__ == "__main__":
    main()
