"""bench.steps.peer_step_gpu --tiny on CPU, end to end: our runtime's plan and torchtitan's model
and step at tiny widths on the same tokens (skipped where torchtitan cannot be imported; the
0.3.0 wheel and its deps from .whl/ go on PYTHONPATH for this test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _torchtitan_importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torchtitan.models.qwen3"],
                           capture_output=True, timeout=120)
    return probe.returncode == 0


@pytest.mark.skipif(not _torchtitan_importable(), reason="torchtitan is not importable")
def test_peer_step_tiny(tmp_path):
    out = tmp_path / "peer.json"
    r = subprocess.run(
        [sys.executable, "-m", "bench.steps.peer_step_gpu", "--tiny", "--models", "deepseekmoe",
         "deepseek-v3", "--warmup", "1", "--steps", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["tiny"] and res["steps"] == 2 and res["wheels"]["torchtitan"] == "0.3.0"
    assert {"gpu", "torch", "commit", "date"} <= set(res)
    row = res["models"]["deepseekmoe"]
    # both models hold the same parameters (the script refuses a gap above 0.5%)
    assert row["params"]["ours"] == row["params"]["torchtitan"] > 0
    for side in ("ours", "peer"):
        assert row[side]["status"] == "ok", row[side]
        assert len(row[side]["step_times_s"]) == len(row[side]["losses"]) == 2
        assert row[side]["first_step_s"] > 0 and row[side]["mfu"] > 0
        assert all(4.0 < loss < 7.0 for loss in row[side]["losses"])  # ~ln(256) at init
    assert row["peer"]["settings"]["ac"] == "selective"
    assert row["speedup_vs_torchtitan"] == (row["peer"]["step_time_s"]
                                            / row["ours"]["step_time_s"])
    # DeepSeek-V3 needs MLA, which our runtime refuses (plans.execution): recorded, not run
    v3 = res["models"]["deepseek-v3"]
    assert v3["status"] == "skipped" and "model.mla" in v3["reason"]


@pytest.mark.parametrize("card", ["h200", "h100"])
def test_the_capped_plans_hold_our_predicted_allocated_peak_to_torchtitans_measured_one(card):
    """bench/gpu_plans/peer_capped/ and peer_capped_h100/ (bench.steps.peer_plans): each job's
    plan is the fastest of the search on the card's calibrated cluster whose predicted
    allocated peak (its peak less the allocator's reserve: what torch.cuda.max_memory_allocated
    measures, on both sides) is at most torchtitan's measured peak on it on that card (its
    blocks compiled); a job without a plan there has none."""
    from bench.steps.peer_plans import CARDS, JOBS, allocated_gib, capped_plan, path_of
    from plans.catalog import load_cluster, load_plan

    for shape in JOBS:
        picked, cap = capped_plan(shape, card)
        if not path_of(shape, 1, card).exists():
            assert picked is None
            continue
        plan = load_plan(path_of(shape, 1, card))
        assert plan.cluster.name == load_cluster(CARDS[card][0]).name
        assert allocated_gib(plan) <= cap
        assert plan.summary() == picked.summary()
        assert plan.prediction.step_time_s == pytest.approx(picked.prediction.step_time_s)


def test_a_model_without_a_capped_plan_is_recorded_as_skipped(tmp_path, monkeypatch):
    """--plans capped for a job bench.steps.peer_plans found no plan for: skipped, naming it."""
    from types import SimpleNamespace

    from bench.steps import peer_step_gpu

    absent = tmp_path / "qwen4l_1gpu.json"
    monkeypatch.setitem(peer_step_gpu.PLAN_SETS["capped"], "qwen3-30b-a3b", absent)
    row = peer_step_gpu.run_model("qwen3-30b-a3b", SimpleNamespace(plans="capped"), None)
    assert row["status"] == "skipped" and "qwen4l_1gpu.json absent" in row["reason"]


def test_peer_step_runs_our_capped_plan(tmp_path):
    """--plans capped: ours runs the plan of bench/gpu_plans/peer_capped/ (here at tiny widths,
    without torchtitan), the row names the set and the plan."""
    out = tmp_path / "peer.json"
    r = subprocess.run(
        [sys.executable, "-m", "bench.steps.peer_step_gpu", "--tiny", "--models", "mixtral-8x7b",
         "--plans", "capped", "--no-peer", "--warmup", "1", "--steps", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(out.read_text())["models"]["mixtral-8x7b"]
    assert row["plans"] == "capped" and "peer_capped" in row["plan"]
    assert row["ours"]["status"] == "ok" and row["peer"]["status"] == "skipped"
