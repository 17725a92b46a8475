"""The `moeplan` command line: each command a thin typed function over library code.

Bad input never shows a traceback: a SpecError (or a pydantic error turned into one) prints one
line `error: <field>: <reason>` on stderr and exits 2.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
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
    Kernels,
    Precision,
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
    "  moeplan explain \"pp2 dp4 sp2 ep8 a2a mbs1\" --model qwen3-30b-a3b \\\n"
    "      --cluster h200 --gpus 16\n"
    "  moeplan compare plan.json other.yaml\n"
    "  moeplan export plan.json --to megatron --steps 1000 > megatron.sh\n\n"
    "Lists (--tp 1,2 --gpus 8,16 --cluster h100,h200): comma-separated or the option "
    "repeated. Plans: a file or the plan notation. docs/cli.md has the rules.",
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
    torchtitan = "torchtitan"
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
PlotOpt = Annotated[
    Path | None, typer.Option("--plot", help="Write a plot (.png or .svg; needs matplotlib).")
]
PlotForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing --plot file.")]
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
              gpus: int, memory_cap_gib: float | None = None) -> tuple[plans.TrainingSpec, str]:
    """The job's TrainingSpec, and a note for the job header when the batch was defaulted."""
    from pydantic import ValidationError

    from plans.errors import describe

    note, defaulted = "", global_batch is None
    if defaulted:
        global_batch, note = default_global_batch(gpus), " (default: GPUs / 2)"
    try:
        spec = plans.TrainingSpec(global_batch=global_batch, seq_len=seq_len,
                                  precision=Precision(precision.value),
                                  memory_cap_gib=memory_cap_gib)
    except ValidationError as e:
        # the option the user gave (or, for a defaulted batch, the --gpus it came from)
        field = str(e.errors()[0]["loc"][0]) if e.errors()[0]["loc"] else ""
        option = {"global_batch": "--global-batch", "seq_len": "--seq-len",
                  "precision": "--precision", "memory_cap_gib": "--memory-cap"}.get(field)
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


# ---- questions: the pin options and plans given as notation --------------------------------


def pin_options(fn: Callable) -> Callable:
    """Give a command the pin options (planner.pins.PINS: --pp --vpp --sp --tp --cp --ep --etp
    --mbs --attention --dispatch --overlap --recompute --grad-sync --optimizer-sharding), each
    a list under one rule; the command receives their raw values as ``pins``, a dict by
    parameter name (planner.pins.parse_pins reads them)."""
    import inspect

    from planner.pins import LIST_RULE, PINS

    options = [inspect.Parameter(
        pin.name, inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[list[str] | None, typer.Option(
            pin.option, help=f"{pin.help} {LIST_RULE}")]) for pin in PINS]
    signature = inspect.signature(fn, eval_str=True)
    kept = [p for p in signature.parameters.values() if p.name != "pins"]

    @wraps(fn)
    def wrapper(*args, **kwargs):
        raw = {pin.name: kwargs.pop(pin.name, None) for pin in PINS}
        return fn(*args, pins=raw, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*kept, *options])
    wrapper.__annotations__ = {p.name: p.annotation for p in (*kept, *options)}
    return wrapper


def _no_plan(model, cluster, training, result, pinned) -> plans.SpecError:
    """Why a search found nothing: no layout matched the pins, or none fitted."""
    job = (f"{cluster.gpus} x {cluster.gpu.name} (global batch {training.global_batch}, "
           f"seq {training.seq_len})")
    if pinned.text and result.stats.candidates == 0:
        return plans.SpecError(
            f"{pinned.text.split()[0]}: no layout of {model.name} on {job} matches "
            f"{pinned.text} (attention and expert groups stay inside the NVLink domain of "
            f"{cluster.nvlink_domain}; pp x the attention degree divides the GPUs; dp x mbs "
            "divides the global batch)")
    where = f" with {pinned.text}" if pinned.text else ""
    cap = training.memory_cap_gib
    option, under = ("--memory-cap", f" under {cap:g} GiB") if cap is not None else ("--gpus", "")
    return plans.SpecError(
        f"{option}: no plan of {model.name}{where} fits {job}{under}; "
        f"{result.stats.pruned_memory} candidates out of memory, "
        f"{result.stats.invalid} invalid")


def _pinned_search(model, cluster, training, pinned, kernels: Kernels = Kernels.fused,
                   runnable: bool = False, top: int = 1, json_out: bool = True,
                   target: Target = Target.moeplan):
    """The search of the pinned space for ``target`` (for moeplan with --runnable, narrowed
    to what its runtime runs)."""
    from planner.search import search
    from planner.space import SearchSpace

    space = _for_target(SearchSpace(kernels=kernels, **pinned.fields),
                        TrainingPrecision(training.precision.value), target, runnable)
    with _progress_search(json_out, "searching layouts") as progress:
        result = search(model, cluster, training, space, top=top, progress=progress)
    if result.best is None:
        raise _no_plan(model, cluster, training, result, pinned)
    return result


PlanRefArg = Annotated[str, typer.Argument(
    help="A plan file (.json or .yaml, from `moeplan search --out`) or the plan notation in "
    "quotes ('pp2 dp4 sp2 ep8 a2a mbs1 rc:full', with --model, --cluster and --gpus; "
    "docs/cli.md has the grammar).")]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", help="Catalog model or spec file a plan in notation is for.")]
OptGpusOpt = Annotated[int | None, typer.Option(
    "--gpus", min=1, help="GPUs of the job a plan in notation is for.")]
OptBatchOpt = Annotated[int | None, typer.Option(
    "--global-batch", min=1, help="Sequences per step of a plan in notation; default half the "
    "GPU count.")]
OptSeqOpt = Annotated[int | None, typer.Option(
    "--seq-len", min=1, help="Tokens per sequence of a plan in notation; default 8192.")]
OptPrecisionOpt = Annotated[TrainingPrecision | None, typer.Option(
    "--precision", help="Training compute precision of a plan in notation; default bf16.")]


def _is_plan_file(ref: str) -> bool:
    """A plan reference names a file (by its suffix, a path separator, or because something
    exists at it: the loader says what is wrong with a directory or a device) or is notation."""
    return bool(ref.strip()) and (Path(ref).suffix.lower() in (".json", ".yaml", ".yml")
                                  or "/" in ref or Path(ref).exists())


def _job_options_for_notation(refs: list[str], model, gpus, global_batch, seq_len,
                              precision) -> None:
    """Refuse job options no plan uses: every plan given is a file, which holds its job."""
    if all(_is_plan_file(r) for r in refs):
        for option, value in (("--model", model), ("--gpus", gpus),
                              ("--global-batch", global_batch), ("--seq-len", seq_len),
                              ("--precision", precision)):
            if value is not None:
                raise plans.SpecError(f"{option}: a plan file holds its job; {option} goes "
                                      "with a plan in notation")


def _load_plan_ref(ref: str, model: str | None, cluster: str | None, gpus: int | None,
                   global_batch: int | None, seq_len: int | None,
                   precision: TrainingPrecision | None):
    """The plan a reference names: a plan file (priced on --cluster when given), or the
    notation built for --model on --gpus x --cluster, its layers split as the search splits
    them (planner.search.split_stages)."""
    if _is_plan_file(ref):
        loaded = plans.catalog.load_plan(Path(ref))
        if cluster is not None:
            from planner.calibrate import on

            loaded = on(loaded, plans.catalog.load_cluster(cluster, what="--cluster"))
        return loaded
    for option, value in (("--model", model), ("--cluster", cluster), ("--gpus", gpus)):
        if value is None:
            raise plans.SpecError(f"{option}: the plan notation {ref!r} needs --model, "
                                  "--cluster and --gpus (or give a plan file)")
    from planner.search import split_stages
    from plans.notation import plan_from_notation

    spec_model = plans.catalog.load_model(model)
    spec_cluster = plans.catalog.load_cluster(cluster, gpus=gpus, what="--cluster")
    training, _ = _training(global_batch, seq_len or 8192,
                            precision or TrainingPrecision.bf16, gpus)
    return split_stages(plan_from_notation(ref, spec_model, spec_cluster, training))


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
@pin_options
def search_cmd(
    model: ModelArg,
    cluster: ClusterArg,
    gpus: GpusOpt,
    global_batch: BatchOpt = None,
    seq_len: SeqOpt = 8192,
    precision: PrecisionOpt = TrainingPrecision.bf16,
    top: Annotated[int, typer.Option("--top", min=1, help="Plans to keep.")] = 5,
    kernels: Annotated[Kernels, typer.Option(
        "--kernels", help="The layers' memory-bound operators: fused torch.compile regions "
        "(default) or eager PyTorch.")] = Kernels.fused,
    runnable: RunnableOpt = False,
    target: TargetOpt = Target.moeplan,
    memory_cap: Annotated[float | None, typer.Option(
        "--memory-cap", metavar="GIB", help="Hold each GPU's predicted peak memory to this "
        "many GiB (below the GPU's usable memory), e.g. another trainer's measured peak; "
        "the plans record it (training.memory_cap_gib).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write the best plan here (YAML for a .yaml or .yml name, else JSON).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out or --plot "
                                                        "file.")] = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Write the plans' stacked time breakdowns (.png or .svg; needs "
        "matplotlib).")] = None,
    json_out: JsonOpt = False,
    pins: dict | None = None,
) -> None:
    """Find the fastest plans that fit, beside Megatron-Core's best plan (searched over what
    it runs) and the paper's Megatron-LM layout (the reference). The pin options (--tp 1,2
    --ep 8 --recompute sel ...) restrict what is searched: one value pins it.

    \b
    Examples:
      moeplan search mixtral-8x7b h100 --gpus 64 --global-batch 256 --seq-len 4096
      moeplan search qwen3-30b-a3b h200 --gpus 8 --target megatron --out plan.json
      moeplan search internal-352b h800 --gpus 1440 --global-batch 720 --json
      moeplan search qwen3-30b-a3b h200 --gpus 8 --recompute full --out plan.yaml
      moeplan search qwen3-30b-a3b h200 --gpus 8 --tp 1 --ep 4,8 --mbs 1,2
      moeplan search qwen3-30b-a3b h200 --gpus 8 --runnable --memory-cap 60
    """
    from planner.pins import parse_pins
    from planner.report import job_document, job_text, print_search, search_document

    _check_out(out, force)
    _check_plot(plot, force)
    spec_model = plans.catalog.load_model(model)
    spec_cluster = plans.catalog.load_cluster(cluster, gpus=gpus)
    training, batch_note = _training(global_batch, seq_len, precision, gpus, memory_cap)
    pinned = parse_pins(pins or {}, Precision(precision.value))
    result = _pinned_search(spec_model, spec_cluster, training, pinned, kernels, runnable,
                            top, json_out, target=target)
    if out is not None:
        from plans.io import plan_text

        _write_new(out, plan_text(result.best.plan, out), force)
    if plot is not None:
        rows = [(f"#{i + 1}", r.plan, r.evaluation) for i, r in enumerate(result.top)]
        if result.baseline is not None:
            rows.append(("megatron", result.baseline.plan, result.baseline.evaluation))
        _plots().breakdown_plot(rows, plot, job_text(spec_model, spec_cluster, training),
                                force)
    if json_out:
        job = job_document(spec_model, spec_cluster, training)
        if pinned.text:
            job["pins"] = pinned.text
        typer.echo(json.dumps(search_document(result, job), indent=2))
    else:
        print_search(result, job_text(spec_model, spec_cluster, training, batch_note)
                     + (f"; {pinned.text}" if pinned.text else ""))
        if out is not None:
            typer.echo(f"best plan written to {out}")
        if plot is not None:
            typer.echo(f"plot written to {plot}")


@app.command(short_help="Time and memory breakdown of a plan, per step and per layer.")
@user_errors
@pin_options
def explain(
    plan: Annotated[str | None, typer.Argument(
        help="A plan file (.json or .yaml) or the plan notation in quotes ('pp4 vpp8 dp16 ep8 "
        "a2a mbs1', with --model, --cluster and --gpus); without it, the fastest plan the pin "
        "options allow for --model on --gpus x --cluster.")] = None,
    measured: Annotated[Path | None, typer.Option(
        "--measured", help="A measured step of this plan (bench.steps.train_step's result "
        "JSON): "
        "predicted and measured seconds per runtime component, side by side.")] = None,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", help="The cluster (catalog name or spec file): for a plan file, price it "
        "here instead of its own, at the plan's GPU count (e.g. the calibrated h200-runtime a "
        "run was measured on); for notation or pins, the cluster it is built for.")] = None,
    model: ModelOpt = None,
    gpus: OptGpusOpt = None,
    global_batch: OptBatchOpt = None,
    seq_len: OptSeqOpt = None,
    precision: OptPrecisionOpt = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Write the step's stacked time breakdown (.png or .svg; needs "
        "matplotlib).")] = None,
    force: PlotForceOpt = False,
    json_out: JsonOpt = False,
    pins: dict | None = None,
) -> None:
    """Time breakdown per layer and per step, memory breakdown and critical path of a plan;
    with --measured, the plan as the runtime executed it against a measured step, per
    component. The plan is a file, the notation, or (none given) the fastest plan the pin
    options allow.

    \b
    Examples:
      moeplan explain plan.json
      moeplan explain "pp2 dp4 sp2 ep8 a2a mbs1" --model qwen3-30b-a3b \\
          --cluster h200 --gpus 16 --global-batch 64 --seq-len 4096
      moeplan explain --model mixtral-8x7b --cluster h100 --gpus 16 --tp 8 --ep 1
      moeplan explain plan.json --measured train_step.json --cluster h200-runtime
    """
    from planner.pins import parse_pins

    _check_plot(plot, force)
    if plot is not None and measured is not None:
        raise plans.SpecError("--plot: draws the predicted breakdown; not with --measured")
    pinned = parse_pins(pins or {}, Precision((precision or TrainingPrecision.bf16).value))
    loaded = _explained_plan(plan, model, cluster, gpus, global_batch, seq_len, precision,
                             pinned, json_out)
    if measured is not None:
        _echo_measured(loaded, measured, json_out)
    else:
        _echo_explain(loaded, plot, force, json_out)


def _explained_plan(plan: str | None, model: str | None, cluster: str | None,
                    gpus: int | None, global_batch: int | None, seq_len: int | None,
                    precision: TrainingPrecision | None, pinned, json_out: bool):
    """The plan ``explain`` prices: the PLAN given, or the fastest the pins allow."""
    if plan is None:
        for option, value in (("--model", model), ("--cluster", cluster), ("--gpus", gpus)):
            if value is None:
                raise plans.SpecError(f"{option}: give a PLAN (file or notation), or --model, "
                                      "--cluster and --gpus for the fastest plan the pins "
                                      "allow")
        spec_model = plans.catalog.load_model(model)
        spec_cluster = plans.catalog.load_cluster(cluster, gpus=gpus, what="--cluster")
        training, _ = _training(global_batch, seq_len or 8192,
                                precision or TrainingPrecision.bf16, gpus)
        return _pinned_search(spec_model, spec_cluster, training, pinned,
                              json_out=json_out).best.plan
    if pinned.text:
        raise plans.SpecError(f"{pinned.text.split()[0]}: the pin options choose a plan "
                              "by search; a PLAN states its layout (write it in the "
                              "notation)")
    _job_options_for_notation([plan], model, gpus, global_batch, seq_len, precision)
    return _load_plan_ref(plan, model, cluster, gpus, global_batch, seq_len, precision)


def _echo_measured(loaded, measured: Path, json_out: bool) -> None:
    from planner.measured import compare
    from planner.report import measured_document, print_measured

    comparison = compare(loaded, measured)
    if json_out:
        typer.echo(json.dumps(measured_document(comparison, measured), indent=2))
    else:
        print_measured(comparison, measured)


def _echo_explain(loaded, plot: Path | None, force: bool, json_out: bool) -> None:
    import cost_models
    from planner.report import explain_document, job_text, print_explain

    priced, notes = _by_target(loaded)
    evaluation = cost_models.evaluate(priced)
    if plot is not None:
        _plots().breakdown_plot([("plan", priced, evaluation)], plot,
                                job_text(priced.model, priced.cluster, priced.training), force)
    if json_out:
        typer.echo(json.dumps(explain_document(priced, evaluation), indent=2))
    else:
        for note in notes:
            typer.echo(note)
        print_explain(priced, evaluation)
        if plot is not None:
            typer.echo(f"plot written to {plot}")


@app.command("compare", short_help="Plans side by side: breakdowns, deltas, why one is faster.")
@user_errors
def compare_cmd(
    plan: Annotated[list[str], typer.Argument(
        metavar="PLAN...", help="Two plans or more: files (.json or .yaml) or the plan "
        "notation in quotes (with --model, --cluster and --gpus).")],
    model: ModelOpt = None,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", help="The cluster plans in notation are built for; plan files are "
        "priced on it too (at their GPU counts).")] = None,
    gpus: OptGpusOpt = None,
    global_batch: Annotated[int | None, typer.Option(
        "--global-batch", min=1, help="Sequences per step of plans in notation; default "
        "half the GPU count.")] = None,
    seq_len: OptSeqOpt = None,
    precision: OptPrecisionOpt = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Write the plans' stacked time breakdowns (.png or .svg; needs "
        "matplotlib).")] = None,
    force: PlotForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Two plans or more side by side: each step-time component in ms, each plan's
    difference from the first, throughput and memory, and one sentence per plan on what
    makes the faster one faster (the component whose time differs the most).

    \b
    Examples:
      moeplan compare plan.json "pp1 dp2 tp4 etp4 mbs1 ov:none sync:fp32"
      moeplan compare "pp2 dp4 sp2 ep8 a2a mbs1" "pp2 dp4 sp2 ep8 ag+rs mbs1" \\
          --model qwen3-30b-a3b --cluster h200 --gpus 16 --global-batch 64
    """
    import cost_models
    from planner.report import compare_document, compare_labels, print_compare

    if len(plan) < 2:
        raise plans.SpecError("PLAN: give two plans or more to compare")
    _check_plot(plot, force)
    _job_options_for_notation(plan, model, gpus, global_batch, seq_len, precision)
    loaded = [_load_plan_ref(ref, model, cluster, gpus, global_batch, seq_len, precision)
              for ref in plan]
    items = [(label, p, cost_models.evaluate(p))
             for label, p in zip(compare_labels(len(loaded)), loaded, strict=True)]
    if plot is not None:
        from planner.report import job_text

        first = loaded[0]
        _plots().breakdown_plot(items, plot, job_text(first.model, first.cluster,
                                                      first.training), force)
    if json_out:
        typer.echo(json.dumps(compare_document(items, plan), indent=2))
        return
    print_compare(items, plan)
    if plot is not None:
        typer.echo(f"plot written to {plot}")


@app.command(short_help="Re-check a plan and say how the runtime would run it.")
@user_errors
def validate(
    plan: PlanRefArg,
    model: ModelOpt = None,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", help="For a plan file, price it on this cluster; for notation, the "
        "cluster it is built for.")] = None,
    gpus: OptGpusOpt = None,
    global_batch: OptBatchOpt = None,
    seq_len: OptSeqOpt = None,
    precision: OptPrecisionOpt = None,
) -> None:
    """Re-check a plan, generated, hand-written or in notation, against its specs and memory.

    \b
    Examples:
      moeplan validate plan.json
      moeplan validate "pp1 dp2 sp4 ep8 a2a mbs1" --model qwen3-30b-a3b --cluster h200 \\
          --gpus 8
    """
    import cost_models
    from plans.execution import Backend, deviations, executed_plan, refusals

    _job_options_for_notation([plan], model, gpus, global_batch, seq_len, precision)
    loaded = _load_plan_ref(plan, model, cluster, gpus, global_batch, seq_len, precision)
    priced, notes = _by_target(loaded)
    evaluation = cost_models.evaluate(priced)
    if not evaluation.feasible:
        raise plans.SpecError(f"{plan}: does not fit: {evaluation.reason}")
    from planner.report import ms_text, tflops_per_gpu, tflops_text

    typer.echo(f"ok: {loaded.summary()}")
    typer.echo(f"predicted step {ms_text(evaluation.step_time_s)} ms, "
               f"{evaluation.tokens_per_s:,.0f} tokens/s, "
               f"{tflops_text(tflops_per_gpu(loaded, evaluation))} TFLOP/s/GPU, MFU "
               f"{evaluation.mfu:.1%}, peak memory {evaluation.memory.peak_bytes / 2**30:.1f} GiB")
    if loaded.prediction is not None:
        stored = loaded.prediction.step_time_s
        if abs(stored - evaluation.step_time_s) > 1e-6 * max(stored, 1e-12):
            typer.echo(f"note: the plan's stored prediction ({ms_text(stored)} ms) differs "
                       "from this cost model's; the specs or efficiency factors changed")
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
                   f"{ms_text(ran.step_time_s)} ms, MFU {ran.mfu:.1%}; `moeplan search "
                   "--runnable` plans for that")


# ---- what-if and scaling -------------------------------------------------------------------------



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
@pin_options
def whatif_cmd(
    model: ModelArg,
    cluster: Annotated[str | None, typer.Argument(
        help="Catalog cluster name or a .yaml/.json ClusterSpec (or --cluster a,b).")] = None,
    gpus: GpusOpt = ...,
    vary: Annotated[list[str] | None, typer.Option(
        "--vary", help="KNOB=V1,V2,... with values absolute or multipliers (2x); repeat for a "
        "grid. Knobs: gpu_tflops, hbm_gib, hbm_tb_s, nvlink_gb_s, nvlink_domain, network_gb_s, "
        "overlap_share (0-1: communication hidden beside compute).")] = None,
    clusters: Annotated[list[str] | None, typer.Option(
        "--cluster", help="Machines to compare, each re-planned (catalog names or spec "
        "files), instead of CLUSTER. One value or a list: comma-separated (h100,h200) or the "
        "option repeated.")] = None,
    global_batch: BatchOpt = None,
    seq_len: SeqOpt = 8192,
    precision: PrecisionOpt = TrainingPrecision.bf16,
    runnable: RunnableOpt = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Write a plot (.png or .svg; needs matplotlib): a line over one knob, "
        "a heatmap over a grid of two (machines count as one).")] = None,
    force: PlotForceOpt = False,
    json_out: JsonOpt = False,
    pins: dict | None = None,
) -> None:
    """Change the hardware (or compare machines), re-plan at every point, and compare with the
    Megatron-style layout. The pin options restrict every point's search.

    \b
    Examples:
      moeplan whatif mixtral-8x7b h800 --gpus 64 --global-batch 256 \\
          --vary gpu_tflops=1x,2x,4x
      moeplan whatif internal-352b h800 --gpus 1440 --global-batch 720 \\
          --vary nvlink_gb_s=400,900 --vary network_gb_s=25,50 --plot whatif.png
      moeplan whatif qwen3-30b-a3b --cluster h100,h200,b200 --gpus 16
      moeplan whatif qwen3-30b-a3b h200-runtime --gpus 8 --runnable \\
          --vary overlap_share=0,0.5,0.9
    """
    from planner.pins import parse_pins, split_values
    from planner.report import job_document, job_text, print_whatif, whatif_document
    from planner.space import SearchSpace
    from planner.whatif import parse_vary, whatif_machines

    _check_plot(plot, force)
    machines = split_values("--cluster", clusters)
    if (cluster is None) == (machines is None):
        raise plans.SpecError("--cluster: give one CLUSTER, or machines to compare as "
                              "--cluster a,b; not both")
    names = machines or [cluster]
    if len(set(names)) < len(names):
        raise plans.SpecError(f"--cluster: {next(n for n in names if names.count(n) > 1)} "
                              "given twice")
    if not vary and len(names) < 2:
        raise plans.SpecError("--vary: give a knob to vary (KNOB=V1,V2), or two machines or "
                              "more with --cluster a,b")
    spec_model = plans.catalog.load_model(model)
    what = "--cluster" if machines else "cluster"
    specs = [(n, plans.catalog.load_cluster(n, gpus=gpus, what=what)) for n in names]
    spec_cluster = specs[0][1]
    training, batch_note = _training(global_batch, seq_len, precision, gpus)
    varies = [parse_vary(v) for v in vary or []]
    pinned = parse_pins(pins or {}, Precision(precision.value))
    space = _for_target(SearchSpace(**pinned.fields), precision, Target.moeplan, runnable)
    with _progress_search(json_out, "re-planning") as progress:
        points = whatif_machines(spec_model, specs, training, varies, space,
                                 progress=progress)
        if not machines:
            points = [replace(p, machine=None) for p in points]
    on = ", ".join(c.gpu.name for _, c in specs)
    title = f"{spec_model.name} on {gpus} x {on}"
    header = job_text(spec_model, [c for _, c in specs] if machines else spec_cluster,
                      training, batch_note) + (f"; {pinned.text}" if pinned.text else "")
    job = job_document(spec_model, spec_cluster, training)
    if machines:
        job["cluster"] = [c.name for _, c in specs]
    _finish(points, json_out, plot,
            lambda pts: whatif_document(pts, job),
            lambda pts: print_whatif(pts, header),
            lambda pts, path: _plots().whatif_plot(pts, path, title, force))


@app.command("scale", short_help="Strong or weak scaling of the best plan and the baseline.")
@user_errors
@pin_options
def scale_cmd(
    model: ModelArg,
    cluster: ClusterArg,
    gpus: Annotated[list[str], typer.Option(
        "--gpus", help="GPU counts: comma-separated (240,480) or the option repeated.")],
    global_batch: Annotated[int | None, typer.Option(
        "--global-batch", min=1, help="Sequences per step (strong scaling); default half the "
        "largest GPU count.")] = None,
    weak: Annotated[int | None, typer.Option(
        "--weak", min=1, help="Weak scaling: sequences per NVLink-domain replica "
        "(global batch grows with the GPUs); without it, strong scaling.")] = None,
    seq_len: SeqOpt = 8192,
    precision: PrecisionOpt = TrainingPrecision.bf16,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Write a plot (.png or .svg; needs matplotlib): tokens/s with the "
        "ideal (linear from the first count) and MFU.")] = None,
    force: PlotForceOpt = False,
    json_out: JsonOpt = False,
    pins: dict | None = None,
) -> None:
    """Strong or weak scaling of the best plan and the Megatron-style layout. The pin options
    restrict every GPU count's search.

    \b
    Examples:
      moeplan scale internal-352b h800 --gpus 240,480,720,960,1440 \\
          --global-batch 720
      moeplan scale internal-352b h800 --gpus 240,480,960 --weak 24 \\
          --plot scale.svg
    """
    from planner.pins import parse_pins
    from planner.report import job_document, print_scale, scale_document
    from planner.scale import scale
    from planner.space import SearchSpace

    counts = _int_list(gpus, "--gpus")
    if weak is not None and global_batch is not None:
        raise plans.SpecError("--global-batch: weak scaling (--weak) sets the global batch at "
                              "each GPU count; give one of the two")
    _check_plot(plot, force)
    pinned = parse_pins(pins or {}, Precision(precision.value))
    spec_model = plans.catalog.load_model(model)
    spec_cluster = plans.catalog.load_cluster(cluster)
    training, batch_note = _training(global_batch, seq_len, precision, max(counts))
    with _progress_search(json_out, "scaling") as progress:
        points = scale(spec_model, spec_cluster, training, counts, weak,
                       SearchSpace(**pinned.fields), progress=progress)
    kind = (f"weak, {weak} seqs/replica" if weak
            else f"strong, global batch {training.global_batch}")
    title = f"{spec_model.name} on {spec_cluster.gpu.name} ({kind})"
    header = (f"{spec_model.name} on {spec_cluster.gpu.name} x "
              f"{', '.join(f'{c:,}' for c in counts)} GPUs: "
              + (f"weak scaling, {weak} sequences per NVLink-domain replica" if weak else
                 f"strong scaling, global batch {training.global_batch:,}{batch_note}")
              + f" x {seq_len:,} tokens, {training.precision.value}"
              + (f"; {pinned.text}" if pinned.text else ""))
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


def _int_list(raw: list[str], option: str) -> list[int]:
    """Positive whole numbers under the list rule (planner.pins), each once."""
    from planner.pins import split_values

    values = []
    for text in split_values(option, raw) or []:
        if not text.isdigit() or int(text) < 1:
            raise plans.SpecError(f"{option}: {text!r} is not a positive GPU count")
        values.append(int(text))
    if not values:
        raise plans.SpecError(f"{option}: no GPU counts given")
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
    _need_torch("profile")
    loaded = plans.catalog.load_plan(plan)
    if loaded.degrees.world != 1:
        raise plans.SpecError(f"{plan}: degrees: profiling runs one process; this plan needs "
                        f"{loaded.degrees.world} GPUs")
    _check_out(out, force)
    _run_runtime([sys.executable, "-m", "runtime.profile", "--plan", str(plan), "--out",
                  str(out), "--steps", str(steps), "--warmup", str(warmup),
                  *(["--force"] if force else [])], "profiling")


@app.command("sweep", short_help="Time kernels and collectives over shapes (for calibrate).")
@user_errors
def sweep_cmd(
    out: Annotated[Path, typer.Option("--out", help="Sweep JSON to write.")],
    nproc_per_node: Annotated[int, typer.Option(
        "--nproc-per-node", min=1, help="Processes, one GPU each; 1 times kernels and "
        "copies only (collectives need a peer).")] = 2,
    smoke: Annotated[bool, typer.Option("--smoke", help="Tiny shapes (a CPU check).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Time GEMMs, grouped GEMMs, attention, memory-bound operators and NCCL collectives over
    shapes on this machine's GPUs (python -m runtime.sweep under torchrun): measurements only,
    the --collectives input of `calibrate`, which prices every row when it fits.

    \b
    Example:
      moeplan sweep --nproc-per-node 2 --out sweep.json
      moeplan calibrate --collectives sweep.json --out my-gpu.yaml
    """
    _torchrun("sweep", "runtime.sweep", nproc_per_node, out, smoke, force, "the sweep")


@app.command("overlap", short_help="Time NCCL beside the expert GEMMs (for calibrate).")
@user_errors
def overlap_cmd(
    out: Annotated[Path, typer.Option("--out", help="Measurement JSON to write.")],
    smoke: Annotated[bool, typer.Option("--smoke", help="Small shapes (a CPU check).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Time an EP = 2 dispatch's NCCL all-to-all (and a copy-engine peer copy) alone and
    beside the expert GEMMs on two of this machine's GPUs (python -m runtime.beside under
    torchrun): the --overlap input of `calibrate`, which fits the share it hides.

    \b
    Example:
      moeplan overlap --out beside.json
      moeplan calibrate --collectives sweep.json --overlap beside.json \\
          --out my-gpu.yaml
    """
    _torchrun("overlap", "runtime.beside", 2, out, smoke, force, "the overlap measurement")


@app.command("dispatch", short_help="Time the EP dispatchers over shapes (for calibrate).")
@user_errors
def dispatch_cmd(
    out: Annotated[Path, typer.Option("--out", help="Measurement JSON to write.")],
    nproc_per_node: Annotated[int, typer.Option(
        "--nproc-per-node", min=2, help="Processes, one GPU each: the EP group.")] = 2,
    smoke: Annotated[bool, typer.Option("--smoke", help="Tiny shapes (a CPU check).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Time the runtime's two EP dispatchers (all-to-all; all-gather + reduce-scatter),
    dispatch and combine, forward and backward, over hidden sizes, expert counts, tokens and
    top-k on this machine's GPUs (python -m runtime.dispatch_sweep under torchrun): the
    --dispatch input of `calibrate`, which fits the eager dispatch's factors.

    \b
    Example:
      moeplan dispatch --out dispatch.json
      moeplan calibrate --collectives sweep.json --dispatch dispatch.json \\
          --out my-gpu.yaml
    """
    _torchrun("dispatch", "runtime.dispatch_sweep", nproc_per_node, out, smoke, force,
              "the dispatcher sweep")


@app.command("parity", short_help="Check a layout's loss and gradients against one GPU.")
@user_errors
def parity_cmd(
    plan: PlanArg,
    out: Annotated[Path, typer.Option("--out", help="Check JSON to write.")],
    share_gpu: Annotated[bool, typer.Option(
        "--share-gpu", help="Ranks share the visible GPUs over gloo.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Run one step of PLAN on this machine's GPUs, one process each (python -m runtime.parity
    under torchrun), and compare its loss and every gradient with the one-process reference's:
    does the layout compute what one GPU computes. bf16 on GPU, judged against the bf16
    reference's own error (see runtime/parity.py); exit status 1 when the check fails.

    \b
    Example:
      moeplan parity bench/gpu_plans/x2/mixtral2l_search_best.json --out p.json
    """
    gpus = plans.catalog.load_plan(plan).degrees.world
    _torchrun("parity", "runtime.parity", gpus, out, False, force, "the parity check",
              "--plan", str(plan), *(["--share-gpu"] if share_gpu else []))


@app.command("memory", short_help="Probe a plan's step for peak memory per phase and module.")
@user_errors
def memory_cmd(
    plan: PlanArg,
    out: Annotated[Path, typer.Option("--out", help="Probe JSON to write.")],
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Run a warm-up step of PLAN on this machine's GPUs, one process each (python -m
    runtime.memory_probe under torchrun), then probe one step: the resident bytes, the peak
    allocated bytes per phase (forward, loss, backward, grad_sync, optimizer), the step's
    allocated and reserved peaks and the bytes each module keeps for backward, per rank. Set
    them beside `explain`'s memory terms.

    \b
    Example:
      moeplan memory bench/gpu_plans/mixtral2l_1gpu.json --out memory.json
    """
    gpus = plans.catalog.load_plan(plan).degrees.world
    _torchrun("memory", "runtime.memory_probe", gpus, out, False, force, "the memory probe",
              "--plan", str(plan))


def _torchrun(command: str, module: str, nproc: int, out: Path, smoke: bool, force: bool,
              what: str, *args: str) -> None:
    """`moeplan COMMAND`'s runtime measurement, ``python -m module ARGS --out OUT``, under
    torchrun on ``nproc`` of this machine's GPUs, once torch is there and OUT may be written."""
    _need_torch(command)
    _check_out(out, force)
    _run_runtime([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes",
                  "1", "--nproc-per-node", str(nproc), "-m", module, *args, "--out", str(out),
                  *(["--smoke"] if smoke else []), *(["--force"] if force else [])], what)


def _run_runtime(cmd: list[str], what: str) -> None:
    """Run a runtime command ``cmd``; its failure as one line and its exit status."""
    import subprocess

    code = subprocess.call(cmd)
    if code < 0:  # killed by a signal: say which, exit as a shell reports it (128 + N)
        import signal

        name = signal.Signals(-code).name
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        typer.echo(f"error: {what} was killed by {name}{hint}", err=True)
        raise typer.Exit(128 - code)
    if code != 0:
        typer.echo(f"error: {what} exited with status {code}", err=True)
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
        "--collectives", help="`moeplan sweep`'s JSON (kernel micro-benchmarks, copies, "
                              "NCCL collectives).")
    ] = None,
    overlap: Annotated[Path | None, typer.Option(
        "--overlap", help="`moeplan overlap`'s JSON (NCCL beside the expert GEMMs, 2 "
                          "GPUs): sets efficiency.overlap.")
    ] = None,
    dispatch: Annotated[Path | None, typer.Option(
        "--dispatch", help="`moeplan dispatch`'s JSON (the EP dispatchers): sets "
                           "gather_scatter and dispatch_floor_us, fitted last.")
    ] = None,
    base: Annotated[str, typer.Option(
        "--base", help="Catalog cluster or YAML the factors start from.")] = "h200",
    fused_profile: Annotated[Path | None, typer.Option(
        "--fused-profile", help="A profiled 1-GPU step of a kernels: fused plan: sets "
                                "gemm, grouped_gemm, attention and fused_elementwise from "
                                "its kernel classes.")] = None,
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
      moeplan calibrate --collectives sweep.json --out my-h200.yaml
      moeplan calibrate profile.json --plan bench/gpu_plans/mixtral2l_1gpu.json \\
          --out my-h200.yaml
    """
    from planner import calibrate as cal

    _check_out(out, force)
    base_cluster = plans.catalog.load_cluster(base, what="--base")
    if profile is None and collectives is None:
        raise plans.SpecError("profile: give a profiled step, a --collectives sweep, or both")
    if profile is not None and plan is None:
        raise plans.SpecError("--plan: the 1-GPU plan that was profiled is needed with a "
                              "profile")
    given = _calibration_inputs(profile, plan, collectives, overlap, fused_profile, fused_plan,
                                runs, base_cluster, dispatch)
    result = _fit(given, base_cluster, name or f"{base_cluster.name}-calibrated")
    pairs = cal.runs_with_plans(runs, plans_dir) if runs else []
    if runs is not None and not pairs:
        raise plans.SpecError(f"--runs: no train_step_<plan>.json in {runs} with its <plan>.json "
                              f"in {plans_dir} (--plans)")
    fitted = [p.resolve() for p in (plan, fused_plan) if p is not None]
    rows, held, held_before = _fidelity_rows(pairs, result.cluster, fitted)
    sources = [f"{what} {path.name}, commit {doc.commit}" for what, path, doc in (
        ("profile", profile, given.profile), ("collectives", collectives, given.sweep),
        ("fused profile", fused_profile, given.fused), ("overlap", overlap, given.overlap),
        ("dispatch", dispatch, given.dispatch)) if doc is not None]
    _write_calibrated(out, result.cluster, base_cluster, sources, force)
    _echo_calibrated(result, base_cluster, out, rows, held, held_before, json_out)


def _echo_calibrated(result, base_cluster, out: Path, rows: list[dict], held: list,
                     held_before: list, json_out: bool) -> None:
    """The fitted factors, each run's errors and the held-out runs' median error, after and
    with the base's factors."""
    from planner import calibrate as cal

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
        typer.echo(f"held-out step-time error over {after.runs} runs: median "
                   f"{after.median_abs_step_error:.1%}\n  with {base_cluster.name}'s factors: "
                   f"{was.median_abs_step_error:.1%}")
    typer.echo(f"wrote {out}")


@dataclass(frozen=True)
class _CalibrationInputs:
    """The measurements ``calibrate`` fits to, read and checked against the base cluster."""

    profile: object | None
    plan: plans.Plan | None
    sweep: object | None
    overlap: object | None
    fused: object | None
    fused_plan: plans.Plan | None
    dispatch: object | None


def _fit(given: _CalibrationInputs, base_cluster, name: str):
    """The calibration of ``given``'s measurements: the sweep, profiles and overlap, then the
    fused step's factors, then the eager dispatch's on that cluster."""
    from planner import calibrate as cal

    result = cal.calibrate(given.profile, given.plan, base_cluster, name, given.sweep,
                           given.overlap)
    if given.fused is not None:
        eager = (given.profile, given.plan) if given.profile is not None else None
        result = cal.with_fused_step(result, given.fused, given.fused_plan, eager)
    if given.dispatch is not None:
        result = cal.with_dispatch(result, given.dispatch)
    return result


def _calibration_inputs(profile: Path | None, plan: Path | None, collectives: Path | None,
                        overlap: Path | None, fused_profile: Path | None,
                        fused_plan: Path | None, runs: Path | None,
                        base_cluster, dispatch: Path | None = None) -> _CalibrationInputs:
    from planner import calibrate as cal
    from planner.measured import check_profile_pairing
    from plans.results import DispatchSweep, OverlapBench, ProfileResult, Sweep, read

    measured_profile = read(ProfileResult, profile, "profile") if profile else None
    sweep = read(Sweep, collectives, "--collectives") if collectives else None
    beside = read(OverlapBench, overlap, "--overlap") if overlap else None
    dispatchers = read(DispatchSweep, dispatch, "--dispatch") if dispatch else None
    for taken, option in ((measured_profile, "profile"), (sweep, "--collectives"),
                          (beside, "--overlap"), (dispatchers, "--dispatch")):
        if taken is not None:
            cal.check_device(taken, option, base_cluster)
    if runs is not None and not runs.is_dir():
        raise plans.SpecError(f"--runs: {runs} is not a folder")
    if (fused_profile is None) != (fused_plan is None):
        raise plans.SpecError("--fused-profile: goes with --fused-plan, the plan it profiled")
    profiled_plan = plans.catalog.load_plan(plan) if plan else None
    if measured_profile is not None:
        cal.check_one_gpu(profiled_plan, "--plan")
        check_profile_pairing(profiled_plan, measured_profile, profile, "profile", "--plan")
    fused = read(ProfileResult, fused_profile, "--fused-profile") if fused_profile else None
    fused_plan_spec = plans.catalog.load_plan(fused_plan) if fused_plan else None
    if fused is not None:
        cal.check_device(fused, "--fused-profile", base_cluster)
        cal.check_one_gpu(fused_plan_spec, "--fused-plan")
        check_profile_pairing(fused_plan_spec, fused, fused_profile, "--fused-profile",
                              "--fused-plan")
    return _CalibrationInputs(measured_profile, profiled_plan, sweep, beside, fused,
                              fused_plan_spec, dispatchers)


def _fidelity_rows(pairs, cluster, fitted: list[Path]):
    """Each measured run against the calibrated cluster and the base's factors: the rows
    shown, and the held-out (not fitted to) runs' rows after and before."""
    from planner import calibrate as cal

    rows, held, held_before = [], [], []
    for run, plan_path in pairs:
        row = cal.fidelity_row(run, plan_path, cluster)
        before = cal.fidelity_row(run, plan_path)
        held_out = plan_path.resolve() not in fitted
        rows.append({**row.as_dict(), "step_error_before": before.step_error,
                     "held_out": held_out})
        if held_out:
            held.append(row)
            held_before.append(before)
    return rows, held, held_before


def _write_calibrated(out: Path, cluster, base_cluster, sources: list[str],
                      force: bool) -> None:
    import yaml

    header = (f"# {cluster.name}: {base_cluster.name} with efficiency factors fitted to "
              f"moeplan's runtime by `moeplan calibrate`\n# ({'; '.join(sources)}).\n")
    _write_new(out, header + yaml.safe_dump(cluster.model_dump(mode="json"),
                                            sort_keys=False), force)


@app.command("export", short_help="Print a launch script: Megatron-LM, torchtitan, torchrun "
             "or Slurm.")
@user_errors
def export_cmd(
    plan: PlanRefArg,
    to: Annotated[ExportTarget, typer.Option("--to", help="What to launch with.")],
    steps: Annotated[int | None, typer.Option(
        "--steps", min=1, help="Optimizer steps (megatron: --train-iters; torchtitan: "
        "--training.steps; else the runtime's --steps); default: megatron's script asks for "
        "TRAIN_ITERS, torchtitan's config function sets them, the runtime runs 10.")
    ] = None,
    model: ModelOpt = None,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", help="The cluster a plan in notation is built for.")] = None,
    gpus: OptGpusOpt = None,
    global_batch: OptBatchOpt = None,
    seq_len: OptSeqOpt = None,
    precision: OptPrecisionOpt = None,
) -> None:
    """Print a launch script for the plan: Megatron-LM's pretrain_gpt.py, torchtitan 0.3.0's
    trainer, or moeplan's runtime under torchrun or Slurm. A plan the launcher cannot express
    is refused with the reason (plans.execution: the launcher's column).

    \b
    Examples:
      moeplan export plan.json --to megatron --steps 1000 > megatron.sh
      moeplan export "pp4 vpp8 dp16 ep8 a2a mbs1 ov:inter" --model mixtral-8x7b \\
          --cluster h100 --gpus 64 --global-batch 256 --to megatron > megatron.sh
      moeplan export plan.json --to torchtitan --steps 1000 > titan.sh
      moeplan export plan.json --to slurm --steps 1000 > job.sbatch
      moeplan export plan.json --to torchrun > run.sh
    """
    import cost_models
    from planner.export import (
        check_megatron,
        megatron_script,
        slurm_script,
        torchrun_script,
        torchtitan_script,
    )
    from plans.execution import as_target, executed_plan

    _job_options_for_notation([plan], model, gpus, global_batch, seq_len, precision)
    if cluster is not None and _is_plan_file(plan):
        raise plans.SpecError("--cluster: a plan file holds its cluster; --cluster goes with "
                              "a plan in notation")
    loaded = _load_plan_ref(plan, model, cluster, gpus, global_batch, seq_len, precision)
    if to in (ExportTarget.torchrun, ExportTarget.slurm) and not _is_plan_file(plan):
        raise plans.SpecError(f"--to {to.value}: the script runs a plan file on every node; "
                              "write one with `moeplan search ... --out plan.json` and the "
                              "pin options (--pp, --ep, ...), then export it")
    # the scripts run on other nodes and from other folders: the plan by its absolute path
    where = str(Path(plan).resolve())
    priced = loaded
    if to == ExportTarget.megatron:
        check_megatron(loaded)  # before executed_plan drops what Megatron does not run
        priced = executed_plan(as_target(loaded, Target.megatron), target=Target.megatron)
        script = megatron_script(priced, steps)  # its header: the prediction as Megatron runs
        if loaded.target != Target.megatron:
            step = cost_models.evaluate(priced).step_time_s
            typer.echo(f"note: {plan}: a plan for target {loaded.target}, priced anew as a "
                       f"megatron plan: predicted step {step:.3f} s", err=True)
    elif to == ExportTarget.torchtitan:  # priced as the plan's own target runs it
        script = torchtitan_script(loaded, steps)  # refuses what torchtitan cannot express
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


def _train_cmd(plan: Path, nproc_per_node: int | None = None, **options: object) -> None:
    """Train with the plan on this machine under torchrun (gloo on CPU, NCCL on GPUs). The
    training options are python -m runtime.train's (plans.run_options), passed through; the
    runtime checks them all, with the plan, the data, the log, the checkpoint folder and its
    free space, before torchrun starts a worker.

    \b
    Example:
      moeplan search tiny-moe h200 --gpus 4 --global-batch 8 --seq-len 256 \\
          --out tiny.json
      moeplan train tiny.json --steps 200 --lr 3e-4 --lr-schedule cosine \\
          --warmup-steps 20 --min-lr 3e-5 --log-file metrics.jsonl
    """
    from planner import launch
    from plans.run_options import run_argv

    _need_torch("train")
    loaded = plans.catalog.load_plan(plan)
    world = loaded.degrees.world
    nproc = nproc_per_node or world
    if nproc != world:
        raise plans.SpecError(f"--nproc-per-node: {nproc} processes on one machine, but the "
                              f"plan's world size is {world}; for several nodes use "
                              "`moeplan export --to torchrun`")
    args = ["--plan", str(plan), *run_argv(options)]
    env = dict(os.environ)
    launch.preflight(args, world, nproc, env)  # the runtime's checks; no worker started
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "-m", "runtime.train", *args]
    outcome = launch.supervise(cmd, env)
    if outcome.message is not None:
        typer.echo(f"error: {outcome.message}", err=True)
    if outcome.code != 0:
        raise typer.Exit(outcome.code)


def _run_option_parameters() -> list:
    """`moeplan train`'s typer parameters: PLAN, --nproc-per-node, then plans.run_options'
    RUN_OPTIONS (the runtime's own, declared once)."""
    import inspect

    from plans.run_options import RUN_OPTIONS

    kw = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("plan", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=PlanArg),
        inspect.Parameter("nproc_per_node", kw, default=None, annotation=Annotated[
            int | None, typer.Option("--nproc-per-node", min=1, help="Processes on this "
                                     "machine; default the plan's world.")]),
    ]
    for o in RUN_OPTIONS:
        if not o.launcher:
            continue
        bounds = {} if o.minimum is None or o.kind is bool else {"min": o.minimum}
        kind = o.kind if o.kind is bool else o.kind | None
        params.append(inspect.Parameter(o.dest, kw, default=o.default, annotation=Annotated[
            kind, typer.Option(o.flag, *o.aliases, help=o.help, **bounds)]))
    return params


_train_cmd.__signature__ = __import__("inspect").Signature(_run_option_parameters())
app.command("train", short_help="Train with the plan on this machine under torchrun.")(
    user_errors(_train_cmd))


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
