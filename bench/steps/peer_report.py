"""docs/peer_steps.md from the committed whole-step peer results (bench/results/h200/
peer_steps/): our searched and memory-capped plans against torchtitan's step, uncompiled and
compiled, and the relaunch's first step. No torch, no GPU.

    python -m bench.steps.peer_report [--check]
"""

from __future__ import annotations

import dataclasses
import statistics

from bench.report import ROOT, fill, load, parser, row, write_or_check

RESULTS = ROOT / "bench" / "results" / "h200" / "peer_steps"
DOC = ROOT / "docs" / "peer_steps.md"
COMMAND = "python -m bench.steps.peer_report"
SPEEDUP_TARGET = 1.15
RELAUNCH_TARGET_S = 5.0
MODELS = {"qwen3-30b-a3b": "qwen4l", "mixtral-8x7b": "mixtral2l", "deepseekmoe": "deepseek4l"}
"""Model -> the shape in its result files' names."""
CAPPED = {"qwen3-30b-a3b": "peer_step_capped.json", "mixtral-8x7b": "peer_step_capped.json",
          "deepseekmoe": "peer_step_capped_deepseek4l.json"}
H100 = ROOT / "bench" / "results" / "h100" / "peer_steps"
"""The capped plans on an H100, beside torchtitan's compiled step rerun in the same call."""
RELAUNCH = "relaunch_mixtral2l_capped.json"
"""The capped plan relaunched over its first launch's compile cache (h200_peer_steps's
relaunch_mixtral2l_capped)."""


def _model(name: str, model: str) -> dict:
    return load(RESULTS / name)["models"][model]


def skipped(run: dict) -> bool:
    """A capped run with no plan under the cap (bench.steps.peer_plans wrote none)."""
    return run.get("status") == "skipped"


def runs(model: str) -> dict[str, tuple[str, dict]]:
    """Run label -> (its plan's notation, its measurement) for ``model``; a capped run that
    has no plan under the cap is (its reason, the skipped record)."""
    shape = MODELS[model]
    searched = _model(f"peer_step_{shape}.json", model)
    capped = _model(CAPPED[model], model)
    compiled = _model(f"peer_step_{shape}_compiled.json", model)
    peer_plan = f"torchtitan mbs{searched['micro_batch_size']}"
    capped_run = ((capped["reason"], capped) if skipped(capped)
                  else (capped["plan_summary"], capped["ours"]))
    return {"ours, searched": (searched["plan_summary"], searched["ours"]),
            "ours, capped": capped_run,
            "torchtitan": (peer_plan, searched["peer"]),
            "torchtitan, compiled": (peer_plan, compiled["peer"])}


def _row(model: str, label: str, plan: str, run: dict) -> str:
    if skipped(run):
        return row([model, label, "skipped: no plan fits under the cap", "", "", "", ""])
    return row([model, label, f"`{plan}`", f"{run['step_time_s'] * 1e3:.1f}", f"{run['mfu']:.1%}",
                f"{run['peak_memory_gib']:.1f}", f"{run['first_step_s']:.1f}"])


def versus(ours: dict, peer: dict) -> tuple[float, bool] | None:
    """Our step's speed-up over ``peer``'s and whether it holds no more memory; None when the
    run is skipped (no plan under the cap)."""
    if skipped(ours):
        return None
    return (peer["step_time_s"] / ours["step_time_s"],
            ours["peak_memory_gib"] <= peer["peak_memory_gib"])


def _target(model: str, label: str, ours: dict, peer: dict) -> tuple[str, list[str]]:
    ours_label = label.removeprefix("ours, ")
    if (vs := versus(ours, peer)) is None:
        return (row([model, ours_label, f"no plan under {peer['peak_memory_gib']:.1f} GiB",
                     "", "", ""]),
                [f"{model} {label}: no plan under torchtitan compiled's peak"])
    speedup, fits = vs
    misses = [f"{model} {label}: {speedup:.2f}x torchtitan compiled"] \
        if speedup < SPEEDUP_TARGET else []
    misses += [] if fits else [f"{model} {label}: more memory than torchtitan compiled"]
    return row([model, ours_label, f"{ours['step_time_s'] * 1e3:.1f} / "
                f"{peer['step_time_s'] * 1e3:.1f}", f"{speedup:.2f}x",
                f"{ours['peak_memory_gib']:.1f} / {peer['peak_memory_gib']:.1f}",
                "no more" if fits else "more"]), misses


def h100_picks(model: str) -> list[tuple[str, dict, dict]]:
    """Our runs on the H100 beside torchtitan's compiled step of the same call: (the cluster
    that priced the plan, the run, its result document); the plan priced on h100-runtime
    (``--plans capped_h100``), and h200-runtime's pick where it is another plan and ran in
    that call."""
    compiled = load(H100 / f"peer_step_{MODELS[model]}_compiled.json")
    doc = load(H100 / "peer_step_capped_h100.json")
    ours = doc["models"][model]
    picks = [("h100-runtime", ours, doc)]
    h200_doc = load(H100 / CAPPED[model])
    h200 = h200_doc["models"][model]
    if h200["plan_summary"] != ours["plan_summary"] and h200_doc["commit"] == compiled["commit"]:
        picks.append(("h200-runtime", h200, h200_doc))
    return picks


def h100_peer(model: str) -> dict:
    """torchtitan's compiled step of ``model`` on the H100 (the call h100_picks ran in)."""
    return load(H100 / f"peer_step_{MODELS[model]}_compiled.json")["models"][model]["peer"]


def h100_rows() -> list[str]:
    """h100_picks against torchtitan compiled on the H100."""
    return [_target(model, f"{cluster} `{run['plan_summary']}`", run["ours"],
                    h100_peer(model))[0]
            for model in MODELS for cluster, run, _ in h100_picks(model)]


def measured_runs() -> list[tuple[str, str, str, dict, dict]]:
    """Every step of ours the report holds: (card, model, plan notation, measurement, its
    result document), the H200's searched and capped plans, then the H100's."""
    out = []
    for model, shape in MODELS.items():
        for name in (f"peer_step_{shape}.json", CAPPED[model]):
            doc = load(RESULTS / name)
            run = doc["models"][model]
            if not skipped(run):
                out.append(("h200", model, run["plan_summary"], run["ours"], doc))
        out += [("h100", model, run["plan_summary"], run["ours"], doc)
                for _, run, doc in h100_picks(model)]
    return out


def predicted_rows() -> tuple[list[str], list[float]]:
    """Each of our measured steps priced now by the cost model on its card's calibrated
    cluster (bench.steps.peer_plans.CARDS): its plan rebuilt from the notation it ran under,
    the model at its reduced depth, the benchmark's global batch, its memory as the runtime
    that measured it ran (plans.results.RuntimeFacts). Rows, and the errors."""
    from bench.fidelity.fidelity_cases import TRAINING
    from bench.memory.memory_cases import SHAPES, reduced
    from bench.steps.peer_plans import CARDS, allocated_of
    from cost_models import evaluate
    from cost_models.memory import memory_breakdown
    from plans import catalog
    from plans.notation import plan_from_notation
    from plans.results import RuntimeFacts

    rows, errors = [], []
    for card, model, summary, run, doc in measured_runs():
        cluster = catalog.load_cluster(CARDS[card][0], gpus=1)
        plan = plan_from_notation(summary, reduced(*SHAPES[MODELS[model]]), cluster, TRAINING)
        ran = dataclasses.replace(evaluate(plan),
                                  memory=memory_breakdown(plan, RuntimeFacts.of(doc)))
        pred = ran.prediction()
        error = pred.step_time_s / run["step_time_s"] - 1
        errors.append(error)
        rows.append(row([card.upper(), model, f"`{summary}`", f"{run['step_time_s'] * 1e3:.1f}",
                         f"{pred.step_time_s * 1e3:.1f}", f"{error:+.1%}",
                         f"{run['peak_memory_gib']:.1f} / {allocated_of(pred):.1f}",
                         doc["commit"]]))
    return rows, errors


def relaunch() -> tuple[dict[str, str], list[str]]:
    r = load(RESULTS / RELAUNCH)
    graphs = r["compiled_graphs"]["first_step"]
    parts = {"first_step": f"{r['first_step_s']:.2f}", "build": f"{r['build_s']:.2f}",
             "step_ms": f"{r['step_time_s'] * 1e3:.1f}",
             **{k: graphs[k] for k in ("hits", "aot_hits", "misses", "aot_misses")}}
    misses = [] if r["first_step_s"] < RELAUNCH_TARGET_S else ["relaunch first step >= 5 s"]
    return parts, misses


def render() -> tuple[str, list[str]]:
    rows, targets, misses = [], [], []
    for model in MODELS:
        measured = runs(model)
        rows += [_row(model, label, plan, run) for label, (plan, run) in measured.items()]
        peer = measured["torchtitan, compiled"][1]
        for label in ("ours, searched", "ours, capped"):
            line, missed = _target(model, label, measured[label][1], peer)
            targets.append(line)
            misses += missed
    relaunched, missed = relaunch()
    version = load(RESULTS / "peer_step_qwen4l.json")["wheels"]["torchtitan"]
    predicted, errors = predicted_rows()
    abs_errors = sorted(abs(e) for e in errors)
    text = fill("peer_steps.md.tmpl", {"rows": "\n".join(rows), "targets": "\n".join(targets),
                                       "h100": "\n".join(h100_rows()),
                                       "predicted": "\n".join(predicted),
                                       "median_error": f"{statistics.median(abs_errors):.1%}",
                                       "worst_error": f"{max(errors, key=abs):+.1%}",
                                       **relaunched, "relaunched": RELAUNCH,
                                       "torchtitan": version})
    return text, misses + missed


def main(argv=None) -> int:
    args = parser(__doc__, "the doc is stale (its missed targets are listed, not failed)") \
        .parse_args(argv)
    text, misses = render()
    for line in misses:
        print(f"target missed: {line}")
    return write_or_check(DOC, text, COMMAND, args.check)


if __name__ == "__main__":
    raise SystemExit(main())
