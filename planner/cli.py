"""The `moeplan` command line: each command a thin typed function over library code.

Bad input never shows a traceback: a SpecError (or a pydantic error turned into one) prints one
line `error: <field>: <reason>` on stderr and exits 2.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from enum import StrEnum
from functools import wraps
from pathlib import Path
from typing import Annotated

# Help in click's plain format: it reads the same piped, in CI logs and at 80 columns, and
# `moeplan --help` does not import rich (typer reads this when it is imported).
os.environ.setdefault("TYPER_USE_RICH", "0")

import typer  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

import plans  # noqa: E402  (lazy: pydantic and the models load inside the commands)
from plans.enums import (  # noqa: E402
    AttentionKind,
    Kernels,
    Overlap,
    Precision,
    Recompute,
    Target,
)

try:  # typer 0.2x vendors its own click; older versions use click itself
    from typer._click import exceptions as click
except ImportError:  # pragma: no cover
    from click import exceptions as click



def usage_line(e: click.UsageError) -> str:
    """A click usage error (bad or missing option, unknown command) as `name: reason`."""
    param = getattr(e, "param", None)
    if param is None:
        text = e.format_message()
    else:
        name = param.opts[0] if param.param_type_name == "option" else param.name
        if isinstance(e, click.MissingParameter):
            text = f"{name}: required {param.param_type_name} is missing"
        else:
            text = f"{name}: {e.message.removeprefix('Value error, ')}"
    return " ".join(text.split())


class OneLineErrors(TyperGroup):
    """Usage errors as one line `error: <option>: <reason>` (exit 2), like every other error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.NoArgsIsHelpError as e:  # bare `moeplan` or a bare command: help, status 0
            typer.echo(e.ctx.get_help() if e.ctx else e.format_message())
            sys.exit(0)
        except click.UsageError as e:
            typer.echo(f"error: {usage_line(e)}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Plan, explain and run Mixture-of-Experts training the MegaScale-MoE way.\n\n"
    "\b\nExamples:\n"
    "  moeplan catalog\n"
    "  moeplan search mixtral-8x7b h100 --gpus 64 --global-batch 256 \\\n"
    "      --out plan.json\n"
    "  moeplan explain plan.json\n"
    "  moeplan export plan.json --to megatron --steps 1000 > megatron.sh",
)


def _version(value: bool) -> None:
    if value:
        from planner.version import moeplan_version

        typer.echo(f"moeplan {moeplan_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Plan, explain and run Mixture-of-Experts training the MegaScale-MoE way."""


class TrainingPrecision(StrEnum):
    """Compute precisions a training job may use (fp32 is a gradient-sync precision only)."""

    bf16 = "bf16"
    fp8 = "fp8"


class ExportTarget(StrEnum):
    megatron = "megatron"
    torchrun = "torchrun"
    slurm = "slurm"


# ---- shared arguments and options, declared once ---------------------------------------------
ModelArg = Annotated[str, typer.Argument(help="Catalog model name or a .yaml/.json ModelSpec.")]
ClusterArg = Annotated[
    str, typer.Argument(help="Catalog cluster name or a .yaml/.json ClusterSpec.")
]
PlanArg = Annotated[Path, typer.Argument(help="A plan JSON (from `moeplan search --out`).")]
GpusOpt = Annotated[int, typer.Option("--gpus", min=1, help="GPUs in the job.")]
BatchOpt = Annotated[int | None, typer.Option(
    "--global-batch", min=1, help="Sequences per step; default half the GPU count (the "
    "paper's 720 sequences of 8,192 tokens on 1,440 GPUs: 4,096 tokens per GPU).")]
SeqOpt = Annotated[int, typer.Option("--seq-len", min=1, help="Tokens per sequence.")]
PrecisionOpt = Annotated[
    TrainingPrecision, typer.Option("--precision", help="Training compute precision.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")]
RunnableOpt = Annotated[bool, typer.Option(
    "--runnable", help="Only what the target executes as written (plans.execution; moeplan: "
    "bf16 GEMMs, no tile-fused overlap; --target megatron always is): predictions for the run "
    "it makes.")]
TargetOpt = Annotated[Target, typer.Option(
    "--target", help="The runtime the plans are for: moeplan (`moeplan train`) or megatron "
    "(`export --to megatron`: only what Megatron-Core runs).")]


def _for_target(space, precision: TrainingPrecision, target: Target, runnable: bool):
    """``space`` for ``target``: what Megatron-Core executes as written, or for moeplan with
    --runnable what its runtime does; a precision the target does not run is refused."""
    from plans.execution import TARGET_NAMES, executes

    if target == Target.moeplan and not runnable:
        return space
    if not executes("training.precision", precision, target=target):
        undo = "drop --runnable" if target == Target.moeplan else "use --target moeplan"
        raise plans.SpecError(f"--precision: {TARGET_NAMES[target]} does not run {precision} "
                              f"GEMMs as written (plans.execution); {undo} or use bf16")
    return space.for_target(target)


def _by_target(plan):
    """The plan as its target runs it, for pricing, and the notes saying where that differs
    from the plan: Megatron-Core's runs_as fields (a field it cannot run is one line, exit 2);
    a moeplan plan as written (`validate` says how moeplan's runtime runs it)."""
    from plans.execution import deviations, executed_plan

    if plan.target == Target.moeplan:
        return plan, []
    notes = [d.note() for d in deviations(plan, target=plan.target)]
    return executed_plan(plan, target=plan.target), notes


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def user_errors(fn: Callable) -> Callable:
    """Turn bad input into one line on stderr and exit status 2."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except plans.SpecError as e:
            raise _fail(str(e)) from None

    return wrapper


def _need_torch(command: str) -> None:
    """The runtime's commands need torch, which planning does not install."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None
    except ImportError:
        found = False
    if not found:
        raise plans.SpecError(f"{command}: needs torch (the runtime): "
                              "pip install -e '.[runtime]'")


def default_global_batch(gpus: int) -> int:
    """--global-batch when not given: half a sequence per GPU, the paper's 720 sequences on
    1,440 GPUs, sized to the job instead of applying that job to every GPU count."""
    return max(1, gpus // 2)


def _training(global_batch: int | None, seq_len: int, precision: TrainingPrecision,
              gpus: int) -> tuple[plans.TrainingSpec, str]:
    """The job's TrainingSpec, and a note for the job header when the batch was defaulted."""
    from pydantic import ValidationError

    from plans.errors import describe

    note, defaulted = "", global_batch is None
    if defaulted:
        global_batch, note = default_global_batch(gpus), " (default: GPUs / 2)"
    try:
        spec = plans.TrainingSpec(global_batch=global_batch, seq_len=seq_len,
                                  precision=Precision(precision.value))
    except ValidationError as e:
        # the option the user gave (or, for a defaulted batch, the --gpus it came from)
        field = str(e.errors()[0]["loc"][0]) if e.errors()[0]["loc"] else ""
        option = {"global_batch": "--global-batch", "seq_len": "--seq-len",
                  "precision": "--precision"}.get(field)
        if field == "global_batch" and defaulted:
            raise plans.SpecError(f"--gpus: the default global batch ({global_batch:,}, half "
                                  f"the GPUs) is out of range: {describe(e)}") from None
        raise plans.SpecError(f"{option}: {describe(e)}" if option
                              else f"training: {describe(e)}") from None
    return spec, note


def _write_new(path: Path, text: str, force: bool) -> None:
    """Write atomically; never replace a file the user made unless asked (plans.io)."""
    from plans.io import write_atomic

    write_atomic(path, text, "--out", force)


def _check_out(path: Path | None, force: bool) -> None:
    """Refuse an --out the write would refuse, before any work (plans.io)."""
    if path is not None:
        from plans.io import check_destination

        check_destination(path, "--out", force)


# ---- commands ------------------------------------------------------------------------------------


@app.command("catalog")
@user_errors
def catalog_cmd(json_out: JsonOpt = False) -> None:
    """List the built-in models and clusters.

    \b
    Examples:
      moeplan catalog
      moeplan catalog --json
    """
    models = {n: plans.catalog.load_model(n) for n in plans.catalog.names("models")}
    clusters = {n: plans.catalog.load_cluster(n) for n in plans.catalog.names("clusters")}
    if json_out:
        from planner.report import envelope

        typer.echo(json.dumps(envelope(
            "catalog", None,
            models={n: m.model_dump(mode="json") for n, m in models.items()},
            clusters={n: c.model_dump(mode="json") for n, c in clusters.items()},
        ), indent=2))
        return
    from planner.report import print_catalog

    print_catalog(models, clusters)


@app.command("import-hf")
@user_errors
def import_hf_cmd(
    config: Annotated[Path, typer.Argument(
        help="A Hugging Face config.json, or a local snapshot folder holding one.")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write the model spec YAML here (default: stdout).")] = None,
    name: Annotated[str | None, typer.Option(
        "--name", help="The spec's name (default: the snapshot folder's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out file.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Write the ModelSpec of a Hugging Face config (plans.hf).

    Any command that takes a model also takes the config.json or its folder directly.

    \b
    Examples:
      moeplan import-hf DeepSeek-V3/config.json --out deepseek-v3.yaml
      moeplan import-hf ~/.cache/huggingface/hub/models--openai--gpt-oss-120b/snapshots/X
      moeplan import-hf config.json --json
    """
    import yaml

    from planner.report import envelope, params_text

    _check_out(out, force)
    spec = plans.hf.load(config)
    if name is not None:
        spec = plans.catalog.parse(plans.ModelSpec, {**spec.model_dump(), "name": name},
                                   "--name")
    text = yaml.safe_dump({"name": spec.name, **spec.model_dump(mode="json",
                                                                exclude_defaults=True)},
                          sort_keys=False)
    if out is not None:
        _write_new(out, f"# moeplan import-hf {config}\n{text}", force)
    if json_out:
        typer.echo(json.dumps(envelope(
            "import-hf", None, model=spec.model_dump(mode="json"),
            total_params=spec.total_params, active_params=spec.active_params,
            out=str(out) if out is not None else None), indent=2))
    elif out is None:
        typer.echo(f"# {spec.name}: {params_text(spec)}\n{text}", nl=False)
    else:
        typer.echo(f"{spec.name}: {params_text(spec)}; wrote {out}")


@app.command()
def schema() -> None:
    """Print the Plan JSON Schema."""
    typer.echo(json.dumps(plans.Plan.model_json_schema(), indent=2))


@app.command("search", short_help="Find the fastest plans that fit, beside Megatron-Core's best.")
@user_errors
def search_cmd(
    model: ModelArg,
    cluster: ClusterArg,
    gpus: GpusOpt,
    global_batch: BatchOpt = None,
    seq_len: SeqOpt = 8192,
    precision: PrecisionOpt = TrainingPrecision.bf16,
    top: Annotated[int, typer.Option("--top", min=1, help="Plans to keep.")] = 5,
    overlap: Annotated[
        list[Overlap] | None,
        typer.Option("--overlap", help="Allowed overlap levels (repeat); default those some "
                     "runtime executes (none, inter_op): inter_intra_op only by name."),
    ] = None,
    recompute: Annotated[
        list[Recompute] | None,
        typer.Option("--recompute", help="Allowed recomputation policies (repeat); default all."),
    ] = None,
    attention: Annotated[
        list[AttentionKind] | None,
        typer.Option("--attention", help="Allowed attention strategies (repeat); default "
                     "ulysses_sp and tp (cp is for comparing predictions: the runtime does not "
                     "run it)."),
    ] = None,
    kernels: Annotated[Kernels, typer.Option(
        "--kernels", help="The layers' memory-bound operators: fused torch.compile regions "
        "(default) or eager PyTorch.")] = Kernels.fused,
    runnable: RunnableOpt = False,
    target: TargetOpt = Target.moeplan,
    out: Annotated[Path | None, typer.Option("--out", help="Write the best plan here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out file.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Find the fastest plans that fit, beside Megatron-Core's best plan (searched over what
    it runs) and the paper's Megatron-LM layout (the reference).

    \b
    Examples:
      moeplan search mixtral-8x7b h100 --gpus 64 --global-batch 256 --seq-len 4096
      moeplan search qwen3-30b-a3b h200 --gpus 8 --target megatron --out plan.json
      moeplan search internal-352b h800 --gpus 1440 --global-batch 720 --json
      moeplan search qwen3-30b-a3b h200 --gpus 8 --recompute full --out plan.json
    """
    from planner.report import job_document, job_text, print_search, search_document
    from planner.search import search
    from planner.space import SearchSpace

    _check_out(out, force)
    spec_model = plans.catalog.load_model(model)
    spec_cluster = plans.catalog.load_cluster(cluster, gpus=gpus)
    training, batch_note = _training(global_batch, seq_len, precision, gpus)
    space = SearchSpace(
        **({"overlap": tuple(overlap)} if overlap else {}),
        recompute=tuple(recompute) if recompute else tuple(Recompute),
        **({"attention": tuple(attention)} if attention else {}),
        kernels=kernels,
    )
    space = _for_target(space, precision, target, runnable)
    if json_out:
        result = search(spec_model, spec_cluster, training, space, top=top)
    else:
        with _progress_search(False, "searching layouts") as progress:
            result = search(spec_model, spec_cluster, training, space, top=top,
                            progress=progress)
    if result.best is None:
        raise plans.SpecError(
            f"--gpus: no plan of {spec_model.name} fits {gpus} x {spec_cluster.gpu.name} "
            f"(global batch {training.global_batch}, seq {seq_len}); "
            f"{result.stats.pruned_memory} candidates out of memory, "
            f"{result.stats.invalid} invalid"
        )
    if out is not None:
        _write_new(out, result.best.plan.model_dump_json(indent=2), force)
    if json_out:
        job = job_document(spec_model, spec_cluster, training)
        typer.echo(json.dumps(search_document(result, job), indent=2))
    else:
        print_search(result, job_text(spec_model, spec_cluster, training, batch_note))
        if out is not None:
            typer.echo(f"best plan written to {out}")


@app.command(short_help="Time and memory breakdown of a plan, per step and per layer.")
@user_errors
def explain(
    plan: PlanArg,
    measured: Annotated[Path | None, typer.Option(
        "--measured", help="A measured step of this plan (bench/train_step.py's result JSON): "
        "predicted and measured seconds per runtime component, side by side.")] = None,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", help="Price the plan on this cluster (catalog name or spec file) instead "
        "of its own, at the plan's GPU count: e.g. the calibrated h200-runtime a run was "
        "measured on.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Time breakdown per layer and per step, memory breakdown and critical path of a plan;
    with --measured, the plan as the runtime executed it against a measured step, per
    component.

    \b
    Examples:
      moeplan explain plan.json
      moeplan explain plan.json --json
      moeplan explain plan.json --measured train_step.json --cluster h200-runtime
    """
    import cost_models
    from planner.report import (
        explain_document,
        measured_document,
        print_explain,
        print_measured,
    )

    loaded = plans.catalog.load_plan(plan)
    if cluster is not None:
        from planner.calibrate import on

        loaded = on(loaded, plans.catalog.load_cluster(cluster, what="--cluster"))
    if measured is not None:
        from planner.measured import compare

        comparison = compare(loaded, measured)
        if json_out:
            typer.echo(json.dumps(measured_document(comparison, measured), indent=2))
        else:
            print_measured(comparison, measured)
        return
    priced, notes = _by_target(loaded)
    evaluation = cost_models.evaluate(priced)
    if json_out:
        typer.echo(json.dumps(explain_document(priced, evaluation), indent=2))
    else:
        for note in notes:
            typer.echo(note)
        print_explain(priced, evaluation)


@app.command(short_help="Re-check a plan file and say how the runtime would run it.")
@user_errors
def validate(plan: PlanArg) -> None:
    """Re-check a plan, generated or hand-written, against its specs and memory.

    \b
    Example:
      moeplan validate plan.json
    """
    import cost_models
    from plans.execution import Backend, deviations, executed_plan, refusals

    loaded = plans.catalog.load_plan(plan)
    priced, notes = _by_target(loaded)
    evaluation = cost_models.evaluate(priced)
    if not evaluation.feasible:
        raise plans.SpecError(f"{plan}: does not fit: {evaluation.reason}")
    typer.echo(f"ok: {loaded.summary()}")
    typer.echo(f"predicted step {evaluation.step_time_s:.3f} s, {evaluation.tokens_per_s:,.0f} "
               f"tokens/s, MFU {evaluation.mfu:.1%}, peak memory "
               f"{evaluation.memory.peak_bytes / 2**30:.1f} GiB")
    if loaded.prediction is not None:
        stored = loaded.prediction.step_time_s
        if abs(stored - evaluation.step_time_s) > 1e-6 * max(stored, 1e-12):
            typer.echo(f"note: the plan's stored prediction ({stored:.3f} s) differs from this "
                       "cost model's; the specs or efficiency factors changed")
    if loaded.target == Target.megatron:
        from plans.execution import TARGET_NAMES

        for note in notes:
            typer.echo(note)
        typer.echo(f"{TARGET_NAMES[loaded.target]} runs it (target megatron): launch it with "
                   "`moeplan export --to megatron`")
        return
    if refused := refusals(loaded, Backend.cuda_nccl):
        typer.echo(f"moeplan train refuses it: {refused[0]}")
        return
    found = deviations(loaded)
    if found:
        ran = cost_models.evaluate(executed_plan(loaded))
        runs = ", ".join(f"{d.field} {d.executed}" for d in found)
        typer.echo(f"moeplan train runs it with {runs} (plans.execution): predicted step "
                   f"{ran.step_time_s:.3f} s, MFU {ran.mfu:.1%}; `moeplan search --runnable` "
                   "plans for that")


# ---- what-if and scaling -------------------------------------------------------------------------

PlotOpt = Annotated[
    Path | None, typer.Option("--plot", help="Write a plot (.png or .svg; needs matplotlib).")
]
PlotForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing --plot file.")]


def _progress_search(json_out: bool, label: str):
    """A progress bar on a terminal's stderr (off under --json, piped or in CI logs): yields a
    callback (done, total)."""
    from contextlib import contextmanager

    @contextmanager
    def bar():
        if json_out or not sys.stderr.isatty():
            yield None
            return
        from rich.console import Console
        from rich.progress import Progress

        with Progress(transient=True, console=Console(stderr=True)) as p:
            task = p.add_task(label, total=None)
            yield lambda i, n: p.update(task, completed=i, total=n)

    return bar()


@app.command("whatif", short_help="Change the hardware, re-plan at every point, compare.")
@user_errors
def whatif_cmd(
    model: ModelArg,
    cluster: ClusterArg,
    gpus: GpusOpt,
    vary: Annotated[list[str], typer.Option(
        "--vary", help="KNOB=V1,V2,... with values absolute or multipliers (2x); repeat for a "
        "grid. Knobs: gpu_tflops, hbm_gib, hbm_tb_s, nvlink_gb_s, nvlink_domain, network_gb_s, "
        "overlap_share (0-1: communication hidden beside compute).")],
    global_batch: BatchOpt = None,
    seq_len: SeqOpt = 8192,
    precision: PrecisionOpt = TrainingPrecision.bf16,
    runnable: RunnableOpt = False,
    plot: PlotOpt = None,
    force: PlotForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Change the hardware, re-plan at every point, and compare with the Megatron-style layout.

    \b
    Examples:
      moeplan whatif mixtral-8x7b h800 --gpus 64 --global-batch 256 \\
          --vary gpu_tflops=1x,2x,4x
      moeplan whatif internal-352b h800 --gpus 1440 --global-batch 720 \\
          --vary nvlink_gb_s=400,900 --vary network_gb_s=25,50 --plot whatif.png
      moeplan whatif qwen3-30b-a3b h200-runtime --gpus 8 --runnable \\
          --vary overlap_share=0,0.5,0.9
    """
    from planner.report import job_document, job_text, print_whatif, whatif_document
    from planner.space import SearchSpace
    from planner.whatif import parse_vary, whatif

    _check_plot(plot, force)
    spec_model = plans.catalog.load_model(model)
    spec_cluster = plans.catalog.load_cluster(cluster, gpus=gpus)
    training, batch_note = _training(global_batch, seq_len, precision, gpus)
    varies = [parse_vary(v) for v in vary]
    space = _for_target(SearchSpace(), precision, Target.moeplan, True) if runnable else None
    with _progress_search(json_out, "re-planning") as progress:
        points = whatif(spec_model, spec_cluster, training, varies, space, progress=progress)
    title = f"{spec_model.name} on {gpus} x {spec_cluster.gpu.name}"
    _finish(points, json_out, plot,
            lambda pts: whatif_document(pts, job_document(spec_model, spec_cluster, training)),
            lambda pts: print_whatif(pts, job_text(spec_model, spec_cluster, training,
                                                   batch_note)),
            lambda pts, path: _plots().whatif_plot(pts, path, title, force))


@app.command("scale", short_help="Strong or weak scaling of the best plan and the baseline.")
@user_errors
def scale_cmd(
    model: ModelArg,
    cluster: ClusterArg,
    gpus: Annotated[str, typer.Option("--gpus", help="GPU counts, comma-separated.")],
    global_batch: Annotated[int | None, typer.Option(
        "--global-batch", min=1, help="Sequences per step (strong scaling); default half the "
        "largest GPU count.")] = None,
    weak: Annotated[int | None, typer.Option(
        "--weak", min=1, help="Weak scaling: sequences per NVLink-domain replica "
        "(global batch grows with the GPUs); without it, strong scaling.")] = None,
    seq_len: SeqOpt = 8192,
    precision: PrecisionOpt = TrainingPrecision.bf16,
    plot: PlotOpt = None,
    force: PlotForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Strong or weak scaling of the best plan and the Megatron-style layout.

    \b
    Examples:
      moeplan scale internal-352b h800 --gpus 240,480,720,960,1440 \\
          --global-batch 720
      moeplan scale internal-352b h800 --gpus 240,480,960 --weak 24 \\
          --plot scale.svg
    """
    from planner.report import job_document, print_scale, scale_document
    from planner.scale import scale

    counts = _int_list(gpus, "--gpus")
    if weak is not None and global_batch is not None:
        raise plans.SpecError("--global-batch: weak scaling (--weak) sets the global batch at "
                              "each GPU count; give one of the two")
    _check_plot(plot, force)
    spec_model = plans.catalog.load_model(model)
    spec_cluster = plans.catalog.load_cluster(cluster)
    training, batch_note = _training(global_batch, seq_len, precision, max(counts))
    with _progress_search(json_out, "scaling") as progress:
        points = scale(spec_model, spec_cluster, training, counts, weak, progress=progress)
    kind = (f"weak, {weak} seqs/replica" if weak
            else f"strong, global batch {training.global_batch}")
    title = f"{spec_model.name} on {spec_cluster.gpu.name} ({kind})"
    header = (f"{spec_model.name} on {spec_cluster.gpu.name} x "
              f"{', '.join(f'{c:,}' for c in counts)} GPUs: "
              + (f"weak scaling, {weak} sequences per NVLink-domain replica" if weak else
                 f"strong scaling, global batch {training.global_batch:,}{batch_note}")
              + f" x {seq_len:,} tokens, {training.precision.value}")
    job = {**job_document(spec_model, spec_cluster, training, gpus=counts),
           "weak_seqs_per_replica": weak}
    if weak:
        job["global_batch"] = None
    _finish(points, json_out, plot, lambda pts: scale_document(pts, job),
            lambda pts: print_scale(pts, header),
            lambda pts, path: _plots().scale_plot(pts, path, title, force))


def _plots():
    import planner.plots

    return planner.plots


def _check_plot(plot: Path | None, force: bool) -> None:
    """Refuse a bad --plot path before any work."""
    if plot is not None:
        _plots().check_plot_path(plot, force)


def _finish(points, json_out: bool, plot: Path | None, document, printer, draw) -> None:
    """Draw the plot if asked, then print one JSON document or the table."""
    if plot is not None:
        draw(points, plot)
    if json_out:
        typer.echo(json.dumps(document(points), indent=2))
        return
    printer(points)
    if plot is not None:
        typer.echo(f"plot written to {plot}")


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise plans.SpecError(f"{option}: {text!r} must be comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise plans.SpecError(f"{option}: {text!r} must list positive GPU counts")
    if len(set(values)) < len(values):
        twice = next(v for v in values if values.count(v) > 1)
        raise plans.SpecError(f"{option}: {twice} given twice")
    return values


# ---- export and training ------------------------------------------------------------------


@app.command("profile", short_help="Profile a 1-GPU plan's step kernel by kernel (for calibrate).")
@user_errors
def profile_cmd(
    plan: PlanArg,
    out: Annotated[Path, typer.Option("--out", help="Profile JSON to write.")],
    steps: Annotated[int, typer.Option("--steps", min=1, help="Profiled steps.")] = 2,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Steps run first.")] = 2,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Profile a 1-GPU plan's training step kernel by kernel (the input of `calibrate`).

    \b
    Example:
      moeplan profile bench/gpu_plans/mixtral2l_1gpu.json --out profile.json
    """
    import subprocess

    _need_torch("profile")
    loaded = plans.catalog.load_plan(plan)
    if loaded.degrees.world != 1:
        raise plans.SpecError(f"{plan}: degrees: profiling runs one process; this plan needs "
                        f"{loaded.degrees.world} GPUs")
    _check_out(out, force)
    code = subprocess.call([sys.executable, "-m", "runtime.profile", "--plan", str(plan),
                            "--out", str(out), "--steps", str(steps), "--warmup", str(warmup),
                            *(["--force"] if force else [])])
    if code < 0:  # killed by a signal: say which, exit as a shell reports it (128 + N)
        import signal

        name = signal.Signals(-code).name
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        typer.echo(f"error: profiling was killed by {name}{hint}", err=True)
        raise typer.Exit(128 - code)
    if code != 0:
        typer.echo(f"error: profiling exited with status {code}", err=True)
        raise typer.Exit(code)


@app.command("calibrate", short_help="Fit the cost model's efficiency factors to measurements.")
@user_errors
def calibrate_cmd(
    out: Annotated[Path, typer.Option("--out", help="Calibrated cluster YAML to write.")],
    profile: Annotated[Path | None, typer.Argument(
        help="One profiled 1-GPU step: `moeplan profile`'s JSON (optional with a sweep of "
             "kernel micro-benchmarks: then it sets only the elementwise factor).")] = None,
    plan: Annotated[Path | None, typer.Option(
        "--plan", help="The 1-GPU plan that was profiled.")] = None,
    collectives: Annotated[Path | None, typer.Option(
        "--collectives", help="bench/calibrate_gpu.py's sweep (kernel micro-benchmarks, "
                              "copies, NCCL collectives).")
    ] = None,
    overlap: Annotated[Path | None, typer.Option(
        "--overlap", help="bench/copy_engine_gpu.py's result (NCCL beside the expert GEMMs, "
                          "2 GPUs): sets efficiency.overlap.")
    ] = None,
    base: Annotated[str, typer.Option(
        "--base", help="Catalog cluster or YAML the factors start from.")] = "h200",
    fused_profile: Annotated[Path | None, typer.Option(
        "--fused-profile", help="A profiled 1-GPU step of a kernels: fused plan: sets "
                                "fused_elementwise.")] = None,
    fused_plan: Annotated[Path | None, typer.Option(
        "--fused-plan", help="The kernels: fused plan of --fused-profile.")] = None,
    name: Annotated[str | None, typer.Option(
        "--name", help="Name of the calibrated cluster; default <base name>-calibrated.")
    ] = None,
    runs: Annotated[Path | None, typer.Option(
        "--runs", help="Folder of measured steps (train_step_<plan>.json) to test against.")
    ] = None,
    plans_dir: Annotated[Path, typer.Option(
        "--plans", help="Folder of the measured runs' <plan>.json files.")
    ] = Path("bench/gpu_plans"),
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Fit the cost model's efficiency factors to this runtime on your GPUs, and show how well
    the calibrated model predicts measured steps it never saw.

    \b
    Examples:
      moeplan calibrate --collectives calibration.json --out my-h200.yaml
      moeplan calibrate profile.json --plan bench/gpu_plans/mixtral2l_1gpu.json \\
          --out my-h200.yaml
    """
    import yaml

    from planner import calibrate as cal
    from plans.results import OverlapBench, ProfileResult, Sweep, read

    _check_out(out, force)
    base_cluster = plans.catalog.load_cluster(base, what="--base")
    if profile is None and collectives is None:
        raise plans.SpecError("profile: give a profiled step, a --collectives sweep, or both")
    if profile is not None and plan is None:
        raise plans.SpecError("--plan: the 1-GPU plan that was profiled is needed with a "
                              "profile")
    measured_profile = read(ProfileResult, profile, "profile") if profile else None
    sweep = read(Sweep, collectives, "--collectives") if collectives else None
    beside = read(OverlapBench, overlap, "--overlap") if overlap else None
    if runs is not None and not runs.is_dir():
        raise plans.SpecError(f"--runs: {runs} is not a folder")
    if (fused_profile is None) != (fused_plan is None):
        raise plans.SpecError("--fused-profile: goes with --fused-plan, the plan it profiled")
    from planner.measured import check_profile_pairing

    profiled_plan = plans.catalog.load_plan(plan) if plan else None
    if measured_profile is not None:
        cal.check_one_gpu(profiled_plan, "--plan")
        check_profile_pairing(profiled_plan, measured_profile, profile, "profile", "--plan")
    fused = read(ProfileResult, fused_profile, "--fused-profile") if fused_profile else None
    fused_plan_spec = plans.catalog.load_plan(fused_plan) if fused_plan else None
    if fused is not None:
        cal.check_one_gpu(fused_plan_spec, "--fused-plan")
        check_profile_pairing(fused_plan_spec, fused, fused_profile, "--fused-profile",
                              "--fused-plan")
    result = cal.calibrate(measured_profile, profiled_plan, base_cluster,
                           name or f"{base_cluster.name}-calibrated", sweep, beside)
    if fused is not None:
        result = cal.with_fused_step(result, fused, fused_plan_spec)
    pairs = cal.runs_with_plans(runs, plans_dir) if runs else []
    if runs is not None and not pairs:
        raise plans.SpecError(f"--runs: no train_step_<plan>.json in {runs} with its <plan>.json "
                              f"in {plans_dir} (--plans)")
    rows, held, held_before = [], [], []
    for run, plan_path in pairs:
        row = cal.fidelity_row(run, plan_path, result.cluster)
        before = cal.fidelity_row(run, plan_path)
        fitted = [p.resolve() for p in (plan, fused_plan) if p is not None]
        held_out = plan_path.resolve() not in fitted
        rows.append({**row.as_dict(), "step_error_before": before.step_error,
                     "held_out": held_out})
        if held_out:
            held.append(row)
            held_before.append(before)
    sources = ([f"profile {profile.name}, commit {measured_profile.commit}"] if profile else []
               ) + ([f"collectives {collectives.name}, commit {sweep.commit}"] if sweep else []
                    ) + ([f"fused profile {fused_profile.name}, commit {fused.commit}"]
                         if fused else []
                         ) + ([f"overlap {overlap.name}, commit {beside.commit}"] if beside else [])
    header = (f"# {result.cluster.name}: {base_cluster.name} with efficiency factors fitted to "
              f"moeplan's runtime by `moeplan calibrate`\n# ({'; '.join(sources)}).\n")
    _write_new(out, header + yaml.safe_dump(result.cluster.model_dump(mode="json"),
                                            sort_keys=False), force)
    after = cal.fidelity_summary([r.step_error for r in held], [r.memory_error for r in held])
    was = cal.fidelity_summary([r.step_error for r in held_before],
                               [r.memory_error for r in held_before])
    summary = {"median_abs_step_error": after and after.median_abs_step_error,
               "median_abs_step_error_before": was and was.median_abs_step_error}
    if json_out:
        typer.echo(json.dumps({"cluster": result.cluster.model_dump(mode="json"),
                               "factors": result.factors, "out": str(out), "runs": rows,
                               "held_out": summary}, indent=2))
        return
    from planner.report import echo_calibration

    echo_calibration(base_cluster, result, rows)
    if after is not None:
        typer.echo(f"held-out step-time error: median {after.median_abs_step_error:.1%} "
                   f"(with {base_cluster.name}'s factors {was.median_abs_step_error:.1%}) over "
                   f"{after.runs} runs")
    typer.echo(f"wrote {out}")


@app.command("export", short_help="Print a launch script: Megatron-LM, torchrun or Slurm.")
@user_errors
def export_cmd(
    plan: PlanArg,
    to: Annotated[ExportTarget, typer.Option("--to", help="What to launch with.")],
    steps: Annotated[int | None, typer.Option(
        "--steps", min=1, help="Optimizer steps (megatron: --train-iters; else the runtime's "
        "--steps); default: megatron's script asks for TRAIN_ITERS, the runtime runs 10.")
    ] = None,
) -> None:
    """Print a launch script for the plan: Megatron-LM's pretrain_gpt.py, or moeplan's runtime
    under torchrun or Slurm. A plan Megatron cannot express is refused with the reason.

    \b
    Examples:
      moeplan export plan.json --to megatron --steps 1000 > megatron.sh
      moeplan export plan.json --to slurm --steps 1000 > job.sbatch
      moeplan export plan.json --to torchrun > run.sh
    """
    import cost_models
    from planner.export import megatron_script, slurm_script, torchrun_script
    from plans.execution import as_target, executed_plan

    loaded = plans.catalog.load_plan(plan)
    # the scripts run on other nodes and from other folders: the plan by its absolute path
    where = str(plan.resolve())
    priced = loaded
    if to == ExportTarget.megatron:
        script = megatron_script(loaded, steps)  # refuses what Megatron cannot express
        priced = executed_plan(as_target(loaded, Target.megatron), target=Target.megatron)
        if loaded.target != Target.megatron:
            step = cost_models.evaluate(priced).step_time_s
            typer.echo(f"note: {plan}: a plan for target {loaded.target}, priced anew as a "
                       f"megatron plan: predicted step {step:.3f} s", err=True)
    elif loaded.target != Target.moeplan:
        raise plans.SpecError(f"target: {loaded.target} is not run by moeplan's runtime: "
                              "`--to torchrun|slurm` launch moeplan plans; use --to megatron")
    elif to == ExportTarget.torchrun:
        script = torchrun_script(loaded, where, steps)
    else:
        script = slurm_script(loaded, where, steps)
    evaluation = cost_models.evaluate(priced)
    if not evaluation.feasible:
        typer.echo(f"warning: {plan}: the plan does not fit: {evaluation.reason}", err=True)
    typer.echo(script, nl=False)


@app.command("train", short_help="Train with the plan on this machine under torchrun.")
@user_errors
def train_cmd(
    plan: PlanArg,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps to train (with "
                                       "--resume: the step to reach).")] = 10,
    data: Annotated[Path | None, typer.Option("--data", help="Token file (.u16/.u32).")] = None,
    nproc_per_node: Annotated[int | None, typer.Option(
        "--nproc-per-node", min=1, help="Processes on this machine; default the plan's world.")
    ] = None,
    log: Annotated[Path | None, typer.Option(
        "--log", help="JSON-lines log, one record per step; an existing log is appended to "
        "(a resumed run continues it).")] = None,
    ckpt_dir: Annotated[Path | None, typer.Option(
        "--ckpt-dir", help="Folder of checkpoints (torch DCP), one per saved step.")] = None,
    ckpt_every: Annotated[int | None, typer.Option(
        "--ckpt-every", min=1, help="Save a checkpoint every N steps (needs --ckpt-dir).")
    ] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from the newest checkpoint in --ckpt-dir.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Start afresh in a --ckpt-dir holding another run's checkpoints "
        "(they are deleted first).")] = False,
) -> None:
    """Train with the plan on this machine under torchrun (gloo on CPU, NCCL on GPUs).

    \b
    Example:
      moeplan search tiny-moe h200 --gpus 4 --global-batch 8 --seq-len 256 \\
          --out tiny.json
      moeplan train tiny.json --steps 20 --log metrics.jsonl
    """
    from planner import launch

    _need_torch("train")
    loaded = plans.catalog.load_plan(plan)
    # what the launcher alone can tell; the runtime's own checks run next (launch.preflight)
    if data is not None and data.suffix not in (".u16", ".u32"):
        raise plans.SpecError(f"--data: {data} must end in .u16 or .u32 (the token width)")
    if ckpt_every is not None and ckpt_dir is None:
        raise plans.SpecError("--ckpt-every: needs --ckpt-dir")
    if resume and ckpt_dir is None:
        raise plans.SpecError("--resume: needs --ckpt-dir")
    world = loaded.degrees.world
    nproc = nproc_per_node or world
    if nproc != world:
        raise plans.SpecError(f"--nproc-per-node: {nproc} processes on one machine, but the "
                              f"plan's world size is {world}; for several nodes use "
                              "`moeplan export --to torchrun`")
    args = ["--plan", str(plan), "--steps", str(steps)]
    for flag, value in (("--data", data), ("--log-file", log), ("--ckpt-dir", ckpt_dir),
                        ("--ckpt-every", ckpt_every)):
        if value is not None:
            args += [flag, str(value)]
    args += [flag for flag, on in (("--resume", resume), ("--overwrite", overwrite)) if on]
    env = dict(os.environ)
    launch.preflight(args, world, nproc, env)  # the runtime's checks; no worker started
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "-m", "runtime.train", *args]
    outcome = launch.supervise(cmd, env)
    if outcome.message is not None:
        typer.echo(f"error: {outcome.message}", err=True)
    if outcome.code != 0:
        raise typer.Exit(outcome.code)


def _interrupted(signum, frame) -> None:
    """Ctrl-C: say so (click ends the run with status 130 and no word of its own)."""
    typer.echo("interrupted", err=True)
    raise KeyboardInterrupt


def main() -> None:
    import signal

    signal.signal(signal.SIGINT, _interrupted)  # `train`'s launcher installs its own
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
