"""Memory truth: the peak device memory of training steps of many plans, and its parts.

    python -m bench.memory.memory_suite --world 1 --out-dir bench/results/h200/memory
    torchrun --nproc-per-node 2 -m bench.memory.memory_suite --world 2 --out-dir ...

Runs every case of ``CASES`` (or those ``--cases`` names) whose world size is ``--world``
(or the ``--plan-files``) in one process per rank, one after another, each probed as
`moeplan memory` probes a plan
(runtime/memory_probe.py: a warm-up step, then per phase and per module), and writes
``memory_<case>.json`` in its document's shape. Predictions are not computed here:
``bench/memory/memory_report.py`` holds the committed measurements against the cost model of
the tree it runs on.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench._dist_bench import finish, init
from bench._meta import bad_input, write_result
from bench.memory.memory_cases import CASES
from plans.catalog import load_plan
from runtime.memory_probe import document, line, probe_step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, required=True, help="run the cases of this many GPUs")
    p.add_argument("--plan-files", type=Path, nargs="*", default=[],
                   help="plan files to run instead of the built-in cases, named by their "
                        "file stem")
    p.add_argument("--cases", nargs="+", choices=list(CASES), metavar="CASE",
                   help="run only these cases of bench/memory/memory_cases.py")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != args.world:
        return bad_input(f"--world {args.world} but WORLD_SIZE={world}")
    plans = ({f.stem: load_plan(f) for f in args.plan_files} if args.plan_files
             else {n: case() for n, case in CASES.items() if n in (args.cases or CASES)})
    rank, world, device, _ = init()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, plan in plans.items():
        if plan.degrees.world != world:
            continue
        result = probe_step(name, plan, rank, world, device, args.seed)
        doc = document(name, plan, result, rank, world, device)
        if doc is not None:
            write_result(args.out_dir / f"memory_{name}.json", doc, indent=1)
            print(line(doc), flush=True)
    finish(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
