"""Metadata every benchmark result carries: what ran, where, when, on which commit."""

from __future__ import annotations

import json
from pathlib import Path

from plans.io import write_atomic
from runtime.provenance import metadata

RESULTS = Path(__file__).parent / "results"


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    write_atomic(path, json.dumps({**metadata(), **payload}, indent=2) + "\n", name, force=True)
    return path
