"""What a measurement ran on: the result schema, commit, date, Python, machine, torch, GPU and
the facts of this runtime that price it (plans.results.MEASURED_UNDER). torch is imported only
when this is called, so torch-free benchmark scripts can stamp their results too."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

from plans.results import MEASURED_UNDER, SCHEMA_VERSION


def commit() -> str:
    """MOEPLAN_COMMIT when set (a tree sent to a GPU machine by `git archive`: the repository
    around it, if any, is not the one it came from), else git's short HEAD, else "unknown"."""
    if named := os.environ.get("MOEPLAN_COMMIT"):
        return named
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def metadata() -> dict:
    try:
        import torch

        torch_version = torch.__version__
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        torch_version, gpu = None, None
    # the collectives' switches the run was launched with (NVLink multicast off, record-stream
    # behaviour, ...): two runs of one commit differ by them
    switches = {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    return {
        "schema_version": SCHEMA_VERSION,
        **MEASURED_UNDER,
        "commit": commit(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch_version,
        "gpu": gpu,
        **({"nccl_switches": switches} if switches else {}),
    }
