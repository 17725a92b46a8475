"""`moeplan sweep` (runtime/sweep.py) on CPU: gloo, 2 processes, tiny shapes (--smoke)."""

from __future__ import annotations


def test_sweep_measures_every_kind_calibrate_prices(tmp_path, python, smoke_run):
    """A row of every kind the fit reads, each with its shape and measured seconds and no
    prediction (calibrate prices every row itself); `moeplan calibrate` refuses the CPU sweep
    against the H200 base."""
    from planner.calibrate import row_seconds
    from plans.catalog import load_cluster
    from plans.results import Sweep, SweepOp, read

    out = smoke_run("sweep")
    sweep = read(Sweep, out, "sweep")
    assert sweep.world == 2 and sweep.commit
    assert {row.op for row in sweep.rows} == set(SweepOp)
    h200 = load_cluster("h200", gpus=2)
    for row in sweep.rows:
        assert row.measured_s > 0 and "predicted_s" not in row.model_extra, row.name
        assert row_seconds(row, h200) > 0, row.name
        if row.op in (SweepOp.gemm, SweepOp.grouped_mm, SweepOp.flash_attn,
                      SweepOp.attention_core, SweepOp.layer_op):
            assert row.shape and row.device_s > 0, row.name
    assert {row.layer_op for row in sweep.rows if row.op == SweepOp.layer_op} == {
        "attn_norm", "attn_residual", "router_topk", "dispatch_permute", "expert_swiglu",
        "combine_unpermute"}
    cluster = tmp_path / "c.yaml"
    r = python("-m", "planner.cli", "calibrate", "--collectives", str(out), "--out", str(cluster),
               "--json")
    assert r.returncode == 2 and not cluster.exists(), r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --collectives: measured on cpu, but --base H200-SXM's GPU is H200-SXM; "
        "calibrate against a base cluster of that device"]


def test_sweep_refuses_an_out_it_cannot_write_before_it_starts(tmp_path, python):
    out = tmp_path / "none" / "sweep.json"
    r = python("-m", "runtime.sweep", "--smoke", "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: --out: {out}: cannot write (folder {out.parent} does not exist)"]


def test_a_one_process_sweep_times_kernels_and_copies_only(tmp_path, python):
    """One process (one GPU): no collective rows, and the sweep is still a Sweep calibrate
    reads (its links then keep the base cluster's)."""
    from plans.results import Sweep, SweepOp, read

    out = tmp_path / "sweep.json"
    r = python("-m", "planner.cli", "sweep", "--smoke", "--nproc-per-node", "1", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    sweep = read(Sweep, out, "sweep")
    assert sweep.world == 1
    ops = {row.op for row in sweep.rows}
    assert not any(op.collective for op in ops) and SweepOp.copy in ops
