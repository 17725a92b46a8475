"""The first step of a relaunch: one plan launched twice (bench/steps/train_step.py, a process each)
over one torch.compile cache folder (runtime.compile_cache), empty before the first launch.
The first launch compiles every region; the second loads them from the cache.

    python -m bench.steps.compile_relaunch --plan PLAN --out RESULT.json [--steps S] [--warmup W]
        [--cache-dir DIR]

Writes JSON (bench/_meta.py's metadata): per launch, the trainer's build time, the first
step's time, the median of the measured steps, the graphs the first step loaded from the
cache and compiled, and the launch's wall time (process start, model build and every step);
``target_met``: the relaunch's first step under ``TARGET_FIRST_STEP_S`` (issue 34's
target).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._meta import bad_input, write_result
from bench.campaign import launcher
from bench.report import ROOT
from plans import SpecError
from plans.catalog import load_plan

TARGET_FIRST_STEP_S = 5.0
"""A relaunch's first step under 5 s (issue 34's targets)."""

LAUNCHES = ("cold", "relaunch")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path, help="result JSON")
    p.add_argument("--steps", type=int, default=3, help="measured steps of each launch")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps (the first included)")
    p.add_argument("--cache-dir", type=Path,
                   help="the cache folder, emptied first (default: a new temporary folder)")
    return p.parse_args(argv)


def launch(plan: Path, world: int, out: Path, cache: Path, steps: int, warmup: int) -> dict:
    """One bench/steps/train_step.py launch; its result's first-step fields and its wall time."""
    cmd = [*launcher(world), "-m", "bench.steps.train_step", "--plan", str(plan), "--out", str(out),
           "--steps", str(steps), "--warmup", str(warmup), "--compile-cache", str(cache)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not out.exists():
        return {"status": "failed", "exit": r.returncode, "wall_s": wall}
    doc = json.loads(out.read_text())
    return {"status": "ok", "wall_s": wall, "build_s": doc["build_s"],
            "first_step_s": doc["first_step_s"],
            "step_median_s": doc["step_median_s"], "step_times_s": doc["step_times_s"],
            "warmup_step_times_s": doc["warmup_step_times_s"],
            "compiled_graphs": doc["compiled_graphs"], "mfu": doc["mfu"]}


def write(args: argparse.Namespace, world: int, runs: dict[str, dict]) -> None:
    relaunch = runs.get("relaunch", {"status": "not run"})
    doc = {"benchmark": "first step of a launch and of its relaunch over one "
           "torch.compile cache", "plan": str(args.plan), "world": world,
           "steps": args.steps, "warmup": args.warmup, "launches": runs,
           "target_first_step_s": TARGET_FIRST_STEP_S,
           "target_met": (relaunch["status"] == "ok"
                          and relaunch["first_step_s"] < TARGET_FIRST_STEP_S)}
    write_result(args.out, doc)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        return bad_input("--steps must be >= 1 and --warmup >= 0")
    try:
        world = load_plan(args.plan).degrees.world
    except SpecError as e:
        return bad_input(str(e))
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="compile_relaunch_") as scratch:
        cache = args.cache_dir or Path(scratch) / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        for name in LAUNCHES:
            runs[name] = launch(args.plan, world, Path(scratch) / f"{name}.json", cache,
                                args.steps, args.warmup)
            print(f"{name}: {json.dumps(runs[name])}", flush=True)
            write(args, world, runs)  # after each launch: a timeout keeps the first
    relaunch = runs["relaunch"]
    if all(r["status"] == "ok" for r in runs.values()):
        print(f"first step {runs['cold']['first_step_s']:.2f} s, relaunch "
              f"{relaunch['first_step_s']:.2f} s (target {TARGET_FIRST_STEP_S:.0f} s); "
              f"steady {relaunch['step_median_s'] * 1e3:.1f} ms -> {args.out}")
    return 0 if all(r["status"] == "ok" for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
