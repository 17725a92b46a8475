"""bench/kernels/expert_paths_gpu.py on CPU, shapes divided down (a smoke test of the script the
h200_kernels campaign runs): every ExpertGemm path and the references timed, the
fastest path named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from plans.enums import ExpertGemm

ROOT = Path(__file__).resolve().parents[2]


def test_expert_paths_script(tmp_path):
    out = tmp_path / "e.json"
    r = subprocess.run(
        [sys.executable, "-m", "bench.kernels.expert_paths_gpu", "--shapes", "mixtral-8x7b",
         "qwen3-30b-a3b", "--tokens", "16", "--scale", "256", "--kernels", "eager",
         "--warmup", "0", "--repeats", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["dtype"] == "float32" and doc["tokens"] == 16 and doc["kernels"] == "eager"
    assert list(doc["shapes"]) == ["mixtral-8x7b", "qwen3-30b-a3b"]
    row = doc["shapes"]["mixtral-8x7b"]
    assert (row["experts"], row["hidden"], row["ffn_hidden"], row["top_k"]) == (
        8, 4096 // 256, 14336 // 256, 2)
    assert row["rows"] == 16 * 2 == sum(row["rows_per_expert"])
    assert set(row["paths"]) == {*ExpertGemm, "grouped_w13_stored", "dense"}
    assert all(t["fwd_s"] > 0 and t["fwd_bwd_s"] > 0 for t in row["paths"].values())
    assert row["fastest"] in set(ExpertGemm)
    assert "fwd+bwd ms" in r.stdout
