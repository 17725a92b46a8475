"""Hold measured GPU training runs against the cost model's predictions for the same plans.

    python -m bench.fidelity.gpu_fidelity --runs bench/results/h200 --plans bench/gpu_plans \
        --name gpu_fidelity_h200

Reads each `train_step_<plan>.json` (bench/steps/train_step.py) or `train_<plan>.jsonl` (the
runtime's per-step log, steps after the first `--skip` averaged), evaluates `<plan>.json`
with the cost model as the runtime executed it (plans.execution: no overlap, gradient sync after
the backward, no gradient-accumulation fusion, bf16 GEMMs), on the plan's own cluster or on
`--cluster` (e.g. one `moeplan calibrate` wrote), and writes the step-time and peak-memory
errors per plan to bench/results/<name>.json (planner.calibrate.fidelity_row). No torch needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench._meta import write
from planner.calibrate import fidelity_row, fidelity_summary, runs_with_plans
from plans import catalog


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=Path, default=Path("bench/results/h200"),
                    help="folder of train_step_<plan>.json results or train_<plan>.jsonl logs")
    ap.add_argument("--plans", type=Path, default=Path("bench/gpu_plans"))
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    ap.add_argument("--name", default="gpu_fidelity_h200")
    ap.add_argument("--cluster", help="price every plan on this cluster (name or YAML, e.g. a "
                                      "`moeplan calibrate` output) instead of its own")
    ap.add_argument("--calibrated-on", nargs="*", default=[],
                    help="plans whose runs set the cluster's factors (left out of the held-out "
                         "error)")
    args = ap.parse_args()
    cluster = catalog.load_cluster(args.cluster) if args.cluster else None
    rows = []
    for run, plan in runs_with_plans(args.runs, args.plans):
        rows.append({**fidelity_row(run, plan, cluster, args.skip).as_dict(),
                     "used_for_calibration": plan.stem in args.calibrated_on})
    if not rows:
        sys.exit(f"no train_*.jsonl logs with matching plans under {args.runs}")
    held_out = [r for r in rows if not r["used_for_calibration"]] or rows
    held = fidelity_summary([r["step_error"] for r in held_out],
                            [r["memory_error"] for r in held_out])
    path = write(args.name, {
        "benchmark": "measured GPU training steps vs cost-model predictions",
        "cluster": args.cluster or "each plan's own",
        "calibrated_on": args.calibrated_on,
        "rows": rows,
        "median_abs_step_error": held.median_abs_step_error,
        "max_abs_step_error": held.worst_abs_step_error,
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
    print(f"held-out step-time error: median {held.median_abs_step_error:.1%}, "
          f"max {held.worst_abs_step_error:.1%}; wrote {path}")


if __name__ == "__main__":
    main()
