"""Exports: Megatron-LM arguments checked against Megatron's flag names and constraints;
torchrun and Slurm launches."""

import shlex
import shutil
import subprocess

import pytest

from planner.export import (
    megatron_args,
    megatron_env,
    megatron_layout,
    megatron_layout_layers,
    megatron_script,
    slurm_script,
    torchrun_command,
    torchrun_script,
)
from plans import (
    EPFFN,
    TPFFN,
    Degrees,
    Dispatch,
    Overlap,
    PipelineSchedule,
    Plan,
    Precision,
    Recompute,
    SpecError,
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
    "--no-gradient-accumulation-fusion": False, "--optimizer": True, "--norm-epsilon": True,
    "--rotary-base": True,
    "--attention-dropout": True, "--hidden-dropout": True, "--qk-layernorm": False,
    "--moe-router-pre-softmax": False, "--moe-aux-loss-coeff": True,
    "--pipeline-model-parallel-layout": True, "--recompute-modules": True,
    "--fp8-recipe": True, "--train-iters": True,
    "--multi-latent-attention": False, "--q-lora-rank": True, "--kv-lora-rank": True,
    "--qk-head-dim": True, "--qk-pos-emb-head-dim": True, "--v-head-dim": True,
    "--rope-type": True, "--no-rope-fusion": False, "--moe-router-score-function": True,
    "--moe-router-enable-expert-bias": False, "--moe-router-topk-scaling-factor": True,
    "--moe-router-num-groups": True, "--moe-router-group-topk": True, "--mtp-num-layers": True,
    "--window-size": True, "--window-attn-skip-freq": True, "--softmax-type": True,
    "--rotary-percent": True, "--add-qkv-bias": False, "--overlap-moe-expert-parallel-comm": False,
    "--sgd-momentum": True, "--quick-geglu": False, "--glu-linear-offset": True,
    "--activation-func-clamp-value": True, "--rotary-scaling-factor": True, "--mscale": True,
    "--mscale-all-dim": True,
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
            j = i + 2
            while flag == "--recompute-modules" and j < len(args) and not args[j].startswith("-"):
                j += 1
            out[flag] = " ".join(args[i + 1:j])
            assert flag not in CHOICES or out[flag] in CHOICES[flag], (flag, out[flag])
            i = j
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
    if pp > 1:
        chunks = a["--pipeline-model-parallel-layout"].split("|")
        assert len(chunks) % pp == 0
        assert a["--pipeline-model-parallel-layout"].startswith("E")
        assert a["--pipeline-model-parallel-layout"].endswith("L")
        count = sum(int(c.split("t*")[1].rstrip("L")) if "t*" in c else c.count("t")
                    for c in chunks)
        assert count == layers
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
        overlap=Overlap.none,
    )
    return Plan(**{**base, **kw})


PLANS = {
    "megascale": plan(),
    "megatron": plan(degrees=Degrees(pp=4, dp=2, tp=8, etp=8), attention=TPAttention(),
                     ffn=TPFFN(), grad_sync_precision=Precision.fp32, recompute=Recompute.full),
    "interleaved": plan(degrees=Degrees(pp=4, vpp=2, dp=2, sp=8, ep=8), stage_layers=(4,) * 8,
                        schedule=PipelineSchedule.interleaved_1f1b),
    "ep_overlap": plan(degrees=Degrees(pp=4, vpp=2, dp=2, sp=8, ep=8), stage_layers=(4,) * 8,
                       schedule=PipelineSchedule.interleaved_1f1b, overlap=Overlap.inter_op,
                       ffn=EPFFN(dispatch=Dispatch.all_to_all)),
    "uneven": plan(stage_layers=(9, 8, 8, 7), training=TrainingSpec(
        global_batch=256, seq_len=4096, precision="fp8")),
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
    assert parsed["--pipeline-model-parallel-layout"] == "Et*9|t*8|t*8|t*7L"
    assert parsed["--fp8-format"] == "hybrid" and parsed["--fp8-recipe"] == "tensorwise"
    mx = PLANS["uneven"].model_copy(update={"training": TrainingSpec(
        global_batch=256, seq_len=4096, precision="fp8", fp8_recipe="mxfp8")})
    assert parse_megatron(megatron_args(mx)[0])["--fp8-recipe"] == "mxfp8"
    interleaved = PLANS["interleaved"].model_copy(update={"stage_layers": (5, 4, 4, 4, 4, 4, 4, 3)})
    layout = parse_megatron(megatron_args(interleaved)[0])["--pipeline-model-parallel-layout"]
    assert layout == "Et*5|t*4|t*4|t*4|t*4|t*4|t*4|t*3L"
    parsed = parse_megatron(megatron_args(PLANS["megatron"])[0])
    assert "--grad-reduce-in-bf16" not in parsed and parsed["--recompute-granularity"] == "full"
    assert parsed["--sequence-parallel"] is True
    assert "--no-gradient-accumulation-fusion" not in parsed  # Megatron fuses by default
    unfused = PLANS["megatron"].model_copy(update={"grad_accumulation_fusion": False})
    assert parse_megatron(megatron_args(unfused)[0])["--no-gradient-accumulation-fusion"] is True


def test_a_recipe_pipeline_layout_reads_back_as_the_plans_stage_split():
    model = catalog.load_model("deepseek-v3")  # 61 layers, one MTP module
    assert megatron_layout_layers("Et*4|(t*4|)*14tmL", model, 16) == (4,) * 15 + (1,)
    no_mtp = model.model_copy(update={"mtp_layers": 0})
    assert megatron_layout_layers("Et|(tt|)*30L", no_mtp, 32) == (1,) + (2,) * 30 + (0,)
    for plan in (PLANS["uneven"], PLANS["interleaved"]):
        chunks = len(plan.stage_layers)
        assert megatron_layout_layers(megatron_layout(plan), plan.model,
                                      chunks) == plan.stage_layers


@pytest.mark.parametrize(("layout", "why"), [
    ("Et*4|(t*4|)*14tL", "MTP"),          # the model's MTP module is missing
    ("Et*4|(t*4|)*13tmL", "chunks"),      # 15 chunks for pp x vp = 16
    ("Et*4|(t*4|)*14t*2mL", "decoder"),   # 62 decoder layers
    ("t*4|E(t*4|)*14tmL", "embedding"),   # the embedding is not first
    ("Et*4|(t*4|*14tmL", "unclosed"),
])
def test_a_layout_that_is_not_the_models_is_refused(layout, why):
    with pytest.raises(SpecError, match=why):
        megatron_layout_layers(layout, catalog.load_model("deepseek-v3"), 16)


def test_torchrun_single_and_multi_node():
    single = plan(cluster=catalog.load_cluster("h100", gpus=8),
                  degrees=Degrees(pp=1, dp=1, sp=8, ep=8), stage_layers=(32,))
    cmd = torchrun_command(single, "plan.json", steps=5)
    assert cmd[:3] == ["torchrun", "--standalone", "--nnodes"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8"
    assert cmd[cmd.index("--numa-binding") + 1] == "node"  # CPUs near each worker's GPU
    assert cmd[-4:] == ["--plan", "plan.json", "--steps", "5"]
    multi = torchrun_command(PLANS["megascale"], "plan.json")
    assert multi[multi.index("--nnodes") + 1] == "8"
    assert multi[multi.index("--rdzv-endpoint") + 1] == '"$MASTER_ADDR:29500"'


def test_slurm_script():
    script = slurm_script(PLANS["megascale"], "my plans/$x.json", steps=100)
    assert "#SBATCH --nodes=8" in script and "#SBATCH --gpus-per-node=8" in script
    srun = next(line for line in script.splitlines() if line.startswith("CMD=(srun "))
    assert '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in srun
    words = shlex.split(srun.replace("$MASTER_ADDR", "host").removeprefix("CMD=(")[:-1])
    assert "torchrun" in words and "runtime.train" in words
    assert words[words.index("--plan") + 1] == "my plans/$x.json"  # quoted, not expanded


SCRIPTS = {
    "megatron": lambda p, path: megatron_script(p),
    "torchrun": torchrun_script,
    "slurm": slurm_script,
}


@pytest.mark.parametrize("target", SCRIPTS)
def test_scripts_stop_with_a_clear_message_when_a_variable_is_unset(target, tmp_path):
    """Run the script under bash with the launchers faked: an unset MASTER_ADDR (or training
    setting) stops it with a message naming the variable, before anything is launched."""
    script = tmp_path / "run.sh"
    script.write_text(SCRIPTS[target](PLANS["megascale"], "plan.json"))
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("torchrun", "srun", "scontrol"):
        (fake / tool).write_text("#!/bin/sh\necho launched\n")
        (fake / tool).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "MEGATRON_LM": "/m", "LR": "1e-4",
           "TRAIN_ITERS": "10", "DATA_PATH": "/d", "TOKENIZER_MODEL": "/t", "RDZV_ID": "j1"}
    if target == "slurm":
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
        assert done.returncode != 0 and "submit this script with sbatch" in done.stderr
        env["SLURM_JOB_NODELIST"], env["SLURM_CPUS_ON_NODE"] = "n[1-8]", "64"
        env["SLURM_JOB_ID"] = "41"
    else:
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
        assert done.returncode != 0 and "set MASTER_ADDR" in done.stderr
        assert "launched" not in done.stdout
        env["MASTER_ADDR"] = "n1"
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "launched" in done.stdout, done.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("target", SCRIPTS)
def test_scripts_are_shellcheck_clean(target, tmp_path):
    for name, p in PLANS.items():
        script = tmp_path / f"{name}.sh"
        script.write_text(SCRIPTS[target](p, "my plan.json"))
        done = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


def test_megatron_model_environment_recompute_and_steps():
    qwen = plan(model=catalog.load_model("qwen3-30b-a3b"), degrees=Degrees(pp=4, dp=4, sp=4,
                ep=8), stage_layers=(12, 12, 12, 12))
    parsed = parse_megatron(megatron_args(qwen, steps=7)[0])
    assert parsed["--rotary-base"] == "1000000" and parsed["--qk-layernorm"] is True
    assert parsed["--moe-aux-loss-coeff"] == "0.001" and parsed["--norm-epsilon"] == "1e-06"
    assert parsed["--attention-dropout"] == parsed["--hidden-dropout"] == "0"
    assert parsed["--recompute-modules"] == "core_attn"  # selective: the attention core
    assert parsed["--train-iters"] == "7"
    assert megatron_env(qwen) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # CP (Ulysses) > 1
    no_sp = plan(degrees=Degrees(pp=4, dp=16, ep=8))
    assert megatron_env(no_sp) == {}
    script = megatron_script(no_sp)
    assert "set TRAIN_ITERS" in script and "LR=" in script and "set DATA_PATH" in script
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in script
    assert 'TRAIN_ITERS="${TRAIN_ITERS:-3}"' in megatron_script(no_sp, steps=3)
    hunyuan = catalog.load_model("hunyuan-large")
    top1 = plan(model=hunyuan, degrees=Degrees(pp=4, dp=2, sp=8, ep=8), stage_layers=(16,) * 4)
    assert parse_megatron(megatron_args(top1)[0])["--moe-router-pre-softmax"] is True


@pytest.mark.parametrize("update, reason", [
    ({"grad_sync_precision": Precision.fp8}, "fp8 gradient sync"),
    ({"model": catalog.load_model("mixtral-8x7b").model_copy(update={"top_k": 1})},
     "pre-softmax"),
    ({"model": catalog.load_model("mixtral-8x7b").model_copy(update={"kv_heads": 4})},
     "above model.kv_heads"),
    ({"training": TrainingSpec(global_batch=256, seq_len=4104)}, "2 x CP"),
    ({"model": catalog.load_model("mixtral-8x7b").model_copy(update={"swiglu_limit": 7.0})},
     "swiglu_limit without linear biases"),
    ({"model": catalog.load_model("mixtral-8x7b").model_copy(update={
        "rope_scaling": catalog.load_model("gpt-oss-120b").rope_scaling})},
     "--to megatron: model.rope_scaling: Megatron-LM's arguments cannot express YaRN for GPT "
     "attention"),
])
def test_megatron_refuses_what_it_cannot_express(update, reason):
    p = PLANS["uneven"].model_copy(update=update)
    with pytest.raises(SpecError, match=reason):
        megatron_args(p)


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


def test_megatron_prices_the_materialised_logits_of_a_chunked_plan():
    from cost_models import evaluate
    from plans.enums import CrossEntropy

    p = plan(model=catalog.load_model("qwen3-30b-a3b"), cluster=catalog.load_cluster(
        "h100", gpus=8), degrees=Degrees(pp=1, dp=8, ep=8), stage_layers=(48,),
        training=TrainingSpec(global_batch=16, seq_len=8192), micro_batch_size=2,
        cross_entropy=CrossEntropy.chunked)
    assert any("materialises" in n for n in megatron_args(p)[1])
    as_run = evaluate(p.model_copy(update={"cross_entropy": CrossEntropy.materialized}))
    # a GPU with just the room the chunked plan needs: Megatron's logits no longer fit
    tight = p.cluster.gpu.model_copy(update={"hbm_gib": (
        evaluate(p).memory.peak_bytes + as_run.memory.peak_bytes) / 2 / 2**30
        / p.cluster.efficiency.memory_usable})
    small = p.model_copy(update={"cluster": p.cluster.model_copy(update={"gpu": tight})})
    assert evaluate(small).feasible
    with pytest.raises(SpecError, match="materialises the whole micro-batch's logits"):
        megatron_args(small)


def test_inter_op_is_megatrons_ep_overlap_and_tile_fused_overlap_is_refused():
    """plans.execution's megatron column: overlap inter_op runs as
    --overlap-moe-expert-parallel-comm where its checks hold; the rest is refused naming
    the field and the target; plain SGD exports without Megatron's default momentum."""
    parsed = parse_megatron(megatron_args(PLANS["ep_overlap"])[0])
    assert parsed["--overlap-moe-expert-parallel-comm"] is True
    assert "--overlap-moe-expert-parallel-comm" not in parse_megatron(
        megatron_args(PLANS["interleaved"])[0])
    for update, field in (({"overlap": Overlap.inter_intra_op}, "overlap: inter_intra_op"),
                          ({"overlap": Overlap.inter_op}, "overlap: inter_op")):
        with pytest.raises(SpecError, match=f"^--to megatron: {field} is not run by target "
                           "megatron"):
            megatron_args(PLANS["megascale"].model_copy(update=update))
    sgd = PLANS["megascale"].model_copy(update={"training": TrainingSpec(
        global_batch=256, seq_len=4096, optimizer="sgd")})
    assert parse_megatron(megatron_args(sgd)[0])["--sgd-momentum"] == "0"
def _dry_run(script: str, tmp_path, *argv: str, **env: str) -> tuple[list[str], str]:
    """The command a script would run (DRY_RUN=1) as words, and what it said it would do."""
    path = tmp_path / "run.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    done = subprocess.run(["bash", str(path), *argv], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1", **env})
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout), done.stderr


def test_runtime_scripts_pass_data_checkpoints_and_steps_and_say_so(tmp_path):
    p = PLANS["megascale"]
    words, said = _dry_run(torchrun_script(p, "/plans/a b.json", steps=100), tmp_path,
                           "--seed", "3", MASTER_ADDR="n1", RDZV_ID="job7",
                           DATA="/data/tok.u16", CKPT_DIR="/ckpt", CKPT_EVERY="50",
                           LOG_FILE="/logs/m.jsonl")
    assert words[words.index("--rdzv-id") + 1] == "job7"
    run = words[words.index("runtime.train") + 1:]
    assert run == ["--plan", "/plans/a b.json", "--steps", "100", "--data", "/data/tok.u16",
                   "--ckpt-dir", "/ckpt", "--ckpt-every", "50", "--log-file", "/logs/m.jsonl",
                   "--seed", "3"]
    assert "100 steps" in said and "/data/tok.u16" in said and "/ckpt every 50" in said
    words, said = _dry_run(torchrun_script(p, "/p.json"), tmp_path, MASTER_ADDR="n1",
                           SLURM_JOB_ID="99", STEPS="7", RESUME="1")
    assert words[words.index("--rdzv-id") + 1] == "99"
    assert words[words.index("runtime.train") + 1:] == ["--plan", "/p.json", "--steps", "7",
                                                         "--resume"]
    assert "synthetic tokens" in said and "checkpoints: none" in said


def test_slurm_rendezvous_is_the_job(tmp_path):
    words, said = _dry_run(slurm_script(PLANS["megascale"], "/p.json", steps=20), tmp_path,
                           SLURM_JOB_NODELIST="n[1-8]", SLURM_JOB_ID="12345",
                           SLURM_CPUS_ON_NODE="64", MASTER_ADDR="n1", CKPT_DIR="/c")
    assert words[0] == "srun" and words[words.index("--rdzv-id") + 1] == "12345"
    assert words[words.index("--rdzv-endpoint") + 1] == "n1:29500"
    assert words[-4:] == ["--ckpt-dir", "/c", "--ckpt-every", "1000"]
    assert "20 steps" in said


def test_megatron_script_takes_extra_arguments(tmp_path):
    words, said = _dry_run(megatron_script(PLANS["megascale"], steps=30), tmp_path,
                           "--eval-iters", "0", MEGATRON_LM="/m", MASTER_ADDR="n1",
                           RDZV_ID="r", MOCK_DATA="1", EXTRA_ARGS="--seed 5 --no-load-optim")
    assert words[-5:] == ["--seed", "5", "--no-load-optim", "--eval-iters", "0"]
    assert "--mock-data" in words and words[words.index("--train-iters") + 1] == "30"
    assert "synthetic tokens" in said and "30 iterations" in said
