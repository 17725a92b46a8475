"""`moeplan parity` (runtime/parity.py) on CPU: 2 gloo processes, fp32 against the fp32
tolerances."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dist_workers import make_plan

ROOT = Path(__file__).resolve().parents[2]


def test_a_pipeline_layout_passes_in_fp32(tmp_path, python):
    plan = tmp_path / "p.json"
    plan.write_text(make_plan(pp=2, vpp=2, stage_layers=(1, 1, 1, 1)).model_dump_json())
    out = tmp_path / "r.json"
    r = python("-m", "planner.cli", "parity", str(plan), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["pass"] and res["precision"] == "fp32" and res["world"] == 2
    assert res["loss_rel_err"] < 1e-5 and res["grad_max_rel_err"] < 1e-4
    assert "commit" in res and not res["params_without_grad"]
    again = python("-m", "planner.cli", "parity", str(plan), "--out", str(out))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --out: {out} exists; pass --force to replace it"]


def test_ranks_take_turns_on_a_shared_device(tmp_path, python):
    # --share-gpu: both ranks on one device over gloo, references run one rank at a time
    plan = tmp_path / "p.json"
    plan.write_text(make_plan(sp=2, ep=2).model_dump_json())
    out = tmp_path / "r.json"
    r = python("-m", "planner.cli", "parity", str(plan), "--out", str(out), "--share-gpu")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["pass"] and res["backend"] == "gloo" and res["world"] == 2
    assert res["loss_rel_err"] < 1e-5 and res["grad_max_rel_err"] < 1e-4


def test_a_launch_of_the_wrong_size_is_refused_in_one_line(tmp_path, python):
    plan = tmp_path / "p.json"
    plan.write_text(make_plan(sp=2, ep=2).model_dump_json())
    out = tmp_path / "r.json"
    r = python("-m", "runtime.parity", "--plan", str(plan), "--out", str(out))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: degrees: plan needs 2 processes, launched with WORLD_SIZE=1"]
    assert not out.exists()


@pytest.mark.parametrize("module", ["runtime.parity", "runtime.memory_probe"])
def test_the_measurement_imports_neither_planner_nor_cost_models(module):
    code = (f"import sys, {module}\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('planner', 'cost_models')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
