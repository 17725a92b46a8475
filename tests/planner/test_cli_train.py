"""A plan written by `moeplan search` for a small cluster trains end to end under `moeplan
train` (torchrun, gloo on this CPU machine)."""

import json
import os
import subprocess
import sys


def test_search_then_train(tmp_path):
    """Eager kernels: four ranks compiling fused ones on a CPU machine take minutes
    (tests/runtime/test_kernels.py holds fused against eager)."""
    plan = tmp_path / "tiny.json"
    log = tmp_path / "metrics.jsonl"
    moeplan = [sys.executable, "-m", "planner.cli"]
    found = subprocess.run([*moeplan, "search", "tiny-moe", "h200", "--gpus", "4",
                            "--global-batch", "8", "--seq-len", "256", "--kernels", "eager",
                            "--out", str(plan)],
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    cache = tmp_path / "compile_cache"
    trained = subprocess.run([*moeplan, "train", str(plan), "--steps", "2", "--log", str(log),
                              "--compile-cache", str(cache)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert trained.returncode == 0, trained.stderr[-3000:]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["loss"] > 0 and s["tokens_per_s"] > 0 for s in steps)
    # the launcher hands the cache folder to every rank; the summary names it
    assert cache.is_dir() and f"compile cache {cache.resolve()}" in trained.stdout


def test_train_refuses_a_launch_that_does_not_match_the_plan(tmp_path):
    plan = tmp_path / "tiny.json"
    subprocess.run([sys.executable, "-m", "planner.cli", "search", "tiny-moe", "h200", "--gpus",
                    "2", "--global-batch", "8", "--seq-len", "256", "--out", str(plan)],
                   check=True, capture_output=True, timeout=120)
    result = subprocess.run([sys.executable, "-m", "planner.cli", "train", str(plan),
                             "--nproc-per-node", "3"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: --nproc-per-node: 3 processes")
    assert "Traceback" not in result.stderr


def test_json_stdout_is_pure_json_in_a_real_process():
    """Nothing but the JSON document reaches stdout in a real process."""
    result = subprocess.run([sys.executable, "-m", "planner.cli", "search", "mixtral-8x7b", "h100",
                             "--gpus", "16", "--global-batch", "32", "--seq-len", "4096",
                             "--top", "2", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["top"][0]["step_time_s"] > 0
