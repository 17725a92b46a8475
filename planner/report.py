"""Human tables and JSON documents for search results and plan explanations."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from cost_models import Evaluation
from planner.search import Ranked, SearchResult
from plans import EPFFN, Plan

GIB = 2**30


def _ffn(plan: Plan) -> str:
    d = plan.degrees
    if isinstance(plan.ffn, EPFFN):
        short = {"all_to_all": "a2a", "allgather_reduce_scatter": "ag+rs"}[plan.ffn.dispatch]
        return f"ep{d.ep} {short}" if d.ep > 1 else "ep1"
    return f"etp{d.etp}"


def _attention(plan: Plan) -> str:
    d = plan.degrees
    n = d.attention_group
    return {"ulysses_sp": f"sp{n}", "tp": f"tp{n}", "cp": f"cp{n}"}[plan.attention.kind]


def layout_text(plan: Plan) -> str:
    d = plan.degrees
    vpp = f" vpp{d.vpp}" if d.vpp > 1 else ""
    return f"pp{d.pp}{vpp} dp{d.dp} {_attention(plan)} {_ffn(plan)} mbs{plan.micro_batch_size}"


def options_text(plan: Plan) -> str:
    overlap = {"none": "none", "inter_op": "inter", "inter_intra_op": "inter+intra"}
    recompute = {"none": "none", "selective": "sel", "full": "full"}
    sched = "1f1b" if plan.schedule.value == "1f1b" else "i1f1b"
    return (f"{sched} ov:{overlap[plan.overlap.value]} rc:{recompute[plan.recompute.value]} "
            f"sync:{plan.grad_sync_precision.value}")


def plans_table(rows: list[tuple[str, Ranked]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("", no_wrap=True)
    table.add_column("layout", no_wrap=True)
    table.add_column("options")
    for col in ("step s", "tokens/s", "MFU", "GiB"):
        table.add_column(col, justify="right", no_wrap=True)
    for label, r in rows:
        p, e = r.plan, r.evaluation
        table.add_row(label, layout_text(p), options_text(p), f"{e.step_time_s:.3f}",
                      f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
                      f"{e.memory.peak_bytes / GIB:.1f}")
    return table


def print_search(result: SearchResult, console: Console) -> None:
    rows = [(f"#{i + 1}", r) for i, r in enumerate(result.top)]
    if result.baseline is not None:
        rows.append(("megatron", result.baseline))
    console.print(plans_table(rows, "Best plans (fastest first) and the Megatron-LM-style layout"))
    s = result.stats
    console.print(
        f"searched {s.candidates:,} candidates in {s.seconds:.2f} s: {s.invalid:,} invalid, "
        f"{s.pruned_memory:,} out of memory, {s.pruned_bound:,} bounded out, "
        f"{s.dominated:,} dominated, {s.evaluated:,} evaluated, {s.feasible:,} feasible"
    )
    if result.speedup is not None:
        console.print(f"predicted speedup over the Megatron-LM-style layout: "
                      f"[bold]{result.speedup:.2f}x[/bold]")
    elif result.baseline is None:
        console.print("the Megatron-LM-style layout does not fit this job")


def search_document(result: SearchResult) -> dict:
    s = result.stats
    return {
        "best": result.best.plan.model_dump(mode="json") if result.best else None,
        "top": [r.plan.model_dump(mode="json") for r in result.top],
        "baseline": result.baseline.plan.model_dump(mode="json") if result.baseline else None,
        "speedup": result.speedup,
        "search": {
            "candidates": s.candidates, "feasible": s.feasible, "seconds": s.seconds,
            "layouts": s.layouts, "invalid": s.invalid, "pruned_memory": s.pruned_memory,
            "pruned_bound": s.pruned_bound, "dominated": s.dominated, "evaluated": s.evaluated,
        },
    }


def explain_document(plan: Plan, e: Evaluation) -> dict:
    return {
        "plan": plan.summary(),
        "feasible": e.feasible,
        "reason": e.reason,
        "step": {"step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
                 "breakdown_s": dict(e.breakdown_s)},
        "layer": {
            "forward_s": e.layer.fwd_s, "backward_s": e.layer.bwd_s,
            "compute_s": e.layer.compute_s, "exposed_comm_s": dict(e.layer.exposed_comm_s),
            "critical_path": list(e.layer.critical_path),
        },
        "memory_gib": {k: v / GIB for k, v in e.memory.components_bytes.items()},
        "peak_memory_gib": e.memory.peak_bytes / GIB,
        "usable_memory_gib": e.memory.capacity_bytes / GIB,
        "memory_safety_margin": 1 - plan.cluster.efficiency.memory_usable,
    }


def print_explain(plan: Plan, e: Evaluation, console: Console) -> None:
    console.print(f"[bold]{plan.model.name}[/bold] on {plan.cluster.gpus} x "
                  f"{plan.cluster.gpu.name}: {plan.summary()}")
    step = Table(title="Per step", title_justify="left")
    step.add_column("component")
    step.add_column("seconds", justify="right")
    step.add_column("share", justify="right")
    for k, v in e.breakdown_s.items():
        step.add_row(k, f"{v:.4f}", f"{v / e.step_time_s:.1%}")
    step.add_row("[bold]step[/bold]", f"{e.step_time_s:.4f}", "100%")
    console.print(step)
    console.print(f"tokens/s {e.tokens_per_s:,.0f}   MFU {e.mfu:.1%}")

    layer = Table(title="One MoE layer, one micro-batch", title_justify="left")
    layer.add_column("part")
    layer.add_column("ms", justify="right")
    layer.add_row("forward", f"{e.layer.fwd_s * 1e3:.3f}")
    layer.add_row("backward", f"{e.layer.bwd_s * 1e3:.3f}")
    layer.add_row("compute (fwd+bwd)", f"{e.layer.compute_s * 1e3:.3f}")
    for k, v in e.layer.exposed_comm_s.items():
        layer.add_row(f"exposed {k}", f"{v * 1e3:.3f}")
    console.print(layer)
    console.print("critical path: " + " -> ".join(e.layer.critical_path))

    mem = Table(title="Memory per GPU (peak stage)", title_justify="left")
    mem.add_column("component")
    mem.add_column("GiB", justify="right")
    for k, v in e.memory.components_bytes.items():
        mem.add_row(k, f"{v / GIB:.2f}")
    mem.add_row("[bold]peak[/bold] = states + max(fwd/bwd transients, optimizer step) "
                "+ allocator reserve", f"{e.memory.peak_bytes / GIB:.2f}")
    gpu, usable = plan.cluster.gpu, plan.cluster.efficiency.memory_usable
    mem.add_row(f"usable = {gpu.hbm_gib:g} GiB HBM x {usable:g} (safety margin "
                f"{1 - usable:.0%}: CUDA context, NCCL buffers, prediction error)",
                f"{e.memory.capacity_bytes / GIB:.2f}")
    mem.add_row("headroom", f"{(e.memory.capacity_bytes - e.memory.peak_bytes) / GIB:.2f}")
    console.print(mem)
    if not e.feasible:
        console.print(f"[red]infeasible:[/red] {e.reason}")


# ---- what-if and scaling -------------------------------------------------------------------------


def _tokens(r: Ranked | None) -> str:
    return f"{r.evaluation.tokens_per_s:,.0f}" if r else "does not fit"


def whatif_document(points) -> list[dict]:
    from planner.whatif import plan_changes

    reference = points[0].result.best.plan if points and points[0].result.best else None
    out = []
    for p in points:
        best, base = p.result.best, p.result.baseline
        out.append({
            "settings": {s.knob.value: s.text for s in p.settings},
            "best": best.plan.model_dump(mode="json") if best else None,
            "tokens_per_s": best.evaluation.tokens_per_s if best else None,
            "mfu": best.evaluation.mfu if best else None,
            "baseline_tokens_per_s": base.evaluation.tokens_per_s if base else None,
            "baseline_mfu": base.evaluation.mfu if base else None,
            "speedup": p.result.speedup,
            "changes": plan_changes(reference, best.plan if best else None),
        })
    return out


def print_whatif(points, console: Console) -> None:
    doc = whatif_document(points)
    table = Table(title="What if: best plan at each setting vs the Megatron-LM-style layout",
                  title_justify="left")
    for col in ("setting", "best plan", "tokens/s", "MFU", "megatron tokens/s", "speedup",
                "changed vs first"):
        table.add_column(col, justify="right" if col in ("tokens/s", "MFU", "speedup",
                                                          "megatron tokens/s") else "left")
    for p, d in zip(points, doc, strict=True):
        best = p.result.best
        table.add_row(
            p.label, f"{layout_text(best.plan)} {options_text(best.plan)}" if best else "-",
            _tokens(best),
            f"{best.evaluation.mfu:.1%}" if best else "-", _tokens(p.result.baseline),
            f"{d['speedup']:.2f}x" if d["speedup"] else "-", ", ".join(d["changes"]) or "-",
        )
    console.print(table)


def scale_document(points) -> list[dict]:
    from planner.scale import row

    return [{
        "gpus": p.gpus,
        "global_batch": p.training.global_batch,
        "best": row(p.result.best, p.gpus),
        "baseline": row(p.result.baseline, p.gpus),
        "speedup": p.result.speedup,
    } for p in points]


def print_scale(points, console: Console) -> None:
    table = Table(title="Scaling: best plan and Megatron-LM-style layout", title_justify="left")
    for col in ("GPUs", "batch", "plan", "tokens/s", "/GPU", "MFU", "days/1T", "megatron tokens/s",
                "megatron MFU", "speedup"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for d in scale_document(points):
        b, m = d["best"], d["baseline"]
        table.add_row(
            str(d["gpus"]), str(d["global_batch"]), b["plan"] if b else "-",
            f"{b['tokens_per_s']:,.0f}" if b else "-",
            f"{b['tokens_per_s_per_gpu']:,.0f}" if b else "-",
            f"{b['mfu']:.1%}" if b else "-", f"{b['days_per_1t_tokens']:.1f}" if b else "-",
            f"{m['tokens_per_s']:,.0f}" if m else "-", f"{m['mfu']:.1%}" if m else "-",
            f"{d['speedup']:.2f}x" if d["speedup"] else "-",
        )
    console.print(table)


def calibration_tables(base, result, rows: list[dict]) -> list[Table]:
    """The fitted factors against the base cluster's, and measured runs against predictions
    before and after (``held_out`` runs were not used for fitting)."""
    factors = Table(title=f"{result.cluster.name}: fitted factors")
    for col in ("factor", base.name, "fitted"):
        factors.add_column(col, justify="right" if col != "factor" else "left")
    for name, value in result.factors.items():
        old = (base.node.nvlink_latency_us if name == "nvlink_latency_us"
               else getattr(base.efficiency, name))
        factors.add_row(name, f"{old:g}", f"{value:.3f}")
    tables = [factors]
    if rows:
        runs = Table(title="measured steps against predictions (plans priced as executed)")
        for col in ("plan", "measured ms", "before", "after", "memory"):
            runs.add_column(col, justify="left" if col == "plan" else "right")
        for r in rows:
            label = r["plan"] + ("" if r["held_out"] else " (fitted on)")
            runs.add_row(label, f"{r['measured_step_s'] * 1e3:.1f}",
                         f"{r['step_error_before']:+.0%}", f"{r['step_error']:+.0%}",
                         f"{r['memory_error']:+.0%}")
        tables.append(runs)
    return tables
