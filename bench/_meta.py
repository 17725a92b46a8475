"""Metadata every benchmark result carries: what ran, where, when, on which commit."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def metadata() -> dict:
    # a tree sent to a GPU machine (`git archive`) names its commit in MOEPLAN_COMMIT; the
    # git repository around it, if any, is not the one it came from
    commit = os.environ.get("MOEPLAN_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                check=True, cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    try:
        import torch

        torch_version = torch.__version__
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        torch_version, gpu = None, None
    return {
        "commit": commit,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch_version,
        "gpu": gpu,
    }


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**metadata(), **payload}, indent=2) + "\n")
    return path
