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
from plans.results import Sweep, SweepOp, read  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "bench" / "results" / "h200" / "fidelity" / "calibration_h200.json"
"""The micro-benchmark sweep docs/fidelity.md calibrates from (campaign h200_fidelity)."""
HOPPER = ("h100", "h800", "h200")
"""The catalog's clusters of the GH100 die."""
CARRIED = ("gemm", "grouped_gemm", "grouped_gemm_half_rows", "attention")


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
            "attention": sig3(attention)}


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
    not_carried = {
        "gemm_launch_us": {
            "fitted": runtime["gemm_launch_us"],
            "why": "each sweep row times one call between CUDA events on an idle GPU, so "
                   "PyTorch's dispatch of the call on the host is inside it (host_share: the "
                   "smallest GEMM's FLOPs take a fraction of its measured time); in a step "
                   "whose host runs ahead of the GPU the dispatch overlaps earlier kernels, "
                   "and how far a system's host runs ahead is its own, not the die's"},
        "grouped_gemm_launch_us": {
            "fitted": runtime["grouped_gemm_launch_us"],
            "why": "the same one-call timing, plus this runtime's own work per call (the "
                   "experts' row offsets computed on the device first)"},
        "attention (attention core)": {
            "fitted": runtime["attention"],
            "why": "fitted to this runtime's attention core: eager RoPE and the GQA "
                   "expansion priced inside FlashAttention's FLOPs"},
        "elementwise": {
            "fitted": runtime["elementwise"],
            "why": "this runtime's eager memory-bound layer operators (several passes per "
                   "operator where a fused kernel makes one)"},
        "fused_elementwise": {
            "fitted": runtime_cluster.fused_elementwise,
            "why": "what is left of this runtime's profiled fused step (h200-runtime): its "
                   "torch.compile regions and everything else the model does not price there"},
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
            "not_carried": not_carried}


def main() -> None:
    doc = results()
    path = write("hopper_factors", doc)
    print("carried to " + ", ".join(HOPPER) + ": "
          + ", ".join(f"{k} {v:g}" for k, v in doc["carried"].items()))
    h = doc["host_share"]
    print(f"{h['row']}: measured {h['measured_us']:.1f} us, its FLOPs {h['work_us']:.1f} us")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
