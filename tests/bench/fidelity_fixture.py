"""TEST FIXTURE, not a measurement: synthetic micro-benchmark sweeps and train-step results
generated from the cost model itself with known ("true") efficiency factors, plus a
deterministic noise, so the calibration fits and the fidelity report can be checked end to end
where the truth is known. Nothing here is written under bench/results."""

from __future__ import annotations

import json
from pathlib import Path

import cost_models
from cost_models.memory import GIB
from planner.calibrate import on, row_seconds, with_efficiency
from plans import ClusterSpec, catalog
from plans.execution import Backend, executed_plan, record
from plans.results import Sweep, SweepOp, SweepRow

TRUTH = {"gemm": 0.72, "gemm_launch_us": 20.0, "grouped_gemm": 0.66,
         "grouped_gemm_half_rows": 120.0, "grouped_gemm_launch_us": 50.0,
         "grouped_gemm_stream_tb_s": 3.4,
         "attention": 0.47, "elementwise": 0.09, "elementwise_launch_us": 20.0, "hbm": 0.88,
         "nvlink": 0.6, "nvlink_all_to_all": 0.7}
TRUE_LATENCY_US = 40.0


def true_cluster(base: str = "h200", **overrides: float) -> ClusterSpec:
    c = with_efficiency(catalog.load_cluster(base), **{**TRUTH, **overrides})
    return c.model_copy(update={"node": c.node.model_copy(
        update={"nvlink_latency_us": TRUE_LATENCY_US})})


def wobble(i: int, noise: float) -> float:
    """+noise, -noise, +noise, ...: a deterministic error of both signs."""
    return 1 + noise * (-1) ** i


def _row(op: SweepOp, truth: ClusterSpec, **kw) -> SweepRow:
    row = SweepRow(name=op.value, op=op, measured_s=1.0, **kw)
    return row.model_copy(update={"measured_s": row_seconds(row, truth)})


def synthetic_sweep(truth: ClusterSpec, noise: float = 0.0, collectives: bool = False
                    ) -> Sweep:
    """Rows over the shapes bench/kernels/calibrate_gpu.py times, measured as the cost model prices
    them on ``truth`` (2 GPUs), times ``wobble``."""
    truth = truth.with_gpus(2)
    rows = []
    for m in (512, 2048, 8192):
        for n, k in ((4096, 4096), (28672, 4096), (2048, 1536)):
            for bwd in (False, True):
                rows.append(_row(SweepOp.gemm, truth, shape={"m": m, "n": n, "k": k},
                                 backward=bwd))
    for hidden, ffn in ((2048, 768), (4096, 14336)):
        for e in (8, 32, 128):
            for r in (32, 64, 128, 256, 512, 1024, 4096):
                if e * r > 65536 or (ffn > 8192 and e > 16):
                    continue
                for n, k in ((2 * ffn, hidden), (hidden, ffn)):
                    for bwd in (False, True):
                        rows.append(_row(SweepOp.grouped_mm, truth, backward=bwd, shape={
                            "experts": e, "rows": r, "n": n, "k": k}))
    for b, seq, heads in ((2, 4096, 32), (1, 8192, 8), (4, 2048, 16)):
        for bwd in (False, True):
            rows.append(_row(SweepOp.flash_attn, truth, backward=bwd, shape={
                "batch": b, "seq": seq, "heads": heads, "head_dim": 128}))
    for model in ("mixtral-8x7b", "qwen3-30b-a3b"):
        rows += [_row(SweepOp.attention_core, truth, backward=True, shape={
            "model": model, "batch": b, "seq": 4096, "heads": 32, "kv_heads": 8,
            "head_dim": 128}) for b in (1, 2)]
        for op in ("attn_norm", "attn_residual", "router_topk", "dispatch_permute",
                   "expert_swiglu", "combine_unpermute"):
            rows += [_row(SweepOp.layer_op, truth, backward=True, layer_op=op,
                          shape={"model": model, "tokens": t}) for t in (4096, 16384)]
    if collectives:
        for mib in (1, 4, 16, 64, 256):
            rows += [_row(SweepOp.copy, truth, bytes=mib * 2**20)]
            rows += [_row(op, truth, bytes=mib * 2**20) for op in
                     (SweepOp.all_to_all, SweepOp.all_gather, SweepOp.reduce_scatter)]
    rows = [r.model_copy(update={"measured_s": r.measured_s * wobble(i, noise)})
            for i, r in enumerate(rows)]
    return Sweep(world=2, rows=rows)


def write_suite(results: Path, plans: dict[str, Path], truth: ClusterSpec, noise: float,
                memory_under: float = 0.01, profiled: str | None = None) -> None:
    """calibration_h200.json and train_step_<case>.json for every plan: step time the cost
    model's on ``truth`` times ``wobble``, peak memory its prediction less ``memory_under``;
    and profile_<profiled>.json, its wall time the cost model's step of that plan."""
    results.mkdir(parents=True, exist_ok=True)
    sweep = synthetic_sweep(truth, collectives=True)
    (results / "calibration_h200.json").write_text(sweep.model_dump_json(by_alias=True))
    for i, (name, path) in enumerate(plans.items()):
        plan = catalog.load_plan(path)
        e = cost_models.evaluate(executed_plan(on(plan, truth)))
        ran = record(plan, Backend.cuda_nccl)  # what the run executed, as results record it
        doc = {"plan": str(path), "world": plan.degrees.world, "deviations": ran,
               "step_time_s": e.step_time_s * wobble(i, noise), "mfu": e.mfu,
               "peak_memory_gib_per_rank": [e.memory.peak_bytes / GIB / (1 - memory_under)],
               "measured_steps": 5, "synthetic_test_fixture": True}
        (results / f"train_step_{name}.json").write_text(json.dumps(doc))
        if name == profiled:
            profile = {"step_wall_s": e.step_time_s, "class_s": {}, "slowest": [],
                       "deviations": ran, "synthetic_test_fixture": True}
            (results / f"profile_{name}.json").write_text(json.dumps(profile))
