"""Exports: Megatron-LM arguments checked against Megatron's flag names and constraints;
torchrun and Slurm launches."""

import shlex

import pytest

from planner.export import megatron_args, megatron_script, slurm_script, torchrun_command
from plans import (
    EPFFN,
    TPFFN,
    Degrees,
    Dispatch,
    PipelineSchedule,
    Plan,
    Precision,
    Recompute,
    TPAttention,
    TrainingSpec,
    UlyssesAttention,
    catalog,
)

# Flags of Megatron-LM's pretrain_gpt.py (megatron/training/arguments.py) that exports may use:
# name -> takes a value.
MEGATRON_FLAGS = {
    "--num-layers": True, "--hidden-size": True, "--num-attention-heads": True,
    "--kv-channels": True, "--group-query-attention": False, "--num-query-groups": True,
    "--seq-length": True, "--max-position-embeddings": True, "--vocab-size": True,
    "--tokenizer-type": True, "--normalization": True, "--swiglu": False,
    "--position-embedding-type": True, "--disable-bias-linear": False, "--num-experts": True,
    "--moe-router-topk": True, "--moe-ffn-hidden-size": True, "--moe-grouped-gemm": False,
    "--moe-router-load-balancing-type": True, "--untie-embeddings-and-output-weights": False,
    "--moe-shared-expert-intermediate-size": True, "--ffn-hidden-size": True,
    "--moe-layer-freq": True, "--cp-comm-type": True, "--tensor-model-parallel-size": True,
    "--pipeline-model-parallel-size": True, "--context-parallel-size": True,
    "--expert-model-parallel-size": True, "--expert-tensor-parallel-size": True,
    "--sequence-parallel": False, "--num-layers-per-virtual-pipeline-stage": True,
    "--decoder-first-pipeline-num-layers": True, "--decoder-last-pipeline-num-layers": True,
    "--moe-token-dispatcher-type": True, "--moe-expert-capacity-factor": True,
    "--micro-batch-size": True, "--global-batch-size": True, "--recompute-granularity": True,
    "--recompute-method": True, "--recompute-num-layers": True, "--bf16": False,
    "--use-distributed-optimizer": False, "--fp8-format": True, "--overlap-grad-reduce": False,
    "--overlap-param-gather": False, "--grad-reduce-in-bf16": False,
    "--no-gradient-accumulation-fusion": False, "--optimizer": True,
}
CHOICES = {
    "--moe-token-dispatcher-type": {"allgather", "alltoall", "flex"},
    "--cp-comm-type": {"p2p", "a2a", "allgather", "a2a+p2p"},
    "--recompute-granularity": {"full", "selective"},
    "--recompute-method": {"uniform", "block"},
    "--normalization": {"LayerNorm", "RMSNorm"},
    "--fp8-format": {"e4m3", "hybrid"},
    "--optimizer": {"adam", "sgd"},
}


def parse_megatron(args: list[str]) -> dict[str, str | bool]:
    """Parse like Megatron's argparse would, then check its cross-argument constraints."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag in MEGATRON_FLAGS, f"unknown Megatron flag {flag}"
        assert flag not in out, f"{flag} given twice"
        if MEGATRON_FLAGS[flag]:
            out[flag] = args[i + 1]
            assert flag not in CHOICES or args[i + 1] in CHOICES[flag], (flag, args[i + 1])
            i += 2
        else:
            out[flag] = True
            i += 1
    return out


def check_megatron_constraints(a: dict, world: int) -> None:
    n = lambda f, d=1: int(a.get(f, d))  # noqa: E731
    tp, pp, cp = n("--tensor-model-parallel-size"), n("--pipeline-model-parallel-size"), n(
        "--context-parallel-size")
    ep, etp = n("--expert-model-parallel-size"), n("--expert-tensor-parallel-size")
    assert world % (tp * pp * cp) == 0, "world = TP x PP x DP x CP"
    dp = world // (tp * pp * cp)
    assert n("--num-experts") % ep == 0, "EP divides the expert count"
    assert (tp * cp * dp) % (etp * ep) == 0, "ETP x EP divides TP x CP x DP (parallel folding)"
    assert n("--global-batch-size") % (n("--micro-batch-size") * dp) == 0
    assert n("--num-attention-heads") % tp == 0 and n("--num-query-groups") % tp == 0 or (
        tp % n("--num-query-groups") == 0)
    if "--sequence-parallel" in a:
        assert tp > 1
    if "--overlap-param-gather" in a:
        assert "--use-distributed-optimizer" in a, "param gather overlap needs the dist. opt."
    if tp > 1 and n("--num-experts") > 0:
        assert "--sequence-parallel" in a, "MoE with TP needs sequence parallelism"
    layers = n("--num-layers")
    if "--num-layers-per-virtual-pipeline-stage" in a:
        assert pp > 2 or pp == 2
        assert layers % (pp * n("--num-layers-per-virtual-pipeline-stage")) == 0
    elif "--decoder-first-pipeline-num-layers" in a:
        rest = layers - n("--decoder-first-pipeline-num-layers") - n(
            "--decoder-last-pipeline-num-layers")
        assert pp > 2 and rest % (pp - 2) == 0 or pp == 2 and rest == 0
    else:
        assert layers % pp == 0
    assert n("--seq-length") % (2 * cp if cp > 1 else 1) == 0
    if "--fp8-format" in a:
        assert "--bf16" in a


def plan(**kw) -> Plan:
    base = dict(
        model=catalog.load_model("mixtral-8x7b"),
        cluster=catalog.load_cluster("h100", gpus=64),
        training=TrainingSpec(global_batch=256, seq_len=4096),
        degrees=Degrees(pp=4, dp=2, sp=8, ep=8),
        attention=UlyssesAttention(),
        ffn=EPFFN(dispatch=Dispatch.allgather_reduce_scatter),
        stage_layers=(8, 8, 8, 8),
    )
    return Plan(**{**base, **kw})


PLANS = {
    "megascale": plan(),
    "megatron": plan(degrees=Degrees(pp=4, dp=2, tp=8, etp=8), attention=TPAttention(),
                     ffn=TPFFN(), grad_sync_precision=Precision.fp32, recompute=Recompute.full),
    "interleaved": plan(degrees=Degrees(pp=4, vpp=2, dp=2, sp=8, ep=8), stage_layers=(4,) * 8,
                        schedule=PipelineSchedule.interleaved_1f1b),
    "uneven": plan(stage_layers=(9, 8, 8, 7), training=TrainingSpec(
        global_batch=256, seq_len=4096, precision="fp8"), grad_sync_precision=Precision.fp8),
    "shared": plan(model=catalog.load_model("tiny-moe-shared"),
                   cluster=catalog.load_cluster("h100", gpus=8),
                   degrees=Degrees(pp=2, dp=2, sp=2, ep=4), stage_layers=(2, 2)),
}


@pytest.mark.parametrize("name", PLANS)
def test_megatron_args_parse_and_satisfy_constraints(name):
    p = PLANS[name]
    args, notes = megatron_args(p)
    parsed = parse_megatron(args)
    check_megatron_constraints(parsed, p.degrees.world)
    assert int(parsed["--micro-batch-size"]) == p.micro_batch_size
    assert int(parsed["--expert-model-parallel-size"]) == p.degrees.ep


def test_ulysses_maps_to_a2a_context_parallel_with_a_note():
    args, notes = megatron_args(PLANS["megascale"])
    parsed = parse_megatron(args)
    assert parsed["--context-parallel-size"] == "8" and parsed["--cp-comm-type"] == "a2a"
    assert parsed["--tensor-model-parallel-size"] == "1"
    assert parsed["--moe-token-dispatcher-type"] == "allgather"
    assert any("Ulysses" in n for n in notes)
    script = megatron_script(PLANS["megascale"])
    assert "# note: Ulysses SP=8" in script and "--cp-comm-type a2a" in script


def test_the_checker_catches_a_wrong_layout():
    args, _ = megatron_args(PLANS["megascale"])
    parsed = parse_megatron(args)
    parsed["--expert-model-parallel-size"] = "16"
    with pytest.raises(AssertionError):
        check_megatron_constraints(parsed, 64)
    with pytest.raises(AssertionError, match="unknown Megatron flag"):
        parse_megatron(["--tensor-parallel", "8"])


def test_megatron_uneven_and_precision():
    parsed = parse_megatron(megatron_args(PLANS["uneven"])[0])
    assert parsed["--decoder-first-pipeline-num-layers"] == "9"
    assert parsed["--decoder-last-pipeline-num-layers"] == "7"
    assert parsed["--fp8-format"] == "hybrid"
    parsed = parse_megatron(megatron_args(PLANS["megatron"])[0])
    assert "--grad-reduce-in-bf16" not in parsed and parsed["--recompute-granularity"] == "full"
    assert parsed["--sequence-parallel"] is True
    assert "--no-gradient-accumulation-fusion" not in parsed  # Megatron fuses by default
    unfused = PLANS["megatron"].model_copy(update={"grad_accumulation_fusion": False})
    assert parse_megatron(megatron_args(unfused)[0])["--no-gradient-accumulation-fusion"] is True


def test_torchrun_single_and_multi_node():
    single = plan(cluster=catalog.load_cluster("h100", gpus=8),
                  degrees=Degrees(pp=1, dp=1, sp=8, ep=8), stage_layers=(32,))
    cmd = torchrun_command(single, "plan.json", steps=5)
    assert cmd[:3] == ["torchrun", "--standalone", "--nnodes"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8"
    assert cmd[-4:] == ["--plan", "plan.json", "--steps", "5"]
    multi = torchrun_command(PLANS["megascale"], "plan.json")
    assert multi[multi.index("--nnodes") + 1] == "8"
    assert multi[multi.index("--rdzv-endpoint") + 1] == "$MASTER_ADDR:29500"


def test_slurm_script():
    script = slurm_script(PLANS["megascale"], "plan.json", steps=100)
    assert "#SBATCH --nodes=8" in script and "#SBATCH --gpus-per-node=8" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    words = shlex.split(srun.replace("$MASTER_ADDR", "host"))
    assert words[1] == "torchrun" and "runtime.train" in words


def test_megatron_optimizer_and_its_sharding_follow_the_plan():
    from plans import Optimizer, OptimizerSharding

    plan = PLANS["megascale"]
    parsed = parse_megatron(megatron_args(plan)[0])
    assert parsed["--use-distributed-optimizer"] is True and "--optimizer" not in parsed
    full = plan.model_copy(update={
        "optimizer_sharding": OptimizerSharding.none,
        "training": plan.training.model_copy(update={"optimizer": Optimizer.sgd})})
    parsed = parse_megatron(megatron_args(full)[0])
    assert "--use-distributed-optimizer" not in parsed and parsed["--optimizer"] == "sgd"
    assert "--overlap-param-gather" not in parsed
