"""The memory suite's table: every committed measurement (bench/results/h200/memory) against the
cost model of this tree.

    python -m bench.memory.memory_report [--check]

Prints the table and writes it to docs/memory.md (its prose: bench/templates/memory.md.tmpl);
``--check`` writes nothing and exits 1 when docs/memory.md is not what this script writes or a
plan misses the target (prediction within 10% of the measured peak and never more than 3% below
it). The measured peak is the caching allocator's peak reserved bytes on the rank with the
highest (what the device must hold); the cost model predicts it, allocator reserve included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from bench.report import fill, write_or_check  # noqa: E402
from cost_models.memory import GIB, memory_breakdown  # noqa: E402
from plans import Plan  # noqa: E402
from plans.execution import executed_as_measured  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "h200" / "memory"
DOC = ROOT / "docs" / "memory.md"
WITHIN, BELOW = 0.10, 0.03


def rows(results: Path = RESULTS) -> list[dict]:
    """One row per committed case: plan, measured peaks (GiB), predicted peak, error."""
    out = []
    for path in sorted(results.glob("memory_*.json")):
        doc = json.loads(path.read_text())
        ranks = [r for r in doc["ranks"] if r.get("status") == "ok"]
        if len(ranks) != len(doc["ranks"]):
            continue
        plan = Plan.model_validate(doc["plan"])
        # priced as the run executed it (what it recorded; none: before fusion ran)
        ran = executed_as_measured(plan, doc.get("deviations"))
        predicted = memory_breakdown(ran).peak_bytes / GIB
        reserved = max(r["peak_reserved_bytes"] for r in ranks) / GIB
        allocated = max(r["peak_allocated_bytes"] for r in ranks) / GIB
        out.append({
            "case": doc["case"], "gpus": doc["world"], "summary": plan.summary(),
            "measured_reserved_gib": reserved, "measured_allocated_gib": allocated,
            "predicted_gib": predicted, "error": predicted / reserved - 1,
            "commit": doc.get("commit", "?"),
        })
    return out


def meets(row: dict) -> bool:
    return -BELOW <= row["error"] <= WITHIN


def table(data: list[dict]) -> str:
    lines = [
        "| case | GPUs | measured peak GiB (reserved / allocated) | predicted GiB | error |",
        "|---|---|---|---|---|",
    ]
    for r in data:
        mark = "" if meets(r) else " **miss**"
        lines.append(
            f"| {r['case']} | {r['gpus']} | {r['measured_reserved_gib']:.1f} / "
            f"{r['measured_allocated_gib']:.1f} | {r['predicted_gib']:.1f} | "
            f"{r['error']:+.1%}{mark} |")
    errors = [r["error"] for r in data]
    ok = sum(meets(r) for r in data)
    lines += ["", f"{ok} of {len(data)} plans within the target (-{BELOW:.0%} .. +{WITHIN:.0%}); "
              f"error from {min(errors):+.1%} to {max(errors):+.1%}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when docs/memory.md is stale or a plan misses "
                        "the target")
    args = p.parse_args(argv)
    data = rows()
    text = table(data)
    if not args.check:
        print(text)
    misses = [] if all(meets(r) for r in data) else [
        "a plan misses the memory target (see python -m bench.memory.memory_report)"]
    return write_or_check(DOC, fill("memory.md.tmpl", {"table": text}),
                          "python -m bench.memory.memory_report", args.check, misses)


if __name__ == "__main__":
    sys.exit(main())
