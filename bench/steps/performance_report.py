"""The runtime's speed, from the committed H200 results: docs/performance.md.

    python -m bench.steps.performance_report [--check]

Reads the current results of the campaigns that measure the runtime's speed (bench/results/
INDEX.md: h200/ the train steps, h200/moe_layer, h200/attention_block, h200/kernels,
h200/searched) and fills the ``{{name}}`` parts of
bench/templates/performance.md.tmpl; ``--check`` exits 1 when the committed doc is stale.
No torch.
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from bench.report import ROOT, fill, load, parser, table, write_or_check

RESULTS = ROOT / "bench" / "results" / "h200"
LAYER, ATTENTION = RESULTS / "moe_layer", RESULTS / "attention_block"
KERNEL_DIR, SEARCHED_DIR = RESULTS / "kernels", RESULTS / "searched"
DOC = ROOT / "docs" / "performance.md"
TEMPLATE = "performance.md.tmpl"
"""The document (piece ``document``) and the clauses that come and go (bench.report.fill)."""

STEPS = (
    # (layout, variant, the plan of bench/gpu_plans whose train step h200/ holds)
    ("1 GPU", "eager, mbs 1 (8 micro-batches)", "mixtral2l_1gpu"),
    ("1 GPU", "eager, mbs 1, + gradient-accumulation fusion", "mixtral2l_1gpu_gaf"),
    ("1 GPU", "eager, mbs 8 (one micro-batch)", "mixtral2l_1gpu_mbs8"),
    ("1 GPU", "fused, mbs 8", "mixtral2l_1gpu_mbs8_fused"),
    ("1 GPU", "fused, mbs 8, + gradient-accumulation fusion", "mixtral2l_1gpu_mbs8_fused_gaf"),
    ("dp2 x ep2", "eager a2a, mbs 1, serial", "mixtral2l_dp2_ep2"),
    ("dp2 x ep2", "+ overlapped gradient sync", "mixtral2l_dp2_ep2_gsync"),
    ("dp2 x ep2", "+ inter-op overlapped MoE (no sync overlap)", "mixtral2l_dp2_ep2_interop"),
    ("dp2 x ep2", "eager ag+rs, mbs 4", "mixtral2l_dp2_ep2_ag_mbs4"),
    ("dp2 x ep2", "fused ag+rs, mbs 4", "mixtral2l_dp2_ep2_ag_mbs4_fused"),
    ("dp2 x ep2", "fused + sync overlap, ag+rs, mbs 4", "mixtral2l_dp2_ep2_ag_mbs4_fused_gsync"),
    ("dp2 x ep2", "fused + sync overlap + inter-op, ag+rs, mbs 4", "mixtral2l_dp2_ep2_ag_mbs4_all"),
    ("sp2 x ep2", "eager a2a, mbs 1", "mixtral2l_sp2_ep2_a2a"),
    ("sp2 x ep2", "eager ag+rs, mbs 1", "mixtral2l_sp2_ep2_ag"),
    ("sp2 x ep2", "eager ag+rs, mbs 8", "mixtral2l_sp2_ep2_ag_mbs8"),
    ("sp2 x ep2", "fused ag+rs, mbs 8", "mixtral2l_sp2_ep2_ag_mbs8_fused"),
    ("sp2 x ep2", "fused + sync overlap, ag+rs, mbs 8", "mixtral2l_sp2_ep2_ag_mbs8_fused_gsync"),
    ("sp2 x ep2", "fused + sync overlap + inter-op, ag+rs, mbs 8", "mixtral2l_sp2_ep2_ag_mbs8_all"),
    ("pp2", "eager, mbs 1", "mixtral2l_pp2"),
)
SEARCHED = ("qwen4l", "deepseek4l", "mixtral2l")
"""The reduced models of bench/steps/steps_searched.py, whose searched plans h200/searched holds."""
PEER_TARGET = 1.15
TARGETS = {"1 GPU": ("MFU >= 50%", None, 0.50), "dp2 x ep2": ("<= 215 ms", 0.215, 0.45),
           "sp2 x ep2": ("<= 250 ms", 0.250, 0.45)}
KERNELS = {(False, "eager"): "eager", (False, "fused"): "fused",
           (True, "fused"): "fused + accumulation fusion"}
PROBES = (("none (NCCL defaults)", "x2_base"), ("NCCL capped to 16 CTAs", "x2_cta16"),
          ("GEMMs leave 16 SMs, NCCL 16 CTAs", "x2_carve16"),
          ("GEMMs leave 24 SMs, NCCL 24 CTAs", "x2_carve24"),
          ("GEMMs leave 16 SMs, NCCL uncapped", "x2_carve16_free"),
          ("4 chunks", "x2_c4"), ("4 chunks, 16 SMs left, NCCL 16 CTAs", "x2_carve16_c4"))
EXPERT_GEMMS = (("mixtral-8x7b, 16k tokens", "expert_gemm_mixtral"),
                ("mixtral-8x7b, 16k tokens, balanced rows", "expert_gemm_mixtral_balanced"),
                ("mixtral-8x7b, 4,096 tokens", "expert_gemm_mixtral_4k"),
                ("qwen3-30b-a3b, 16k tokens", "expert_gemm_qwen3"),
                ("deepseekmoe-16b, 16k tokens", "expert_gemm_deepseekmoe"))
ATTENTION_X2 = ATTENTION / "attention_block_x2.json"
"""The two-GPU block (its head-group rows too), written by h200_layers' step
attention_block_x2."""


def _load(path: Path) -> dict | None:
    return load(path) if path.exists() else None


def _step(stem: str, folder: Path = RESULTS) -> dict | None:
    return _load(folder / f"train_step_{stem}.json")


def _piece(name: str, **parts: str) -> str:
    """A clause of the template's that comes and goes, on its line."""
    return fill(TEMPLATE, parts, name).rstrip("\n")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def step_table() -> str:
    cells = []
    for layout, variant, stem in STEPS:
        r = _step(stem)
        cells.append([layout, variant, "not measured", "", ""] if r is None else
                     [layout, variant, f"{r['step_time_s'] * 1e3:.1f}", f"{r['mfu']:.1%}",
                      r.get("commit", "?")])
    return table(["layout", "variant", "step ms", "MFU", "commit"], cells, "llrr")


def targets() -> str:
    cells = []
    for layout, (text, step_s, mfu) in TARGETS.items():
        runs = [r for lay, _, stem in STEPS if lay == layout and (r := _step(stem)) is not None]
        best = min(runs, key=lambda r: r["step_time_s"])
        met = best["mfu"] >= mfu and (step_s is None or best["step_time_s"] <= step_s)
        extra = "" if step_s is None else f" and MFU >= {mfu:.0%}"
        cells.append([layout, text + extra, f"{best['step_time_s'] * 1e3:.1f} ms, MFU "
                      f"{best['mfu']:.1%}", "yes" if met else "no"])
    return table(["layout", "target", "best measured", "met"], cells)


def _ours_s(row: dict) -> float:
    """Our layer as a plan would run it: the faster dispatcher and overlap setting."""
    return min(min(v["fwd_bwd_s"]["serial"], v["fwd_bwd_s"].get("inter_op", float("inf")))
               for k, v in row.items() if k in ("local", "a2a", "ag_rs"))


def _layer_docs() -> list[tuple[str, dict]]:
    """(kernels, result) of the MoE layer runs in h200/moe_layer, 1 GPU then EP = 2, eager,
    fused, fused with accumulation fusion; each shape's row from the newest run of it."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for path in LAYER.glob("moe_layer_x*.json"):
        d = load(path)
        kernels = KERNELS[(d.get("grad_accumulation_fusion", False), d["kernels"])]
        groups.setdefault((d["world"], kernels), []).append(d)
    out = []
    for (world, kernels) in sorted(groups, key=lambda k: (k[0], list(KERNELS.values())
                                                         .index(k[1]))):
        shapes: dict[str, dict] = {}
        for d in sorted(groups[world, kernels], key=lambda d: d["date"], reverse=True):
            for shape, row in d["shapes"].items():
                shapes.setdefault(shape, {**row, "commit": d.get("commit", "?")})
        out.append((kernels, {"world": world, "shapes": shapes}))
    return out


def layer_table() -> str:
    cells = []
    for kernels, doc in _layer_docs():
        for shape, row in doc["shapes"].items():
            peer = row.get("peer", {})
            peer_ms = _ms(peer["fwd_bwd_s"]) if peer.get("status") == "ok" else \
                peer.get("status", "-")
            for disp in ("local", "a2a", "ag_rs"):
                if disp not in row:
                    continue
                t = row[disp]["fwd_bwd_s"]
                cells.append([doc["world"], shape, kernels, disp, _ms(t["serial"]),
                              _ms(t["inter_op"]) if "inter_op" in t else "-",
                              _ms(t["compute_alone"]),
                              _ms(t["comm_alone"]) if "comm_alone" in t else "-",
                              f"{t['overlap_target']['ratio']:.2f}" if "overlap_target" in t
                              else "-", peer_ms, row["commit"]])
    return table(["GPUs", "shape", "kernels", "dispatcher", "serial ms", "inter-op ms",
                  "compute alone ms", "comm alone ms", "inter-op / max(alone)", "torchtitan ms",
                  "commit"], cells, "llllrrrrrr")


def peer_table() -> str:
    """Per GPU count and shape: our best layer (either kernel set, dispatcher, overlap)
    against torchtitan's, measured in the same launch."""
    best: dict[tuple[int, str], tuple[float, str, float]] = {}
    for kernels, doc in _layer_docs():
        for shape, row in doc["shapes"].items():
            peer = row.get("peer", {})
            if peer.get("status") != "ok":
                continue
            ours, key = _ours_s(row), (doc["world"], shape)
            if key not in best or peer["fwd_bwd_s"] / ours > best[key][2]:
                best[key] = (ours, kernels, peer["fwd_bwd_s"] / ours)
    return table(["GPUs", "shape", "ours ms (kernels)", "ours vs torchtitan",
                  f">= {PEER_TARGET}x"],
                 ([world, shape, f"{_ms(ours)} ({kernels})", f"{speed:.2f}x",
                   "yes" if speed >= PEER_TARGET else "no"]
                  for (world, shape), (ours, kernels, speed) in sorted(best.items())), "llrr")


def trace_table() -> str:
    """The traced inter-op step at EP = 2: each stream's busy time and how long both ran."""
    cells = []
    for kernels, doc in _layer_docs():
        if doc["world"] != 2:
            continue
        for shape, row in doc["shapes"].items():
            for disp, traces in row.get("trace", {}).items():
                t = traces.get("inter_op")
                if t is None:
                    continue
                streams = sorted(t["streams"].values(),
                                 key=lambda v: -v["kind_ms"].get("gemm", 0.0))
                comp, comm = streams[0], streams[1] if len(streams) > 1 else None
                ck = comp["kind_ms"]
                cells.append([shape, kernels, disp, f"{comp['busy_ms']:.1f} "
                              f"({ck.get('gemm', 0):.1f} / {ck.get('other', 0):.1f})",
                              f"{comm['busy_ms']:.1f} ({comm['kind_ms'].get('nccl', 0):.1f} / "
                              f"{comm['kind_ms'].get('other', 0):.1f})" if comm else "-",
                              f"{t['concurrent_ms']:.1f}", f"{t['wall_ms']:.1f}"])
    return table(["shape", "kernels", "dispatcher", "compute stream ms (GEMM / other)",
                  "comm stream ms (NCCL / other)", "side by side ms", "kernel span ms"],
                 cells, "lllrrrr")


def probe_table() -> str:
    """The overlap probes (h200_layers' steps x2_*): inter-op / max(alone) per setting."""
    cols = [(shape, disp) for shape in ("mixtral-8x7b", "qwen3-30b-a3b")
            for disp in ("a2a", "ag_rs")]
    cells = []
    for text, stem in PROBES:
        doc = load(LAYER / "overlap_probes" / f"{stem}.json")
        cells.append([text, *(f"{doc['shapes'][s][d]['fwd_bwd_s']['overlap_target']['ratio']:.2f}"
                              for s, d in cols)])
    return table(["setting", *(f"{s} {d}" for s, d in cols)], cells, "l" + "r" * len(cols))


def fused_table() -> str:
    cells = []
    for shape in ("mixtral", "qwen3"):
        for name, row in load(KERNEL_DIR / f"fused_ops_{shape}.json")["ops"].items():
            e, f = row["eager"]["fwd_bwd_s"], row["fused"]["fwd_bwd_s"]
            cells.append([shape, name, f"{e * 1e3:.3f}", f"{f * 1e3:.3f}", f"{e / f:.2f}x",
                          f"{row['fused']['fwd_bwd_hbm_fraction']:.0%}"])
    return table(["shape", "operator", "eager fwd+bwd ms", "fused fwd+bwd ms", "speed-up",
                  "fused share of HBM peak"], cells, "llrrrr")


def loss_table() -> str:
    cells = []
    for shape in ("qwen3", "mixtral"):
        doc = load(KERNEL_DIR / f"fused_loss_{shape}.json")
        row, sh = doc["ops"]["cross_entropy"], doc["shapes"]
        e, f = row["eager"]["device_fwd_bwd_s"], row["fused"]["device_fwd_bwd_s"]
        g = row["gemms_fwd_bwd_s"]
        cells.append([shape, f"{sh['tokens']:,}", f"{sh['vocab']:,}", _ms(e), _ms(f), _ms(g),
                      f"{(e - g) * 1e3:.1f} / {(f - g) * 1e3:.1f}",
                      f"{row['fused_vs_eager']:.1e}", doc.get("commit", "?")])
    return table(["shape", "tokens", "vocabulary", "eager ms", "fused ms", "its GEMMs alone ms",
                  "beside the GEMMs, eager / fused ms", "fused vs eager", "commit"], cells,
                 "lrrrrrlr")


def searched_table() -> str:
    cells = []
    for shape in SEARCHED:
        r = _step(f"{shape}_1gpu", SEARCHED_DIR)
        pred = r["prediction"]
        cells.append([shape, f"`{r['plan_summary']}`", f"{r['step_time_s'] * 1e3:.1f}",
                      f"{r['mfu']:.1%}", f"{pred['step_time_s'] * 1e3:.1f}",
                      f"{pred['step_time_s'] / r['step_time_s'] - 1:+.1%}",
                      f"{pred['peak_memory_gib']:.1f} / "
                      f"{max(r['peak_reserved_gib_per_rank']):.1f}", r.get("commit", "?")])
    return table(["model", "plan", "step ms", "MFU", "predicted ms", "error",
                  "peak GiB predicted / reserved", "commit"], cells, "llrrrr")


def searched_parity() -> str:
    """The 2-GPU searched plans' bf16 parity with both ranks on one GPU, one clause each."""
    parts = []
    for shape in SEARCHED:
        r = _load(SEARCHED_DIR / f"parity_shared_{shape}_2gpu_mbs1.json")
        if r is not None:
            parts.append(f"`{r['plan_summary']}` {'passes' if r['pass'] else 'fails'} (loss "
                         f"{r['loss_layout_vs_fp32']:.1e} from fp32, the one-rank bf16 "
                         f"reference {r['loss_bf16_reference_vs_fp32']:.1e}; "
                         f"{r.get('commit', '?')})")
    return "; ".join(parts)


def searched_x2() -> str:
    steps = [r for shape in SEARCHED if (r := _step(f"{shape}_2gpu", SEARCHED_DIR)) is not None]
    runs = ", ".join(f"`{r['plan_summary']}` {r['step_time_s'] * 1e3:.1f} ms (predicted "
                     f"{r['prediction']['step_time_s'] * 1e3:.1f})" for r in steps)
    return _piece("searched_x2", runs=runs) if steps else _piece("searched_x2_unrun")


def tp_memory() -> str:
    """The searched tp2 plan's per-rank peak with both ranks on the one GPU."""
    r = _step("qwen4l_2gpu_shared", SEARCHED_DIR)
    return (f"{max(r['peak_reserved_gib_per_rank']):.1f} GiB reserved at {r.get('commit', '?')} "
            f"against {r['prediction']['peak_memory_gib']:.1f} predicted")


def copy_engine_table() -> str:
    cells = []
    for r in load(RESULTS / "copy_engine_x2.json")["rows"]:
        ce = r["copy_engine"]
        cells.append([r["shape"]["name"], f"{r['bytes_to_peer'] / 2**20:.0f}",
                      _ms(r["compute_s"]), _ms(r["nccl_s"]), _ms(r["nccl_beside_compute_s"]),
                      f"{r['nccl_overlap_ratio']:.2f}",
                      *([_ms(ce["copy_s"]), _ms(ce["copy_beside_compute_s"]),
                         f"{ce['overlap_ratio']:.2f}", f"{ce['gbps']:.0f}"]
                        if ce["status"] == "ok" else [ce["status"], "", "", ""])])
    return table(["shape", "MiB to peer", "GEMMs alone ms", "NCCL alone ms", "NCCL beside ms",
                  "ratio", "peer copy alone ms", "peer copy beside ms", "ratio", "copy GB/s"],
                 cells, "l" + "r" * 9)


def expert_gemm_table() -> str:
    docs = [(name, load(KERNEL_DIR / f"{stem}.json")) for name, stem in EXPERT_GEMMS]
    variants = list(dict.fromkeys(v for _, d in docs for v in d["variants"]))
    cells = [[v, *(_ms(d["variants"][v]["fwd_bwd_s"]) if v in d["variants"] else "-"
                   for _, d in docs)] for v in variants]
    cells.append(["commit", *(d.get("commit", "?") for _, d in docs)])
    return table(["variant", *(n for n, _ in docs)], cells, "l" + "r" * len(docs))


def attention_table() -> str:
    cells = []
    for path in (ATTENTION / "attention_block_x1.json", ATTENTION_X2):
        doc = _load(path)
        if doc is None:
            continue
        for shape, row in doc["models"].items():
            comm = row.get("comm_alone_s")
            for v in row["variants"].values():
                pred = v["predicted"]["block_s"]
                times = [_ms(x) if x is not None else "-" for x in (
                    v.get("compute_alone_s"), v.get("exposed_comm_s"), comm)]
                cells.append([doc["world"], shape, v["kernels"], v["recompute"],
                              _ms(v["block_s"]), _ms(pred), f"{pred / v['block_s'] - 1:+.1%}",
                              *times, doc.get("commit", "?")])
    return table(["GPUs", "shape", "kernels", "recompute", "block ms", "predicted ms", "error",
                  "compute alone ms", "exposed comm ms", "all-to-alls alone ms", "commit"],
                 cells, "llllrrrrrr")


def _head_group_docs() -> list[dict]:
    """The simulated SP rank on one GPU, and the two-GPU block where it ran."""
    return [d for d in (_load(ATTENTION / "attention_block_x1_simulated_sp2.json"),
                        _load(ATTENTION_X2)) if d is not None]


def head_groups_table() -> str:
    """Blocking Ulysses core / head groups per cell: compute alone with the host ahead, on an
    idle GPU, the host's time to issue it; on two GPUs the block and its exposed comm."""
    def pair(a, b) -> str:
        return " / ".join(_ms(x) if x is not None else "-" for x in (a, b))

    cells = []
    for doc in _head_group_docs():
        gpus = f"{doc['world']}" + (f" (one SP = {doc['simulated_sp']} rank)"
                                    if doc["world"] == 1 else "")
        for shape, row in doc["models"].items():
            for v in row["variants"].values():
                g = v.get("head_groups")
                if g is None:
                    continue
                cells.append([gpus, shape, v["kernels"], v["recompute"], *(
                    pair(v.get(k), g.get(k)) for k in (
                        "compute_alone_device_s", "compute_alone_s", "compute_alone_host_s",
                        "block_s", "exposed_comm_s")),
                    pair(v["predicted"]["block_s"], g["predicted"]["block_s"]),
                    doc.get("commit", "?")])
    return table(["GPUs", "shape", "kernels", "recompute", "compute alone, host ahead ms",
                  "compute alone, idle GPU ms", "host issues it ms", "block ms",
                  "exposed comm ms", "predicted ms", "commit"], cells)


def _span(xs: list[float]) -> str:
    lo, hi = _ms(min(xs)), _ms(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def head_groups() -> dict[str, str]:
    """What the head groups cost one simulated SP rank's compute, against the prediction."""
    doc = _head_group_docs()[0]
    pairs = [(v, v["head_groups"], shape) for shape, row in doc["models"].items()
             for v in row["variants"].values() if "head_groups" in v]
    device = [g["compute_alone_device_s"] - v["compute_alone_device_s"] for v, g, _ in pairs]
    share = [g["compute_alone_device_s"] / v["compute_alone_device_s"] - 1 for v, g, _ in pairs]
    priced = [g["predicted"]["block_s"] - v["predicted"]["block_s"] for v, g, _ in pairs]
    v, g, shape = max(pairs, key=lambda p: p[1]["compute_alone_host_s"]
                      / p[1]["compute_alone_device_s"])
    return {"hg_device": _span(device), "hg_share_lo": f"{min(share):+.1%}",
            "hg_share_hi": f"{max(share):+.1%}", "hg_priced": _span(priced),
            "hg_host": _ms(g["compute_alone_host_s"]), "hg_shape": shape,
            "hg_kernels": v["kernels"], "hg_recompute": v["recompute"],
            "hg_host_device": _ms(g["compute_alone_device_s"]),
            "hg_blocking_host": _ms(v["compute_alone_host_s"]),
            "hg_blocking_device": _ms(v["compute_alone_device_s"])}


def head_group_parity() -> str:
    """The head groups' bf16 parity with both ranks on one GPU, without and with recompute."""
    docs = [load(ATTENTION / f"parity_shared_mixtral2l_sp2_ep2_a2a_interop{t}.json")
            for t in ("", "_sel", "_full")]
    return "; ".join(
        f"`{d['plan_summary'].split(' sync:')[0]}` {d.get('commit', '?')}: "
        f"{'pass' if d['pass'] else 'FAIL'}, loss {d['loss_rel_err']:.2e} and gradients up "
        f"to {d['grad_max_rel_err']:.2e} from the one-GPU bf16 reference (the layout "
        f"{d['grad_max_layout_vs_fp32']:.3f} and the reference "
        f"{d['grad_max_bf16_reference_vs_fp32']:.3f} from fp32)" for d in docs)


def clocks() -> dict[str, str]:
    """The SM clock and power while the Mixtral-shaped layer runs (nvidia-smi every 250 ms)."""
    rows = list(csv.reader((LAYER / "clocks_smi.csv").read_text().splitlines()))[1:]
    layer = load(LAYER / "clocks_x1_fused_gaf.json")
    busy = [r for r in rows if float(r[3].split()[0]) > 300]  # the layer running, not idle
    mhz = sorted(int(r[1].split()[0]) for r in busy)
    shape = layer["shapes"]["mixtral-8x7b"]
    ours, peer = shape["local"]["fwd_bwd_s"]["serial"], shape["peer"]["fwd_bwd_s"]
    return {"clk_commit": layer.get("commit", "?"), "clk_ours": _ms(ours),
            "clk_peer": _ms(peer), "clk_speed": f"{peer / ours:.2f}",
            "clk_busy": str(len(busy)),
            "clk_capped": str(sum(int(r[6], 16) & 0x4 != 0 for r in busy)),  # SW power cap
            "clk_watts": f"{statistics.median(float(r[3].split()[0]) for r in busy):.0f}",
            "clk_limit": busy[0][4].strip(), "clk_median": f"{statistics.median(mhz):.0f}",
            "clk_range": f"{mhz[0]}-{mhz[-1]}", "clk_max": busy[0][2].strip()}


def ceiling() -> dict[str, str]:
    """How much faster than torchtitan's our Mixtral-shaped layer could be with its expert
    GEMMs at the best rate measured for the same FLOPs (issue 11's 1.15x target)."""
    gemms = load(KERNEL_DIR / "expert_gemm_mixtral.json")
    even = load(KERNEL_DIR / "expert_gemm_mixtral_balanced.json")
    layer = load(LAYER / "moe_layer_x1_fused_mixtral.json")
    v = {k: x["fwd_bwd_s"] * 1e3 for k, x in gemms["variants"].items()}
    moved = max(abs(x["fwd_bwd_s"] * 1e3 / v[k] - 1) for k, x in even["variants"].items())
    shape = layer["shapes"]["mixtral-8x7b"]
    ours, peer = shape["local"]["fwd_bwd_s"]["serial"] * 1e3, shape["peer"]["fwd_bwd_s"] * 1e3
    rest = ours - (v["grouped"] - v["swiglu"])  # our layer less its grouped GEMMs
    best = min(v["dense"], v["per_expert_fn"])
    top = best - v["swiglu"] + rest
    return {"ceil_commit": gemms.get("commit", "?"), "ceil_dense": f"{v['dense']:.2f}",
            "ceil_swiglu": f"{v['swiglu']:.2f}", "ceil_per_expert": f"{v['per_expert_fn']:.2f}",
            "ceil_grouped": f"{v['grouped']:.2f}", "ceil_moved": f"{moved:.1%}",
            "ceil_gemms": f"{best - v['swiglu']:.1f}",
            "ceil_tflops": f"{3 * gemms['gemm_flops_fwd'] / (best - v['swiglu']) / 1e9:.0f}",
            "ceil_rest": f"{rest:.1f}", "ceil_ours": f"{ours:.2f}", "ceil_layer": f"{top:.1f}",
            "ceil_peer": f"{peer:.2f}", "ceil_speed": f"{peer / top:.2f}",
            "ceil_layer_commit": layer.get("commit", "?")}


def fusion() -> dict[str, str]:
    """The steps with gradient-accumulation fusion against their twins without it."""
    out = {}
    for key, stem in (("gaf_mbs1", "mixtral2l_1gpu"), ("gaf_mbs8", "mixtral2l_1gpu_mbs8_fused")):
        a, b = _step(stem)["step_time_s"], _step(f"{stem}_gaf")["step_time_s"]
        out |= {f"{key}_twin": f"{a * 1e3:.1f}", f"{key}": f"{b * 1e3:.1f}",
                f"{key}_gain": f"{1 - b / a:.1%}"}
    v = load(KERNEL_DIR / "expert_gemm_qwen3.json")["variants"]
    ratio = v["runtime_accumulating"]["fwd_bwd_s"] / v["grouped_accumulate"]["fwd_bwd_s"]
    return out | {"qwen_per_expert": f"{ratio:.2f}"}


def interop_step() -> str:
    """The overlapped dp2 x ep2 step against its serial twin."""
    over, serial = _step("mixtral2l_dp2_ep2_interop"), _step("mixtral2l_dp2_ep2")
    return (f"{over['step_time_s'] * 1e3:.1f} against {serial['step_time_s'] * 1e3:.1f} ms, "
            f"{over.get('commit', '?')} and {serial.get('commit', '?')}")


def sections() -> dict[str, str]:
    """The generated parts of the report, by the name its template gives."""
    parts = {fn.__name__: fn() for fn in (
        step_table, targets, layer_table, peer_table, trace_table, probe_table, attention_table,
        head_groups_table, fused_table, loss_table, searched_table, copy_engine_table,
        expert_gemm_table, head_group_parity, searched_parity, searched_x2, tp_memory,
        interop_step)}
    x2_note = "" if ATTENTION_X2.exists() else _piece("attention_x2_unrun")
    return {**parts, **head_groups(), **clocks(), **ceiling(), **fusion(),
            "attention_x2_note": x2_note}


def render() -> str:
    """docs/performance.md: the template's prose with its ``{{name}}`` parts filled in."""
    return fill(TEMPLATE, sections(), "document")


def main() -> int:
    check = parser(__doc__, "docs/performance.md is stale").parse_args().check
    return write_or_check(DOC, render(), "python -m bench.steps.performance_report", check)


if __name__ == "__main__":
    sys.exit(main())
