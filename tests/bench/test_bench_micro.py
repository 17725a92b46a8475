"""bench/steps/speedup_report.py and bench/kernels/fused_ops_gpu.py on CPU, tiny shapes via
flags (smoke tests of the scripts the GPU campaign runs; the dispatcher sweep's is
tests/runtime/test_dispatch_sweep.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)


def test_speedup_report(tmp_path):
    def run_json(step: float, pred: float) -> dict:
        return {"plan": "p", "plan_summary": "s", "step_time_s": step, "mfu": 0.5,
                "peak_memory_gib_per_rank": [1.0, 2.0], "measured_steps": 5,
                "prediction": {"step_time_s": pred, "mfu": 0.6, "tokens_per_s": 1.0,
                               "peak_memory_gib": 1.0, "breakdown_s": {}}}

    best, base = tmp_path / "b.json", tmp_path / "m.json"
    best.write_text(json.dumps(run_json(1.0, 1.0)))
    base.write_text(json.dumps(run_json(1.5, 2.0)))
    out = tmp_path / "s.json"
    r = _run("-m", "bench.steps.speedup_report", "--best", str(best), "--baseline", str(base),
             "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["measured_speedup"] == 1.5 and res["predicted_speedup"] == 2.0
    assert res["measured_over_predicted"] == 0.75 and "commit" in res
    base.write_text(json.dumps({**run_json(1.5, 2.0), "step_time_s": "fast"}))
    r = _run("-m", "bench.steps.speedup_report", "--best", str(best), "--baseline", str(base),
             "--out", str(tmp_path / "t.json"))
    assert r.returncode == 2 and "step_time_s" in r.stderr and not (tmp_path / "t.json").exists()


def test_fused_ops_script(tmp_path):
    """bench/kernels/fused_ops_gpu.py on CPU, one operator (CPU compilation dominates the time)."""
    out = tmp_path / "f.json"
    r = _run("-m", "bench.kernels.fused_ops_gpu", "--tokens", "64", "--seq", "32", "--hidden", "32",
             "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--ffn", "48",
             "--experts", "4", "--warmup", "1", "--repeats", "2", "--ops", "permute",
             "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["dtype"] == "float32" and res["shapes"]["tokens"] == 64
    (row,) = res["ops"].values()
    assert row["fwd_bytes"] == (64 + 128) * 32 * 4  # tokens read once, k x tokens rows written
    for kind in ("eager", "fused"):
        assert row[kind]["fwd_s"] > 0 and row[kind]["fwd_bwd_s"] > 0
    bad = _run("-m", "bench.kernels.fused_ops_gpu", "--ops", "nope", "--out", str(out))
    assert bad.returncode == 2 and "argument --ops: invalid choice: 'nope'" in bad.stderr
