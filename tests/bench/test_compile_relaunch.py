"""bench/steps/compile_relaunch.py on CPU with a tiny eager plan (a smoke test of the script the
h200_steps campaign runs): two launches over one compile cache, each launch's first
step apart from its steady state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from dist_workers import make_plan  # noqa: E402


def test_compile_relaunch_script(tmp_path):
    plan, out = tmp_path / "p.json", tmp_path / "r.json"
    plan.write_text(make_plan().model_dump_json())
    r = subprocess.run(
        [sys.executable, "-m", "bench.steps.compile_relaunch", "--plan", str(plan), "--steps", "1",
         "--warmup", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert list(doc["launches"]) == ["cold", "relaunch"] and doc["world"] == 1
    for launch in doc["launches"].values():
        assert launch["status"] == "ok" and launch["wall_s"] > launch["first_step_s"] > 0
        assert launch["warmup_step_times_s"] == [launch["first_step_s"]]
        assert launch["step_median_s"] == launch["step_times_s"][0]
        # eager kernels: nothing compiled, nothing loaded
        nothing = {"hits": 0, "misses": 0, "aot_hits": 0, "aot_misses": 0, "aot_bypasses": 0}
        assert launch["compiled_graphs"]["first_step"] == nothing
    assert doc["target_met"] == (doc["launches"]["relaunch"]["first_step_s"] < 5.0)
    assert "relaunch" in r.stdout.splitlines()[-1]
