"""One-off: bring every committed result under bench/results to plans.results.SCHEMA_VERSION.

- ``schema_version`` and the facts each run was measured under (plans.results.MEASURED_UNDER):
  ``eager_step_in_buckets`` is false for a run dated before 2026-12-01T09:34:07+00:00 (commit
  029a588, when the runtime's eager optimizer began stepping one bucket at a time);
- train steps that say ``zero1: true | false`` say ``optimizer_sharding`` instead;
- sweep rows that only name their collective or copy get ``op`` and ``bytes``.

Each file keeps its own JSON layout (indent, trailing newline). Run once from the repository
root: python bench/migrate_results.py
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SCHEMA_VERSION = 1
BUCKETS_SINCE = datetime.fromisoformat("2026-12-01T09:34:07+00:00")
MIB = re.compile(r"(\d+) MiB")


def layout(text: str, data: object) -> tuple[int | None, bool]:
    for indent in (2, 1, 4, None):
        dumped = json.dumps(data, indent=indent)
        if text in (dumped, dumped + "\n"):
            return indent, text.endswith("\n")
    raise SystemExit("no JSON layout reproduces the file")


def in_buckets(date: str) -> bool:
    when = datetime.fromisoformat(date)
    return (when if when.tzinfo else when.replace(tzinfo=UTC)) >= BUCKETS_SINCE


def sweep_row(row: dict) -> dict:
    if "op" in row or "measured_s" not in row:
        return row
    size = MIB.search(row["name"])
    extra = {"bytes": int(size.group(1)) * 2**20} if size and int(size.group(1)) else {}
    return {**row, "op": row["name"].split(" ", 1)[0], **extra}


def migrated(doc: dict) -> dict:
    doc = {"schema_version": SCHEMA_VERSION,
           "eager_step_in_buckets": in_buckets(doc["date"]), **doc}
    if "zero1" in doc and "optimizer_sharding" not in doc:  # in its place
        doc = {("optimizer_sharding" if k == "zero1" else k):
               (("zero1" if v else "none") if k == "zero1" else v) for k, v in doc.items()}
    if isinstance(doc.get("rows"), list):
        doc["rows"] = [sweep_row(r) if isinstance(r, dict) else r for r in doc["rows"]]
    return doc


def main() -> None:
    changed = 0
    for path in sorted(RESULTS.rglob("*.json")):
        text = path.read_text()
        doc = json.loads(text)
        if not isinstance(doc, dict) or "date" not in doc or "schema_version" in doc:
            print(f"left as it is: {path}")
            continue
        indent, newline = layout(text, doc)
        path.write_text(json.dumps(migrated(doc), indent=indent) + ("\n" if newline else ""))
        changed += 1
    print(f"migrated {changed} results")


if __name__ == "__main__":
    main()
