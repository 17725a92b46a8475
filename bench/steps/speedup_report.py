"""Measured speedup of moeplan search's plan over the Megatron-style baseline, held against the
predicted one.

    python -m bench.steps.speedup_report --best RUN_BEST.json --baseline RUN_BASELINE.json \
        --out $OUT/speedup_x8.json

Reads two bench/steps/train_step.py results (each carries its plan's prediction) and writes the
measured step times, the predicted ones, both speedups (baseline / best) and their ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench._meta import write_result
from plans import SpecError
from plans.results import TrainStepResult, read


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--best", required=True, type=Path)
    ap.add_argument("--baseline", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    try:
        runs = {k: read(TrainStepResult, p, f"--{k}")
                for k, p in (("best", args.best), ("baseline", args.baseline))}
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = {}
    for k, r in runs.items():
        pred = r.prediction
        rows[k] = {"plan": r.plan, "summary": r.plan_summary,
                   "measured_step_s": r.step_time_s, "measured_mfu": r.mfu,
                   "predicted_step_s": pred.step_time_s if pred else None,
                   "predicted_mfu": pred.mfu if pred else None,
                   "peak_memory_gib": max(r.peak_memory_gib_per_rank)}
    measured = rows["baseline"]["measured_step_s"] / rows["best"]["measured_step_s"]
    have_pred = all(rows[k]["predicted_step_s"] for k in rows)
    predicted = (rows["baseline"]["predicted_step_s"] / rows["best"]["predicted_step_s"]
                 if have_pred else None)
    result = {"benchmark": "search's plan vs Megatron baseline: speedup",
              "runs": rows, "measured_speedup": measured, "predicted_speedup": predicted,
              "measured_over_predicted": measured / predicted if predicted else None}
    write_result(args.out, result)
    print(f"speedup measured {measured:.3f}, predicted "
          f"{'n/a' if predicted is None else f'{predicted:.3f}'} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
