"""The memory suite's table: the newest committed measurement of each case (bench/results/h200/
memory, and bench/results/h100/memory for the cases one H100 holds) against the cost model of
this tree, each priced as the runtime that measured it ran (plans.results.RuntimeFacts).

    python -m bench.memory.memory_report [--check]

Prints the table and writes it to docs/memory.md (its prose: bench/templates/memory.md.tmpl);
``--check`` writes nothing and exits 1 when docs/memory.md is not what this script writes or a
plan misses the target (prediction within 10% of the measured peak and never more than 3% below
it). The measured peak is the caching allocator's peak reserved bytes on the rank with the
highest (what the device must hold); the cost model predicts it, allocator reserve included.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.report import ROOT, fill, load, parser, table, write_or_check
from cost_models.memory import GIB, memory_breakdown
from plans import Plan
from plans.execution import executed_as_measured
from plans.results import RuntimeFacts

RESULTS = {"H200": ROOT / "bench" / "results" / "h200" / "memory",
           "H100": ROOT / "bench" / "results" / "h100" / "memory"}
"""Card -> its folder of the suite's measurements (the bytes a plan holds do not depend on the
card: the same runtime, torch and caching allocator)."""
DOC = ROOT / "docs" / "memory.md"
WITHIN, BELOW = 0.10, 0.03


def rows(results: dict[str, Path] = RESULTS) -> list[dict]:
    """One row per committed case, its newest measurement over the cards: plan, measured peaks
    (GiB), predicted peak, error."""
    newest: dict[str, dict] = {}
    for card, folder in results.items():
        for path in sorted(folder.glob("memory_*.json")):
            doc = load(path)
            ranks = [r for r in doc["ranks"] if r.get("status") == "ok"]
            if len(ranks) == len(doc["ranks"]) and (
                    doc["case"] not in newest or doc["date"] > newest[doc["case"]]["date"]):
                newest[doc["case"]] = {**doc, "card": card, "ranks": ranks}
    return [_row(doc) for _, doc in sorted(newest.items())]


def _row(doc: dict) -> dict:
    plan = Plan.model_validate(doc["plan"])
    # priced as the run executed it (what it recorded; none: before fusion ran), by the
    # runtime that ran it
    ran = executed_as_measured(plan, doc.get("deviations"))
    predicted = memory_breakdown(ran, RuntimeFacts.of(doc)).peak_bytes / GIB
    reserved = max(r["peak_reserved_bytes"] for r in doc["ranks"]) / GIB
    allocated = max(r["peak_allocated_bytes"] for r in doc["ranks"]) / GIB
    return {"case": doc["case"], "gpus": doc["world"], "summary": plan.summary(),
            "card": doc["card"], "measured_reserved_gib": reserved,
            "measured_allocated_gib": allocated, "predicted_gib": predicted,
            "error": predicted / reserved - 1, "commit": doc.get("commit", "?")}


def meets(row: dict) -> bool:
    return -BELOW <= row["error"] <= WITHIN


def report(data: list[dict]) -> str:
    cells = [[r["case"], r["gpus"], r["card"], f"{r['measured_reserved_gib']:.1f} / "
              f"{r['measured_allocated_gib']:.1f}", f"{r['predicted_gib']:.1f}",
              f"{r['error']:+.1%}" + ("" if meets(r) else " **miss**"), r["commit"]]
             for r in data]
    errors = [r["error"] for r in data]
    return (table(["case", "GPUs", "card", "measured peak GiB (reserved / allocated)",
                   "predicted GiB", "error", "commit"], cells)
            + f"\n\n{sum(map(meets, data))} of {len(data)} plans within the target "
            f"(-{BELOW:.0%} .. +{WITHIN:.0%}); error from {min(errors):+.1%} to "
            f"{max(errors):+.1%}.")


def main(argv=None) -> int:
    args = parser(__doc__, "docs/memory.md is stale or a plan misses the target") \
        .parse_args(argv)
    data = rows()
    text = report(data)
    if not args.check:
        print(text)
    misses = [] if all(meets(r) for r in data) else [
        "a plan misses the memory target (see python -m bench.memory.memory_report)"]
    return write_or_check(DOC, fill("memory.md.tmpl", {"table": text}),
                          "python -m bench.memory.memory_report", args.check, misses)


if __name__ == "__main__":
    sys.exit(main())
