"""Metadata every benchmark result carries: what ran, where, when, on which commit."""

from __future__ import annotations

import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from plans.io import write_atomic
from runtime.provenance import metadata

RESULTS = Path(__file__).parent / "results"
EXIT_BAD_INPUT = 2


def bad_input(message: str, rank: int = 0) -> int:
    """``error: message`` on stderr from rank 0 (one line a launch); the bad-input status."""
    if rank == 0:
        print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def write(name: str, payload: dict) -> Path:
    path = RESULTS / f"{name}.json"
    write_result(path, payload, name)
    return path


def package_version(package: str) -> str | None:
    """The installed version of ``package`` (a peer's, beside ours), None where it is absent."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_result(out: Path, doc: dict, what: str = "--out", indent: int = 2) -> None:
    """``doc`` after the metadata every result carries, written to ``out`` (a benchmark's
    ``--out``: the one output convention) in one step, its folder made."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps({**metadata(), **doc}, indent=indent) + "\n", what, force=True)
