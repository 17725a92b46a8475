"""Every bench script answers -h with its usage and writes nothing: the generators among them
(results and plans recomputed from the committed code) used to run on any argument and rewrite
what they own, measured plans included (bench/memory/memory_searched.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                 for p in (ROOT / "bench").rglob("*.py")
                 if not p.name.startswith("_") and "__main__" in p.read_text())


def _tree_state() -> dict[str, tuple[int, int]]:
    """Size and modification time of every file under bench/ (bytecode caches aside)."""
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns)
            for f in (ROOT / "bench").rglob("*") if f.is_file() and "__pycache__" not in f.parts}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_usage_and_writes_nothing(script):
    before = _tree_state()
    r = subprocess.run([sys.executable, "-m", script, "-h"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("usage:"), r.stdout[:200]
    assert _tree_state() == before
