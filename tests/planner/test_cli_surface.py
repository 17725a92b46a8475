"""The CLI's surface, frozen (torchtitan style): every command with its arguments and options
(choices included). A change here is a change users see: update SURFACE on purpose."""

import subprocess
import sys

import typer.main

from planner.cli import app

SURFACE = {   '': ['--version <bool>', '--install-completion <bool>', '--show-completion <bool>'],
    'catalog': ['--json <bool>'],
    'import-hf': ['CONFIG', '--out <path>', '--name <str>', '--force <bool>', '--json <bool>'],
    'schema': [],
    'search': [   'MODEL',
                  'CLUSTER',
                  '--gpus <int range>',
                  '--global-batch <int range>',
                  '--seq-len <int range>',
                  '--precision <bf16|fp8>',
                  '--top <int range>',
                  '--kernels <eager|fused>',
                  '--runnable <bool>',
                  '--target <moeplan|megatron>',
                  '--memory-cap <float>',
                  '--out <path>',
                  '--force <bool>',
                  '--plot <path>',
                  '--json <bool>',
                  '--pp <list[str]>',
                  '--vpp <list[str]>',
                  '--sp <list[str]>',
                  '--tp <list[str]>',
                  '--cp <list[str]>',
                  '--ep <list[str]>',
                  '--etp <list[str]>',
                  '--mbs <list[str]>',
                  '--attention <list[str]>',
                  '--dispatch <list[str]>',
                  '--overlap <list[str]>',
                  '--recompute <list[str]>',
                  '--grad-sync <list[str]>',
                  '--optimizer-sharding <list[str]>'],
    'explain': [   'PLAN',
                   '--measured <path>',
                   '--cluster <str>',
                   '--model <str>',
                   '--gpus <int range>',
                   '--global-batch <int range>',
                   '--seq-len <int range>',
                   '--precision <bf16|fp8>',
                   '--plot <path>',
                   '--force <bool>',
                   '--json <bool>',
                   '--pp <list[str]>',
                   '--vpp <list[str]>',
                   '--sp <list[str]>',
                   '--tp <list[str]>',
                   '--cp <list[str]>',
                   '--ep <list[str]>',
                   '--etp <list[str]>',
                   '--mbs <list[str]>',
                   '--attention <list[str]>',
                   '--dispatch <list[str]>',
                   '--overlap <list[str]>',
                   '--recompute <list[str]>',
                   '--grad-sync <list[str]>',
                   '--optimizer-sharding <list[str]>'],
    'compare': [   'PLAN',
                   '--model <str>',
                   '--cluster <str>',
                   '--gpus <int range>',
                   '--global-batch <int range>',
                   '--seq-len <int range>',
                   '--precision <bf16|fp8>',
                   '--plot <path>',
                   '--force <bool>',
                   '--json <bool>'],
    'validate': [   'PLAN',
                    '--model <str>',
                    '--cluster <str>',
                    '--gpus <int range>',
                    '--global-batch <int range>',
                    '--seq-len <int range>',
                    '--precision <bf16|fp8>'],
    'whatif': [   'MODEL',
                  'CLUSTER',
                  '--gpus <int range>',
                  '--vary <list[str]>',
                  '--cluster <list[str]>',
                  '--global-batch <int range>',
                  '--seq-len <int range>',
                  '--precision <bf16|fp8>',
                  '--runnable <bool>',
                  '--plot <path>',
                  '--force <bool>',
                  '--json <bool>',
                  '--pp <list[str]>',
                  '--vpp <list[str]>',
                  '--sp <list[str]>',
                  '--tp <list[str]>',
                  '--cp <list[str]>',
                  '--ep <list[str]>',
                  '--etp <list[str]>',
                  '--mbs <list[str]>',
                  '--attention <list[str]>',
                  '--dispatch <list[str]>',
                  '--overlap <list[str]>',
                  '--recompute <list[str]>',
                  '--grad-sync <list[str]>',
                  '--optimizer-sharding <list[str]>'],
    'scale': [   'MODEL',
                 'CLUSTER',
                 '--gpus <list[str]>',
                 '--global-batch <int range>',
                 '--weak <int range>',
                 '--seq-len <int range>',
                 '--precision <bf16|fp8>',
                 '--plot <path>',
                 '--force <bool>',
                 '--json <bool>',
                 '--pp <list[str]>',
                 '--vpp <list[str]>',
                 '--sp <list[str]>',
                 '--tp <list[str]>',
                 '--cp <list[str]>',
                 '--ep <list[str]>',
                 '--etp <list[str]>',
                 '--mbs <list[str]>',
                 '--attention <list[str]>',
                 '--dispatch <list[str]>',
                 '--overlap <list[str]>',
                 '--recompute <list[str]>',
                 '--grad-sync <list[str]>',
                 '--optimizer-sharding <list[str]>'],
    'profile': [   'PLAN',
                   '--out <path>',
                   '--steps <int range>',
                   '--warmup <int range>',
                   '--force <bool>'],
    'sweep': ['--out <path>', '--nproc-per-node <int range>', '--smoke <bool>', '--force <bool>'],
    'overlap': ['--out <path>', '--smoke <bool>', '--force <bool>'],
    'dispatch': [   '--out <path>',
                    '--nproc-per-node <int range>',
                    '--smoke <bool>',
                    '--force <bool>'],
    'parity': ['PLAN', '--out <path>', '--share-gpu <bool>', '--force <bool>'],
    'memory': ['PLAN', '--out <path>', '--force <bool>'],
    'calibrate': [   '--out <path>',
                     'PROFILE',
                     '--plan <path>',
                     '--collectives <path>',
                     '--overlap <path>',
                     '--dispatch <path>',
                     '--base <str>',
                     '--fused-profile <path>',
                     '--fused-plan <path>',
                     '--name <str>',
                     '--runs <path>',
                     '--plans <path>',
                     '--force <bool>',
                     '--json <bool>'],
    'export': [   'PLAN',
                  '--to <megatron|torchtitan|torchrun|slurm>',
                  '--steps <int range>',
                  '--model <str>',
                  '--cluster <str>',
                  '--gpus <int range>',
                  '--global-batch <int range>',
                  '--seq-len <int range>',
                  '--precision <bf16|fp8>'],
    'train': [   'PLAN',
                 '--nproc-per-node <int range>',
                 '--steps <int range>',
                 '--data <path>',
                 '--data-dtype <u16|u32>',
                 '--log-file --log <path>',
                 '--tensorboard-dir <path>',
                 '--ckpt-dir <path>',
                 '--ckpt-every <int range>',
                 '--ckpt-keep <int range>',
                 '--resume <bool>',
                 '--overwrite <bool>',
                 '--seed <int>',
                 '--lr <float range>',
                 '--lr-schedule <constant|cosine>',
                 '--warmup-steps <int range>',
                 '--min-lr <float range>',
                 '--weight-decay <float range>',
                 '--clip-grad <float range>',
                 '--aux-loss-coeff <float range>',
                 '--per-expert-balance <bool>',
                 '--timeout-s <float range>',
                 '--compile-cache <path>']}


def cli_surface() -> dict[str, list[str]]:
    group = typer.main.get_command(app)
    ctx = group.make_context("moeplan", [], resilient_parsing=True)

    def text(p) -> str:
        if p.param_type_name != "option":
            return p.name.upper()
        return " ".join([*p.opts, *p.secondary_opts, p.display_type(ctx)]).strip()

    return {name: [text(p) for p in cmd.params]
            for name, cmd in {"": group, **group.commands}.items()}


def test_cli_surface_is_frozen():
    assert cli_surface() == SURFACE


def test_help_imports_no_models_and_no_cost_model():
    """`moeplan --help` stays fast: the pydantic models, rich, the cost model and the planner
    load inside the commands, never for help."""
    code = ("import sys; sys.argv = ['moeplan', '--help']\n"
            "import planner.cli\n"
            "try:\n    planner.cli.main()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('pydantic', 'rich', 'cost_models', 'planner.search', "
            "'plans.plan', 'torch') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout, done.stdout[-300:]
    assert "Commands:" in done.stdout and "-h, --help" in done.stdout


def test_version_and_completion():
    from typer.testing import CliRunner

    runner = CliRunner()
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("moeplan ")
    completion = runner.invoke(app, ["--show-completion", "bash"])
    assert completion.exit_code == 0 and "complete" in completion.output
    short = runner.invoke(app, ["search", "-h"])
    assert short.exit_code == 0 and "--precision <bf16|fp8>" in short.output
    assert "Examples:" in short.output
