"""Human tables and JSON documents for search, scale, what-if, catalog and explain.

Tables never cut a value: rows are plain text, aligned; where a row does not fit the output
width (COLUMNS, a terminal's width, or 80 columns piped and in CI logs), each row becomes a
record whose values wrap between values, never inside one. JSON documents share
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
from plans import ClusterSpec, ModelSpec, Plan, Precision, TrainingSpec

GIB = 2**30
JSON_SCHEMA_VERSION = 1
"""Version of the --json documents' shape (envelope and ranked-plan object)."""
HEADROOM_WARNING = 0.05
"""Plans with less than this share of usable memory left get a warning: allocator
fragmentation and workspace the model does not count can exceed it."""


TIE_TOLERANCE = 0.05
"""Plans whose predicted step is within this share of the best one's are ties: the cost
model's stated error, the target docs/fidelity.md holds it to (median |step-time error| <= 5%;
`python -m bench.fidelity.fidelity_report` measures 2.0% over its 19 H200 plans, 1.5% over the 1-GPU
ones). A ranking inside it is not a prediction."""
TIME_DIGITS = 4
"""Significant figures of the largest time in a column of times; the others share its
decimals (at most 3 decimals of a millisecond)."""


# ---- numbers: times, rates, counts -------------------------------------------------------------


def ms_column(seconds: Sequence[float | None], signed: bool = False) -> list[str]:
    """Times as milliseconds, every one at the decimals that give the column's largest
    TIME_DIGITS significant figures: `1,304` beside `2` and `0`, `12.35` beside `0.41` and
    `0.00`; None as `-`; ``signed``: a leading + or -."""
    import math

    largest = max((abs(v) for v in seconds if v is not None), default=0.0) * 1e3
    decimals = 3 if largest == 0 else min(3, max(0, TIME_DIGITS - 1 - math.floor(
        math.log10(largest))))
    sign = "+" if signed else ""

    def cell(v: float | None) -> str:
        if v is None:
            return "-"
        text = f"{v * 1e3:{sign},.{decimals}f}"
        return text.lstrip("+-") if float(text.replace(",", "")) == 0 else text

    return [cell(v) for v in seconds]


def ms_text(seconds: float) -> str:
    """One time in ms at TIME_DIGITS significant figures (ms_column of one)."""
    return ms_column([seconds])[0]


def format_count(n: float) -> str:
    """A count (parameters, tokens) in K, M, B or T at three significant figures: 46.7B,
    1.20T, 350M, 12.0K; below a thousand as it is."""
    if abs(n) < 1e3:
        return f"{n:g}"
    for scale, unit in ((1e3, "K"), (1e6, "M"), (1e9, "B"), (1e12, "T")):
        text = next((t for t in (f"{n / scale:.{d}f}" for d in (2, 1, 0))
                     if len(t.lstrip("-").replace(".", "")) <= 3), f"{n / scale:.0f}")
        if abs(float(text)) < 1000 or unit == "T":
            return f"{text}{unit}"
    raise AssertionError("unreachable")  # the T row always returns


def tflops_per_gpu(plan: Plan, e: Evaluation) -> float:
    """Model TFLOP/s per GPU (Megatron-LM's throughput figure): MFU x the bf16 dense peak
    MFU is measured against (cost_models.evaluate)."""
    return e.mfu * plan.cluster.gpu.bf16_dense_tflops


def peak_note(cluster: ClusterSpec, precision: Precision) -> str:
    """What MFU is measured against, and for fp8 training the peak it is not."""
    gpu = cluster.gpu
    note = (f"MFU = model TFLOP/s/GPU / the {gpu.name}'s bf16 dense peak, "
            f"{gpu.bf16_dense_tflops:,.0f} TFLOP/s")
    if precision == Precision.fp8:
        note += (f", for fp8 training too (its fp8 dense peak, {gpu.fp8_dense_tflops:,.0f} "
                 f"TFLOP/s, would give {gpu.bf16_dense_tflops / gpu.fp8_dense_tflops:.2g}x "
                 "that MFU)")
    return note


def is_tie(best: Evaluation, other: Evaluation) -> bool:
    """Within TIE_TOLERANCE of the best plan's step time, either way (a baseline row can be
    the faster: Megatron-Core's best beside the best plan of the moeplan target)."""
    return abs(other.step_time_s - best.step_time_s) <= best.step_time_s * TIE_TOLERANCE


# ---- tables ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    name: str
    numeric: bool = True
    """Right-aligned; in a record shown as `name value`. Text columns (left-aligned) are
    shown in a record on their own line, without their name."""


PIPED_COLUMNS = 80


def output_width() -> int:
    """Width to fit tables in: $COLUMNS when set, the terminal's width on a terminal, else
    PIPED_COLUMNS (piped output and CI logs are read at 80 columns)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else PIPED_COLUMNS


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


def params_text(model: ModelSpec) -> str:
    """``671B total, 37.6B active`` (ModelSpec.total_params, active_params)."""
    return (f"{format_count(model.total_params)} total, "
            f"{format_count(model.active_params)} active")


def job_text(model: ModelSpec, cluster: ClusterSpec | Sequence[ClusterSpec],
             training: TrainingSpec, batch_note: str = "") -> str:
    """The job in one line: model, GPUs (of each machine compared), batch, sequence,
    precision, and the memory cap where the job sets one."""
    if not isinstance(cluster, ClusterSpec):
        gpus = (f"{cluster[0].gpus:,} GPUs of each of "
                f"{', '.join(f'{c.name} ({c.gpu.name})' for c in cluster)}")
    else:
        gpus = f"{cluster.gpus:,} x {cluster.gpu.name}"
        if cluster.gpus > cluster.node.gpus_per_node:
            gpus += f" ({cluster.nodes} nodes of {cluster.node.gpus_per_node})"
    return (f"{model.name} ({params_text(model)}) on {gpus}: global batch "
            f"{training.global_batch:,}{batch_note} x {training.seq_len:,} tokens = "
            f"{training.tokens_per_step:,} tokens/step, {training.precision.value}"
            + ("" if training.memory_cap_gib is None
               else f", at most {training.memory_cap_gib:g} GiB per GPU"))


def job_document(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 gpus: int | list[int] | None = None) -> dict:
    job = {"model": model.name, "cluster": cluster.name,
           "gpus": cluster.gpus if gpus is None else gpus,
           "global_batch": training.global_batch, "seq_len": training.seq_len,
           "precision": training.precision.value}
    if training.memory_cap_gib is not None:
        job["memory_cap_gib"] = training.memory_cap_gib
    return job


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
    its mechanisms no runtime executes; ``refused``: why its own target would not run it."""
    return {
        "label": label,
        "notation": plan.summary(),
        "target": plan.target.value,
        "unexecuted": unexecuted(plan),
        "refused": refused(plan),
        "step_time_s": e.step_time_s,
        "tokens_per_s": e.tokens_per_s,
        "tokens_per_s_per_gpu": e.tokens_per_s / plan.cluster.gpus,
        "mfu": e.mfu,
        "tflops_per_gpu": tflops_per_gpu(plan, e),
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
                Column("options", numeric=False), Column("step ms"), Column("vs #1"),
                Column("tokens/s"), Column("TFLOP/s/GPU"), Column("MFU"),
                Column("peak/usable GiB"))


def plan_rows(rows: Sequence[tuple[str, Plan, Evaluation]]) -> list[list[str]]:
    """Ranked plans as PLAN_COLUMNS rows: step times in one ms format, each step against the
    first row's (`tie` within TIE_TOLERANCE of it)."""
    steps = ms_column([e.step_time_s for _, _, e in rows])
    first = rows[0][2] if rows else None
    out = []
    for (label, p, e), step in zip(rows, steps, strict=True):
        versus = e.step_time_s / first.step_time_s - 1
        against = ("-" if e is first else f"{versus:+.1%}" + (" tie" if is_tie(first, e)
                                                               else ""))
        out.append([label, p.layout_notation(), p.options_notation(), step, against,
                    f"{e.tokens_per_s:,.0f}", f"{tflops_per_gpu(p, e):,.0f}", f"{e.mfu:.1%}",
                    memory_text(e)])
    return out


def tie_note() -> str:
    return (f"tie: within {TIE_TOLERANCE:.0%} of #1's step time, the cost model's stated error "
            "(docs/fidelity.md): their order is not a prediction")


UNEXECUTED_MARK = "*"
"""Marks a row using a mechanism no runtime executes (plans.execution.executed_anywhere)."""


def unexecuted(plan: Plan) -> list[str]:
    """The plan's fields whose values no target executes as written (tile-fused overlap)."""
    from plans.execution import executed_anywhere

    return [f"{f} {v}" for f, v in (("overlap", plan.overlap.value),)
            if not executed_anywhere(f, v)]


REFUSED_MARK = "!"
"""Marks a row its own target would refuse to run (plans.execution.refusals): a field of the
model or job that no layout changes, such as multi-token prediction on target moeplan."""


def refused(plan: Plan) -> list[str]:
    """Why the plan's own target would not run it (plans.execution.refusals), if it would not."""
    from plans.execution import refusals

    return refusals(plan, target=plan.target)


def echo_refused(why: dict[str, str]) -> None:
    """One line per reason of ``why`` (row label -> the first reason its plan's target gives
    for refusing it), naming its rows."""
    for reason in dict.fromkeys(why.values()):
        labels = ", ".join(label for label, r in why.items() if r == reason)
        echo(f"{REFUSED_MARK} {labels}: refused by the plan's target ({reason}): predictions "
             "for comparison only")


def print_search(result: SearchResult, job: str) -> None:
    rows = [(f"#{i + 1}", r) for i, r in enumerate(result.top)]
    if result.baseline is not None:
        rows.append(("megatron", result.baseline))
    if result.reference is not None:
        rows.append(("paper", result.reference))
    marked = [label for label, r in rows if unexecuted(r.plan)]
    why = {label: reasons[0] for label, r in rows if (reasons := refused(r.plan))}
    echo(job)
    table = [(label + (UNEXECUTED_MARK if label in marked else "")
              + (REFUSED_MARK if label in why else ""), r.plan, r.evaluation)
             for label, r in rows]
    echo_table("Best plans (fastest first)", PLAN_COLUMNS, plan_rows(table))
    echo(f"megatron: {BASELINE_LABEL}; paper: {REFERENCE_LABEL}")
    if marked:
        echo(f"{UNEXECUTED_MARK} no runtime executes tile-fused overlap (ov:inter+intra, "
             "plans.execution): predictions for comparison only")
    echo_refused(why)
    if result.best is not None:
        if any(is_tie(result.best.evaluation, r.evaluation) for _, r in rows[1:]):
            echo(tie_note())
        echo(peak_note(result.best.plan.cluster, result.best.plan.training.precision))
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
        top=[{**_ranked(f"#{i + 1}", r),
              "tie_with_best": is_tie(result.best.evaluation, r.evaluation)}
             for i, r in enumerate(result.top)],
        tie_tolerance=TIE_TOLERANCE,
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
        mfu_peak_tflops=plan.cluster.gpu.bf16_dense_tflops,
        legend=dict(legend(e)),
    )


LAYER_TERMS = {
    "forward": "the layer's forward, exposed communication included",
    "backward": "its backward: gradients, reruns and exposed communication",
    "compute (fwd+bwd, no reruns)": "its operators' compute, forward and backward",
    "recompute (reruns in bwd)": "operators rerun in the backward",
    "exposed <kind>": "communication of that kind no compute hid",
}
"""The per-layer table's rows in explain: forward + backward = compute + recompute + the
exposed communication."""


def legend(e: Evaluation) -> list[tuple[str, str]]:
    """Each term explain shows for ``e``, with its meaning (the step's, cost_models.evaluate;
    the kinds of communication, cost_models.volumes; memory's, cost_models.memory)."""
    from cost_models.evaluate import BREAKDOWN_TERMS
    from cost_models.memory import MEMORY_TERMS
    from cost_models.volumes import COMM_KINDS

    kinds = {k.value: text for k, text in COMM_KINDS.items()}
    out = []
    for key in e.breakdown_s:
        kind = key.removeprefix("exposed_comm.")
        if kind != key:
            out.append((key, f"{kinds.get(kind, kind)}: the part no compute hid"))
        else:
            out.append((key, BREAKDOWN_TERMS.get(key, "")))
    out += [(f"layer {k}", v) for k, v in LAYER_TERMS.items()
            if k != "recompute (reruns in bwd)" or e.layer.recompute_s]
    out += [(f"memory {k}", MEMORY_TERMS.get(k, "")) for k in e.memory.components_bytes]
    return out


def legend_markdown() -> str:
    """Every term of explain's tables as docs/cli.md's legend shows them (its tables are
    this text)."""
    from cost_models.evaluate import BREAKDOWN_TERMS
    from cost_models.memory import MEMORY_TERMS
    from cost_models.volumes import COMM_KINDS

    parts = []
    for title, terms in (("Per step (`step.breakdown_s`)", BREAKDOWN_TERMS),
                         ("Kinds of communication (`exposed_comm.<kind>`)",
                          {k.value: v for k, v in COMM_KINDS.items()}),
                         ("One MoE layer, one micro-batch", LAYER_TERMS),
                         ("Memory per GPU (`memory_gib`)", MEMORY_TERMS)):
        rows = "\n".join(f"| `{k}` | {v} |" for k, v in terms.items())
        parts.append(f"{title}:\n\n| term | meaning |\n|---|---|\n{rows}")
    return "\n\n".join(parts) + "\n"


def tflops_text(tflops: float) -> str:
    return f"{tflops:,.0f}" if tflops >= 100 else f"{tflops:.3g}"


def print_explain(plan: Plan, e: Evaluation) -> None:
    model = plan.model
    echo(job_text(model, plan.cluster, plan.training))
    echo(f"model: {format_count(model.total_params)} parameters, "
         f"{format_count(model.active_params)} active per token")
    echo(f"plan: {plan.summary()}")
    if (source := plan.cluster.efficiency_source) is not None:
        echo(f"efficiency factors: {source.kind.value} ({source.note})")
    times = ms_column([*e.breakdown_s.values(), e.step_time_s])
    rows = [[k, t, f"{v / e.step_time_s:.1%}"]
            for (k, v), t in zip(e.breakdown_s.items(), times, strict=False)]
    rows.append(["step", times[-1], "100%"])
    echo_table("Per step", (Column("component", False), Column("ms"), Column("share")), rows)
    echo(f"tokens/s {e.tokens_per_s:,.0f}   TFLOP/s/GPU {tflops_text(tflops_per_gpu(plan, e))}"
         f"   MFU {e.mfu:.1%}")
    echo(peak_note(plan.cluster, plan.training.precision))
    parts = [("forward", e.layer.fwd_s), ("backward", e.layer.bwd_s),
             ("compute (fwd+bwd, no reruns)", e.layer.compute_s)]
    if e.layer.recompute_s:
        parts.append(("recompute (reruns in bwd)", e.layer.recompute_s))
    # forward + backward = compute + recompute + the exposed communication below
    parts += [(f"exposed {k}", v) for k, v in e.layer.exposed_comm_s.items()]
    rows = [[name, t] for (name, _), t in zip(parts, ms_column([v for _, v in parts]),
                                               strict=True)]
    echo_table("One MoE layer, one micro-batch", (Column("part", False), Column("ms")), rows)
    echo("critical path: " + " -> ".join(e.layer.critical_path))
    gpu, usable = plan.cluster.gpu, plan.cluster.efficiency.memory_usable
    # the safety margin (1 - memory_usable) stays free for the CUDA context, NCCL's buffers
    # and the prediction's error
    cap = plan.training.memory_cap_gib
    capped = cap is not None and e.memory.capacity_bytes == cap * GIB
    names = [*e.memory.components_bytes, "peak (states + transients + reserve)",
             "usable (the job's cap, training.memory_cap_gib)" if capped
             else f"usable ({gpu.hbm_gib:g} GiB x {usable:g}, {1 - usable:.0%} margin)",
             "headroom"]
    sizes = [*e.memory.components_bytes.values(), e.memory.peak_bytes,
             e.memory.capacity_bytes, e.memory.capacity_bytes - e.memory.peak_bytes]
    rows = [[n, f"{g / GIB:.3g}"] for n, g in zip(names, sizes, strict=True)]
    echo_table("Memory per GPU (peak stage)", (Column("component", False), Column("GiB")), rows)
    if not e.feasible:
        echo(f"infeasible: {e.reason}")
    for w in headroom_warnings([("this plan", e)]):
        echo(w)
    print("Terms:")
    width = output_width()
    for term, meaning in legend(e):
        line = f"  {term}: {meaning}"
        print(textwrap.fill(line, width, subsequent_indent="      ", break_long_words=False,
                            break_on_hyphens=False) if width else line)


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


def print_measured(c, path) -> None:
    """The components of a measured step beside the cost model's: which part is off."""
    plan = c.executed
    echo(job_text(plan.model, plan.cluster, plan.training))
    echo(f"plan as executed: {plan.summary()}")
    if c.deviations:
        echo("evaluated as the runtime ran it: "
             + ", ".join(f"{d.field} {d.planned} -> {d.executed}" for d in c.deviations))
    times = ms_column([t for r in c.rows for t in (r.predicted_s, r.measured_s)])
    rows = [[r.component, times[2 * i], times[2 * i + 1],
             "-" if r.error is None else f"{r.error:+.0%}"] for i, r in enumerate(c.rows)]
    echo(f"measured: {path}")
    echo_table("Seconds per step, mean over ranks",
               (Column("component", False), Column("predicted ms"), Column("measured ms"),
                Column("error")), rows)
    echo("error = predicted / measured - 1; forward and backward hold the layer rows and loss")
    if (w := c.worst()) is not None:
        predicted, measured = ms_column([w.predicted_s, w.measured_s])
        echo(f"most off: {w.component}, predicted {predicted} ms, measured {measured} ms")


# ---- compare --------------------------------------------------------------------------------


def compare_labels(count: int) -> list[str]:
    """A, B, C, ... for the plans compared (AA, AB, ... past Z)."""
    letters = [chr(ord("A") + i) for i in range(26)]
    return [letters[i] if i < 26 else letters[i // 26 - 1] + letters[i % 26]
            for i in range(count)]


def _components(items: Sequence[tuple[str, Plan, Evaluation]]) -> list[str]:
    """Every breakdown component of the plans, in the order they first appear."""
    return list(dict.fromkeys(k for _, _, e in items for k in e.breakdown_s))


def why_faster(a: tuple[str, Evaluation], b: tuple[str, Evaluation]) -> str:
    """One sentence: which of two plans is faster, by how much, and the component whose time
    differs the most in its favour (ties within TIE_TOLERANCE said so)."""
    (fast, fe), (slow, se) = sorted((a, b), key=lambda x: x[1].step_time_s)
    saved = se.step_time_s - fe.step_time_s
    if saved == 0:
        return f"{a[0]} and {b[0]} predict the same step time"
    keys = dict.fromkeys([*fe.breakdown_s, *se.breakdown_s])
    gains = {k: se.breakdown_s.get(k, 0.0) - fe.breakdown_s.get(k, 0.0) for k in keys}
    key = max(gains, key=gains.get)
    step, part = ms_column([saved, gains[key]])
    tie = (f"; within the cost model's {TIE_TOLERANCE:.0%} error, a tie" if is_tie(fe, se)
           else "")
    ratio = se.step_time_s / fe.step_time_s
    how = f"{ratio:.3g}x as fast as" if ratio >= 2 else f"{ratio - 1:.1%} faster than"
    return (f"{fast} is {how} {slow} ({step} ms less per step), most of it in {key} "
            f"({part} ms less){tie}")


def compare_document(items: Sequence[tuple[str, Plan, Evaluation]], sources: Sequence[str]
                     ) -> dict:
    """compare --json: each plan (label, where it came from, its ranked object), every
    component's seconds per plan, each plan's differences from the first, and the sentences."""
    first = items[0]
    jobs = [job_document(p.model, p.cluster, p.training) for _, p, _ in items]
    keys = _components(items)
    return envelope(
        "compare", jobs[0] if all(j == jobs[0] for j in jobs) else None,
        plans=[{**ranked_document(label, p, e), "source": src, "job": job}
               for (label, p, e), src, job in zip(items, sources, jobs, strict=True)],
        breakdown_s={k: {label: e.breakdown_s.get(k, 0.0) for label, _, e in items}
                     for k in keys},
        delta_s={label: {**{k: e.breakdown_s.get(k, 0.0) - first[2].breakdown_s.get(k, 0.0)
                            for k in keys},
                         "step": e.step_time_s - first[2].step_time_s}
                 for label, _, e in items[1:]},
        why=[why_faster((first[0], first[2]), (label, e)) for label, _, e in items[1:]],
    )


def print_compare(items: Sequence[tuple[str, Plan, Evaluation]], sources: Sequence[str]
                  ) -> None:
    """The plans' step breakdowns side by side in ms, each against the first, their
    throughput and memory, and why the faster is faster."""
    jobs = [job_text(p.model, p.cluster, p.training) for _, p, _ in items]
    one_job = len(set(jobs)) == 1
    if one_job:
        echo(jobs[0])
    for (label, p, _), src, job in zip(items, sources, jobs, strict=True):
        where = "" if src == p.summary() else f" ({src})"
        echo(f"{label}: {p.summary()}{where}" + ("" if one_job else f" [{job}]"))
    keys = _components(items)
    first = items[0][2]
    values = [[e.breakdown_s.get(k, 0.0) for _, _, e in items] for k in keys]
    values.append([e.step_time_s for _, _, e in items])
    cells = ms_column([v for row in values for v in row])
    deltas = ms_column([row[i] - row[0] for row in values for i in range(1, len(items))],
                       signed=True)
    n, m = len(items), len(items) - 1
    rows = [[name, *cells[r * n:(r + 1) * n], *deltas[r * m:(r + 1) * m]]
            for r, name in enumerate([*keys, "step"])]
    labels = [label for label, _, _ in items]
    echo_table("Per step, ms", (Column("component", False), *map(Column, labels),
                                *(Column(f"{x}-{labels[0]}") for x in labels[1:])), rows)
    metrics = [
        ["tokens/s", *(f"{e.tokens_per_s:,.0f}" for _, _, e in items)],
        ["TFLOP/s/GPU", *(tflops_text(tflops_per_gpu(p, e)) for _, p, e in items)],
        ["MFU", *(f"{e.mfu:.1%}" for _, _, e in items)],
        ["peak/usable GiB", *(memory_text(e) for _, _, e in items)],
        ["fits", *("yes" if e.feasible else "no" for _, _, e in items)],
    ]
    echo_table("Throughput and memory per GPU", (Column("", False), *map(Column, labels)),
               metrics)
    clusters = {(p.cluster.gpu.name, p.training.precision) for _, p, _ in items}
    for gpu_name, precision in sorted(clusters):
        cluster = next(p.cluster for _, p, _ in items if p.cluster.gpu.name == gpu_name)
        echo(peak_note(cluster, precision))
    for label, _, e in items[1:]:
        echo(why_faster((labels[0], first), (label, e)) + ".")
    for label, _, e in items:
        if not e.feasible:
            echo(f"{label} does not fit: {e.reason}")


# ---- catalog --------------------------------------------------------------------------------


def print_catalog(models: dict[str, ModelSpec], clusters: dict[str, ClusterSpec]) -> None:
    echo_table("Models", [Column("name", False), *map(Column, (
        "layers", "hidden", "heads q/kv", "experts", "top-k", "total", "active"))],
        [[n, str(m.layers), str(m.hidden), f"{m.query_heads}/{m.kv_heads}", str(m.experts),
          str(m.top_k), format_count(m.total_params), format_count(m.active_params)]
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
        "reference_speedup": p.result.reference_speedup,
            "changes": plan_changes(reference, best.plan if best else None),
        })
    return envelope("whatif", job, points=out)


def print_whatif(points, job: str) -> None:
    doc = whatif_document(points, {})["points"]
    echo(job)
    rows, evaluations, why = [], [], {}
    for p, d in zip(points, doc, strict=True):
        best = p.result.best
        if best and d["best"]["refused"]:
            why[p.label] = d["best"]["refused"][0]
        rows.append([
            p.label, best.plan.summary() + (REFUSED_MARK if p.label in why else "")
            if best else "-", _tokens(best),
            tflops_text(tflops_per_gpu(best.plan, best.evaluation)) if best else "-",
            f"{best.evaluation.mfu:.1%}" if best else "-",
            memory_text(best.evaluation) if best else "-", _tokens(p.result.baseline),
            f"{d['speedup']:.2f}x" if d["speedup"] else "-", ", ".join(d["changes"]) or "-",
        ])
        if best:
            evaluations.append((p.label, best.evaluation))
    echo_table(f"What if: best plan at each setting vs {BASELINE_LABEL}",
               (Column("setting", False), Column("best plan", False), Column("tokens/s"),
                Column("TFLOP/s/GPU"), Column("MFU"), Column("peak/usable GiB"),
                Column("megatron tokens/s"),
                Column("speedup"), Column("changed vs first", False)), rows)
    echo_refused(why)
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
        "reference_speedup": p.result.reference_speedup,
    } for p in points])


def print_scale(points, job: str) -> None:
    echo(job)
    rows, evaluations, why = [], [], {}
    for d, p in zip(scale_document(points, {})["points"], points, strict=True):
        b, m = d["best"], d["baseline"]
        if b and b["refused"]:
            why[f"{d['gpus']:,} GPUs"] = b["refused"][0]
        rows.append([
            f"{d['gpus']:,}", f"{d['global_batch']:,}",
            b["notation"] + (REFUSED_MARK if b["refused"] else "") if b else "-",
            f"{b['tokens_per_s']:,.0f}" if b else "-",
            f"{b['tokens_per_s_per_gpu']:,.0f}" if b else "-",
            tflops_text(b["tflops_per_gpu"]) if b else "-",
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
                Column("/GPU"), Column("TFLOP/s/GPU"), Column("MFU"), Column("days/1T"),
                Column("peak/usable GiB"),
                Column("megatron tokens/s"), Column("megatron MFU"), Column("speedup")), rows)
    echo_refused(why)
    for w in headroom_warnings(evaluations):
        echo(w)


def echo_calibration(base, result, rows: list[dict]) -> None:
    """The fitted factors against the base cluster's, and measured runs against predictions
    before and after (``held_out`` runs were not used for fitting), as plain tables."""
    from planner.calibrate import factor_value

    factors = [(name, f"{factor_value(base, name):g}", f"{value:.3f}")
               for name, value in result.factors.items()]
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
