"""bench/layers/dispatch_gpu.py and bench/steps/speedup_report.py on CPU: gloo, 2 processes,
tiny shapes via flags (smoke tests of the scripts the GPU campaign runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "64", "--experts", "4", "--seq", "128", "--warmup", "1", "--repeats", "2"]


def _run(*cmd: str, procs: int = 2) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              str(procs)] if procs > 1 else [sys.executable]
    return subprocess.run([*launch, *cmd], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)


def test_dispatch_script(tmp_path):
    out = tmp_path / "d.json"
    r = _run("-m", "bench.layers.dispatch_gpu", *TINY, "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    for key in ("commit", "date", "torch", "gpu", "world", "backend", "dtype", "rows",
                "crossover_top_k", "prediction_sources", "tokens_per_rank"):
        assert key in res, key
    assert res["world"] == 2 and res["dtype"] == "float32" and res["tokens_per_rank"] == 64
    assert [row["top_k"] for row in res["rows"]] == [1, 2, 3, 4]
    for key in ("measured_fwd", "measured_fwd_bwd", "predicted_collectives",
                "predicted_layer_ops_fwd_bwd"):
        assert key in res["crossover_top_k"], key
    for row in res["rows"]:
        for d in ("a2a", "ag_rs"):
            m, pred = row[d]["measured"], row[d]["predicted"]
            assert m["fwd_s"] > 0 and m["fwd_bwd_s"] > 0 and m["collectives_fwd_s"] > 0
            assert pred["collectives"]["fwd_s"] > 0 and pred["layer_ops"]["fwd_bwd_s"] > 0
            assert len(pred["transfers"]) == 2
            assert all(t["measured_s"] > 0 for t in pred["transfers"])
        # all-to-all carries k x tokens rows; all-gather n x tokens, whatever k
        a2a = row["a2a"]["predicted"]["transfers"][0]["buffer_bytes"]
        ag = row["ag_rs"]["predicted"]["transfers"][0]["buffer_bytes"]
        assert a2a == 64 * row["top_k"] * 64 * 2 and ag == 2 * 64 * 64 * 2


def test_dispatch_sweep(tmp_path):
    out = tmp_path / "sweep.json"
    r = _run("-m", "bench.layers.dispatch_gpu", *TINY, "--max-top-k", "2",
             "--sweep-hidden", "32,64", "--sweep-experts", "4", "--sweep-seq", "64,128", "--out",
             str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    shapes = [(c["hidden"], c["experts"], c["tokens_per_rank"]) for c in res["configs"]]
    assert shapes == [(32, 4, 32), (32, 4, 64), (64, 4, 32), (64, 4, 64)]
    for c in res["configs"]:
        assert [row["top_k"] for row in c["rows"]] == [1, 2]
        for row in c["rows"]:
            assert row["a2a"]["measured"]["fwd_bwd_s"] > 0
            assert row["ag_rs"]["measured"]["fwd_bwd_s"] > 0


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
             "--out", str(out), procs=1)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["measured_speedup"] == 1.5 and res["predicted_speedup"] == 2.0
    assert res["measured_over_predicted"] == 0.75 and "commit" in res
    base.write_text(json.dumps({**run_json(1.5, 2.0), "step_time_s": "fast"}))
    r = _run("-m", "bench.steps.speedup_report", "--best", str(best), "--baseline", str(base),
             "--out", str(tmp_path / "t.json"), procs=1)
    assert r.returncode == 2 and "step_time_s" in r.stderr and not (tmp_path / "t.json").exists()


def test_fused_ops_script(tmp_path):
    """bench/kernels/fused_ops_gpu.py on CPU, one operator (CPU compilation dominates the time)."""
    out = tmp_path / "f.json"
    r = _run("-m", "bench.kernels.fused_ops_gpu", "--tokens", "64", "--seq", "32", "--hidden", "32",
             "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--ffn", "48",
             "--experts", "4", "--warmup", "1", "--repeats", "2", "--ops", "permute",
             "--out", str(out), procs=1)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["dtype"] == "float32" and res["shapes"]["tokens"] == 64
    (row,) = res["ops"].values()
    assert row["fwd_bytes"] == (64 + 128) * 32 * 4  # tokens read once, k x tokens rows written
    for kind in ("eager", "fused"):
        assert row[kind]["fwd_s"] > 0 and row[kind]["fwd_bwd_s"] > 0
    bad = _run("-m", "bench.kernels.fused_ops_gpu", "--ops", "nope", "--out", str(out), procs=1)
    assert bad.returncode == 2 and "argument --ops: invalid choice: 'nope'" in bad.stderr
