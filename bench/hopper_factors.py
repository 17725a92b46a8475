"""The efficiency factors of the Hopper die and its vendor kernels, fitted to the committed H200
micro-benchmark sweep: what the catalog's H100, H800 and H200 clusters carry.

    python bench/hopper_factors.py    # writes bench/results/hopper_factors.json

H100 SXM, H800 SXM and H200 SXM are one die (GH100: 132 SMs, 989 dense bf16 TFLOP/s at the
same clocks, 700 W; NVIDIA's H100 and H200 datasheets; the MegaScale-MoE paper's Table 4 for
H800): they differ in HBM (capacity, bandwidth) and NVLink, which the catalog states per
cluster. A factor measured on H200 carries to the other two when it is a property of that die
and the vendor kernel that runs it, and of nothing else:

- gemm: cuBLAS's large bf16 GEMMs (torch.matmul), the peak fraction of the sweep's fit
  (planner.calibrate.fit_gemm over its 70 GEMM rows);
- grouped_gemm, grouped_gemm_half_rows: a CUTLASS Hopper grouped GEMM (torch._grouped_mm) over
  8..128 experts and 32..4096 rows per expert, its peak and half-point (fit_grouped over 304
  rows);
- attention: a fused FlashAttention-class kernel (torch's causal SDPA alone, no RoPE, no GQA
  expansion), its peak fraction over the 24 bare-SDPA rows (fit_peak).

Not carried, each with its reason in the JSON: the fixed times per GEMM call (each row times
one call between CUDA events on an idle GPU, so the host's dispatch of that call is inside:
a step whose host runs ahead of the GPU does not pay it), the runtime's attention core (its
eager RoPE and GQA expansion), the memory-bound operators' factors (this runtime's eager and
torch.compile'd operators, or what is left of its profiled step), its eager dispatch, and the
NVLink fit (H100's 18 links and H800's 8 against the H200 measured). No published run was
consulted: the values come from the sweep alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from _meta import write  # noqa: E402

from planner.calibrate import (  # noqa: E402
    fit_gemm,
    fit_grouped,
    fit_kernels,
    fit_peak,
    kernel_rows,
    row_seconds,
    with_efficiency,
)
from plans import Efficiency, catalog  # noqa: E402
from plans.results import KernelSweep, Sweep, SweepOp, read  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "bench" / "results" / "h200" / "fidelity" / "calibration_h200.json"
"""The micro-benchmark sweep docs/fidelity.md calibrates from (campaign h200_fidelity)."""
DEVICE = ROOT / "bench" / "results" / "h200" / "device_sweep"
"""The same kernels timed with the host ahead of the GPU (campaigns h200_device_sweep and
h200_fused_device): each kernel row's ``device_s``, and the memory-bound operators' device
times at three shapes."""
DEVICE_SWEEP = DEVICE / "calibration_h200_1gpu.json"
FUSED_SHAPES = ("mixtral", "qwen3", "352b")
"""bench/fused_ops_gpu.py's results in DEVICE: Mixtral-8x7B and Qwen3-30B-A3B at 16k tokens,
the 352B job's per-rank shapes (1,024 tokens)."""
FUSED_OPS = ("rms_norm", "rope", "swiglu", "permute", "unpermute")
"""The operators the cost model prices at fused_elementwise under fused kernels
(cost_models.layer_graph); the router is priced at elementwise in both kernel sets."""
HOPPER = ("h100", "h800", "h200")
"""The catalog's clusters of the GH100 die."""
CARRIED = ("gemm", "grouped_gemm", "grouped_gemm_half_rows", "attention", "fused_elementwise")


def sig3(x: float) -> float:
    """Three significant digits, as the catalog writes factors."""
    return float(f"{x:.3g}")


def base() -> object:
    """H200 at the uncalibrated defaults: the fit never starts from what the catalog carries."""
    return catalog.load_cluster("h200").model_copy(update={"efficiency": Efficiency()})


def carried(sweep: Sweep) -> dict[str, float]:
    """The die-and-vendor-kernel factors, fitted to the sweep."""
    h200 = base()
    gemm = fit_gemm(kernel_rows(sweep, SweepOp.gemm), h200)
    grouped = fit_grouped(kernel_rows(sweep, SweepOp.grouped_mm), h200)
    attention = fit_peak(kernel_rows(sweep, SweepOp.flash_attn), h200, "attention")
    return {"gemm": sig3(gemm["gemm"]), "grouped_gemm": sig3(grouped["grouped_gemm"]),
            "grouped_gemm_half_rows": sig3(grouped["grouped_gemm_half_rows"]),
            "attention": sig3(attention), "fused_elementwise": sig3(fused_rate()["fraction"])}


def fused_rate() -> dict:
    """fused_elementwise: the bytes the cost model counts for the fused operators (forward and
    backward; cost_models.layer_graph's fused-kernel bytes) over their device time, as a
    fraction of H200's peak HBM bandwidth, summed over the three shapes. Device time (the host
    ahead) is the die's and the fused kernel's; one call on an idle GPU holds this runtime's
    dispatch (at the 352B job's 1,024 tokens, 4-30x the kernels' time)."""
    moved = device_s = one_call_s = 0.0
    per_shape = {}
    for shape in FUSED_SHAPES:
        doc = json.loads((DEVICE / f"fused_ops_{shape}.json").read_text())
        ops = [doc["ops"][op] for op in FUSED_OPS]
        b = sum(o["fwd_bytes"] + o["bwd_bytes"] for o in ops)
        d = sum(o["fused"]["device_fwd_bwd_s"] for o in ops)
        c = sum(o["fused"]["fwd_bwd_s"] for o in ops)
        peak = doc["hbm_tb_s"] * 1e12
        per_shape[shape] = {"tokens": doc["shapes"]["tokens"], "device": b / d / peak,
                            "one_call": b / c / peak, "commit": doc["commit"]}
        moved, device_s, one_call_s = moved + b / peak, device_s + d, one_call_s + c
    return {"fraction": moved / device_s, "one_call_fraction": moved / one_call_s,
            "per_shape": per_shape, "ops": list(FUSED_OPS)}


def device_fit() -> dict:
    """The dense and grouped GEMMs refitted to their device times (the host ahead): the fixed
    time per call that is the GPU's, and how the carried factors price the 352B job's
    per-rank kernels against their device times."""
    sweep = read(KernelSweep, DEVICE_SWEEP, "sweep")
    h200 = base()

    def on_device(op: SweepOp) -> list:
        return [r.model_copy(update={"measured_s": r.device_s})
                for r in kernel_rows(sweep, op) if r.device_s]
    gemm = fit_gemm(on_device(SweepOp.gemm), h200)
    grouped = fit_grouped(on_device(SweepOp.grouped_mm), h200)
    factors = carried(read(Sweep, SWEEP, "sweep"))
    priced = with_efficiency(h200, **{k: factors[k] for k in CARRIED})
    job = [r for r in sweep.rows if r.device_s and (
        (r.op == SweepOp.gemm and r.shape.get("m") == 1024)
        or (r.op == SweepOp.grouped_mm and r.shape.get("experts") == 4)
        or (r.op == SweepOp.flash_attn and r.shape.get("heads") == 4))]
    return {
        "sweep": str(DEVICE_SWEEP.relative_to(ROOT)), "commit": sweep.commit,
        "gemm_launch_us": round(gemm["gemm_launch_us"], 2), "gemm": round(gemm["gemm"], 3),
        "grouped_gemm_launch_us": round(grouped["grouped_gemm_launch_us"], 2),
        "grouped_gemm": round(grouped["grouped_gemm"], 3),
        "job_rows": [{"name": r.name, "device_us": round(r.device_s * 1e6, 1),
                      "one_call_us": round(r.measured_s * 1e6, 1),
                      "priced_us": round(row_seconds(r, priced) * 1e6, 1)} for r in job],
    }


def host_share(sweep: Sweep, factors: dict[str, float]) -> dict[str, float]:
    """The smallest GEMM row (one forward call): measured against its FLOPs at the fitted peak
    with no fixed time, i.e. how much of one timed call is not the kernel's work."""
    row = min(kernel_rows(sweep, SweepOp.gemm),
              key=lambda r: (r.backward, r.shape["m"] * r.shape["n"] * r.shape["k"]))
    work = row_seconds(row, with_efficiency(base(), gemm=factors["gemm"]))
    return {"row": row.name, "measured_us": row.measured_s * 1e6, "work_us": work * 1e6}


def results() -> dict:
    sweep = read(Sweep, SWEEP, "sweep")
    factors = carried(sweep)
    runtime = fit_kernels(sweep, base())
    runtime_cluster = catalog.load_cluster("h200-runtime").efficiency
    on_device = device_fit()
    not_carried = {
        "gemm_launch_us": {
            "fitted": runtime["gemm_launch_us"],
            "on_device": on_device["gemm_launch_us"],
            "why": "each sweep row times one call between CUDA events on an idle GPU, so "
                   "PyTorch's dispatch of the call on the host is inside it (host_share); "
                   "timed with the host ahead the fixed time is the on_device value "
                   "(device_fit), the GPU's own, within the fit's noise of none"},
        "grouped_gemm_launch_us": {
            "fitted": runtime["grouped_gemm_launch_us"],
            "on_device": on_device["grouped_gemm_launch_us"],
            "why": "the same one-call timing, plus this runtime's own work per call (the "
                   "experts' row offsets computed on the device first); on_device as above"},
        "attention (attention core)": {
            "fitted": runtime["attention"],
            "why": "fitted to this runtime's attention core: eager RoPE and the GQA "
                   "expansion priced inside FlashAttention's FLOPs"},
        "elementwise": {
            "fitted": runtime["elementwise"],
            "why": "this runtime's eager memory-bound layer operators (several passes per "
                   "operator where a fused kernel makes one), one call at a time: their "
                   "host dispatch is inside"},
        "fused_elementwise (h200-runtime)": {
            "fitted": runtime_cluster.fused_elementwise,
            "why": "what is left of this runtime's profiled fused step (h200-runtime): its "
                   "torch.compile regions, their host dispatch and everything else the model "
                   "does not price there; the die's fused rate is carried from device times "
                   "instead (fused_rate)"},
        "gather_scatter, dispatch_floor_us": {
            "fitted": runtime_cluster.gather_scatter,
            "why": "this runtime's eager token permutation and its host waits"},
        "nvlink_latency_us, nvlink, nvlink_all_to_all": {
            "fitted": runtime_cluster.nvlink,
            "why": "NCCL over H200's 18 NVLink 4 links; H100 has the same links but the "
                   "catalog keeps its prior until an H100 node is measured, and H800 has 8 "
                   "(its NVLink is DeepSeek-V3's measured 160 GB/s)"},
    }
    return {"benchmark": "Hopper efficiency factors carried from the H200 sweep to the catalog",
            "sweep": str(SWEEP.relative_to(ROOT)), "clusters": list(HOPPER),
            "carried": factors, "host_share": host_share(sweep, factors),
            "fused_rate": fused_rate(), "device_fit": on_device,
            "not_carried": not_carried}


def main() -> None:
    doc = results()
    path = write("hopper_factors", doc)
    print("carried to " + ", ".join(HOPPER) + ": "
          + ", ".join(f"{k} {v:g}" for k, v in doc["carried"].items()))
    h = doc["host_share"]
    print(f"{h['row']}: measured {h['measured_us']:.1f} us, its FLOPs {h['work_us']:.1f} us")
    d = doc["device_fit"]
    print(f"with the host ahead: {d['gemm_launch_us']} us per GEMM call, "
          f"{d['grouped_gemm_launch_us']} us per grouped call")
    for r in d["job_rows"]:
        print(f"  {r['name']:44s} device {r['device_us']:8.1f} us, priced {r['priced_us']:8.1f}")
    for shape, f in doc["fused_rate"]["per_shape"].items():
        print(f"fused operators at {shape} shapes: {f['device']:.3f} of peak HBM on the device, "
              f"{f['one_call']:.3f} one call at a time")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
