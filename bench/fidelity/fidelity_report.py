"""The fidelity suite's table: the cost model, calibrated on micro-benchmarks only, against the
measured training steps of the suite's plans (committed under bench/results/h200/fidelity).

    python -m bench.fidelity.fidelity_report [--check] [--results DIR] [--doc PATH]

Fits the cluster as `moeplan calibrate` does (planner.calibrate.calibrate) from the
campaign's micro-benchmarks and at most the profiled step of fidelity_cases.PROFILED, never
from the suite's train steps; prices every plan of fidelity_cases.CASES as the runtime executed
it on that cluster; writes docs/fidelity.md (prose: bench/templates/fidelity.md.tmpl, which
states the targets), with docs/fidelity_at_scale.md as a section. ``--check`` writes nothing
and exits 1 when the document is stale, a target is missed or a plan has no measurement.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from bench.fidelity.fidelity_cases import CASES, PROFILED, plan_path
from bench.report import ROOT, fill, load, parser, table, write_or_check
from cost_models import skew
from cost_models.layer import layer_key
from planner.calibrate import (
    Calibration,
    calibrate,
    factor_value,
    fidelity_row,
    fidelity_summary,
    row_seconds,
    with_dispatch,
    with_efficiency,
)
from plans import Overlap, catalog
from plans.results import (
    DispatchSweep,
    OverlapBench,
    ProfileResult,
    Sweep,
    SweepOp,
    SweepRow,
    read,
)

RESULTS = ROOT / "bench" / "results" / "h200" / "fidelity"
DEVICE = ROOT / "bench" / "results" / "h200" / "device_sweep"
"""The profiled 1-GPU steps of the current runtime (campaign h200_kernels)."""
REPEAT = ROOT / "bench" / "results" / "h200" / "fidelity_repeat"
"""An earlier launch of the same plans (each its own launch, the same runtime code for these
plans): how far one launch's step time is from another's."""
DOC = ROOT / "docs" / "fidelity.md"
TEMPLATE = "fidelity.md.tmpl"
"""The document's prose, a piece per part (bench/report.fill)."""
AT_SCALE = ROOT / "docs" / "fidelity_at_scale.md"
SWEEP = "calibration_h200.json"
OVERLAP = "copy_engine_x2.json"
"""The machine's NCCL-beside-GEMM micro-benchmark (`moeplan overlap`), next to the
suite's folder: it sets efficiency.overlap (planner.calibrate.fit_overlap)."""
DISPATCH = "moe_layer/dispatch_sweep_x2.json"
"""The machine's EP dispatcher sweep (`moeplan dispatch`), beside the suite's folder: it sets
gather_scatter and dispatch_floor_us, fitted last (planner.calibrate.with_dispatch)."""
BASE = "h200"
NAME = "H200-SXM-fidelity"
MEDIAN, WORST, MEMORY_BELOW = 0.05, 0.10, 0.05


def fit(results: Path, with_profile: bool = True) -> tuple[Calibration, list[str]] | None:
    """The calibrated cluster and the files it was fitted from; None without a sweep.
    ``with_profile``: the profiled step of PROFILED sets elementwise, when it was measured."""
    if not (results / SWEEP).exists():
        return None
    sweep = read(Sweep, results / SWEEP, "sweep")
    profile_path = results / f"profile_{PROFILED}.json"
    profile = (read(ProfileResult, profile_path, "profile")
               if with_profile and profile_path.exists() else None)
    plan = catalog.load_plan(plan_path(PROFILED)) if profile else None
    overlap_path = results.parent / OVERLAP
    overlap = read(OverlapBench, overlap_path, "overlap") if overlap_path.exists() else None
    cal = calibrate(profile, plan, catalog.load_cluster(BASE), NAME, sweep, overlap)
    dispatch_path = results.parent / DISPATCH
    if dispatch_path.exists():
        cal = with_dispatch(cal, read(DispatchSweep, dispatch_path, "dispatch sweep"))
    used = ([SWEEP] + ([profile_path.name] if profile else [])
            + ([f"../{OVERLAP}"] if overlap else [])
            + ([f"../{DISPATCH}"] if dispatch_path.exists() else []))
    return cal, used


def launches(results: Path, name: str) -> list[tuple[float, Path]]:
    """(step seconds, file) of each launch of plan ``name`` at the commit of its result in
    ``results``: that file and the same plan's in the campaign's further launch folders
    (``launch_*/``, campaign h200_fidelity), fastest first; a launch of
    another commit is another runtime and is left out."""
    main = results / f"train_step_{name}.json"
    if not main.exists():
        return []
    docs = [(load(p), p) for p in [main, *sorted(results.glob(f"launch_*/train_step_{name}.json"))]]
    commit = docs[0][0].get("commit")
    return sorted((d["step_time_s"], p) for d, p in docs if d.get("commit") == commit)


def rows(results: Path, cal: Calibration, measured_skew: bool = False) -> list[dict]:
    """One row per suite plan: fidelity_row on the calibrated cluster against the plan's
    median launch (of an even count, the faster of the middle two), or unmeasured."""
    out = []
    for name in CASES:
        if runs := launches(results, name):
            _, run = runs[(len(runs) - 1) // 2]
            out.append({"case": name, "launch_step_s": [t for t, _ in runs],
                        **fidelity_row(run, plan_path(name), cal.cluster,
                                       measured_skew=measured_skew).as_dict()})
        else:
            out.append({"case": name, "missing": True})
    return out


def skew_text(plain: list[dict], skewed: list[dict]) -> str:
    """The suite priced with the routing skew each run logged, beside the balanced router the
    plans state: which EP plans move, and how far."""
    def ep(rows):
        return {r["case"]: r["step_error"] for r in rows
                if not r.get("missing") and CASES[r["case"]]().degrees.ep > 1}
    skews = [r["measured_skew"] for r in skewed if r.get("measured_skew")]
    if not skews:
        return fill(TEMPLATE, {}, "no_skew")
    before, after = ep(plain), ep(skewed)
    moved = "; ".join(f"{c} {before[c]:+.0%} -> {after[c]:+.0%}" for c in sorted(before))
    return fill(TEMPLATE, {"lo": f"{min(skews):.1f}", "hi": f"{max(skews):.1f}",
                           "summary": summary_text(summary(skewed)), "moved": moved}, "skew")


def summary(data: list[dict]) -> dict:
    measured = [r for r in data if not r.get("missing")]
    s = fidelity_summary([r["step_error"] for r in measured],
                         [r["memory_error"] for r in measured])
    if s is None:
        return {"measured": 0, "missing": len(data)}
    return {
        "measured": s.runs, "missing": len(data) - s.runs,
        "median_abs": s.median_abs_step_error, "worst_abs": s.worst_abs_step_error,
        "slow": s.slower, "fast": s.faster, "memory_lowest": s.lowest_memory_error,
    }


def meets(s: dict) -> bool:
    return (s["measured"] > 0 and s["missing"] == 0 and s["median_abs"] <= MEDIAN
            and s["worst_abs"] <= WORST and s["slow"] > 0 and s["fast"] > 0
            and s["memory_lowest"] >= -MEMORY_BELOW)


def plan_table(data: list[dict]) -> str:
    cells = []
    for r in data:
        if r.get("missing"):
            cells.append([r["case"], "", "", "", "not measured", "", "", "", ""])
            continue
        step_mark = " **miss**" if abs(r["step_error"]) > WORST else ""
        mem_mark = " **miss**" if r["memory_error"] < -MEMORY_BELOW else ""
        times = r.get("launch_step_s", [r["measured_step_s"]])
        spread = (f"{len(times)}: {times[0] * 1e3:.1f}-{times[-1] * 1e3:.1f}" if len(times) > 1
                  else "1")
        cells.append([r["case"], r["gpus"], f"`{r['layout']}`",
                      f"{r['predicted_step_s'] * 1e3:.1f}", f"{r['measured_step_s'] * 1e3:.1f}",
                      spread, f"{r['step_error']:+.1%}{step_mark}",
                      f"{r['predicted_peak_gib']:.1f} / {r['measured_peak_gib']:.1f}",
                      f"{r['memory_error']:+.1%}{mem_mark}"])
    return table(["plan", "GPUs", "layout", "predicted ms", "measured ms", "launches: ms",
                  "error", "peak GiB predicted / measured", "memory error"], cells)


def summary_parts(s: dict) -> dict[str, object]:
    """A measured summary's numbers and targets as the documents print them."""
    return {
        "measured": s["measured"], "missing": s["missing"], "median_abs": f"{s['median_abs']:.1%}",
        "median": f"{MEDIAN:.0%}", "worst_abs": f"{s['worst_abs']:.1%}", "worst": f"{WORST:.0%}",
        "slow": s["slow"], "fast": s["fast"], "memory_lowest": f"{s['memory_lowest']:+.1%}",
        "memory_below": f"{MEMORY_BELOW:.0%}", "verdict": "meets" if meets(s) else "misses"}


def summary_text(s: dict) -> str:
    if not s["measured"]:
        return fill(TEMPLATE, {}, "no_measurement").rstrip("\n")
    return fill(TEMPLATE, summary_parts(s), "summary").rstrip("\n")


def factor_table(cal: Calibration) -> str:
    base = catalog.load_cluster(BASE)
    cells = []
    for name, value in cal.factors.items():
        # three significant digits, never in powers of ten (the floors are thousands of us)
        cells.append([name, f"{factor_value(base, name):g}", f"{float(f'{value:.3g}'):g}"])
    return table(["factor", base.name, "fitted"], cells)


def sweep_kind(row: SweepRow) -> str:
    """The group a sweep row is summarised in: its op, the grouped GEMMs by rows per expert,
    the layer operators by name, the loss by kind."""
    match row.op:
        case SweepOp.grouped_mm:
            return f"grouped_mm, {row.shape['rows']} rows per expert"
        case SweepOp.layer_op:
            return f"layer_op {row.layer_op}"
        case SweepOp.head_loss:
            return f"head_loss {'chunked' if row.shape['chunked'] else 'materialized'}"
    return row.op.value


def sweep_table(results: Path, cal: Calibration) -> str:
    """The micro-benchmarks against the calibrated model, per kind of row."""
    sweep = read(Sweep, results / SWEEP, "sweep")
    cluster = catalog.resize(cal.cluster, sweep.world, "sweep")
    by_kind: dict[str, list[float]] = {}
    for row in sorted(sweep.rows, key=lambda r: (list(SweepOp).index(r.op),
                                                 r.shape.get("rows", 0))):
        predicted = row_seconds(row, cluster)
        if predicted is not None:
            by_kind.setdefault(sweep_kind(row), []).append(predicted / row.measured_s - 1)
    return table(["kind", "rows", "median error", "most optimistic", "most pessimistic"],
                 ([kind, len(errors), f"{statistics.median(errors):+.1%}", f"{min(errors):+.1%}",
                   f"{max(errors):+.1%}"] for kind, errors in by_kind.items()))


def shared_text(folder: Path) -> str:
    """Two-rank plans with both ranks on one GPU over gloo (bench/steps/train_step.py --share-gpu
    --memory-timeline): each rank's allocated and reserved peaks and its streams' reserve."""
    runs = sorted(folder.glob("train_step_*.json")) if folder.is_dir() else []
    if not runs:
        return ""
    cells = []
    for path in runs:
        d = load(path)
        timeline = max(d.get("memory_timeline_per_rank") or [{}],
                       key=lambda t: t.get("reserved_peak_gib", 0))
        streams = sorted(timeline.get("reserved_at_peak_gib_by_stream", {}).values(),
                         reverse=True)
        cells.append([Path(d["plan"]).stem, f"{max(d['peak_memory_gib_per_rank']):.2f}",
                      ", ".join(f"{g:.2f}" for g in d["peak_reserved_gib_per_rank"]),
                      " + ".join(f"{g:.2f}" for g in streams), d.get("commit", "?")])
    return fill(TEMPLATE, {"table": table(
        ["plan", "allocated peak GiB", "reserved peak GiB (per rank)",
         "reserved at the peak by stream GiB (highest rank)", "commit"], cells)}, "shared")


def repeat_text(data: list[dict]) -> str:
    """How far one launch's step time is from another's, at the same commit: each plan's
    launches (the table's range) over their fastest."""
    spread = {r["case"]: r["launch_step_s"][-1] / r["launch_step_s"][0] - 1 for r in data
              if not r.get("missing") and len(r.get("launch_step_s", [])) > 1}
    if not spread:
        return ""
    worst = max(spread, key=spread.get)
    calm = sorted(spread.values())
    return fill(TEMPLATE, {"median": f"{calm[len(calm) // 2]:.1%}",
                           "worst": f"{spread[worst]:.1%}", "case": worst}, "repeat")


def overlap_text(results: Path, cal: Calibration, data: list[dict]) -> str:
    """The overlapped plans priced with the base cluster's prior share of hidden communication
    and with the share the machine's micro-benchmark measured (efficiency.overlap)."""
    prior = catalog.load_cluster(BASE).efficiency.overlap
    fitted = cal.cluster.efficiency.overlap
    if fitted == prior:
        return ""
    at_prior = Calibration(with_efficiency(cal.cluster, overlap=prior), cal.factors)
    before = {r["case"]: r for r in rows(results, at_prior) if not r.get("missing")}
    moved = [(r["case"], before[r["case"]]["step_error"], r["step_error"]) for r in data
             if r["case"] in before and CASES[r["case"]]().overlap != Overlap.none]
    bench = read(OverlapBench, results.parent / OVERLAP, "overlap")
    shapes = "; ".join(
        f"{r.shape.get('name', 'a shape')}: "
        f"GEMMs {r.compute_s * 1e3:.2f} ms, NCCL {r.nccl_s * 1e3:.2f}, together "
        f"{r.nccl_beside_compute_s * 1e3:.2f}" for r in bench.rows)
    return fill(TEMPLATE, {
        "prior": f"{prior:.0%}", "overlap_file": OVERLAP, "shapes": shapes,
        "fitted": f"{fitted:.0%}",
        "moved": "; ".join(f"{c} {a:+.1%} -> {b:+.1%}" for c, a, b in moved)}, "overlap")


def head_groups_text(data: list[dict]) -> str:
    """The plans priced with Ulysses in head groups (plans.layout.ulysses_chunks) whose
    measured launch ran another schedule: not the same step until re-measured."""
    stale = [r for r in data if not r.get("missing")
             and r["priced_head_groups"] != (r["run_head_groups"] or 1)]
    if not stale:
        return ""
    runs = "; ".join(
        f"{r['case']} ({r['priced_head_groups']} priced, "
        f"{r['run_head_groups'] or 'none recorded, all blocking'} at {r['run_commit']})"
        for r in stale)
    return fill(TEMPLATE, {"runs": runs}, "head_groups")


def host_text(data: list[dict]) -> str:
    """The runtime before and after the router's host sync was removed: each plan's step in the
    earlier launch (REPEAT) against the suite's median launch now, the implicit host syncs one
    step still has, and the idle device time of the profiled 1-GPU steps (DEVICE)."""
    cells = []
    for r in data:
        earlier = REPEAT / f"train_step_{r['case']}.json"
        if r.get("missing") or not earlier.exists():
            continue
        then, now = load(earlier), load(Path(r["run"]))
        syncs = (now.get("host_syncs_per_rank") or [None])[0]
        cells.append([r["case"], f"{then['step_time_s'] * 1e3:.1f} ({then['commit']})",
                      f"{r['measured_step_s'] * 1e3:.1f} ({r['run_commit']})",
                      f"{r['measured_step_s'] / then['step_time_s'] - 1:+.1%}",
                      "-" if syncs is None else sum(syncs.values())])
    if not cells:
        return ""
    idle = [load(p)["idle_fraction"] for p in sorted(DEVICE.glob("profile_*.json"))]
    idle_text = f"{max(idle):.1%} of the step at most" if idle else "(not profiled)"
    return fill(TEMPLATE, {"idle": idle_text, "table": table(
        ["plan", "before ms (commit)", "now ms (commit)", "change",
         "implicit host syncs per step, rank 0"], cells)}, "host")


def rank_load_text(data: list[dict]) -> str:
    """The busiest EP rank's routed rows over its group's mean, measured (bench/steps/train_step.py:
    per layer where the run counted per layer, else over the whole step) beside
    cost_models.skew's derivation from the logged expert-level skew and for a balanced
    router."""
    cells, kinds = [], set()
    for r in data:
        if r.get("missing"):
            continue
        run = load(Path(r["run"]))
        busiest, kind = ((run["ep_rank_load_layer"], "each layer")
                         if run.get("ep_rank_load_layer") is not None
                         else (run.get("ep_rank_load_step"), "the whole step"))
        if busiest is None:
            continue
        kinds.add(kind)
        plan = catalog.load_plan(plan_path(r["case"]))
        n, m = plan.degrees.ep, plan.model
        routed = layer_key(plan).tokens * n * m.top_k
        derived = skew.rank_skew(routed, m.experts, n, run["routing_skew"], None)
        balanced = skew.rank_skew(routed, m.experts, n, 1.0, None)
        cells.append([r["case"], f"{run['routing_skew']:.1f}", f"{busiest:.3f}", kind,
                      f"{derived:.3f}", f"{balanced:.3f}"])
    if not kinds:
        return ""
    step_only = (fill(TEMPLATE, {}, "step_only").replace("\n", " ")
                 if "the whole step" in kinds else "")
    return fill(TEMPLATE, {"step_only": step_only, "table": table(
        ["plan", "logged routing_skew", "measured busiest rank / mean", "over",
         "derived from the logged skew", "derived for a balanced router"], cells)}, "rank_load")


def cap_text(folders: list[Path]) -> str:
    """The suite plans run with each rank's caching allocator capped at the predicted peak
    (bench/memory/memory_cap.py): whether they fit, and what the cap cost. A run that stopped out of
    memory wrote one file per rank that stopped; it is one row."""
    docs: dict[tuple, dict] = {}
    for folder in folders:
        for path in sorted(folder.glob("memory_cap_*.json")) if folder.is_dir() else []:
            d = load(path)
            key = (folder.name, d["plan"], d.get("scale", 1.0))
            if key in docs:  # another rank of the same run out of memory
                docs[key]["ranks"].append(d["rank"])
                continue
            docs[key] = {**d, "ranks": [d.get("rank")], "folder": folder.name}
    if not docs:
        return ""
    cells = []
    for d in docs.values():
        name = Path(d["plan"]).stem
        if d.get("scale", 1.0) != 1.0:
            name += f" (control: {d['scale']:g} x the prediction)"
        shared = d.get("ranks_per_gpu", 1) > 1 or d["folder"] == "shared"
        # an out-of-memory record before 2026-12-01 did not say its world: the plan's
        world = d.get("world") or catalog.load_plan(ROOT / d["plan"]).degrees.world
        gpus = "1, both ranks (gloo)" if shared else str(world)
        if d["fits"]:
            r = max(d["per_rank"], key=lambda x: x["reserved_peak_gib"])
            step = ("(shared)" if shared else
                    f"{max(x['step_time_s'] for x in d['per_rank']) * 1e3:.1f}")
            outcome = ["yes", f"{r['reserved_peak_gib']:.2f}",
                       max(x["alloc_retries"] for x in d["per_rank"]), step]
        else:
            ranks = ", ".join(str(r) for r in sorted(d["ranks"]))
            outcome = [f"no: out of memory (rank {ranks})", "", "", ""]
        cells.append([name, gpus, f"{d['cap_gib']:.2f}", *outcome, d.get("commit", "?")])
    return fill(TEMPLATE, {"table": table(
        ["plan", "GPUs", "cap (the predicted peak) GiB", "fits", "reserved peak under the cap GiB",
         "allocation retries", "step ms under the cap", "commit"], cells)}, "cap")


def render(results: Path = RESULTS, at_scale: Path = AT_SCALE) -> tuple[str, dict]:
    """The document and its summary."""
    parts = [fill(TEMPLATE, {}, "header")]
    fitted = fit(results)
    if fitted is None:
        s = {"measured": 0, "missing": len(CASES)}
        where = results.relative_to(ROOT) if results.is_relative_to(ROOT) else results
        parts.append(fill(TEMPLATE, {"results": where}, "no_sweep"))
    else:
        cal, used = fitted
        data = rows(results, cal)
        s = summary(data)
        parts.append(fill(TEMPLATE, {"plan_table": plan_table(data), "summary": summary_text(s)},
                          "measured"))
        memory = results.parent / "memory"  # h200_memory's cap/ and shared/ steps
        parts += [overlap_text(results, cal, data), head_groups_text(data),
                  shared_text(memory / "shared"), cap_text([memory / "cap", memory / "shared"]),
                  skew_text(data, rows(results, cal, measured_skew=True)),
                  rank_load_text(data), host_text(data), repeat_text(data)]
        if f"profile_{PROFILED}.json" in used:
            alone, _ = fit(results, with_profile=False)
            parts.append(fill(TEMPLATE, {"summary": summary_text(summary(rows(results, alone)))},
                              "alone"))
        parts.append(fill(TEMPLATE, {
            "sources": ", ".join(f"`{u}`" for u in used), "factor_table": factor_table(cal),
            "sweep_table": sweep_table(results, cal)}, "calibrated"))
    if at_scale.exists():
        parts.append("## At scale\n\n" + _demoted(at_scale.read_text()))
    return "\n".join(parts).rstrip() + "\n", s


def _demoted(markdown: str) -> str:
    """Another document's headings one level down (its title becomes a subsection)."""
    return "\n".join("#" + ln if ln.startswith("#") else ln for ln in markdown.splitlines())


def main(argv=None) -> int:
    p = parser(__doc__, "the document is stale, a target is missed or a plan is not measured")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--doc", type=Path, default=DOC)
    args = p.parse_args(argv)
    text, s = render(args.results)
    if not args.check:
        print(text)
    misses = [] if s["measured"] and meets(s) else [
        "fidelity targets missed or a plan not measured (see the document)"]
    return write_or_check(args.doc, text, "python -m bench.fidelity.fidelity_report",
                          args.check, misses)


if __name__ == "__main__":
    sys.exit(main())
