"""Human tables and JSON documents for search, scale, what-if, catalog and explain.

Tables never cut a value: rows are plain text, aligned, as wide as their values (piped output,
CI logs); where the output width is known (COLUMNS, or a terminal) and a row does not fit, each
row becomes a record whose values wrap between values, never inside one. JSON documents share
one envelope (schema version, moeplan version, command, job) and one ranked-plan object.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models import Evaluation
from planner.search import BASELINE_LABEL, REFERENCE_LABEL, Ranked, SearchResult
from plans import ClusterSpec, ModelSpec, Plan, TrainingSpec

GIB = 2**30
JSON_SCHEMA_VERSION = 1
"""Version of the --json documents' shape (envelope and ranked-plan object)."""
HEADROOM_WARNING = 0.05
"""Plans with less than this share of usable memory left get a warning: allocator
fragmentation and workspace the model does not count can exceed it."""


# ---- tables ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    name: str
    numeric: bool = True
    """Right-aligned; in a record shown as `name value`. Text columns (left-aligned) are
    shown in a record on their own line, without their name."""


def output_width() -> int | None:
    """Width to fit tables in: $COLUMNS when set, the terminal's width on a terminal, else
    none (piped: rows as wide as their values)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def render_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]],
                 width: int | None = None) -> str:
    """Aligned rows under a header, or, when they do not fit ``width``, one record per row:
    the first value, then each text value on its own line and the numeric values as
    `name value` pairs wrapped between pairs."""
    widths = [max([len(c.name), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    table_width = sum(widths) + 2 * (len(columns) - 1)
    lines = [title]
    if width is None or table_width <= width:
        def line(cells: Sequence[str]) -> str:
            return "  ".join(cell.rjust(w) if c.numeric else cell.ljust(w)
                             for c, cell, w in zip(columns, cells, widths, strict=True)).rstrip()
        lines += [line([c.name for c in columns]), line(["-" * w for w in widths])]
        lines += [line(r) for r in rows]
        return "\n".join(lines)
    label_width = widths[0]
    for r in rows:
        head = r[0].ljust(label_width)
        pairs: list[str] = []
        for c, cell in zip(columns[1:], r[1:], strict=True):
            if not c.numeric:
                if cell in ("", "-"):
                    continue
                if head is not None and len(head) + 2 + len(cell) <= width:
                    lines.append(f"{head}  {cell}")
                else:
                    if head is not None:
                        lines.append(head.rstrip())
                    lines += textwrap.wrap(cell, width, initial_indent=" " * (label_width + 2),
                                           subsequent_indent=" " * (label_width + 4),
                                           break_long_words=False, break_on_hyphens=False)
                head = None
            elif cell:
                pairs.append(f"{c.name} {cell}" if c.name else cell)
        if head is not None:
            lines.append(head.rstrip())
        indent = " " * (label_width + 2)
        current = ""
        for pair in pairs:
            if current and len(indent) + len(current) + 3 + len(pair) > width:
                lines.append(indent + current)
                current = ""
            current += (" | " if current else "") + pair
        if current:
            lines.append(indent + current)
    return "\n".join(lines)


def echo_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    print(render_table(title, columns, rows, output_width()))


def echo(text: str) -> None:
    """A line of prose, wrapped between words to the output width when there is one."""
    width = output_width()
    print(textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False,
                        subsequent_indent="  ") if width else text)


# ---- the job, the ranked plan, the envelope ---------------------------------------------------


def param_count(n: float) -> str:
    """A parameter count in K, M, B or T with three significant digits (671B, 46.7B, 1.03T)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,.0f}"


def params_text(model: ModelSpec) -> str:
    """``671B total, 37.6B active`` (ModelSpec.total_params, active_params)."""
    return f"{param_count(model.total_params)} total, {param_count(model.active_params)} active"


def job_text(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
             batch_note: str = "") -> str:
    """The job in one line: model, GPUs, batch, sequence, precision."""
    gpus = f"{cluster.gpus:,} x {cluster.gpu.name}"
    if cluster.gpus > cluster.node.gpus_per_node:
        gpus += f" ({cluster.nodes} nodes of {cluster.node.gpus_per_node})"
    return (f"{model.name} ({params_text(model)}) on {gpus}: global batch "
            f"{training.global_batch:,}{batch_note} x {training.seq_len:,} tokens = "
            f"{training.tokens_per_step:,} tokens/step, {training.precision.value}")


def job_document(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 gpus: int | list[int] | None = None) -> dict:
    return {"model": model.name, "cluster": cluster.name,
            "gpus": cluster.gpus if gpus is None else gpus,
            "global_batch": training.global_batch, "seq_len": training.seq_len,
            "precision": training.precision.value}


def envelope(command: str, job: dict | None, **payload) -> dict:
    """Every --json document: {schema_version, moeplan_version, command, job, ...payload}."""
    from planner.version import moeplan_version

    return {"schema_version": JSON_SCHEMA_VERSION, "moeplan_version": moeplan_version(),
            "command": command, "job": job, **payload}


def headroom(e: Evaluation) -> float:
    """Share of usable memory a plan leaves free (negative: it does not fit)."""
    return 1 - e.memory.peak_bytes / e.memory.capacity_bytes


def ranked_document(label: str, plan: Plan, e: Evaluation) -> dict:
    """One ranked plan, the same object in search, scale, whatif and explain; ``unexecuted``:
    its mechanisms no runtime executes."""
    return {
        "label": label,
        "notation": plan.summary(),
        "target": plan.target.value,
        "unexecuted": unexecuted(plan),
        "step_time_s": e.step_time_s,
        "tokens_per_s": e.tokens_per_s,
        "tokens_per_s_per_gpu": e.tokens_per_s / plan.cluster.gpus,
        "mfu": e.mfu,
        "peak_memory_gib": e.memory.peak_bytes / GIB,
        "usable_memory_gib": e.memory.capacity_bytes / GIB,
        "memory_headroom": headroom(e),
        "feasible": e.feasible,
        "plan": plan.model_dump(mode="json"),
    }


def _ranked(label: str, r: Ranked | None) -> dict | None:
    return None if r is None else ranked_document(label, r.plan, r.evaluation)


def _gib(n_bytes: float) -> str:
    gib = n_bytes / GIB
    return f"{gib:.1f}" if gib >= 1 else f"{gib:.2g}"


def memory_text(e: Evaluation) -> str:
    return f"{_gib(e.memory.peak_bytes)}/{_gib(e.memory.capacity_bytes)}"


def seconds_text(t: float) -> str:
    """Step time: milliseconds shown below a second, three significant digits at least."""
    return f"{t:.3f}" if t >= 1 else f"{t:.3g}"


def headroom_warnings(rows: Sequence[tuple[str, Evaluation]]) -> list[str]:
    tight = [f"{label} ({headroom(e):.1%})" for label, e in rows
             if 0 <= headroom(e) < HEADROOM_WARNING]
    if not tight:
        return []
    verb, them = ("leaves", "it") if len(tight) == 1 else ("leave", "them")
    return [f"warning: {', '.join(tight)} {verb} less than {HEADROOM_WARNING:.0%} of usable "
            f"memory free: allocator fragmentation can run {them} out of memory"]


# ---- search ---------------------------------------------------------------------------------

PLAN_COLUMNS = (Column("", numeric=False), Column("layout", numeric=False),
                Column("options", numeric=False), Column("step s"), Column("tokens/s"),
                Column("MFU"), Column("peak/usable GiB"))


def plan_row(label: str, p: Plan, e: Evaluation) -> list[str]:
    return [label, p.layout_notation(), p.options_notation(), seconds_text(e.step_time_s),
            f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}", memory_text(e)]


UNEXECUTED_MARK = "*"
"""Marks a row using a mechanism no runtime executes (plans.execution.executed_anywhere)."""


def unexecuted(plan: Plan) -> list[str]:
    """The plan's fields whose values no target executes as written (tile-fused overlap)."""
    from plans.execution import executed_anywhere

    return [f"{f} {v}" for f, v in (("overlap", plan.overlap.value),)
            if not executed_anywhere(f, v)]


def print_search(result: SearchResult, job: str) -> None:
    rows = [(f"#{i + 1}", r) for i, r in enumerate(result.top)]
    if result.baseline is not None:
        rows.append(("megatron", result.baseline))
    if result.reference is not None:
        rows.append(("paper", result.reference))
    marked = [label for label, r in rows if unexecuted(r.plan)]
    echo(job)
    echo_table(f"Best plans (fastest first), megatron: {BASELINE_LABEL}, paper: "
               f"{REFERENCE_LABEL}", PLAN_COLUMNS,
               [plan_row(label + (UNEXECUTED_MARK if label in marked else ""), r.plan,
                         r.evaluation) for label, r in rows])
    if marked:
        echo(f"{UNEXECUTED_MARK} no runtime executes tile-fused overlap (ov:inter+intra, "
             "plans.execution): predictions for comparison only")
    for w in headroom_warnings([(label, r.evaluation) for label, r in rows]):
        echo(w)
    s = result.stats
    echo(f"searched {s.candidates:,} candidates in {s.seconds:.2f} s: {s.invalid:,} invalid, "
          f"{s.pruned_memory:,} out of memory, {s.pruned_bound:,} bounded out, "
          f"{s.dominated:,} dominated, {s.evaluated:,} evaluated, {s.feasible:,} feasible")
    if result.speedup is not None:
        line = f"predicted speedup over {BASELINE_LABEL}: {result.speedup:.2f}x"
        if result.reference_speedup is not None:
            line += f", over {REFERENCE_LABEL}: {result.reference_speedup:.2f}x"
        echo(line)
    elif result.baseline is None:
        echo(f"no plan of {BASELINE_LABEL} fits this job")


def search_document(result: SearchResult, job: dict) -> dict:
    s = result.stats
    return envelope(
        "search", job,
        top=[_ranked(f"#{i + 1}", r) for i, r in enumerate(result.top)],
        baseline=_ranked("megatron", result.baseline),
        baseline_kind=BASELINE_LABEL,
        speedup=result.speedup,
        reference=_ranked("paper", result.reference),
        reference_kind=REFERENCE_LABEL,
        reference_speedup=result.reference_speedup,
        search={
            "candidates": s.candidates, "feasible": s.feasible, "seconds": s.seconds,
            "layouts": s.layouts, "invalid": s.invalid, "pruned_memory": s.pruned_memory,
            "pruned_bound": s.pruned_bound, "dominated": s.dominated, "evaluated": s.evaluated,
        },
    )


# ---- explain --------------------------------------------------------------------------------


def explain_document(plan: Plan, e: Evaluation) -> dict:
    return envelope(
        "explain", job_document(plan.model, plan.cluster, plan.training),
        plan=ranked_document("plan", plan, e),
        reason=e.reason,
        step={"breakdown_s": dict(e.breakdown_s)},
        layer={
            "forward_s": e.layer.fwd_s, "backward_s": e.layer.bwd_s,
            "compute_s": e.layer.compute_s, "recompute_s": e.layer.recompute_s,
            "exposed_comm_s": dict(e.layer.exposed_comm_s),
            "critical_path": list(e.layer.critical_path),
        },
        memory_gib={k: v / GIB for k, v in e.memory.components_bytes.items()},
        memory_safety_margin=1 - plan.cluster.efficiency.memory_usable,
    )


def print_explain(plan: Plan, e: Evaluation) -> None:
    echo(job_text(plan.model, plan.cluster, plan.training))
    echo(f"plan: {plan.summary()}")
    if (source := plan.cluster.efficiency_source) is not None:
        echo(f"efficiency factors: {source.kind.value} ({source.note})")
    rows = [[k, f"{v:.4g}", f"{v / e.step_time_s:.1%}"] for k, v in e.breakdown_s.items()]
    rows.append(["step", f"{e.step_time_s:.4g}", "100%"])
    echo_table("Per step", (Column("component", False), Column("seconds"), Column("share")),
               rows)
    print(f"tokens/s {e.tokens_per_s:,.0f}   MFU {e.mfu:.1%}")
    rows = [["forward", f"{e.layer.fwd_s * 1e3:.3f}"], ["backward", f"{e.layer.bwd_s * 1e3:.3f}"],
            ["compute (fwd+bwd, no reruns)", f"{e.layer.compute_s * 1e3:.3f}"]]
    if e.layer.recompute_s:
        rows.append(["recompute (reruns in bwd)", f"{e.layer.recompute_s * 1e3:.3f}"])
    # forward + backward = compute + recompute + the exposed communication below
    rows += [[f"exposed {k}", f"{v * 1e3:.3f}"] for k, v in e.layer.exposed_comm_s.items()]
    echo_table("One MoE layer, one micro-batch", (Column("part", False), Column("ms")), rows)
    echo("critical path: " + " -> ".join(e.layer.critical_path))
    rows = [[k, f"{v / GIB:.3g}"] for k, v in e.memory.components_bytes.items()]
    gpu, usable = plan.cluster.gpu, plan.cluster.efficiency.memory_usable
    # the safety margin (1 - memory_usable) stays free for the CUDA context, NCCL's buffers
    # and the prediction's error
    rows += [["peak (states + transients + reserve)", f"{e.memory.peak_bytes / GIB:.3g}"],
             [f"usable ({gpu.hbm_gib:g} GiB x {usable:g}, {1 - usable:.0%} margin)",
              f"{e.memory.capacity_bytes / GIB:.3g}"],
             ["headroom", f"{(e.memory.capacity_bytes - e.memory.peak_bytes) / GIB:.3g}"]]
    echo_table("Memory per GPU (peak stage)", (Column("component", False), Column("GiB")), rows)
    if not e.feasible:
        echo(f"infeasible: {e.reason}")
    for w in headroom_warnings([("this plan", e)]):
        echo(w)


def measured_document(c, path) -> dict:
    """explain --measured --json: the plan as executed, and per component the predicted and
    measured seconds of one step (mean over ranks) and predicted / measured - 1."""
    plan = c.executed
    return envelope(
        "explain", job_document(plan.model, plan.cluster, plan.training),
        plan=ranked_document("plan", plan, c.evaluation),
        measured={
            "result": str(path),
            "run_commit": c.result.commit,
            "gpu": c.result.gpu,
            "evaluated_as_executed": [f"{d.field}={d.executed}" for d in c.deviations],
            "components": [{"component": r.component, "predicted_s": r.predicted_s,
                            "measured_s": r.measured_s, "error": r.error} for r in c.rows],
        },
    )


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3g}" if t < 1 else f"{t * 1e3:,.0f}"


def print_measured(c, path) -> None:
    """The components of a measured step beside the cost model's: which part is off."""
    plan = c.executed
    echo(job_text(plan.model, plan.cluster, plan.training))
    echo(f"plan as executed: {plan.summary()}")
    if c.deviations:
        echo("evaluated as the runtime ran it: "
             + ", ".join(f"{d.field} {d.planned} -> {d.executed}" for d in c.deviations))
    rows = [[r.component, _ms(r.predicted_s), _ms(r.measured_s),
             "-" if r.error is None else f"{r.error:+.0%}"] for r in c.rows]
    echo(f"measured: {path}")
    echo_table("Seconds per step, mean over ranks",
               (Column("component", False), Column("predicted ms"), Column("measured ms"),
                Column("error")), rows)
    echo("error = predicted / measured - 1; forward and backward hold the layer rows and loss")
    if (w := c.worst()) is not None:
        echo(f"most off: {w.component}, predicted {_ms(w.predicted_s)} ms, measured "
             f"{_ms(w.measured_s)} ms")


# ---- catalog --------------------------------------------------------------------------------


def print_catalog(models: dict[str, ModelSpec], clusters: dict[str, ClusterSpec]) -> None:
    echo_table("Models", [Column("name", False), *map(Column, (
        "layers", "hidden", "heads q/kv", "experts", "top-k", "total", "active"))],
        [[n, str(m.layers), str(m.hidden), f"{m.query_heads}/{m.kv_heads}", str(m.experts),
          str(m.top_k), param_count(m.total_params), param_count(m.active_params)]
         for n, m in models.items()])
    print()
    echo_table("Clusters", [Column("name", False), Column("GPU", False), *map(Column, (
        "bf16 TFLOP/s", "HBM GiB", "NVLink GB/s", "domain")), Column("network", False),
        Column("net GB/s/GPU")],
        [[n, c.gpu.name, f"{c.gpu.bf16_dense_tflops:g}", f"{c.gpu.hbm_gib:g}",
          f"{c.node.nvlink_gb_s:g}", str(c.node.gpus_per_node), c.network.name,
          f"{c.network_gb_s_per_gpu:g}"] for n, c in clusters.items()])


# ---- what-if and scaling -------------------------------------------------------------------------


def _tokens(r: Ranked | None) -> str:
    return f"{r.evaluation.tokens_per_s:,.0f}" if r else "does not fit"


def whatif_document(points, job: dict) -> dict:
    from planner.whatif import plan_changes

    reference = points[0].result.best.plan if points and points[0].result.best else None
    out = []
    for p in points:
        best = p.result.best
        out.append({
            "settings": {s.knob.value: s.text for s in p.settings},
            "best": _ranked("best", best),
            "baseline": _ranked("megatron", p.result.baseline),
            "speedup": p.result.speedup,
            "changes": plan_changes(reference, best.plan if best else None),
        })
    return envelope("whatif", job, points=out)


def print_whatif(points, job: str) -> None:
    doc = whatif_document(points, {})["points"]
    echo(job)
    rows, evaluations = [], []
    for p, d in zip(points, doc, strict=True):
        best = p.result.best
        rows.append([
            p.label, best.plan.summary() if best else "-", _tokens(best),
            f"{best.evaluation.mfu:.1%}" if best else "-",
            memory_text(best.evaluation) if best else "-", _tokens(p.result.baseline),
            f"{d['speedup']:.2f}x" if d["speedup"] else "-", ", ".join(d["changes"]) or "-",
        ])
        if best:
            evaluations.append((p.label, best.evaluation))
    echo_table(f"What if: best plan at each setting vs {BASELINE_LABEL}",
               (Column("setting", False), Column("best plan", False), Column("tokens/s"),
                Column("MFU"), Column("peak/usable GiB"), Column("megatron tokens/s"),
                Column("speedup"), Column("changed vs first", False)), rows)
    for w in headroom_warnings(evaluations):
        echo(w)


def scale_document(points, job: dict) -> dict:
    from planner.scale import SECONDS_PER_DAY

    def days(r: Ranked | None) -> float | None:
        return 1e12 / r.evaluation.tokens_per_s / SECONDS_PER_DAY if r else None

    return envelope("scale", job, points=[{
        "gpus": p.gpus,
        "global_batch": p.training.global_batch,
        "best": _ranked("best", p.result.best),
        "baseline": _ranked("megatron", p.result.baseline),
        "best_days_per_1t_tokens": days(p.result.best),
        "speedup": p.result.speedup,
    } for p in points])


def print_scale(points, job: str) -> None:
    echo(job)
    rows, evaluations = [], []
    for d, p in zip(scale_document(points, {})["points"], points, strict=True):
        b, m = d["best"], d["baseline"]
        rows.append([
            f"{d['gpus']:,}", f"{d['global_batch']:,}", b["notation"] if b else "-",
            f"{b['tokens_per_s']:,.0f}" if b else "-",
            f"{b['tokens_per_s_per_gpu']:,.0f}" if b else "-",
            f"{b['mfu']:.1%}" if b else "-",
            f"{d['best_days_per_1t_tokens']:.1f}" if b else "-",
            memory_text(p.result.best.evaluation) if b else "-",
            f"{m['tokens_per_s']:,.0f}" if m else "-", f"{m['mfu']:.1%}" if m else "-",
            f"{d['speedup']:.2f}x" if d["speedup"] else "-",
        ])
        if p.result.best:
            evaluations.append((f"{d['gpus']} GPUs", p.result.best.evaluation))
    echo_table(f"Scaling: best plan and {BASELINE_LABEL}",
               (Column("GPUs"), Column("batch"), Column("plan", False), Column("tokens/s"),
                Column("/GPU"), Column("MFU"), Column("days/1T"), Column("peak/usable GiB"),
                Column("megatron tokens/s"), Column("megatron MFU"), Column("speedup")), rows)
    for w in headroom_warnings(evaluations):
        echo(w)


def echo_calibration(base, result, rows: list[dict]) -> None:
    """The fitted factors against the base cluster's, and measured runs against predictions
    before and after (``held_out`` runs were not used for fitting), as plain tables."""
    factors = []
    for name, value in result.factors.items():
        old = (base.node.nvlink_latency_us if name == "nvlink_latency_us"
               else getattr(base.efficiency, name))
        factors.append((name, f"{old:g}", f"{value:.3f}"))
    echo_table(f"{result.cluster.name}: fitted factors",
               (Column("factor", False), Column(base.name), Column("fitted")), factors)
    if not rows:
        return
    runs = [(r["plan"] + ("" if r["held_out"] else " (fitted on)"),
             f"{r['measured_step_s'] * 1e3:.1f}", f"{r['step_error_before']:+.0%}",
             f"{r['step_error']:+.0%}", f"{r['memory_error']:+.0%}") for r in rows]
    print()
    echo_table("measured steps against predictions (plans priced as executed)",
               (Column("plan", False), Column("measured ms"), Column("before"),
                Column("after"), Column("memory")), runs)
