"""Calibrate a cluster's efficiency factors to measurements of this runtime on its GPUs.

    python bench/calibrate_runtime.py \
        --profile bench/results/h200/profile_mixtral2l_1gpu.json \
        --plan bench/gpu_plans/mixtral2l_1gpu.json \
        --collectives bench/results/calibration_h200.json --base h200 \
        --name H200-SXM-runtime --out plans/catalog/clusters/h200-runtime.yaml

One profiled 1-GPU training step (bench/profile_step.py) and the 2-GPU collective sweep
(bench/calibrate_gpu.py) set the factors; every other measured run is held out to test them
(bench/gpu_fidelity.py --cluster). The cost model never imports torch: this runs anywhere.

- gemm, grouped_gemm, attention: the base factor times predicted / measured kernel time of that
  class over the profiled step (the plan priced as the runtime executed it).
- hbm: the median achieved bandwidth of the large copies over the GPU's peak.
- elementwise: what is left of the measured step once everything else is priced: the step is
  T0 + E / elementwise (E the layer's memory-bound bytes at full bandwidth), solved for it.
- node.nvlink_latency_us, nvlink, nvlink_all_to_all: a latency + bytes / bandwidth fit (least
  squares on log time) of the all-gather / reduce-scatter and all-to-all sweeps.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import yaml  # noqa: E402

import cost_models  # noqa: E402
from cost_models import comm  # noqa: E402
from cost_models import compute as cc  # noqa: E402
from cost_models.layer import layer_key  # noqa: E402
from cost_models.layer_graph import OpKind, backward_graph, forward_graph  # noqa: E402
from plans import ClusterSpec, Plan, Precision, catalog  # noqa: E402
from runtime.deviations import executed_plan  # noqa: E402 (no torch)

GROUPED = re.compile(r"grouped|GroupProblemShape|group_gemm", re.IGNORECASE)
MEMORY_CLASSES = ("elementwise", "copy", "reduction_index_sort", "other")


def with_efficiency(cluster: ClusterSpec, **factors: float) -> ClusterSpec:
    return cluster.model_copy(update={"efficiency": cluster.efficiency.model_copy(update=factors)})


def on(plan: Plan, cluster: ClusterSpec) -> Plan:
    return plan.model_copy(update={"cluster": cluster.model_copy(
        update={"gpus": plan.cluster.gpus})})


def measured_classes(profile: dict) -> dict[str, float]:
    """Seconds per step of grouped GEMMs, dense GEMMs, attention and memory-bound kernels.
    Grouped GEMM kernels are picked out of the GEMM class by name (CUTLASS grouped kernels are
    named after their GroupProblemShape)."""
    classes = dict(profile["class_s"])
    moved = sum(k["s_per_step"] for k in profile["slowest"]
                if GROUPED.search(k["name"]) and k["class"] != "grouped_gemm")
    grouped = classes.get("grouped_gemm", 0.0) + moved
    return {
        "grouped_gemm": grouped,
        "gemm": classes.get("gemm", 0.0) - moved,
        "attention": classes.get("attention", 0.0),
        "memory": sum(classes.get(c, 0.0) for c in MEMORY_CLASSES),
    }


def predicted_classes(plan: Plan) -> dict[str, float]:
    """Seconds per step of the cost model's GEMM, grouped GEMM and attention operators (layers
    fwd + bwd over every micro-batch, plus the LM head's GEMMs)."""
    key = layer_key(plan)
    fwd = forward_graph(key)
    bwd = backward_graph(fwd, key.recompute)
    per_layer = {"gemm": 0.0, "grouped_gemm": 0.0, "attention": 0.0}
    kinds = {OpKind.gemm: "gemm", OpKind.grouped_gemm: "grouped_gemm",
             OpKind.attention: "attention"}
    for graph in (fwd, bwd):
        for _, data in graph.nodes(data=True):
            if (label := kinds.get(data["op"].kind)) is not None:
                per_layer[label] += data["duration_s"]
    m, c = plan.num_micro_batches, plan.cluster
    out = {k: v * plan.model.layers * m for k, v in per_layer.items()}
    h, v = plan.model.hidden, plan.model.vocab
    tokens = plan.micro_batch_size * plan.training.seq_len
    head = (cc.gemm_s(tokens, v, h, c, Precision.bf16) + cc.gemm_s(tokens, h, v, c, Precision.bf16)
            + cc.gemm_s(h, v, tokens, c, Precision.bf16))
    out["gemm"] += head * m
    return out


def fit_compute(profile: dict, plan: Plan, base: ClusterSpec) -> dict[str, float]:
    if plan.degrees.world != 1:
        raise SystemExit("error: --plan: calibrate on a 1-GPU plan (no communication)")
    ran = executed_plan(on(plan, base))
    meas, pred = measured_classes(profile), predicted_classes(ran)
    eff = base.efficiency
    factors = {k: min(1.0, getattr(eff, k) * pred[k] / meas[k])
               for k in ("gemm", "grouped_gemm", "attention") if meas[k] > 0}
    cluster = with_efficiency(base, **factors)

    def step(elementwise: float) -> float:
        c = with_efficiency(cluster, elementwise=elementwise)
        return cost_models.evaluate(executed_plan(on(plan, c))).step_time_s

    t1, t_half = step(1.0), step(0.5)
    ideal = t_half - t1  # E: the layers' memory-bound bytes at full bandwidth
    rest = t1 - ideal
    left = profile["step_wall_s"] - rest
    factors["elementwise"] = min(1.0, ideal / left) if left > ideal else 1.0
    return factors


def _size(name: str) -> float:
    return float(re.search(r"(\d+) MiB", name).group(1)) * 2**20


def fit_collectives(sweep: dict, base: ClusterSpec) -> dict[str, float]:
    """Latency (us) and NVLink efficiencies that best fit the measured collectives."""
    world = sweep["world"]
    layout = comm.group_layout(world, 1, base.node.gpus_per_node)
    rings = [(r, _size(r["name"])) for r in sweep["rows"]
             if r["name"].startswith(("all_gather", "reduce_scatter"))]
    a2a = [(r, _size(r["name"])) for r in sweep["rows"] if r["name"].startswith("all_to_all")]

    def error(latency_us: float, ring_eff: float, a2a_eff: float) -> float:
        c = with_efficiency(base, nvlink=ring_eff, nvlink_all_to_all=a2a_eff).model_copy(
            update={"node": base.node.model_copy(update={"nvlink_latency_us": latency_us})})
        err = 0.0
        for r, size in rings:
            f = comm.all_gather_s if r["name"].startswith("all_gather") else comm.reduce_scatter_s
            err += math.log(f(size, layout, c) / r["measured_s"]) ** 2
        for r, size in a2a:
            err += math.log(comm.all_to_all_s(size, layout, c) / r["measured_s"]) ** 2
        return err

    effs = [e / 100 for e in range(20, 101)]
    best = None
    for latency in range(0, 301, 2):
        ring = min(effs, key=lambda e, lat=latency: error(lat, e, 0.65))
        alltoall = min(effs, key=lambda e, lat=latency: error(lat, ring, e))
        candidate = (error(latency, ring, alltoall), latency, ring, alltoall)
        best = min(best, candidate) if best else candidate
    _, latency, ring, alltoall = best
    return {"nvlink_latency_us": float(latency), "nvlink": ring, "nvlink_all_to_all": alltoall}


def fit_hbm(sweep: dict, base: ClusterSpec) -> float:
    achieved = [r["achieved_tb_s"] for r in sweep["rows"] if r["name"].startswith("copy")]
    return min(1.0, statistics.median(achieved) / base.gpu.hbm_tb_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--collectives", type=Path, required=True)
    ap.add_argument("--base", default="h200", help="catalog cluster or YAML to start from")
    ap.add_argument("--name", default="H200-SXM-runtime")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    base = catalog.load_cluster(args.base)
    profile = json.loads(args.profile.read_text())
    sweep = json.loads(args.collectives.read_text())
    plan = catalog.load_plan(args.plan)
    factors = fit_compute(profile, plan, base)
    factors["hbm"] = fit_hbm(sweep, base)
    links = fit_collectives(sweep, base)
    latency = links.pop("nvlink_latency_us")
    factors.update(links)
    cluster = with_efficiency(base, **{k: round(v, 3) for k, v in factors.items()})
    cluster = cluster.model_copy(update={
        "name": args.name,
        "node": base.node.model_copy(update={"nvlink_latency_us": latency})})
    cluster = ClusterSpec.model_validate(cluster.model_dump())  # every factor within bounds
    header = (
        f"# {args.name}: {base.name} with efficiency factors calibrated to moeplan's runtime\n"
        f"# (python bench/calibrate_runtime.py; profile {args.profile.name} at commit "
        f"{profile.get('commit')}, collectives {args.collectives.name} at commit "
        f"{sweep.get('commit')}).\n"
        f"# Held-out check: python bench/gpu_fidelity.py --cluster {args.out}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(header + yaml.safe_dump(cluster.model_dump(mode="json"),
                                                sort_keys=False))
    for k, v in {**factors, "nvlink_latency_us": latency}.items():
        print(f"{k:20s} {v:8.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
