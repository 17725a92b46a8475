"""bench/layers/attention_block_gpu.py on CPU: gloo, 1 and 2 processes, tiny shapes via flags (smoke
tests of the script the h200_layers campaign runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "64", "--ffn-hidden", "128", "--experts", "4", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "16", "--vocab", "128", "--seq", "64", "--batch", "2",
        "--warmup", "1", "--repeats", "2"]


def _run(procs: int, *args: str) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              str(procs)] if procs > 1 else [sys.executable]
    return subprocess.run([*launch, "-m", "bench.layers.attention_block_gpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("procs", [1, 2])
def test_attention_block_script(tmp_path, procs):
    out = tmp_path / "a.json"
    r = _run(procs, *TINY, "--kernels", "eager", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["world"] == procs and res["dtype"] == "float32"
    assert set(res["models"]) == {"mixtral-8x7b", "qwen3-30b-a3b"}
    for row in res["models"].values():
        assert row["tokens_per_rank"] == 2 * 64 // procs and row["hidden"] == 64
        assert row["head_groups"] == 1  # 2 KV heads: one a rank at SP = 2
        assert set(row["variants"]) == {"eager/none", "eager/selective"}
        for v in row["variants"].values():
            assert v["block_s"] > 0 and "head_groups" not in v
            pred = v["predicted"]  # the cost model's block for the same plan
            assert pred["block_s"] > pred["comm_s"] >= 0 and (pred["comm_s"] > 0) == (procs > 1)
            assert (pred["recompute_s"] > 0) == (v["recompute"] == "selective")
            if procs > 1:
                assert v["compute_alone_s"] > 0
                assert v["exposed_comm_s"] == pytest.approx(v["block_s"] - v["compute_alone_s"])
        assert ("comm_alone_s" in row) == (procs > 1)
    assert res["models"]["qwen3-30b-a3b"]["qk_norm"] is True


HEAD_GROUPS = [*TINY, "--heads", "8", "--kv-heads", "4", "--head-dim", "8", "--kernels",
               "eager"]
"""Two KV heads a rank at SP = 2: two head groups."""


@pytest.mark.parametrize("procs, simulate", [(2, 1), (1, 2)], ids=["sp2", "simulated_sp2"])
def test_attention_block_script_in_head_groups(tmp_path, procs, simulate):
    """Where plans.layout.ulysses_chunks splits the heads, each variant also runs the block
    under inter_op (ChunkedUlyssesCore): at SP = 2 over gloo with its exposed all-to-alls; on
    one process, simulating an SP = 2 rank, the compute alone of both cores."""
    out = tmp_path / "a.json"
    r = _run(procs, *HEAD_GROUPS, "--simulate-sp", str(simulate), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["simulated_sp"] == simulate
    for row in res["models"].values():
        assert row["sp"] == 2 and row["head_groups"] == 2 and row["tokens_per_rank"] == 64
        assert ("head_groups_comm_alone_s" in row) == (procs > 1)
        for v in row["variants"].values():
            g = v["head_groups"]
            assert g["groups"] == 2 and g["compute_alone_s"] > 0 and v["compute_alone_s"] > 0
            assert g["compute_alone_device_s"] > 0 and v["compute_alone_device_s"] > 0
            assert g["compute_alone_host_s"] > 0 and v["compute_alone_host_s"] > 0
            assert ("block_s" in g) == ("block_s" in v) == (procs > 1)
            if procs > 1:
                assert g["exposed_comm_s"] == pytest.approx(g["block_s"] - g["compute_alone_s"])
            # the cost model's groups: the same bytes in twice the calls, priced on 2 streams
            assert g["predicted"]["comm_s"] > v["predicted"]["comm_s"] > 0


def test_attention_block_compute_alone_has_the_block_shapes():
    """The all-to-alls' local stand-ins change the layout as the exchange does ([b, s/n, H, d]
    -> [b, s, H/n, d] and back) and, one after the other, give back their input."""
    import torch

    from bench.layers.attention_block_gpu import local_head_to_seq, local_seq_to_head

    x = torch.randn(2, 8, 6, 4)
    heads = local_seq_to_head(x, 2)
    assert heads.shape == (2, 16, 3, 4)
    assert torch.equal(heads[:, :8], x[:, :, :3]) and torch.equal(heads[:, 8:], x[:, :, 3:])
    assert torch.equal(local_head_to_seq(heads, 2), x)


@pytest.mark.parametrize("bad", [["--heads", "3"], ["--simulate-sp", "0"],
                                 ["--simulate-sp", "3"]])
def test_attention_block_bad_shape_is_one_line(tmp_path, bad):
    r = _run(1, *TINY, *bad, "--out", str(tmp_path / "a.json"))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "a.json").exists()
