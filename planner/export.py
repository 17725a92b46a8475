"""Export a plan into the launches people already run: Megatron-LM arguments, torchrun, Slurm."""

from __future__ import annotations

import shlex
from enum import StrEnum

from plans import EPFFN, Dispatch, Optimizer, OptimizerSharding, Plan, Precision, Recompute

RDZV_PORT = 29500


class Target(StrEnum):
    megatron = "megatron"
    torchrun = "torchrun"
    slurm = "slurm"


def megatron_args(plan: Plan) -> tuple[list[str], list[str]]:
    """`pretrain_gpt.py` arguments for the plan, and comments on what Megatron expresses
    differently (the nearest equivalent is used)."""
    m, d, t = plan.model, plan.degrees, plan.training
    notes: list[str] = []
    args: list[str] = [
        "--num-layers", str(m.layers), "--hidden-size", str(m.hidden),
        "--num-attention-heads", str(m.query_heads), "--kv-channels", str(m.head_dim),
        "--group-query-attention", "--num-query-groups", str(m.kv_heads),
        "--seq-length", str(t.seq_len), "--max-position-embeddings", str(t.seq_len),
        "--vocab-size", str(m.vocab), "--tokenizer-type", "NullTokenizer",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--disable-bias-linear",
        "--num-experts", str(m.experts), "--moe-router-topk", str(m.top_k),
        "--moe-ffn-hidden-size", str(m.expert_ffn_hidden), "--moe-grouped-gemm",
        "--moe-router-load-balancing-type", "aux_loss",
    ]
    if not m.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if m.shared_experts:
        args += ["--moe-shared-expert-intermediate-size",
                 str(m.shared_experts * m.shared_expert_ffn_hidden)]
    if m.dense_layers:
        args += ["--ffn-hidden-size", str(m.dense_ffn_hidden),
                 "--moe-layer-freq", f"([0]*{m.dense_layers}+[1]*{m.moe_layers})"]
    else:
        args += ["--ffn-hidden-size", str(m.expert_ffn_hidden)]

    # ---- parallelism: world = TP x PP x DP x CP in Megatron ---------------------------------
    tp, cp = d.tp, d.cp
    if plan.attention.kind == "ulysses_sp" and d.sp > 1:
        cp = d.sp
        args += ["--cp-comm-type", "a2a"]
        notes.append(
            f"Ulysses SP={d.sp} for attention has no TP-free flag in Megatron-LM: it is expressed "
            "as context parallelism with cp_comm_type a2a (the Ulysses all-to-all); Megatron then "
            "also shards the sequence of norms and the FFN input over CP, which MegaScale-MoE does "
            "as well, and folds EP over dp x cp."
        )
    args += [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(d.pp),
        "--context-parallel-size", str(cp), "--expert-model-parallel-size", str(d.ep),
        "--expert-tensor-parallel-size", str(d.etp),
    ]
    if tp > 1:
        args.append("--sequence-parallel")
    if plan.attention.kind == "cp" and d.cp > 1:
        args += ["--cp-comm-type", "p2p"]
    if d.vpp > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", str(m.layers // d.stages)]
        if len(set(plan.stage_layers)) > 1:
            notes.append(f"stage split {list(plan.stage_layers)} is uneven; Megatron's virtual "
                         "pipeline needs equal chunks, so it runs an even split")
    elif d.pp > 1 and len(set(plan.stage_layers)) > 1:
        first, last = plan.stage_layers[0], plan.stage_layers[-1]
        middle = plan.stage_layers[1:-1]
        if len(set(middle)) <= 1:
            args += ["--decoder-first-pipeline-num-layers", str(first),
                     "--decoder-last-pipeline-num-layers", str(last)]
        else:
            notes.append(f"stage split {list(plan.stage_layers)} has unequal middle stages; "
                         "Megatron sets only the first and last stage sizes")
    if isinstance(plan.ffn, EPFFN):
        dispatcher = {Dispatch.all_to_all: "alltoall",
                      Dispatch.allgather_reduce_scatter: "allgather"}[plan.ffn.dispatch]
        args += ["--moe-token-dispatcher-type", dispatcher]
        if plan.ffn.capacity_factor is not None:
            args += ["--moe-expert-capacity-factor", f"{plan.ffn.capacity_factor:g}"]
    else:
        args += ["--moe-token-dispatcher-type", "allgather"]

    # ---- batch, schedule, recomputation, precision ------------------------------------------
    args += ["--micro-batch-size", str(plan.micro_batch_size),
             "--global-batch-size", str(t.global_batch)]
    if plan.recompute == Recompute.selective:
        args += ["--recompute-granularity", "selective"]
        notes.append("selective recomputation: Megatron recomputes core attention; the paper's "
                     "MoE-layer selective rematerialisation is a MegaScale-MoE kernel feature")
    elif plan.recompute == Recompute.full:
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    args.append("--bf16")
    if t.optimizer == Optimizer.sgd:
        args += ["--optimizer", "sgd"]
    zero1 = plan.optimizer_sharding == OptimizerSharding.zero1
    if zero1:  # Megatron's distributed optimizer shards the states over data parallelism
        args.append("--use-distributed-optimizer")
    if t.precision == Precision.fp8:
        args += ["--fp8-format", "hybrid"]
    if plan.grad_sync_overlap:  # overlapping the parameter gather needs the sharded states
        args += ["--overlap-grad-reduce", *(["--overlap-param-gather"] if zero1 else [])]
    if not plan.grad_accumulation_fusion:
        args.append("--no-gradient-accumulation-fusion")
    if plan.grad_sync_precision == Precision.bf16:
        args.append("--grad-reduce-in-bf16")
    elif plan.grad_sync_precision == Precision.fp8:
        args.append("--grad-reduce-in-bf16")
        notes.append("fp8 gradient communication has no Megatron-LM flag: bf16 reduction is used")
    if plan.overlap.value != "none":
        notes.append(f"overlap {plan.overlap.value}: Megatron's nearest is "
                     "--overlap-moe-expert-parallel-comm (EP a2a overlap) where available; "
                     "tile-level fused kernels are MegaScale-MoE's own")
    return args, notes


def megatron_script(plan: Plan) -> str:
    args, notes = megatron_args(plan)
    lines = [f"# moeplan export: {plan.summary()}"]
    lines += [f"# note: {n}" for n in notes]
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    lines.append(
        f"# world size {plan.degrees.world} = {plan.cluster.nodes} nodes x {per_node} GPUs"
    )
    pairs: list[str] = []
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append(f"{args[i]} {shlex.quote(args[i + 1])}")
            i += 2
        else:
            pairs.append(args[i])
            i += 1
    lines.append("MEGATRON_ARGS=(\n" + "\n".join(f"  {p}" for p in pairs) + "\n)")
    lines.append('torchrun ... pretrain_gpt.py "${MEGATRON_ARGS[@]}"')
    return "\n".join(lines) + "\n"


def torchrun_command(plan: Plan, plan_path: str, steps: int | None = None,
                     endpoint: str = "$MASTER_ADDR") -> list[str]:
    """Run our runtime with this plan on the plan's cluster: single node standalone, multi-node
    with a c10d rendezvous on `endpoint`."""
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    cmd = ["torchrun"]
    if plan.cluster.nodes == 1:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        cmd += ["--nnodes", str(plan.cluster.nodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{endpoint}:{RDZV_PORT}", "--rdzv-id", "moeplan"]
    cmd += ["--nproc-per-node", str(per_node), "-m", "runtime.train", "--plan", plan_path]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    return cmd


def slurm_script(plan: Plan, plan_path: str, steps: int | None = None) -> str:
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    run = torchrun_command(plan, plan_path, steps, endpoint="$MASTER_ADDR")
    if plan.cluster.nodes == 1:
        run = torchrun_command(plan, plan_path, steps)
    quoted = " ".join(a if a.startswith("$") or "$" in a else shlex.quote(a) for a in run)
    return "\n".join([
        "#!/bin/bash",
        f"# moeplan export: {plan.summary()}",
        "#SBATCH --job-name=moeplan",
        f"#SBATCH --nodes={plan.cluster.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --exclusive",
        "set -euo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_ADDR",
        f"srun {quoted}",
        "",
    ])
