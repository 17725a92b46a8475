"""`moeplan dispatch` (runtime/dispatch_sweep.py) on CPU: 2 gloo processes, a tiny grid
(--smoke)."""

from __future__ import annotations

import json


def test_two_ranks_time_both_dispatchers_at_every_shape_and_top_k(smoke_run):
    from planner import dispatch_fit as df
    from plans import catalog

    out = smoke_run("dispatch")
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and doc["backend"] == "gloo" and doc["dtype"] == "float32"
    assert "commit" in doc and "schema_version" in doc
    # the smoke grid: hidden 32, 64 x experts 4 x sequence 64, 128 (tokens per rank = seq / 2)
    shapes = [(c["hidden"], c["experts"], c["seq_len"], c["tokens_per_rank"])
              for c in doc["configs"]]
    assert shapes == [(32, 4, 64, 32), (32, 4, 128, 64), (64, 4, 64, 32), (64, 4, 128, 64)]
    for c in doc["configs"]:
        assert [row["top_k"] for row in c["rows"]] == [1, 2]
        assert set(c["crossover_top_k"]) == {"measured_fwd", "measured_fwd_bwd"}
        for row in c["rows"]:
            for d in ("a2a", "ag_rs"):
                # measurements only: the cost model prices them where they are read
                assert set(row[d]) == {"measured"}
                assert row[d]["measured"]["fwd_s"] > 0 and row[d]["measured"]["fwd_bwd_s"] > 0
    # what calibrate --dispatch reads, each point priced by planner.dispatch_fit
    sweep = df.load(out)
    pts = df.points(sweep, catalog.load_cluster("h200-runtime"), catalog.load_model(df.MODEL))
    assert len(pts) == 4 * 2 * 2 and all(p.collectives_s > 0 for p in pts)


def test_bad_input_is_refused_in_one_line(tmp_path, python):
    out = tmp_path / "x.json"
    r = python("-m", "runtime.dispatch_sweep", "--out", str(out))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: WORLD_SIZE: run under torchrun with at least 2 processes (the EP group)"]
    r = python("-m", "runtime.dispatch_sweep", "--out", str(out), "--experts", "3",
               WORLD_SIZE="2")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --experts: 2 ranks must divide 3"]
    assert not out.exists()


def test_the_measurement_imports_neither_planner_nor_cost_models(python):
    code = ("import sys, runtime.dispatch_sweep\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('planner', 'cost_models')]\n"
            "assert not bad, bad\n")
    r = python("-c", code)
    assert r.returncode == 0, r.stderr
