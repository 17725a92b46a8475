"""bench/kernels/copy_engine_gpu.py on CPU: 2 gloo processes, shapes scaled down (smoke test of the
script the copy-engine spike runs on 2 H200s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(procs: int, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(procs), "-m", "bench.kernels.copy_engine_gpu", "--out", str(out), "--scale", "0.02",
         "--warmup", "1", "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_ranks_write_both_shapes_and_say_why_the_copy_engine_is_missing(tmp_path):
    out = tmp_path / "ce.json"
    r = _run(2, out)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and doc["backend"] == "gloo"
    assert [row["shape"]["name"] for row in doc["rows"]] == ["mixtral-8x7b", "qwen3-30b-a3b"]
    for row in doc["rows"]:
        s = row["shape"]
        # EP = 2, balanced: half the routed rows go to the peer (fp32 on CPU: 4 bytes)
        assert row["bytes_to_peer"] == s["tokens"] * s["top_k"] // 2 * s["hidden"] * 4
        assert row["compute_s"] > 0 and row["nccl_s"] > 0
        assert row["nccl_overlap_ratio"] == (
            row["nccl_beside_compute_s"] / max(row["compute_s"], row["nccl_s"]))
        assert row["copy_engine"] == {"status": "unavailable",
                                      "reason": "no CUDA IPC on CPU"}


def test_one_rank_is_refused_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.kernels.copy_engine_gpu", "--out",
                        str(tmp_path / "x.json")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: WORLD_SIZE: this benchmark runs on exactly 2 ranks"]
    assert not (tmp_path / "x.json").exists()
