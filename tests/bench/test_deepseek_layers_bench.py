"""bench.layers.deepseek_layers_gpu on CPU with --tiny (smoke test of the script the
h200_layers campaign runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_deepseek_layers_script_runs_tiny_and_writes_the_prediction_beside(tmp_path):
    out = tmp_path / "v3.json"
    r = subprocess.run([sys.executable, "-m", "bench.layers.deepseek_layers_gpu", "--tiny",
                        "--kernels", "eager", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    for key in ("commit", "date", "torch", "gpu", "device", "model", "rows"):
        assert key in res, key
    assert res["model"]["mla"] and res["model"]["router_score"] == "sigmoid"
    assert [row["block"] for row in res["rows"]] == ["attention", "moe"]
    for row in res["rows"]:
        assert row["measured_fwd_bwd_s"] > 0 and row["predicted_fwd_bwd_s"] > 0
        assert row["ratio"] == row["measured_fwd_bwd_s"] / row["predicted_fwd_bwd_s"]
        assert row["measured_classes_s"] and row["measured_kernels"]
    attention, moe = (row["predicted_operators_s"] for row in res["rows"])
    assert attention["flash_attn"] > 0 and "expert_fc13" not in attention
    assert moe["expert_fc13"] > 0 and "flash_attn" not in moe
    counts = res["rows"][1]["rows_per_expert"]
    assert len(counts) == res["model"]["experts"]
    assert sum(counts) == res["batch"] * res["seq"] * res["model"]["top_k"]

