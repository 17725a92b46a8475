"""`moeplan overlap` (runtime/beside.py) on CPU: 2 gloo processes, shapes scaled down
(--smoke)."""

from __future__ import annotations

import json


def test_two_ranks_write_both_shapes_and_say_why_the_copy_engine_is_missing(smoke_run):
    from plans.results import OverlapBench, read

    out = smoke_run("overlap")
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
    assert read(OverlapBench, out, "--overlap").world == 2  # what calibrate --overlap reads


def test_one_rank_is_refused_in_one_line(tmp_path, python):
    r = python("-m", "runtime.beside", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: WORLD_SIZE: this benchmark runs on exactly 2 ranks"]
    assert not (tmp_path / "x.json").exists()
