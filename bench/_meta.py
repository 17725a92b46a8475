"""Metadata every benchmark result carries: what ran, where, when, on which commit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plans.io import write_atomic  # noqa: E402
from runtime.provenance import metadata  # noqa: E402, F401  (re-exported to the scripts)

RESULTS = Path(__file__).parent / "results"


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    write_atomic(path, json.dumps({**metadata(), **payload}, indent=2) + "\n", name, force=True)
    return path
