"""`moeplan export --to torchtitan`: the arguments parsed by torchtitan 0.3.0's own config
classes and parser (tyro with its ConfigManager's rules; the whole ConfigManager where its
model registries import), and the plans it cannot run refused in one line."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.export import torchtitan_job, torchtitan_model_parts, torchtitan_script
from plans import (
    EPFFN,
    CPAttention,
    Degrees,
    Dispatch,
    Kernels,
    OptimizerSharding,
    Overlap,
    PipelineSchedule,
    Plan,
    Precision,
    Recompute,
    SpecError,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
)
from plans.catalog import load_cluster, load_model

WHEELS = Path(os.environ.get("MOEPLAN_WHEELS", "/work/main/.whl"))
NEEDED = ("torchtitan-0.3.0-", "tyro-", "docstring_parser-", "typeguard-", "spmd_types-")
"""torchtitan 0.3.0 and what its config parsing imports (torch aside)."""

JUDGE = r'''
import dataclasses, json, sys
import tyro
from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.manager import ConfigManager, custom_registry
from torchtitan.distributed.activation_checkpoint import (
    ActivationCheckpointingConfig, SelectiveAC)

argv = json.loads(sys.argv[1])
if sys.argv[2] == "registry":  # the whole parse: --module, --config, the registry's function
    config = ConfigManager().parse_args(argv)
else:
    @dataclasses.dataclass
    class Job:  # the sections of torchtitan.trainer.Trainer.Config the export sets
        training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
        parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
        compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
        activation_checkpoint: ActivationCheckpointingConfig = dataclasses.field(
            default_factory=SelectiveAC.Config)
        dump_folder: str = "./outputs"

    ConfigManager.register_tyro_rules(custom_registry)
    config = tyro.cli(Job, args=argv[4:], registry=custom_registry)
ac = config.activation_checkpoint
print(json.dumps({
    "parallelism": dataclasses.asdict(config.parallelism),
    "training": dataclasses.asdict(config.training),
    "compile": dataclasses.asdict(config.compile),
    "ac": None if ac is None else type(ac).__qualname__,
}))
'''


@pytest.fixture(scope="module")
def torchtitan_path(tmp_path_factory) -> Path:
    wheels = [next(WHEELS.glob(f"{n}*.whl"), None) for n in NEEDED]
    if not all(wheels):
        pytest.skip(f"torchtitan 0.3.0's wheels are not in {WHEELS} (MOEPLAN_WHEELS)")
    target = tmp_path_factory.mktemp("torchtitan")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                        "--target", str(target), *map(str, wheels)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.skip(f"pip could not install torchtitan's wheels: {r.stderr.strip()[-200:]}")
    return target


def qwen_plan(**changes) -> Plan:
    fields = dict(
        model=load_model("qwen3-30b-a3b"), cluster=load_cluster("h200", gpus=16),
        training=TrainingSpec(global_batch=64, seq_len=4096),
        degrees=Degrees(pp=2, dp=8, ep=8), stage_layers=(20, 28), micro_batch_size=2,
        optimizer_sharding=OptimizerSharding.zero1, recompute=Recompute.full,
        ffn=EPFFN(dispatch=Dispatch.all_to_all), overlap=Overlap.none,
        grad_sync_precision=Precision.fp32)
    return Plan(**{**fields, **changes})


PLANS = {
    "pp2_fsdp8_ep8_full": qwen_plan(),
    "cp2_pp2_vpp2_dp4_ep2_fused": qwen_plan(
        degrees=Degrees(pp=2, vpp=2, dp=4, cp=2, ep=2), attention=CPAttention(),
        stage_layers=(12, 12, 12, 12), optimizer_sharding=OptimizerSharding.none,
        schedule=PipelineSchedule.interleaved_1f1b, recompute=Recompute.none,
        kernels=Kernels.fused),
    "tp2_dp8": qwen_plan(degrees=Degrees(dp=8, tp=2, ep=2), attention=TPAttention(),
                         stage_layers=(48,), micro_batch_size=1),
}


def _launched(script: str, tmp_path: Path) -> list[str]:
    """torchtitan.train's arguments as the script's DRY_RUN prints them."""
    path = tmp_path / "titan.sh"
    path.write_text(script)
    env = {**os.environ, "DRY_RUN": "1", "MASTER_ADDR": "node0", "RDZV_ID": "7"}
    r = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    return words[words.index("torchtitan.train") + 1:]


def _judge(argv: list[str], path: Path, how: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", JUDGE, json.dumps(argv), how], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", PLANS)
def test_torchtitans_parser_reads_the_plan(name, torchtitan_path, tmp_path):
    plan = PLANS[name]
    argv = _launched(torchtitan_script(plan, steps=100), tmp_path)
    assert argv[:4] == ["--module", "qwen3", "--config", "qwen3_30b_a3b"]
    got = _judge(argv, torchtitan_path, "sections")
    d, par, tr = plan.degrees, got["parallelism"], got["training"]
    zero1 = plan.optimizer_sharding == OptimizerSharding.zero1
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (
        (d.dp, 1) if zero1 else (1, d.dp))
    assert (par["tensor_parallel_degree"], par["context_parallel_degree"],
            par["pipeline_parallel_degree"], par["expert_parallel_degree"]) == (
        d.tp, d.cp, d.pp, d.ep)
    # the dense mesh is the world; EP divides the FSDP x CP x TP region it borrows
    assert (par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"] * d.cp
            * d.tp * d.pp) == d.world
    assert (par["data_parallel_shard_degree"] * d.cp * d.tp) % d.ep == 0
    assert tr["global_batch_size"] == plan.training.global_batch
    assert tr["seq_len"] == plan.training.seq_len and tr["steps"] == 100
    if d.pp > 1:
        assert par["module_fqns_per_model_part"] == torchtitan_model_parts(plan)
        assert par["pipeline_parallel_microbatch_size"] == plan.micro_batch_size
        assert par["pipeline_parallel_schedule"] == (
            "Interleaved1F1B" if d.vpp > 1 else "1F1B")
        # one pipeline pass per step: the replica's sequences in micro-batches of the plan's
        assert tr["local_batch_size"] * d.dp == plan.training.global_batch
    else:  # gradient accumulation over micro-batches of the plan's size
        assert tr["local_batch_size"] == plan.micro_batch_size
    layers = [m for part in torchtitan_model_parts(plan) for m in part if m.startswith("lay")]
    assert layers == [f"layers.{i}" for i in range(plan.model.layers)]
    if d.cp > 1:
        assert par["context_parallel_load_balancer"] == "headtail"
    assert got["compile"]["enable"] == (plan.kernels == Kernels.fused)
    assert got["ac"] == {Recompute.full: "FullAC.Config", Recompute.none: None}[plan.recompute]


def test_torchtitans_config_manager_reads_the_plan(torchtitan_path, tmp_path):
    """The whole parse, where torchtitan's model registry imports (it needs triton and
    torchdata: CUDA machines)."""
    env = {**os.environ, "PYTHONPATH": str(torchtitan_path)}
    probe = subprocess.run([sys.executable, "-c", "import torchtitan.models.qwen3."
                            "config_registry"], env=env, capture_output=True, text=True,
                           timeout=300)
    if probe.returncode:
        pytest.skip("torchtitan's qwen3 config registry does not import here: "
                    + probe.stderr.strip().splitlines()[-1])
    plan = PLANS["pp2_fsdp8_ep8_full"]
    got = _judge(_launched(torchtitan_script(plan, steps=100), tmp_path), torchtitan_path,
                 "registry")
    assert got["parallelism"]["expert_parallel_degree"] == plan.degrees.ep


def _refused(plan: Plan, tmp_path: Path, *words: str) -> None:
    with pytest.raises(SpecError) as e:
        torchtitan_job(plan)
    line = str(e.value)
    assert line.startswith("--to torchtitan: ") and "\n" not in line, line
    for w in words:
        assert w in line, line
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    r = CliRunner().invoke(app, ["export", str(path), "--to", "torchtitan"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words[0] in lines[0], r.output


REFUSED = {
    "ulysses": (dict(degrees=Degrees(pp=2, dp=4, sp=2, ep=4), attention=UlyssesAttention()),
                ("attention.kind", "ring attention")),
    "bf16_grad_sync": (dict(grad_sync_precision=Precision.bf16),
                       ("grad_sync_precision", "float32 only")),
    "allgather_dispatch": (dict(ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter)),
                           ("ffn.dispatch", "all-to-all only")),
    "selective_recompute": (dict(recompute=Recompute.selective), ("recompute", "per operator")),
    "ep_overlap": (dict(overlap=Overlap.inter_op), ("overlap",)),
    "empty_chunk": (dict(degrees=Degrees(pp=2, vpp=2, dp=8, ep=8),
                         schedule=PipelineSchedule.interleaved_1f1b,
                         stage_layers=(24, 0, 12, 12)), ("stage_layers", "none empty")),
    "ep_without_fsdp": (dict(optimizer_sharding=OptimizerSharding.none),
                        ("degrees", "borrows its ranks from FSDP and TP")),
    "capacity": (dict(ffn=EPFFN(dispatch=Dispatch.all_to_all, capacity_factor=1.25)),
                 ("ffn.capacity_factor", "dropless")),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_torchtitan_cannot_run_is_refused_in_one_line(case, tmp_path):
    changes, words = REFUSED[case]
    _refused(qwen_plan(**changes), tmp_path, *words)


def test_a_model_without_a_torchtitan_config_function_is_refused(tmp_path):
    plan = qwen_plan(model=load_model("qwen3-30b-a3b").model_copy(update={"layers": 40}),
                     stage_layers=(20, 20))
    _refused(plan, tmp_path, "model", "config function")
    with pytest.raises(SpecError) as e:
        torchtitan_job(plan)
    # the spec named, not printed field by field
    assert str(e.value).startswith(f"--to torchtitan: model: {plan.model.name} is not run "), e
    assert "hidden=" not in str(e.value)


def test_the_script_states_what_runs_differently():
    job = torchtitan_job(qwen_plan())
    assert any(n.startswith("optimizer_sharding zero1 runs as FSDP2") for n in job.notes)
    assert any("no auxiliary loss" in n for n in job.notes)
    script = torchtitan_script(qwen_plan())
    assert "# note: grad_accumulation_fusion: planned true, runs false" in script
    notes = [ln for ln in script.splitlines() if ln.startswith(("# note", "#   "))]
    assert len(notes) >= 4 and max(map(len, notes)) <= 100
