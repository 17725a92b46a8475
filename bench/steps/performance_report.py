"""The runtime's speed, from the committed H200 results: docs/performance.md.

    python -m bench.steps.performance_report [--check]

Reads bench/results/h200 (train steps, the MoE layer against torchtitan's, the fused operators)
and writes docs/performance.md; ``--check`` exits 1 when the committed doc is stale. No torch.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "h200"
DOC = ROOT / "docs" / "performance.md"
TEMPLATE = Path(__file__).with_name("performance.md")
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")

STEPS = (
    # (layout, variant, train_step result stem: "folder/stem" for a campaign's own folder)
    ("1 GPU", "eager, mbs 1 (8 micro-batches)", "mixtral2l_1gpu"),
    ("1 GPU", "eager, mbs 8 (one micro-batch)", "mixtral2l_1gpu_mbs8"),
    ("1 GPU", "fused, mbs 8", "mixtral2l_1gpu_mbs8_fused"),
    ("1 GPU", "fused + fused AdamW step, mbs 8", "speed13/mixtral2l_1gpu_mbs8_fused"),
    ("dp2 x ep2", "eager a2a, mbs 1, serial", "mixtral2l_dp2_ep2"),
    ("dp2 x ep2", "+ overlapped gradient sync", "mixtral2l_dp2_ep2_gsync"),
    ("dp2 x ep2", "+ inter-op overlapped MoE (no sync overlap)", "mixtral2l_dp2_ep2_interop"),
    ("dp2 x ep2", "eager ag+rs, mbs 4", "mixtral2l_dp2_ep2_ag_mbs4"),
    ("dp2 x ep2", "fused ag+rs, mbs 4", "mixtral2l_dp2_ep2_ag_mbs4_fused"),
    ("dp2 x ep2", "fused + sync overlap + inter-op, ag+rs, mbs 4", "mixtral2l_dp2_ep2_ag_mbs4_all"),
    ("dp2 x ep2", "fused + fused AdamW step, ag+rs, mbs 4",
     "speed13/mixtral2l_dp2_ep2_ag_mbs4_fused"),
    ("dp2 x ep2", "fused + fused AdamW + sync overlap, ag+rs, mbs 4",
     "speed13/mixtral2l_dp2_ep2_ag_mbs4_fused_gsync"),
    ("sp2 x ep2", "eager a2a, mbs 1", "mixtral2l_sp2_ep2_a2a"),
    ("sp2 x ep2", "eager ag+rs, mbs 1", "mixtral2l_sp2_ep2_ag"),
    ("sp2 x ep2", "eager ag+rs, mbs 8", "mixtral2l_sp2_ep2_ag_mbs8"),
    ("sp2 x ep2", "fused ag+rs, mbs 8", "mixtral2l_sp2_ep2_ag_mbs8_fused"),
    ("sp2 x ep2", "fused + sync overlap + inter-op, ag+rs, mbs 8", "mixtral2l_sp2_ep2_ag_mbs8_all"),
    ("sp2 x ep2", "fused + fused AdamW step, ag+rs, mbs 8",
     "speed13/mixtral2l_sp2_ep2_ag_mbs8_fused"),
    ("sp2 x ep2", "fused + fused AdamW + sync overlap, ag+rs, mbs 8",
     "speed13/mixtral2l_sp2_ep2_ag_mbs8_fused_gsync"),
    ("1 GPU", "fused (router eager, permutation by gathers) + fused AdamW, mbs 8",
     "speed14/mixtral2l_1gpu_mbs8_fused"),
    ("dp2 x ep2", "fused (router eager) + fused AdamW + sync overlap, ag+rs, mbs 4",
     "speed14/mixtral2l_dp2_ep2_ag_mbs4_fused_gsync"),
    ("sp2 x ep2", "fused (router eager) + fused AdamW + sync overlap, ag+rs, mbs 8",
     "speed14/mixtral2l_sp2_ep2_ag_mbs8_fused_gsync"),
    ("1 GPU", "fused + fused AdamW, no host sync in the router, one input copy per step, mbs 8",
     "speed16/mixtral2l_1gpu_mbs8_fused"),
    ("pp2", "eager, mbs 1", "mixtral2l_pp2"),
    # gradient-accumulation fusion, each beside its twin without it in the same campaign
    ("1 GPU", "eager, mbs 1, accumulation pass (the twin)", "speed17/mixtral2l_1gpu"),
    ("1 GPU", "eager, mbs 1, + gradient-accumulation fusion", "speed17/mixtral2l_1gpu_gaf"),
    ("1 GPU", "fused + fused AdamW, mbs 8, accumulation pass (the twin)",
     "speed17/mixtral2l_1gpu_mbs8_fused"),
    ("1 GPU", "fused + fused AdamW, mbs 8, + gradient-accumulation fusion",
     "speed17/mixtral2l_1gpu_mbs8_fused_gaf"),
    # the plan moeplan search --runnable picks (bench/steps/steps_searched.py), as it ran then
    ("1 GPU", "searched: fused + fused AdamW + accumulation fusion, mbs 8",
     "speed22/mixtral2l_1gpu"),
    ("1 GPU", "searched: the same + the fused chunked loss, mbs 8", "speed23/mixtral2l_1gpu"),
)
SEARCHED = ("qwen4l", "deepseek4l", "mixtral2l")
"""The reduced models of bench/steps/steps_searched.py: their searched 1-GPU plans as first measured
(speed22/, the loss eager in every kernel set) and once the fused kernels ran the chunked
loss and the search priced it so (speed23/)."""
LAYERS = ("speed19", "speed18", "speed16", "speed14")
"""The campaign folders of the MoE layer results, newest first (speed19: the 1-GPU layers
re-measured at 335e8e5 beside the peer; h200_layer_gaf: Mixtral with gradient-accumulation
fusion; h200_speed16_1gpu: 1 GPU; h200_speed14: 1 GPU and EP = 2, traced): each shape's row
is read from the newest folder that has it."""
PEER_TARGET = 1.15
TARGETS = {"1 GPU": ("MFU >= 50%", None, 0.50), "dp2 x ep2": ("<= 215 ms", 0.215, 0.45),
           "sp2 x ep2": ("<= 250 ms", 0.250, 0.45)}


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _step(stem: str) -> dict | None:
    """The train_step result of ``stem`` ("folder/stem" when a campaign wrote its own folder)."""
    folder, _, name = stem.rpartition("/")
    return _load(f"{folder}/train_step_{name}" if folder else f"train_step_{name}")


def step_table() -> list[str]:
    lines = ["| layout | variant | step ms | MFU | commit |", "|---|---|---:|---:|---|"]
    for layout, variant, stem in STEPS:
        r = _step(stem)
        if r is None:
            lines.append(f"| {layout} | {variant} | not measured | | |")
            continue
        lines.append(f"| {layout} | {variant} | {r['step_time_s'] * 1e3:.1f} | "
                     f"{r['mfu']:.1%} | {r.get('commit', '?')} |")
    return lines


def targets() -> list[str]:
    lines = ["| layout | target | best measured | met |", "|---|---|---|---|"]
    for layout, (text, step_s, mfu) in TARGETS.items():
        runs = [r for lay, _, stem in STEPS if lay == layout
                and (r := _step(stem)) is not None]
        best = min(runs, key=lambda r: r["step_time_s"])
        met = (best["mfu"] >= mfu) if step_s is None else (
            best["step_time_s"] <= step_s and best["mfu"] >= mfu)
        extra = "" if step_s is None else f" and MFU >= {mfu:.0%}"
        lines.append(f"| {layout} | {text}{extra} | {best['step_time_s'] * 1e3:.1f} ms, "
                     f"MFU {best['mfu']:.1%} | {'yes' if met else 'no'} |")
    return lines


def _ours_s(row: dict) -> float:
    """Our layer as a plan would run it: the faster dispatcher and overlap setting."""
    return min(min(v["fwd_bwd_s"]["serial"], v["fwd_bwd_s"].get("inter_op", float("inf")))
               for k, v in row.items() if k in ("local", "a2a", "ag_rs"))


def _layer_docs() -> list[tuple[str, dict]]:
    """(kernels, result) of the MoE layer runs: eager and fused, 1 GPU then EP = 2; each
    shape's row from the newest of LAYERS that measured it (with its commit)."""
    out = []
    for world in ("x1", "x2"):
        for kernels, suffix in (("eager", ""), ("fused", "_fused"),
                                ("fused + accumulation fusion", "_fused_gaf")):
            docs = [d for folder in LAYERS
                    if (d := _load(f"{folder}/moe_layer_{world}{suffix}")) is not None]
            if not docs:
                continue
            shapes: dict[str, dict] = {}
            for d in docs:
                for shape, row in d["shapes"].items():
                    shapes.setdefault(shape, {**row, "commit": d.get("commit", "?")})
            out.append((kernels, {"world": docs[0]["world"], "shapes": shapes}))
    return out


def layer_table() -> list[str]:
    lines = ["| GPUs | shape | kernels | dispatcher | serial ms | inter-op ms | compute alone ms "
             "| comm alone ms | inter-op / max(alone) | torchtitan ms | commit |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for kernels, doc in _layer_docs():
        for shape, row in doc["shapes"].items():
            peer = row.get("peer", {})
            peer_ms = f"{peer['fwd_bwd_s'] * 1e3:.2f}" if peer.get("status") == "ok" else \
                peer.get("status", "-")
            for disp in ("local", "a2a", "ag_rs"):
                if disp not in row:
                    continue
                t = row[disp]["fwd_bwd_s"]
                inter = f"{t['inter_op'] * 1e3:.2f}" if "inter_op" in t else "-"
                comm = f"{t['comm_alone'] * 1e3:.2f}" if "comm_alone" in t else "-"
                ratio = (f"{t['overlap_target']['ratio']:.2f}"
                         if "overlap_target" in t else "-")
                lines.append(f"| {doc['world']} | {shape} | {kernels} | {disp} | "
                             f"{t['serial'] * 1e3:.2f} | {inter} | "
                             f"{t['compute_alone'] * 1e3:.2f} | {comm} | {ratio} | {peer_ms} "
                             f"| {row['commit']} |")
    return lines


def peer_table() -> list[str]:
    """Per GPU count and shape: our best layer (either kernel set, dispatcher, overlap)
    against torchtitan's, measured in the same launch."""
    best: dict[tuple[int, str], tuple[float, str, float]] = {}
    for kernels, doc in _layer_docs():
        for shape, row in doc["shapes"].items():
            peer = row.get("peer", {})
            if peer.get("status") != "ok":
                continue
            ours = _ours_s(row)
            key = (doc["world"], shape)
            if key not in best or peer["fwd_bwd_s"] / ours > best[key][2]:
                best[key] = (ours, kernels, peer["fwd_bwd_s"] / ours)
    lines = [f"| GPUs | shape | ours ms (kernels) | ours vs torchtitan | >= {PEER_TARGET}x |",
             "|---|---|---:|---:|---|"]
    for (world, shape), (ours, kernels, speed) in sorted(best.items()):
        lines.append(f"| {world} | {shape} | {ours * 1e3:.2f} ({kernels}) | {speed:.2f}x | "
                     f"{'yes' if speed >= PEER_TARGET else 'no'} |")
    return lines


def trace_table() -> list[str]:
    """The traced inter-op step at EP = 2: each stream's busy time and how long both ran."""
    lines = ["| shape | kernels | dispatcher | compute stream ms (GEMM / other) | comm stream ms "
             "(NCCL / other) | side by side ms | kernel span ms |",
             "|---|---|---|---:|---:|---:|---:|"]
    for kernels, doc in _layer_docs():
        if doc["world"] != 2:
            continue
        for shape, row in doc["shapes"].items():
            for disp, traces in row.get("trace", {}).items():
                t = traces.get("inter_op")
                if t is None:
                    continue
                streams = sorted(t["streams"].values(), key=lambda v: -v["kind_ms"].get(
                    "gemm", 0.0))
                comp, comm = streams[0], streams[1] if len(streams) > 1 else None
                ck = comp["kind_ms"]
                cells = (f"{comm['busy_ms']:.1f} ({comm['kind_ms'].get('nccl', 0):.1f} / "
                         f"{comm['kind_ms'].get('other', 0):.1f})") if comm else "-"
                lines.append(f"| {shape} | {kernels} | {disp} | {comp['busy_ms']:.1f} "
                             f"({ck.get('gemm', 0):.1f} / {ck.get('other', 0):.1f}) | {cells} | "
                             f"{t['concurrent_ms']:.1f} | {t['wall_ms']:.1f} |")
    return lines


def schedule_table() -> list[str]:
    """inter-op ms of the fused layer at EP = 2 under each schedule of runtime.parallel.overlap."""
    docs = {name: _load(f"speed16/{stem}") for name, stem in (
        ("collectives alone (the runtime's)", "moe_layer_x2_fused"),
        ("every token move on the comm stream (before)", "moe_layer_x2_fused_token_moves"))}
    if any(d is None for d in docs.values()):
        return []
    lines = ["| schedule | shape | dispatcher | inter-op ms | inter-op / max(alone) |",
             "|---|---|---|---:|---:|"]
    for name, doc in docs.items():
        for shape, row in doc["shapes"].items():
            for disp in ("a2a", "ag_rs"):
                v = row[disp]["fwd_bwd_s"]
                lines.append(f"| {name} | {shape} | {disp} | {v['inter_op'] * 1e3:.2f} | "
                             f"{v['overlap_target']['ratio']:.2f} |")
    return lines


def probe_table() -> list[str]:
    """The overlap probes (bench/overlap_probe.sh): inter-op over max(alone) per setting."""
    probes = (("none (NCCL defaults)", "x2_base"), ("NCCL capped to 16 CTAs", "x2_cta16"),
              ("GEMMs leave 8 SMs, NCCL 8 CTAs", "x2_carve8"),
              ("GEMMs leave 16 SMs, NCCL 16 CTAs", "x2_carve16"),
              ("GEMMs leave 24 SMs, NCCL 24 CTAs", "x2_carve24"),
              ("GEMMs leave 16 SMs, NCCL uncapped", "x2_carve16_free"),
              ("4 chunks", "x2_c4"), ("4 chunks, 16 SMs left, NCCL 16 CTAs", "x2_carve16_c4"))
    cols = [(shape, disp) for shape in ("mixtral-8x7b", "qwen3-30b-a3b")
            for disp in ("a2a", "ag_rs")]
    lines = ["| setting | " + " | ".join(f"{s} {d}" for s, d in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for text, stem in probes:
        doc = _load(f"overlap14/{stem}")
        if doc is None:
            continue
        cells = [f"{doc['shapes'][s][d]['fwd_bwd_s']['overlap_target']['ratio']:.2f}"
                 for s, d in cols]
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    return lines


def fused_table() -> list[str]:
    lines = ["| shape | operator | eager fwd+bwd ms | fused fwd+bwd ms | speed-up | fused share "
             "of HBM peak |", "|---|---|---:|---:|---:|---:|"]
    for shape in ("mixtral", "qwen3"):
        doc = _load(f"speed14/fused_ops_{shape}")
        if doc is None:
            continue
        for name, row in doc["ops"].items():
            e, f = row["eager"]["fwd_bwd_s"], row["fused"]["fwd_bwd_s"]
            lines.append(f"| {shape} | {name} | {e * 1e3:.3f} | {f * 1e3:.3f} | {e / f:.2f}x | "
                         f"{row['fused']['fwd_bwd_hbm_fraction']:.0%} |")
    return lines


def searched_table() -> list[str]:
    lines = ["| model | plan | step ms | MFU | predicted ms | error | peak GiB predicted / "
             "reserved | commit |", "|---|---|---:|---:|---:|---:|---|---|"]
    for shape in SEARCHED:
        for folder in ("speed22", "speed23"):
            r = _step(f"{folder}/{shape}_1gpu")
            if r is None:
                continue
            pred = r["prediction"]
            lines.append(
                f"| {shape} | `{r['plan_summary']}` | {r['step_time_s'] * 1e3:.1f} | "
                f"{r['mfu']:.1%} | {pred['step_time_s'] * 1e3:.1f} | "
                f"{pred['step_time_s'] / r['step_time_s'] - 1:+.1%} | "
                f"{pred['peak_memory_gib']:.1f} / {max(r['peak_reserved_gib_per_rank']):.1f} | "
                f"{r.get('commit', '?')} |")
    return lines


def searched_x2_text() -> str:
    """The 2-GPU searched plans: their bf16 parity with both ranks on one GPU, and their steps
    over NCCL once a two-GPU machine runs h200_searched_x2."""
    parts = []
    for shape in SEARCHED:
        r = _load(f"speed23/rowwise/parity_shared_{shape}_2gpu_mbs1")
        if r is None:
            continue
        parts.append(f"`{r['plan_summary']}` {'passes' if r['pass'] else 'fails'} (loss "
                     f"{r['loss_layout_vs_fp32']:.1e} from fp32, the one-rank bf16 reference "
                     f"{r['loss_bf16_reference_vs_fp32']:.1e}; {r.get('commit', '?')})")
    steps = [r for shape in SEARCHED if (r := _step(f"speed23/x2/{shape}_2gpu")) is not None]
    measured = ("; measured over NCCL: " + ", ".join(
        f"`{r['plan_summary']}` {r['step_time_s'] * 1e3:.1f} ms (predicted "
        f"{r['prediction']['step_time_s'] * 1e3:.1f})" for r in steps) if steps else
        "; their steps over NCCL are `bash bench/run_campaign.sh h200_searched_x2`'s, which has "
        "not run: no two-GPU machine was lent")
    tp = [(r, folder) for folder in ("tp_memory", "tp_vocab")
          if (r := _step(f"speed23/{folder}/qwen4l_2gpu_shared")) is not None]
    vocab = "" if not tp else (
        " The tp2 plan's per-rank peak, both ranks on the one GPU (`h200_searched_tp_memory_shared`"
        ", `h200_tp_vocab_shared`; the TP runtime split only the attention until 4786544, since "
        "then the vocabulary and dense FFNs too, as the cost model prices them and Megatron-LM "
        "runs them; its bf16 parity passes either way): " + ", ".join(
            f"{max(r['peak_reserved_gib_per_rank']):.1f} GiB reserved at {r.get('commit', '?')}"
            for r, _ in tp) + f" against {tp[0][0]['prediction']['peak_memory_gib']:.1f} "
        "predicted.")
    return ("The plans the search picks on two GPUs (`bench/gpu_plans/searched/*_2gpu.json`), at "
            "one sequence per micro-batch with both ranks on the one GPU over gloo (campaign "
            "`h200_rowwise_norm_1gpu`, `speed23/rowwise/`), against the bf16 criterion of the "
            "parity runs: " + "; ".join(parts) + measured + "." + vocab)


def loss_table() -> list[str]:
    lines = ["| shape | tokens | vocabulary | eager ms | fused ms | its GEMMs alone ms | "
             "beside the GEMMs, eager / fused ms | fused vs eager | commit |",
             "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for shape in ("qwen3", "mixtral"):
        doc = _load(f"speed22/fused_loss/fused_loss_{shape}")
        if doc is None:
            continue
        row, sh = doc["ops"]["cross_entropy"], doc["shapes"]
        e, f = row["eager"]["device_fwd_bwd_s"], row["fused"]["device_fwd_bwd_s"]
        g = row["gemms_fwd_bwd_s"]
        lines.append(f"| {shape} | {sh['tokens']:,} | {sh['vocab']:,} | {e * 1e3:.2f} | "
                     f"{f * 1e3:.2f} | {g * 1e3:.2f} | {(e - g) * 1e3:.1f} / {(f - g) * 1e3:.1f} "
                     f"| {row['fused_vs_eager']:.1e} | {doc.get('commit', '?')} |")
    return lines


def copy_engine_table() -> list[str]:
    doc = _load("copy_engine_x2")
    if doc is None:
        return ["(not measured)"]
    lines = ["| shape | MiB to peer | GEMMs alone ms | NCCL alone ms | NCCL beside ms | ratio | "
             "peer copy alone ms | peer copy beside ms | ratio | copy GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        ce = r["copy_engine"]
        cells = ([f"{ce['copy_s'] * 1e3:.2f}", f"{ce['copy_beside_compute_s'] * 1e3:.2f}",
                  f"{ce['overlap_ratio']:.2f}", f"{ce['gbps']:.0f}"] if ce["status"] == "ok"
                 else [ce["status"], "", "", ""])
        lines.append(f"| {r['shape']['name']} | {r['bytes_to_peer'] / 2**20:.0f} | "
                     f"{r['compute_s'] * 1e3:.2f} | {r['nccl_s'] * 1e3:.2f} | "
                     f"{r['nccl_beside_compute_s'] * 1e3:.2f} | {r['nccl_overlap_ratio']:.2f} | "
                     + " | ".join(cells) + " |")
    return lines


EXPERT_GEMMS = (("mixtral-8x7b, 16k tokens", "speed17/expert_gemm_mixtral"),
                ("mixtral-8x7b, 4,096 tokens", "speed17/expert_gemm_mixtral_4k"),
                ("qwen3-30b-a3b, 16k tokens", "speed17/expert_gemm_qwen3"),
                ("deepseekmoe-16b, 16k tokens", "speed17/expert_gemm_deepseekmoe"),
                ("mixtral-8x7b, 16k tokens (ceiling run)",
                 "speed17/gemm_ceiling/expert_gemm_mixtral"),
                ("mixtral-8x7b, 16k tokens, balanced rows",
                 "speed17/gemm_ceiling/expert_gemm_mixtral_balanced"))


def expert_gemm_table() -> list[str]:
    docs = [(name, d) for name, stem in EXPERT_GEMMS if (d := _load(stem)) is not None]
    variants = list(dict.fromkeys(v for _, d in docs for v in d["variants"]))
    lines = ["| variant | " + " | ".join(n for n, _ in docs) + " |",
             "|---|" + "---:|" * len(docs)]
    for v in variants:
        cells = [f"{d['variants'][v]['fwd_bwd_s'] * 1e3:.2f}" if v in d["variants"] else "-"
                 for _, d in docs]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines.append("| commit | " + " | ".join(d.get("commit", "?") for _, d in docs) + " |")
    return lines


ATTENTION_BLOCKS = ("speed20/attention_block_x1", "speed21/attention_block_x2")


def attention_table() -> list[str]:
    lines = ["| GPUs | shape | kernels | recompute | block ms | predicted ms | error | compute "
             "alone ms | exposed comm ms | all-to-alls alone ms | commit |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for stem in ATTENTION_BLOCKS:
        doc = _load(stem)
        if doc is None:
            continue
        for shape, row in doc["models"].items():
            comm = row.get("comm_alone_s")
            for v in row["variants"].values():
                pred = v["predicted"]["block_s"]
                cells = [f"{x * 1e3:.2f}" if x is not None else "-"
                         for x in (v["block_s"], pred)]
                cells.append(f"{pred / v['block_s'] - 1:+.1%}")
                cells += [f"{x * 1e3:.2f}" if x is not None else "-"
                          for x in (v.get("compute_alone_s"), v.get("exposed_comm_s"), comm)]
                lines.append(f"| {doc['world']} | {shape} | {v['kernels']} | {v['recompute']} | "
                             + " | ".join(cells) + f" | {doc.get('commit', '?')} |")
    return lines


HEAD_GROUPS = ("speed21/attention_block_x1_simulated_sp2", ATTENTION_BLOCKS[1])
"""The simulated SP rank on one GPU, and the two-GPU block (its head-group rows)."""


def head_groups_table() -> list[str]:
    """The attention block with the blocking Ulysses core and in head groups: compute alone
    (one simulated SP rank on one GPU, or the real ranks) with the host ahead of the GPU, on
    an idle GPU, and the host's time to issue it; on two GPUs the block and its exposed
    all-to-alls."""
    lines = ["| GPUs | shape | kernels | recompute | compute alone, host ahead ms | compute "
             "alone, idle GPU ms | host issues it ms | block ms | exposed comm ms | predicted "
             "ms | commit |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def pair(a, b) -> str:
        """blocking / groups"""
        return " / ".join(f"{x * 1e3:.2f}" if x is not None else "-" for x in (a, b))

    found = False
    for stem in HEAD_GROUPS:
        doc = _load(stem)
        if doc is None:
            continue
        found = True
        gpus = f"{doc['world']}" + (f" (one SP = {doc['simulated_sp']} rank)"
                                    if doc["world"] == 1 else "")
        for shape, row in doc["models"].items():
            for v in row["variants"].values():
                g = v.get("head_groups")
                if g is None:
                    continue
                cells = [pair(v.get(k), g.get(k)) for k in (
                    "compute_alone_device_s", "compute_alone_s", "compute_alone_host_s",
                    "block_s", "exposed_comm_s")]
                cells.append(pair(v["predicted"]["block_s"], g["predicted"]["block_s"]))
                lines.append(f"| {gpus} | {shape} | {v['kernels']} | {v['recompute']} | "
                             + " | ".join(cells) + f" | {doc.get('commit', '?')} |")
    return lines if found else []


def parity_text() -> str:
    """The head groups' bf16 parity with both ranks on one GPU (gloo, CUDA streams), without
    and with recomputation."""
    docs = [d for d in (_load(f"speed21/parity_shared_mixtral2l_sp2_ep2_a2a_interop{tag}")
                        for tag in ("", "_sel", "_full")) if d is not None]
    if not docs:
        return ""
    runs = "; ".join(
        f"`{d['plan_summary'].split(' sync:')[0]}` {d.get('commit', '?')}: "
        f"{'pass' if d['pass'] else 'FAIL'}, loss {d['loss_rel_err']:.2e} and gradients up "
        f"to {d['grad_max_rel_err']:.2e} from the one-GPU bf16 reference (the layout "
        f"{d['grad_max_layout_vs_fp32']:.3f} and the reference "
        f"{d['grad_max_bf16_reference_vs_fp32']:.3f} from fp32)" for d in docs)
    same = len({(d["loss"], d["grad_max_rel_err"]) for d in docs}) == 1 and len(docs) > 1
    return ("- Ulysses in head groups (under `inter_op`, above), with both ranks on one GPU over "
            f"gloo, each on its two CUDA streams (`speed21/parity_shared_*`): {runs}"
            + (" (the same bits: a rerun repeats the forward's kernels on the same inputs)"
               if same else "")
            + ". Over NCCL it is `h200_head_groups_x2`'s to run.")


def head_groups_text() -> str:
    """What the head groups cost one simulated SP rank's compute, against the prediction."""
    doc = _load(HEAD_GROUPS[0])
    if doc is None:
        return ""
    pairs = [(v, v["head_groups"], shape) for shape, row in doc["models"].items()
             for v in row["variants"].values() if "head_groups" in v]
    device = [g["compute_alone_device_s"] - v["compute_alone_device_s"] for v, g, _ in pairs]
    share = [g["compute_alone_device_s"] / v["compute_alone_device_s"] - 1 for v, g, _ in pairs]
    priced = [g["predicted"]["block_s"] - v["predicted"]["block_s"] for v, g, _ in pairs]
    worst = max(pairs, key=lambda p: p[1]["compute_alone_host_s"]
                / p[1]["compute_alone_device_s"])
    g = worst[1]

    def span(xs: list[float]) -> str:
        lo, hi = f"{min(xs) * 1e3:.2f}", f"{max(xs) * 1e3:.2f}"
        return lo if lo == hi else f"{lo}-{hi}"

    return (
        f"With the host ahead the groups cost the compute {span(device)} ms a block "
        f"({min(share):+.1%} to {max(share):+.1%}: the second core call, each group's "
        f"packing, the streams' events), against {span(priced)} ms priced (the extra "
        f"collective calls). They cost the host more: it takes "
        f"{g['compute_alone_host_s'] * 1e3:.2f} ms to issue the {worst[2]} {worst[0]['kernels']} "
        f"grouped block with {worst[0]['recompute']} recomputation, whose kernels run "
        f"{g['compute_alone_device_s'] * 1e3:.2f} ms (blocking: "
        f"{worst[0]['compute_alone_host_s'] * 1e3:.2f} against "
        f"{worst[0]['compute_alone_device_s'] * 1e3:.2f}), so the groups pay only "
        "where the GPU's queue stays ahead (behind a step's expert GEMMs) and the all-to-alls "
        "hidden beside the other group's core outweigh that cost. On these machines NCCL beside "
        "compute hid none of its time (efficiency.overlap 0), so on `h200-runtime` the cost "
        "model prices inter_op at SP > 1 slower than overlap none and the planner does not "
        "pick it; what the groups hide on two GPUs is `h200_head_groups_x2`'s to measure.")


def clocks_text() -> str:
    """The SM clock and power while the Mixtral-shaped layer runs (nvidia-smi every 250 ms)."""
    path = RESULTS / "speed20" / "clocks" / "smi.csv"
    layer = _load("speed20/clocks/moe_layer_x1_fused_gaf_clocks")
    if not path.exists() or layer is None:
        return ""
    rows = list(csv.reader(path.read_text().splitlines()))[1:]
    busy = [r for r in rows if float(r[3].split()[0]) > 300]  # the layer running, not idle
    clocks = sorted(int(r[1].split()[0]) for r in busy)
    capped = sum(int(r[6], 16) & 0x4 != 0 for r in busy)  # clocks event: SW power cap
    watts = statistics.median(float(r[3].split()[0]) for r in busy)
    shape = layer["shapes"]["mixtral-8x7b"]
    ours, peer = shape["local"]["fwd_bwd_s"]["serial"] * 1e3, shape["peer"]["fwd_bwd_s"] * 1e3
    return (f"Why (`speed20/clocks/`, campaign `h200_layer_clocks`, "
            f"{layer.get('commit', '?')}: nvidia-smi every 250 ms beside `moe_layer_gpu.py "
            f"--shapes mixtral-8x7b --kernels fused --grad-accumulation-fusion`, ours "
            f"{ours:.2f} ms against torchtitan's {peer:.2f}, "
            f"{peer / ours:.2f}x): of the {len(busy)} samples above 300 W, {capped} have the "
            f"clock held by the software power cap; the median draw is {watts:.0f} W of the "
            f"{busy[0][4].strip()} limit and the SM clock median "
            f"{statistics.median(clocks):.0f} MHz (range {clocks[0]}-{clocks[-1]}) against the "
            f"{busy[0][2].strip()} maximum it holds below the cap. The expert GEMMs run at the "
            "rate the power limit leaves, and the peer's grouped GEMMs under the same limit: a "
            "1.15x lead at this shape needs the same FLOPs for less energy.")


def ceiling_text() -> str:
    """How much faster than torchtitan's our Mixtral-shaped layer could be with its expert
    GEMMs at the best rate measured for the same FLOPs (issue 11's 1.15x target)."""
    gemms = _load("speed17/gemm_ceiling/expert_gemm_mixtral")
    layer = _load("speed16/moe_layer_x1_fused")
    if gemms is None or layer is None:
        return ""
    v = {k: x["fwd_bwd_s"] * 1e3 for k, x in gemms["variants"].items()}
    even = _load("speed17/gemm_ceiling/expert_gemm_mixtral_balanced")
    moved = (max(abs(x["fwd_bwd_s"] * 1e3 / v[k] - 1) for k, x in even["variants"].items())
             if even else None)
    shape = layer["shapes"]["mixtral-8x7b"]
    ours, peer = shape["local"]["fwd_bwd_s"]["serial"] * 1e3, shape["peer"]["fwd_bwd_s"] * 1e3
    rest = ours - (v["grouped"] - v["swiglu"])  # our layer less its grouped GEMMs
    best = min(v["dense"], v["per_expert_fn"])
    ceiling = best - v["swiglu"] + rest
    flops = 3 * gemms["gemm_flops_fwd"] / ((best - v["swiglu"]) * 1e-3) / 1e12
    return (f"How far the Mixtral-shaped layer can go (`h200_gemm_ceiling`, "
            f"`speed17/gemm_ceiling/`, {gemms.get('commit', '?')}): the same FLOPs as dense "
            f"cuBLAS matmuls (`dense`: every row through one expert's weights) take "
            f"{v['dense']:.2f} ms with the eager SwiGLU ({v['swiglu']:.2f} ms alone), one "
            f"cuBLAS matmul per expert {v['per_expert_fn']:.2f}, the grouped GEMMs "
            f"{v['grouped']:.2f}"
            + (f"; balanced row counts move each by at most {moved:.1%}" if even else "")
            + f". At the best of these ({best - v['swiglu']:.1f} ms of GEMMs, "
            f"{flops:.0f} TFLOP/s) and with the rest of our fused layer as measured "
            f"({rest:.1f} ms: its {ours:.2f} ms less its grouped GEMMs), the layer would take "
            f"{ceiling:.1f} ms against torchtitan's {peer:.2f}: {peer / ceiling:.2f}x, under the "
            "1.15x target. What is left at this shape is the bf16 GEMM rate itself.")


def _qwen_per_expert() -> float:
    v = _load("speed17/expert_gemm_qwen3")["variants"]
    return v["runtime_accumulating"]["fwd_bwd_s"] / v["grouped_accumulate"]["fwd_bwd_s"]


def fusion_text() -> str:
    """The fused steps against their twins, and the first form (counts read in the forward)."""
    def gain(folder: str, stem: str) -> tuple[float, float, float, str]:
        a, b = _step(f"{folder}/{stem}"), _step(f"{folder}/{stem}_gaf")
        return (a["step_time_s"] * 1e3, b["step_time_s"] * 1e3,
                1 - b["step_time_s"] / a["step_time_s"], b.get("commit", "?"))
    mbs1, mbs8 = gain("speed17", "mixtral2l_1gpu"), gain("speed17", "mixtral2l_1gpu_mbs8_fused")
    first = gain("speed17/counts_in_forward", "mixtral2l_1gpu")
    return (f"The train steps above (one device call, each plan in its own launch; campaign "
            f"`h200_gaf_steps`): eight micro-batches {mbs1[0]:.1f} -> "
            f"{mbs1[1]:.1f} ms ({mbs1[2]:.1%} faster), one micro-batch of the whole batch "
            f"{mbs8[0]:.1f} -> {mbs8[1]:.1f} ms ({mbs8[2]:.1%}: one accumulation pass less). "
            f"The first form ran the experts' forward per expert too and read the row counts "
            f"on the host there: the host waited for the GPU at every MoE layer and the "
            f"eight-micro-batch step went {first[0]:.1f} -> {first[1]:.1f} ms "
            f"(`speed17/counts_in_forward/`, {first[3]}).")


def per_expert_forward_text() -> str:
    """The A/B of one matmul per expert in the forward too (its counts read on the host
    there) against the runtime's grouped forward: bench/ab/ab_experts.sh."""
    ab = "speed19/ab_experts"
    layers = {form: _load(f"{ab}/moe_layer_x1_fused_gaf_{form}")
              for form in ("per_expert", "grouped")}
    steps = {run: _step(f"{ab}/{run}") for run in (
        "mixtral2l_1gpu_mbs8_fused_gaf_grouped_a", "mixtral2l_1gpu_mbs8_fused_gaf_per_expert",
        "mixtral2l_1gpu_mbs8_fused_gaf_grouped_b", "mixtral2l_1gpu_gaf_grouped",
        "mixtral2l_1gpu_gaf_per_expert")}
    gemms = _load(f"{ab}/expert_gemm_mixtral")
    if any(d is None for d in (*layers.values(), *steps.values(), gemms)):
        return ""
    layer = {f: d["shapes"]["mixtral-8x7b"]["local"]["fwd_bwd_s"]["serial"] * 1e3
             for f, d in layers.items()}
    ms = {run: d["step_time_s"] * 1e3 for run, d in steps.items()}
    v = {k: x["fwd_bwd_s"] * 1e3 for k, x in gemms["variants"].items()}
    ceiling = _load("speed17/gemm_ceiling/expert_gemm_mixtral")
    before = ceiling["variants"]["runtime_accumulating"]["fwd_bwd_s"] * 1e3
    return (
        "- One cuBLAS matmul per expert in the forward and the rows' gradient too, for few "
        "wide experts under gradient-accumulation fusion (`bench/ab/ab_experts.sh`, "
        f"`speed19/ab_experts/`, {gemms.get('commit', '?')}): the forward needs the row "
        "counts on the host, so the host waits for the GPU at every MoE layer. The expert "
        f"GEMMs take {v['runtime_accumulating']:.2f} ms (the runtime's grouped form "
        f"{before:.2f} in `speed17/gemm_ceiling/`, another machine), and the Mixtral layer "
        f"{layer['per_expert']:.2f} against {layer['grouped']:.2f} ms in the same call; "
        "but the train steps gain nothing: one micro-batch of the whole batch "
        f"{ms['mixtral2l_1gpu_mbs8_fused_gaf_per_expert']:.1f} ms against "
        f"{ms['mixtral2l_1gpu_mbs8_fused_gaf_grouped_a']:.1f} and "
        f"{ms['mixtral2l_1gpu_mbs8_fused_gaf_grouped_b']:.1f} for the grouped forward before "
        "and after it (A/B/A), eight micro-batches "
        f"{ms['mixtral2l_1gpu_gaf_per_expert']:.1f} against "
        f"{ms['mixtral2l_1gpu_gaf_grouped']:.1f} ms (its slowest steps the host's waits). "
        "The runtime keeps the grouped forward.")


def interop_step_text() -> str:
    """The overlapped dp2 x ep2 step against its serial twin, from their results."""
    over, serial = _step("mixtral2l_dp2_ep2_interop"), _step("mixtral2l_dp2_ep2")
    if over is None or serial is None:
        return "not measured"
    return (f"{over['step_time_s'] * 1e3:.1f} against {serial['step_time_s'] * 1e3:.1f} ms, "
            f"{over.get('commit', '?')} and {serial.get('commit', '?')}")


def sections() -> dict[str, str]:
    """The generated parts of the report, by the name its template (performance.md) gives."""
    return {
        "step_table": "\n".join(step_table()),
        "targets": "\n".join(targets()),
        "layer_table": "\n".join(layer_table()),
        "peer_table": "\n".join(peer_table()),
        "trace_table": "\n".join(trace_table()),
        "schedule_table": "\n".join(schedule_table()),
        "probe_table": "\n".join(probe_table()),
        "attention_x2_note": "" if _load(ATTENTION_BLOCKS[1]) else (
            ", which has not run: no two-GPU machine was lent since the bench was written"),
        "attention_table": "\n".join(attention_table()),
        "head_groups_x2_note": "" if _load(HEAD_GROUPS[1]) else (
            " (not run: no two-GPU machine was lent since the head groups were built)"),
        "head_groups_table": "\n".join(head_groups_table() or [
            "No head-group measurement is committed yet "
            "(`bash bench/run_campaign.sh h200_head_groups_1gpu`)."]),
        "head_groups_text": head_groups_text(),
        "fused_table": "\n".join(fused_table()),
        "loss_table": "\n".join(loss_table()),
        "searched_table": "\n".join(searched_table()),
        "searched_x2_text": searched_x2_text(),
        "copy_engine_table": "\n".join(copy_engine_table()),
        "interop_step_text": interop_step_text(),
        "parity_text": parity_text(),
        "per_expert_forward_text": per_expert_forward_text(),
        "expert_gemm_table": "\n".join(expert_gemm_table()),
        "ceiling_text": ceiling_text(),
        "clocks_text": clocks_text(),
        "qwen_per_expert": f"{_qwen_per_expert():.2f}",
        "fusion_text": fusion_text(),
    }


def render() -> str:
    """docs/performance.md: the template's prose with its ``{{name}}`` parts filled in."""
    parts = sections()
    return PLACEHOLDER.sub(lambda m: parts[m.group(1)], TEMPLATE.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/performance.md is "
                                                        "stale")
    args = p.parse_args()
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print("docs/performance.md is stale: python -m bench.steps.performance_report",
                  file=sys.stderr)
            return 1
        print("docs/performance.md current")
        return 0
    DOC.write_text(text)
    print(f"-> {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
