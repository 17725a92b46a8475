"""Hold measured GPU training runs against the cost model's predictions for the same plans.

    python bench/gpu_fidelity.py --runs bench/results/h200 --plans bench/gpu_plans \
        --name gpu_fidelity_h200

Reads each `train_step_<plan>.json` (bench/train_step.py) or `train_<plan>.jsonl` (the
runtime's per-step log, steps after the first `--skip` averaged), evaluates `<plan>.json`
with the cost model as the runtime executed it (runtime.deviations: no overlap, gradient sync
after the backward, bf16 GEMMs), and writes the step-time and peak-memory errors per plan to
bench/results/<name>.json. The cost model never imports
torch, so this runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from _meta import write  # noqa: E402

import cost_models  # noqa: E402
from plans import catalog  # noqa: E402
from runtime.deviations import deviations, executed_plan  # noqa: E402 (no torch)

GIB = 2**30


def measured(path: Path, skip: int) -> dict:
    """Step time, MFU, peak memory and component times from a bench/train_step.py result
    (.json) or from the runtime's per-step log (.jsonl, first `skip` steps left out)."""
    if path.suffix == ".json":
        r = json.loads(path.read_text())
        return {"step_s": r["step_time_s"], "mfu": r["mfu"],
                "peak_gib": max(r["peak_memory_gib_per_rank"]),
                "components_s": r["components_s"], "steps": r["measured_steps"],
                "commit": r.get("commit")}
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steady = steps[skip:] or steps
    components: dict[str, list[float]] = {}
    for s in steady:
        for k, v in s.get("components_s", {}).items():
            components.setdefault(k, []).append(v)
    return {"step_s": statistics.median(s["step_time_s"] for s in steady),
            "mfu": statistics.median(s["mfu"] for s in steady),
            "peak_gib": max(s["peak_memory_gib"] for s in steps),
            "components_s": {k: statistics.median(v) for k, v in components.items()},
            "steps": len(steady), "commit": None}


def compare(run: Path, plan_path: Path, skip: int, cluster=None) -> dict:
    m = measured(run, skip)
    measured_s, measured_gib = m["step_s"], m["peak_gib"]
    plan = catalog.load_plan(plan_path)
    if cluster is not None:  # the same job on a calibrated spec of the same machines
        plan = plan.model_copy(update={"cluster": catalog.resize(cluster, plan.cluster.gpus,
                                                                 "--cluster")})
    # the prediction for what ran: the runtime's deviations from the plan applied
    e = cost_models.evaluate(executed_plan(plan))
    return {
        "plan": plan_path.stem,
        "layout": plan.summary(),
        "evaluated_as_executed": [f"{d.field}={d.executed}" for d in deviations(plan)],
        "gpus": plan.cluster.gpus,
        "measured_step_s": measured_s,
        "predicted_step_s": e.step_time_s,
        "step_error": e.step_time_s / measured_s - 1,
        "measured_tokens_per_s": plan.training.tokens_per_step / measured_s,
        "measured_mfu": m["mfu"],
        "predicted_mfu": e.mfu,
        "measured_peak_gib": measured_gib,
        "predicted_peak_gib": e.memory.peak_bytes / GIB,
        "memory_error": e.memory.peak_bytes / GIB / measured_gib - 1,
        "measured_components_s": m["components_s"],
        "predicted_breakdown_s": dict(e.breakdown_s),
        "steps_used": m["steps"],
        "run": str(run),
        "run_commit": m["commit"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=Path, default=Path("bench/results/h200"),
                    help="folder of train_step_<plan>.json results or train_<plan>.jsonl logs")
    ap.add_argument("--plans", type=Path, default=Path("bench/gpu_plans"))
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    ap.add_argument("--name", default="gpu_fidelity_h200")
    ap.add_argument("--cluster", help="price every plan on this cluster (name or YAML, e.g. a "
                                      "bench/calibrate_runtime.py output) instead of its own")
    ap.add_argument("--calibrated-on", nargs="*", default=[],
                    help="plans whose runs set the cluster's factors (left out of the held-out "
                         "error)")
    args = ap.parse_args()
    cluster = catalog.load_cluster(args.cluster) if args.cluster else None
    rows = []
    for run in sorted([*args.runs.glob("train_step_*.json"), *args.runs.glob("train_*.jsonl")]):
        name = run.stem.removeprefix("train_step_").removeprefix("train_")
        plan = args.plans / f"{name}.json"
        if plan.exists():
            row = compare(run, plan, args.skip, cluster)
            row["used_for_calibration"] = name in args.calibrated_on
            rows.append(row)
    if not rows:
        sys.exit(f"no train_*.jsonl logs with matching plans under {args.runs}")
    held_out = [r for r in rows if not r["used_for_calibration"]] or rows
    path = write(args.name, {
        "benchmark": "measured GPU training steps vs cost-model predictions",
        "cluster": args.cluster or "each plan's own",
        "calibrated_on": args.calibrated_on,
        "rows": rows,
        "median_abs_step_error": statistics.median(abs(r["step_error"]) for r in held_out),
        "max_abs_step_error": max(abs(r["step_error"]) for r in held_out),
        "worst_memory_underprediction": min(r["memory_error"] for r in rows),
    })
    print(f"{'plan':34s} {'meas ms':>8s} {'pred ms':>8s} {'err':>6s} {'meas GiB':>9s} "
          f"{'pred GiB':>9s} {'err':>6s}")
    for r in rows:
        ms = (r["measured_step_s"] * 1e3, r["predicted_step_s"] * 1e3)
        mark = " (calibration)" if r["used_for_calibration"] else ""
        print(f"{r['plan'] + mark:34s} {ms[0]:8.1f} {ms[1]:8.1f} {r['step_error']:+6.0%} "
              f"{r['measured_peak_gib']:9.1f} {r['predicted_peak_gib']:9.1f} "
              f"{r['memory_error']:+6.0%}")
    errors = [abs(r["step_error"]) for r in held_out]
    print(f"held-out step-time error: median {statistics.median(errors):.1%}, "
          f"max {max(errors):.1%}; wrote {path}")


if __name__ == "__main__":
    main()
