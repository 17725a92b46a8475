"""bench/layers/moe_layer_gpu.py on CPU: gloo, 1 and 2 processes, shapes divided down (smoke tests
of the script the h200_layers campaign runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--tokens", "64", "--scale", "64", "--warmup", "1", "--repeats", "1", "--no-peer"]


def _run(procs: int, *args: str) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              str(procs)] if procs > 1 else [sys.executable]
    return subprocess.run([*launch, "-m", "bench.layers.moe_layer_gpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("procs, shape, gemm", [(1, "qwen3-30b-a3b", "grouped"),
                                               (2, "mixtral-8x7b", "per_expert")])
def test_moe_layer_script(tmp_path, procs, shape, gemm):
    out = tmp_path / "m.json"
    r = _run(procs, "--shapes", shape, *SMALL, "--expert-gemm", gemm, "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["world"] == procs and res["dtype"] == "float32" and res["inter_op_chunks"] == 2
    assert res["expert_gemm"] == gemm
    row = res["shapes"][shape]
    assert row["tokens_per_rank"] == 64 and row["hidden"] in (4096 // 64, 2048 // 64)
    assert row["peer"] == {"status": "skipped", "reason": "--no-peer"}
    labels = ("local",) if procs == 1 else ("a2a", "ag_rs")
    assert {k for k in row if k in ("local", "a2a", "ag_rs")} == set(labels)
    for label in labels:
        times = row[label]["fwd_bwd_s"]
        expect = {"serial", "compute_alone"} | (
            {"inter_op", "comm_alone", "overlap_target"} if procs > 1 else set())
        assert set(times) == expect
        assert all(times[k] > 0 for k in expect - {"overlap_target"})
        if procs > 1:
            target = times["overlap_target"]
            bound = max(times["compute_alone"], times["comm_alone"])
            assert target["bound_s"] == bound
            assert target["met"] == (times["inter_op"] <= 1.1 * bound)


def test_moe_layer_script_with_gradient_accumulation_fusion(tmp_path):
    """--grad-accumulation-fusion: our layer with the runtime's accumulating GEMMs runs every
    variant at EP = 2 and says so in its result."""
    out = tmp_path / "m.json"
    r = _run(2, "--shapes", "mixtral-8x7b", *SMALL, "--grad-accumulation-fusion",
             "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["grad_accumulation_fusion"] is True
    for label in ("a2a", "ag_rs"):
        times = res["shapes"]["mixtral-8x7b"][label]["fwd_bwd_s"]
        assert all(times[k] > 0 for k in ("serial", "inter_op", "compute_alone"))
