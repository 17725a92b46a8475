"""Fingerprint of the search's results, to check that a speed change keeps them identical.

For each job of ``tools.search_speed.JOBS``: the top-5 plans (every field but the model and the
cluster), the Megatron-Core baseline and the paper's reference, each with its whole evaluation
(step time, breakdown, memory, stage times, critical path) written with ``repr``, and the search
counts. Two runs of one commit give byte-identical files; a change that keeps the results keeps
the file.

    python -m tools.search_fingerprint OUT.json [--jobs internal-352b ...]
    cmp before.json after.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from planner.search import Ranked, search
from plans import TrainingSpec, catalog
from tools.search_speed import JOBS


def _record(ranked: Ranked | None) -> dict | None:
    if ranked is None:
        return None
    return {"plan": ranked.plan.model_dump(mode="json", exclude={"model", "cluster"}),
            "evaluation": repr(ranked.evaluation)}


def fingerprint(name: str) -> dict:
    model, cluster, gpus, batch, seq, _ = JOBS[name]
    r = search(catalog.load_model(model), catalog.load_cluster(cluster, gpus=gpus),
               TrainingSpec(global_batch=batch, seq_len=seq))
    stats = {k: v for k, v in vars(r.stats).items() if k != "seconds"}
    return {"top": [_record(x) for x in r.top[:5]], "baseline": _record(r.baseline),
            "reference": _record(r.reference), "stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=list(JOBS))
    args = ap.parse_args()
    out = {name: fingerprint(name) for name in args.jobs}
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
