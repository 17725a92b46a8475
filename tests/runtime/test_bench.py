"""bench/steps/train_step.py and runtime.profile on CPU (gloo; smoke tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_workers import make_plan

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", script, *args]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=180)


def test_train_step_writes_measurement(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(make_plan(sp=2, ep=2).model_dump_json())
    out = tmp_path / "r.json"
    r = _torchrun("bench.steps.train_step", "--plan", str(plan), "--steps", "2", "--warmup", "1",
                  "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    for key in ("commit", "date", "torch", "gpu", "step_time_s", "tokens_per_s", "mfu",
                "peak_memory_gib_per_rank", "components_s", "components_s_per_rank",
                "flops_per_token", "measured_steps"):
        assert key in res, key
    assert len(res["peak_memory_gib_per_rank"]) == 2 and res["measured_steps"] == 2
    for key in ("attention_comm", "attention_comm_bwd", "dispatch", "combine_bwd",
                "expert_compute", "grad_sync", "optimizer", "forward", "backward"):
        assert key in res["components_s"], key
    assert res["components_s"]["dispatch"] > 0 and res["components_s"]["attention_comm_bwd"] > 0
    assert res["ulysses_head_groups"] == 1  # overlap none: the Ulysses all-to-alls block
    # max / mean routed slots per expert, logged by the runtime each step
    assert 1 <= res["routing_skew"] <= res["routing_skew_max"] <= make_plan().model.experts
    # every routed copy is computed by one EP rank's experts (dropless): the ranks' rows add up
    # to the measured steps' tokens x top-k x MoE layers; the busiest over the mean
    spec = make_plan().model
    rows = res["expert_rows_per_rank"]
    assert sum(rows) == 2 * res["tokens_per_step"] * spec.top_k * spec.moe_layers
    assert res["ep_rank_load_step"] == pytest.approx(max(rows) * 2 / sum(rows))
    # per layer: each layer's rows add up to its routed copies; its busiest rank over the mean,
    # averaged over layers, is never below the whole step's
    layers = res["expert_rows_per_rank_layer"]
    assert [sum(r) for r in layers] == rows and len(layers[0]) == spec.moe_layers
    per_layer = [max(x) * 2 / sum(x) for x in zip(*layers, strict=True)]
    assert all(sum(x) == 2 * res["tokens_per_step"] * spec.top_k for x in zip(*layers, strict=True))
    assert res["ep_rank_load_layer"] == pytest.approx(sum(per_layer) / len(per_layer))
    assert 1 <= res["ep_rank_load_step"] <= res["ep_rank_load_layer"] + 1e-12 <= 2 + 1e-12


def test_profile_splits_the_step_into_kernel_classes(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(make_plan().model_dump_json())
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "runtime.profile", "--plan", str(plan), "--out",
                        str(out), "--steps", "1", "--warmup", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert 0 < res["device_busy_s"] and res["step_wall_s"] > 0
    assert sum(res["class_s"].values()) == pytest.approx(res["device_busy_s"])
    assert res["kernel_calls_per_step"] >= sum(k["calls_per_step"] for k in res["slowest"]) > 0
    assert res["slowest"] and {"name", "class", "calls_per_step", "s_per_step"} <= set(
        res["slowest"][0])


def test_profile_refuses_a_plan_for_several_gpus(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(make_plan(sp=2).model_dump_json())
    r = subprocess.run([sys.executable, "-m", "runtime.profile", "--plan", str(plan), "--out",
                        str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: degrees:")
    assert "Traceback" not in r.stderr and not (tmp_path / "r.json").exists()


def test_train_step_measures_several_plans_in_one_launch(tmp_path):
    """--plans: each plan of the launch's world size measured in the same processes, one
    result per plan file; a plan for another GPU count is skipped."""
    names = {"a": make_plan(sp=2, ep=2), "b": make_plan(dp=2, ep=2), "one": make_plan()}
    for name, plan in names.items():
        (tmp_path / f"{name}.json").write_text(plan.model_dump_json())
    out = tmp_path / "results"
    r = _torchrun("bench.steps.train_step",
                  "--plans", *(str(tmp_path / f"{n}.json") for n in names),
                  "--steps", "1", "--warmup", "1", "--out-dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["train_step_a.json", "train_step_b.json"]
    for name in ("a", "b"):
        res = json.loads((out / f"train_step_{name}.json").read_text())
        assert res["plan_summary"] == names[name].summary() and res["world"] == 2
        assert res["measured_steps"] == 1 and res["step_time_s"] > 0


def test_memory_cap_needs_a_gpu_and_says_so_in_one_line(tmp_path):
    """bench/memory/memory_cap.py caps a CUDA allocator: on CPU it stops before any work, exit 2."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would run for real")
    out = tmp_path / "cap.json"
    r = subprocess.run([sys.executable, "-m", "bench.memory.memory_cap", "--plan",
                        "bench/gpu_plans/fidelity/mixtral2l_1gpu_mbs1.json", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: memory_cap.py caps a CUDA device's allocator; no GPU here"]
    assert not out.exists()
