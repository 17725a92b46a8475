"""The dispatcher table: the committed sweep of moeplan's two EP dispatchers on 2 H200s
(bench/results/h200/moe_layer/dispatch_sweep_x2.json) against the cost model of this tree,
and the dispatcher the planner prefers at every measured point.

    python -m bench.layers.dispatch_report [--check]

Writes docs/dispatch.md (its prose: bench/templates/dispatch.md.tmpl). ``--check`` exits 1
when the doc is stale or the planner's dispatcher differs from the faster measured one at any
point. Every point is priced here (planner.dispatch_fit), the sweep holds measurements only.
"""

from __future__ import annotations

import sys

from bench.report import ROOT, fill, parser, write_or_check
from planner import dispatch_fit as df
from plans import catalog

SWEEP = ROOT / "bench" / "results" / "h200" / "moe_layer" / "dispatch_sweep_x2.json"
DOC = ROOT / "docs" / "dispatch.md"
CLUSTER = "h200-runtime"
"""The cluster whose factors price the runs (`moeplan calibrate --dispatch` fitted its
gather_scatter and floors to this sweep)."""


def render() -> tuple[str, dict]:
    sweep = df.load(SWEEP)
    cluster = catalog.load_cluster(CLUSTER)
    rows = df.choices(sweep, cluster, catalog.load_model(df.MODEL))
    s = df.summary(rows)
    eff = cluster.efficiency
    floors = eff.dispatch_floor_us
    text = fill("dispatch.md.tmpl", {
        **s, "sweep": SWEEP.relative_to(ROOT), "commit": sweep.commit, "gpu": sweep.gpu,
        "torch": sweep.torch, "cluster": CLUSTER, "gather_scatter": eff.gather_scatter,
        "floor_a2a": f"{floors.all_to_all:.0f}",
        "floor_ag_rs": f"{floors.allgather_reduce_scatter:.0f}",
        "median": f"{s['median_abs_error']:.1%}", "worst": f"{s['max_abs_error']:.1%}",
        "geomean": f"{s['geomean_ratio']:.3f}", "table": "\n".join(df.table(rows))})
    return text, s


def main() -> int:
    args = parser(__doc__, "the doc is stale or a pick is wrong").parse_args()
    text, s = render()
    wrong = s["points"] - s["picks_equal_faster"]
    print(f"{s['picks_equal_faster']}/{s['points']} picks equal the faster; median "
          f"{s['median_abs_error']:.1%}, worst {s['max_abs_error']:.1%}")
    return write_or_check(DOC, text, "python -m bench.layers.dispatch_report", args.check,
                          [f"{wrong} wrong picks"] if wrong else [])


if __name__ == "__main__":
    sys.exit(main())
