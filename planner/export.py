"""Export a plan into the launches people already run: Megatron-LM arguments, torchtitan,
torchrun, Slurm."""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass

from plans import (
    EPFFN,
    Dispatch,
    ModelSpec,
    Optimizer,
    OptimizerSharding,
    Overlap,
    Plan,
    Precision,
    Recompute,
    SpecError,
)
from plans.enums import (
    CrossEntropy,
    Kernels,
    LinearBias,
    PipelineSchedule,
    RouterScore,
    Target,
    WindowKind,
)
from plans.execution import ExportOnly, as_target, deviations, refusals, torchtitan_model

RDZV_PORT = 29500


def megatron_layout(plan: Plan) -> str:
    """The plan's exact stage split as Megatron-LM's --pipeline-model-parallel-layout: chunks in
    pipeline order (chunk c on stage c mod pp, Megatron's flattening too) separated by "|",
    "E" the embedding on the first chunk, "t" a transformer layer, "m" an MTP module and "L" the
    LM head and loss on the last chunk
    (megatron/core/transformer/pipeline_parallel_layer_layout.py)."""
    last = len(plan.stage_layers) - 1
    chunks = []
    for c, n in enumerate(plan.stage_layers):
        body = "t" * n if n < 2 else f"t*{n}"
        tail = "m" * plan.model.mtp_layers + "L" if c == last else ""
        chunks.append(("E" if c == 0 else "") + body + tail)
    return "|".join(chunks)


def _expand_layout(layout: str) -> str:
    """A Megatron layout string with its repetitions written out: `X*n` repeats the one
    symbol or parenthesised group before it n times."""
    out: list[str] = []
    stack: list[list[str]] = []
    i = 0
    while i < len(layout):
        ch = layout[i]
        if ch == "(":
            stack.append(out)
            out = []
        elif ch == ")":
            group, out = "".join(out), stack.pop()
            out.append(group)
        elif ch == "*":
            digits = re.match(r"\d+", layout[i + 1:])
            if digits is None or not out:
                raise SpecError(f"pipeline layout {layout!r}: '*' needs a symbol and a count")
            out[-1] *= int(digits.group())
            i += len(digits.group())
        elif ch in "EtmL|":
            out.append(ch)
        else:
            raise SpecError(f"pipeline layout {layout!r}: unknown symbol {ch!r}")
        i += 1
    if stack:
        raise SpecError(f"pipeline layout {layout!r}: unclosed '('")
    return "".join(out)


def megatron_layout_layers(layout: str, model: ModelSpec, chunks: int) -> tuple[int, ...]:
    """Decoder layers per model chunk of a --pipeline-model-parallel-layout, megatron_layout's
    inverse (a published recipe's layout read as a Plan's stage_layers); one error line where
    the layout is not ``model``'s over ``chunks`` (pp x vp) chunks."""
    parts = _expand_layout(layout).split("|")
    if len(parts) != chunks:
        raise SpecError(f"pipeline layout {layout!r}: {len(parts)} chunks, the layout has "
                        f"{chunks} (pp x vp)")
    text = "".join(parts)
    if (not parts[0].startswith("E") or not parts[-1].endswith("L")
            or text.count("E") != 1 or text.count("L") != 1):
        raise SpecError(f"pipeline layout {layout!r}: the embedding must open the first chunk "
                        "and the loss close the last")
    if text.count("m") != model.mtp_layers or "m" in "".join(parts[:-1]):
        raise SpecError(f"pipeline layout {layout!r}: the model's {model.mtp_layers} MTP "
                        "modules go in the last chunk")
    out = tuple(p.count("t") for p in parts)
    if sum(out) != model.layers:
        raise SpecError(f"pipeline layout {layout!r}: {sum(out)} decoder layers, the model "
                        f"has {model.layers}")
    return out


def megatron_recompute(plan: Plan) -> list[str]:
    """Megatron-LM recomputation flags: full recomputation from each layer's input (uniform,
    one layer per recomputation unit), or selective recomputation of the plan's modules
    (``Plan.recompute_modules``, Megatron's own names)."""
    if plan.recompute == Recompute.none:
        return []
    if plan.recompute == Recompute.full:
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    return ["--recompute-granularity", "selective", "--recompute-modules",
            *(m.value for m in plan.recompute_modules)]


def megatron_cross_entropy(plan: Plan) -> tuple[str | None, list[str]]:
    """Megatron-LM computes the whole micro-batch's logits (it has no chunked cross-entropy):
    a plan that fits only thanks to the chunks is refused (the reason), else exported with a
    note (a plan that does not fit either way is the export's warning)."""
    if plan.cross_entropy == CrossEntropy.materialized:
        return None, []
    from cost_models import evaluate

    as_run = evaluate(plan.model_copy(update={"cross_entropy": CrossEntropy.materialized,
                                              "prediction": None}))
    if not as_run.feasible and evaluate(plan).feasible:
        return (f"cross_entropy chunked: Megatron materialises the whole micro-batch's logits, "
                f"and then the plan does not fit ({as_run.reason})"), []
    return None, [f"cross_entropy chunked: Megatron materialises the whole micro-batch's "
                  f"logits; the plan still fits (peak {as_run.memory.peak_bytes / 2**30:.1f} "
                  f"of {as_run.memory.capacity_bytes / 2**30:.1f} GiB usable)"]


def megatron_env(plan: Plan) -> dict[str, str]:
    """Environment Megatron-LM needs: validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1
    whenever TP or CP > 1 on GPUs before Blackwell (one connection keeps the sequence-parallel
    collectives in issue order); later GPUs accept it."""
    d = plan.degrees
    if d.tp > 1 or d.cp > 1 or d.sp > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def megatron_refusal(plan: Plan) -> str | None:
    """Why Megatron-Core cannot run this plan as planned, or None: its column of the
    capability table (plans.execution; a plan for another target re-checked as a megatron
    plan), then the model features its arguments cannot express, then whether it fits with
    the logits materialised."""
    found = refusals(as_target(plan, Target.megatron), target=Target.megatron)
    if found:
        return found[0]
    m = plan.model
    if m.top_k == 1 and not m.router_pre_softmax and m.router_score == RouterScore.softmax:
        return ("top-1 routing with renormalised weights: Megatron's TransformerConfig needs "
                "--moe-router-pre-softmax for top-1 (model.router_pre_softmax)")
    if m.rope_theta != int(m.rope_theta):
        return f"model.rope_theta {m.rope_theta:g}: Megatron's --rotary-base is a whole number"
    if m.sliding_window and m.window_kind == WindowKind.chunked:
        return ("model.window_kind chunked: Megatron-LM's window attention (--window-size) "
                "slides; it has no chunked local attention")
    if m.shared_expert_gate:
        return "model.shared_expert_gate: Megatron-LM's arguments have no shared-expert gate"
    if m.swiglu_limit and m.linear_bias != LinearBias.all:
        return ("model.swiglu_limit without linear biases: Megatron-LM turns its fused "
                "quick-GEGLU off with the biases (--disable-bias-linear sets bias_gelu_fusion "
                "false) and runs the clamped activation as eager PyTorch, which "
                "cost_models.megatron does not price")
    if m.kv_share_layers > 1:
        return ("model.kv_share_layers: Megatron-LM has no cross-layer attention (every layer "
                "projects its own keys and values)")
    return megatron_yarn_refusal(m) or megatron_cross_entropy(plan)[0]


MLA_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "truncate": True}
"""YaRN's settings MLA runs at that Megatron-LM has no argument for: MLATransformerConfig's
defaults (megatron-core 0.15.3) and its YarnRotaryEmbedding's whole-dimension ramp."""


def megatron_yarn_refusal(m: ModelSpec) -> str | None:
    """Why Megatron-LM's arguments cannot write the model's YaRN (``rope_scaling``), or None.
    GPT attention: --position-embedding-type has no yarn, and --rope-type yarn is MLA's only
    (core_transformer_config_from_args asserts 'Common attention only support
    rope_type="rope"', megatron/training/arguments.py of core_v0.15.3; Megatron-Bridge's
    providers set position_embedding_type yarn instead). MLA: --rotary-scaling-factor,
    --mscale and --mscale-all-dim, the rest at ``MLA_YARN_FIXED``."""
    y = m.rope_scaling
    if y is None:
        return None
    if m.mla is None:
        return ("model.rope_scaling: Megatron-LM's arguments cannot express YaRN for GPT "
                "attention (--rope-type yarn is MLA's only; --position-embedding-type has no "
                "yarn); Megatron-Bridge's provider runs it")
    for name, value in MLA_YARN_FIXED.items():
        if getattr(y, name) != value:
            return (f"model.rope_scaling.{name} {getattr(y, name)}: Megatron-LM's arguments "
                    f"have no flag for it (MLA runs YaRN at {value})")
    return None


def megatron_attention(m: ModelSpec) -> list[str]:
    """The attention's shape flags: GQA, or MLA (Megatron-Core's MLATransformerConfig: its
    --qk-head-dim is the no-RoPE part, --qk-pos-emb-head-dim the RoPE part; RoPE at the
    model's base, YaRN (rope_scaling) through MLA's fused YaRN kernels, else plain rotary
    unfused); windows, sinks and partial RoPE."""
    if m.mla is None:
        args = ["--kv-channels", str(m.head_dim), "--group-query-attention",
                "--num-query-groups", str(m.kv_heads)]
    else:
        a = m.mla
        args = ["--multi-latent-attention", "--kv-lora-rank", str(a.kv_lora_rank),
                "--qk-head-dim", str(a.qk_nope_head_dim),
                "--qk-pos-emb-head-dim", str(a.qk_rope_head_dim),
                "--v-head-dim", str(a.v_head_dim), *megatron_mla_rope(m)]
        if a.q_lora_rank:
            args += ["--q-lora-rank", str(a.q_lora_rank)]
    if m.sliding_window:
        # Megatron's window is (keys left of the query, keys right of it): the model's window
        # holds the query's own key too
        args += ["--window-size", f"({m.sliding_window - 1},0)"]
        if m.full_attention_every:
            args += ["--window-attn-skip-freq", str(m.full_attention_every)]
    if m.attention_sinks:
        args += ["--softmax-type", "learnable"]
    if m.rotary_fraction != 1:
        args += ["--rotary-percent", f"{m.rotary_fraction:g}"]
    return args


def megatron_mla_rope(m: ModelSpec) -> list[str]:
    """MLA's RoPE: YaRN as the model's (Megatron-Core's fused MLA kernels, on by default),
    the attention factor's mscale over mscale_all_dim (Megatron's defaults 1 and 0 give
    0.1 ln(factor) + 1, the factor without them); plain RoPE unfused (Megatron-Core fuses
    MLA's RoPE for YaRN only)."""
    y = m.rope_scaling
    if y is None:
        return ["--rope-type", "rope", "--no-rope-fusion"]
    return ["--rope-type", "yarn", "--rotary-scaling-factor", f"{y.factor:g}",
            "--mscale", f"{1.0 if y.mscale is None else y.mscale:g}",
            "--mscale-all-dim", f"{0.0 if y.mscale_all_dim is None else y.mscale_all_dim:g}"]


def megatron_glu(m: ModelSpec) -> list[str]:
    """The experts' gated activation: SwiGLU, or GPT-OSS's clamped one (Megatron-Core's
    quick-GEGLU, x sigmoid(1.702 x), with the linear half offset by 1 and both halves clamped;
    fused with the experts' fc1 bias by --bias-gelu-fusion, Megatron-LM's default)."""
    if not m.swiglu_limit:
        return ["--swiglu"]
    return ["--quick-geglu", "--glu-linear-offset", "1",
            "--activation-func-clamp-value", f"{m.swiglu_limit:g}"]


def megatron_routing(m: ModelSpec) -> list[str]:
    """The router's flags beyond top-k: the score function, the aux-loss-free expert bias and
    its update rate, the routed scaling factor and group-limited routing."""
    args = (["--moe-router-score-function", m.router_score.value]
            if m.router_score != RouterScore.softmax else [])  # Megatron's default: softmax
    if m.router_expert_bias:
        args += ["--moe-router-enable-expert-bias",
                 "--moe-router-bias-update-rate", f"{m.expert_bias_update_rate:g}"]
    if m.routed_scaling_factor != 1:
        args += ["--moe-router-topk-scaling-factor", f"{m.routed_scaling_factor:g}"]
    if m.expert_groups > 1:
        args += ["--moe-router-num-groups", str(m.expert_groups),
                 "--moe-router-group-topk", str(m.groups_per_token)]
    return args


def megatron_model_args(m: ModelSpec, seq_len: int) -> list[str]:
    """The model's flags: sizes, the sequence (and RoPE positions), norms, RoPE, biases,
    dropout, the attention's and the router's shape, the MoE layers and the dense ones, MTP."""
    args: list[str] = [
        "--num-layers", str(m.layers), "--hidden-size", str(m.hidden),
        "--num-attention-heads", str(m.query_heads), *megatron_attention(m),
        "--seq-length", str(seq_len), "--max-position-embeddings", str(seq_len),
        "--vocab-size", str(m.vocab),
        "--normalization", "RMSNorm", "--norm-epsilon", f"{m.norm_eps:g}", *megatron_glu(m),
        "--position-embedding-type", "rope", "--rotary-base", str(int(m.rope_theta)),
        *({LinearBias.none: ["--disable-bias-linear"],
           LinearBias.qkv: ["--disable-bias-linear", "--add-qkv-bias"],
           LinearBias.all: []}[m.linear_bias]),
        "--attention-dropout", f"{m.dropout:g}", "--hidden-dropout", f"{m.dropout:g}",
        "--num-experts", str(m.experts), "--moe-router-topk", str(m.top_k),
        "--moe-ffn-hidden-size", str(m.expert_ffn_hidden), "--moe-grouped-gemm",
        *megatron_routing(m),
    ]
    if m.qk_norm:
        args.append("--qk-layernorm")
    if m.router_pre_softmax:
        args.append("--moe-router-pre-softmax")
    if m.aux_loss_coeff > 0:
        args += ["--moe-router-load-balancing-type", "aux_loss",
                 "--moe-aux-loss-coeff", f"{m.aux_loss_coeff:g}"]
    else:
        args += ["--moe-router-load-balancing-type", "none"]
    if not m.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if m.shared_experts:
        args += ["--moe-shared-expert-intermediate-size",
                 str(m.shared_experts * m.shared_expert_ffn_hidden)]
    return args + megatron_ffn_layers(m)


def megatron_ffn_layers(m: ModelSpec) -> list[str]:
    """Which layers are MoE (--moe-layer-freq, the dense FFN's width) and the MTP modules."""
    if m.dense_ffn_layers:
        pattern = (f"([0]*{m.dense_layers}+[1]*{m.moe_layers})" if m.moe_layer_interval == 1
                   else "[" + ",".join(str(int(moe)) for moe in m.moe_pattern) + "]")
        args = ["--ffn-hidden-size", str(m.dense_ffn_hidden), "--moe-layer-freq", pattern]
    else:
        args = ["--ffn-hidden-size", str(m.expert_ffn_hidden)]
    if m.mtp_layers:
        args += ["--mtp-num-layers", str(m.mtp_layers)]
    return args


def megatron_parallel_args(plan: Plan) -> tuple[list[str], list[str]]:
    """The layout's flags (world = TP x PP x DP x CP in Megatron), with notes: Ulysses as
    a2a context parallelism, ring CP, the exact pipeline split, the token dispatcher."""
    d = plan.degrees
    args: list[str] = []
    notes: list[str] = []
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
    if d.pp > 1:  # the exact split, interleaved or not; vpp = chunks / pp
        args += ["--pipeline-model-parallel-layout", megatron_layout(plan)]
    return args + megatron_dispatcher(plan), notes


def megatron_dispatcher(plan: Plan) -> list[str]:
    """The token dispatcher: the plan's EP dispatch (DeepEP as the flex dispatcher's
    backend) and capacity, or allgather for expert TP."""
    if not isinstance(plan.ffn, EPFFN):
        return ["--moe-token-dispatcher-type", "allgather"]
    dispatcher = {Dispatch.all_to_all: "alltoall", Dispatch.allgather_reduce_scatter:
                  "allgather", Dispatch.deepep: "flex"}[plan.ffn.dispatch]
    args = ["--moe-token-dispatcher-type", dispatcher]
    if plan.ffn.dispatch == Dispatch.deepep:
        args.append("--moe-enable-deepep")
    if plan.ffn.capacity_factor is not None:
        args += ["--moe-expert-capacity-factor", f"{plan.ffn.capacity_factor:g}"]
    return args


def megatron_step_args(plan: Plan) -> list[str]:
    """How a step runs: batch, recomputation, precision, optimizer and its sharding, the
    gradient sync and the EP overlap."""
    t = plan.training
    args = ["--micro-batch-size", str(plan.micro_batch_size),
            "--global-batch-size", str(t.global_batch),
            *megatron_recompute(plan), "--bf16"]
    if t.optimizer == Optimizer.sgd:  # the plan's SGD is plain (Megatron's default has 0.9)
        args += ["--optimizer", "sgd", "--sgd-momentum", "0"]
    if plan.optimizer_sharding == OptimizerSharding.zero1:
        # Megatron's distributed optimizer shards the states over data parallelism
        args.append("--use-distributed-optimizer")
    if plan.optimizer_moments == Precision.bf16:
        args += ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                 "--exp-avg-sq-dtype", "bf16"]
    if t.precision == Precision.fp8:
        args += ["--fp8-format", "hybrid", "--fp8-recipe", t.fp8_recipe.value]
    # the gradient reduce only: the plan's ZeRO-1 parameter all-gather follows the optimizer
    # step, exposed (cost_models.grad_sync.exposed_grad_sync_s), so --overlap-param-gather,
    # which hides it behind the next forward, is not the plan
    if plan.grad_sync_overlap:
        args.append("--overlap-grad-reduce")
    if not plan.grad_accumulation_fusion:
        args.append("--no-gradient-accumulation-fusion")
    if plan.grad_sync_precision == Precision.bf16:
        args.append("--grad-reduce-in-bf16")
    if plan.overlap == Overlap.inter_op:  # plans.execution: Megatron-Core's EP overlap
        args.append("--overlap-moe-expert-parallel-comm")
    return args


def check_megatron(plan: Plan) -> None:
    """Raise SpecError, naming the field, when Megatron cannot express ``plan``."""
    why = megatron_refusal(plan)
    if why is not None:
        raise SpecError(f"--to megatron: {why}")


def megatron_args(plan: Plan, steps: int | None = None) -> tuple[list[str], list[str]]:
    """`pretrain_gpt.py` arguments that run the plan (training iterations when ``steps``; the
    learning rate and data are the user's), and notes on what Megatron runs differently.
    Raises SpecError when Megatron cannot express the plan."""
    check_megatron(plan)
    parallel, notes = megatron_parallel_args(plan)
    args = (megatron_model_args(plan.model, plan.training.seq_len) + parallel
            + megatron_step_args(plan))
    notes += megatron_cross_entropy(plan)[1]
    if steps is not None:
        args += ["--train-iters", str(steps)]
    return args, notes


def _pairs(args: list[str]) -> list[str]:
    """Flags with their values on one line each, values quoted for the shell."""
    pairs: list[str] = []
    i = 0
    while i < len(args):
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        pairs.append(" ".join([args[i], *(shlex.quote(v) for v in args[i + 1:j])]))
        i = j
    return pairs


def prediction_lines(plan: Plan) -> list[str]:
    """The cost model's prediction for the plan, as comments to hold against the run's log."""
    import cost_models

    e = cost_models.evaluate(plan)
    peak_tflops = plan.cluster.gpu.bf16_dense_tflops
    # TFLOP/s/GPU is the MFU's numerator: model FLOPs (ModelSpec.flops_per_token) per GPU-second
    return [
        f"# predicted by moeplan's cost model on {plan.cluster.name}: "
        f"{e.step_time_s:.4g} s/iter, {e.mfu * peak_tflops:.4g} TFLOP/s/GPU "
        f"(MFU {e.mfu:.1%} of {peak_tflops:g} bf16 TFLOP/s), "
        f"peak {e.memory.peak_bytes / 2**30:.4g} GiB per GPU",
    ]


def _array(name: str, words: list[str]) -> str:
    return f"{name}=(\n" + "\n".join(f"  {w}" for w in words) + "\n)"


def _megatron_header(plan: Plan, notes: list[str]) -> list[str]:
    """The script's comments: the plan, the prediction and where Megatron's log states the
    same figures, the notes, the world and the usage."""
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    lines = ["#!/bin/bash", f"# moeplan export: {plan.summary()}"]
    lines += prediction_lines(plan)
    lines += [
        "#   Megatron logs, every LOG_INTERVAL iterations: \"elapsed time per iteration (ms)\", "
        "\"throughput per GPU (TFLOP/s/GPU)\"",
        "#   (its own FLOP count, which can differ from moeplan's) and, once, \"max reserved\" "
        "of the memory report",
    ]
    for n in notes:  # comments wrapped between words, read at 100 columns
        lines += textwrap.wrap(f"note: {n}", 98, initial_indent="# ", subsequent_indent="#   ",
                               break_long_words=False, break_on_hyphens=False)
    return lines + [
        f"# world size {plan.degrees.world} = {plan.cluster.nodes} nodes x {per_node} GPUs; "
        "run this script once on every node",
        "# usage: DATA_PATH=prefix TOKENIZER_MODEL=hf-name-or-dir [LR=..] bash THIS "
        "[pretrain_gpt.py flags]",
        "#        MOCK_DATA=1 bash THIS   (synthetic tokens, no tokenizer)",
        "#   training settings below come from the environment (defaults shown); EXTRA_ARGS "
        "and the",
        "#   script's arguments are passed last, so they override any flag before them",
    ]


def _megatron_training(plan: Plan, steps: int | None) -> list[str]:
    """TRAINING_ARGS from the environment: optimizer steps (default ``steps``), a
    warmup-and-cosine learning rate, clipping, weight decay, checkpoints and logs."""
    iters = str(steps) if steps is not None else None
    return [
        "# training: optimizer steps, a warmup-and-cosine learning rate, clipping, weight "
        "decay",
        f'TRAIN_ITERS="${{TRAIN_ITERS:-{iters}}}"' if iters else
        'TRAIN_ITERS="${TRAIN_ITERS:?set TRAIN_ITERS, the optimizer steps}"',
        'LR="${LR:-3e-4}"',
        'MIN_LR="${MIN_LR:-3e-5}"',
        'LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-$(( TRAIN_ITERS / 100 ))}"',
        'CLIP_GRAD="${CLIP_GRAD:-1.0}"',
        'WEIGHT_DECAY="${WEIGHT_DECAY:-0.1}"',
        "# checkpoints (saved to and resumed from CKPT_DIR) and logs",
        'CKPT_DIR="${CKPT_DIR:-checkpoints}"',
        'SAVE_INTERVAL="${SAVE_INTERVAL:-1000}"',
        'LOG_INTERVAL="${LOG_INTERVAL:-10}"',
        'TENSORBOARD_DIR="${TENSORBOARD_DIR:-$CKPT_DIR/tensorboard}"',
        _array("TRAINING_ARGS", [
            '--train-iters "$TRAIN_ITERS"',
            '--lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine',
            '--lr-warmup-iters "$LR_WARMUP_ITERS" --lr-decay-iters "$TRAIN_ITERS"',
            '--clip-grad "$CLIP_GRAD" --weight-decay "$WEIGHT_DECAY"',
            *(['--adam-beta1 0.9 --adam-beta2 0.95'] if plan.training.optimizer != Optimizer.sgd
              else []),
            '--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval "$SAVE_INTERVAL"',
            '--log-interval "$LOG_INTERVAL" --log-throughput',
            '--tensorboard-dir "$TENSORBOARD_DIR" --log-timers-to-tensorboard',
            '--log-memory-to-tensorboard',
        ]),
    ]


MEGATRON_DATA = [
    "# data: a Megatron indexed dataset (PREFIX.bin + PREFIX.idx) read with its "
    "Hugging Face tokenizer",
    "# (the tokenizer's vocabulary is the model's), or synthetic tokens with MOCK_DATA=1",
    'if [[ -n "${MOCK_DATA:-}" ]]; then',
    "  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer)",
    '  DATA_SAID="synthetic tokens (MOCK_DATA)"',
    "else",
    "  DATA_ARGS=(",
    '    --data-path "${DATA_PATH:?set DATA_PATH, a Megatron indexed-dataset prefix '
    '(PREFIX.bin + PREFIX.idx), or MOCK_DATA=1}"',
    '    --tokenizer-type HuggingFaceTokenizer',
    '    --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL, the Hugging Face '
    'tokenizer (a hub name or a folder) of DATA_PATH}"',
    '    --split "${SPLIT:-99,1,0}"',
    "  )",
    '  DATA_SAID="$DATA_PATH (tokenizer $TOKENIZER_MODEL)"',
    "fi",
    "# more pretrain_gpt.py flags: EXTRA_ARGS (split on spaces) and this script's arguments",
    'read -r -a EXTRA <<< "${EXTRA_ARGS:-}"',
]
"""The script's DATA_ARGS (an indexed dataset and its tokenizer, or synthetic tokens) and
EXTRA (EXTRA_ARGS)."""


def megatron_script(plan: Plan, steps: int | None = None) -> str:
    """A bash script launching Megatron-LM's pretrain_gpt.py with the plan on every node: the
    plan's flags, then training flags from environment variables (defaults shown in the
    script), then EXTRA_ARGS and the script's own arguments, which Megatron's argparse lets
    override any earlier flag. DRY_RUN=1 prints the command and starts nothing."""
    args, notes = megatron_args(plan)  # the iterations are TRAIN_ITERS, default ``steps``
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    lines = _megatron_header(plan, notes)
    lines += [
        "set -euo pipefail",
        ': "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (holding pretrain_gpt.py)}"',
    ]
    lines += [f"export {k}={v}" for k, v in megatron_env(plan).items()]
    lines.append(_array("MEGATRON_ARGS", _pairs(args)))
    lines += _megatron_training(plan, steps) + MEGATRON_DATA
    launch = _torchrun_launch(plan)
    lines += launch.checks
    lines.append("CMD=(" + " ".join([*launch.words, '"$MEGATRON_LM/pretrain_gpt.py"',
                                     '"${MEGATRON_ARGS[@]}"', '"${TRAINING_ARGS[@]}"',
                                     '"${DATA_ARGS[@]}"', '"${EXTRA[@]}"', '"$@"']) + ")")
    lines += _say([
        f"Megatron-LM: {plan.summary()}",
        f"{plan.cluster.nodes} node(s) x {per_node} GPUs; $TRAIN_ITERS iterations, lr $LR "
        "(warmup $LR_WARMUP_ITERS, cosine to $MIN_LR)",
        "data: $DATA_SAID; checkpoints: $CKPT_DIR every $SAVE_INTERVAL; TensorBoard: "
        "$TENSORBOARD_DIR",
    ])
    return "\n".join(lines) + "\n"


def _say(summary: list[str]) -> list[str]:
    """Shell lines telling what the script will run (stderr), then running ``CMD``, or only
    printing it (quoted for the shell, on stdout) when DRY_RUN is set."""
    return [
        *(f'echo "moeplan: {line}" >&2' for line in summary),
        'if [[ -n "${DRY_RUN:-}" ]]; then',
        '  printf "%q " "${CMD[@]}"; echo',
        "  exit 0",
        "fi",
        'exec "${CMD[@]}"',
    ]


@dataclass(frozen=True)
class Launch:
    """A torchrun launch as shell text: lines checking the variables it needs, then its words
    (already quoted for the shell)."""

    checks: list[str]
    words: list[str]


MASTER_ADDR_CHECK = (': "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node '
                     '(the rendezvous host)}"')
RDZV_ID_CHECK = (': "${RDZV_ID:=${SLURM_JOB_ID:?set RDZV_ID (or run under Slurm): one id, the '
                 'same on every node and new for every job}}"')


def _torchrun_launch(plan: Plan, rdzv_id: str = '"$RDZV_ID"') -> Launch:
    """torchrun on one node of the plan's cluster: standalone on one node, a c10d rendezvous
    at $MASTER_ADDR otherwise, named ``rdzv_id`` (one job's nodes meet under one id, and a
    later job never joins an earlier one's); each worker bound to the CPUs nearest its GPU
    (torchrun --numa-binding, torch >= 2.9)."""
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    words = ["torchrun"]
    checks: list[str] = []
    if plan.cluster.nodes == 1:
        words += ["--standalone", "--nnodes", "1"]
    else:
        checks.append(MASTER_ADDR_CHECK)
        if rdzv_id == '"$RDZV_ID"':
            checks.append(RDZV_ID_CHECK)
        words += ["--nnodes", str(plan.cluster.nodes), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f'"$MASTER_ADDR:{RDZV_PORT}"', "--rdzv-id", rdzv_id]
    words += ["--nproc-per-node", str(per_node), "--numa-binding", "node"]
    return Launch(checks, words)


def torchrun_command(plan: Plan, plan_path: str, steps: int | None = None,
                     rdzv_id: str = '"$RDZV_ID"') -> list[str]:
    """Shell words running our runtime with this plan on one node of the plan's cluster."""
    words = _torchrun_launch(plan, rdzv_id).words
    words += ["-m", "runtime.train", "--plan", shlex.quote(plan_path)]
    if steps is not None:
        words += ["--steps", str(steps)]
    return words


RUNTIME_SETTINGS = [
    "# training settings from the environment: STEPS, DATA (a token file .u16/.u32, or a",
    "# Megatron indexed dataset PREFIX.bin + PREFIX.idx; synthetic tokens when unset), CKPT_DIR",
    "# with CKPT_EVERY (checkpoints, none when unset), RESUME=1, LOG_FILE; more runtime.train",
    "# flags as this script's arguments; DRY_RUN=1 prints the command and starts nothing",
]


def _runtime_args(steps: int | None) -> list[str]:
    """Shell lines building RUN_ARGS, runtime.train's training flags, from the environment."""
    return [
        f'STEPS="${{STEPS:-{steps if steps is not None else 10}}}"',
        'RUN_ARGS=(--steps "$STEPS")',
        'if [[ -n "${DATA:-}" ]]; then RUN_ARGS+=(--data "$DATA"); fi',
        'if [[ -n "${CKPT_DIR:-}" ]]; then',
        '  RUN_ARGS+=(--ckpt-dir "$CKPT_DIR" --ckpt-every "${CKPT_EVERY:-1000}")',
        "fi",
        'if [[ -n "${RESUME:-}" ]]; then RUN_ARGS+=(--resume); fi',
        'if [[ -n "${LOG_FILE:-}" ]]; then RUN_ARGS+=(--log-file "$LOG_FILE"); fi',
    ]


def _runtime_summary(plan: Plan) -> list[str]:
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    return [
        f"moeplan runtime: {plan.summary()}",
        f"{plan.cluster.nodes} node(s) x {per_node} GPUs; $STEPS steps; data: "
        "${DATA:-synthetic tokens}",
        "checkpoints: ${CKPT_DIR:-none}${CKPT_DIR:+ every ${CKPT_EVERY:-1000} steps}; "
        "log: ${LOG_FILE:-none}",
    ]


def torchrun_script(plan: Plan, plan_path: str, steps: int | None = None) -> str:
    """A bash script running our runtime with the plan; run it on every node. It says what it
    will run before it runs it."""
    launch = _torchrun_launch(plan)
    return "\n".join([
        "#!/bin/bash",
        f"# moeplan export: {plan.summary()}",
        *prediction_lines(plan),
        f"# run on each of the {plan.cluster.nodes} node(s)",
        *RUNTIME_SETTINGS,
        "set -euo pipefail",
        *launch.checks,
        *_runtime_args(steps),
        "CMD=(" + " ".join([*torchrun_command(plan, plan_path), '"${RUN_ARGS[@]}"', '"$@"'])
        + ")",
        *_say(_runtime_summary(plan)),
        "",
    ])


def slurm_script(plan: Plan, plan_path: str, steps: int | None = None) -> str:
    """An sbatch script: one task per node owning all the node's CPUs, running torchrun, which
    binds each worker to the CPUs nearest its GPU; the rendezvous is named after the job."""
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    return "\n".join([
        "#!/bin/bash",
        f"# moeplan export: {plan.summary()}",
        *prediction_lines(plan),
        "#SBATCH --job-name=moeplan",
        f"#SBATCH --nodes={plan.cluster.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --exclusive",
        *RUNTIME_SETTINGS,
        "set -euo pipefail",
        ': "${SLURM_JOB_NODELIST:?submit this script with sbatch}"',
        ': "${SLURM_JOB_ID:?submit this script with sbatch}"',
        'MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
        '| head -n 1)}"',
        "export MASTER_ADDR",
        *_runtime_args(steps),
        "# one task per node with every CPU of the node (srun no longer inherits "
        "--cpus-per-task from sbatch)",
        "CMD=(" + " ".join([
            "srun", "--ntasks-per-node=1", '--cpus-per-task="$SLURM_CPUS_ON_NODE"',
            "--cpu-bind=none",
            *torchrun_command(plan, plan_path, rdzv_id='"$SLURM_JOB_ID"'),
            '"${RUN_ARGS[@]}"', '"$@"']) + ")",
        *_say(_runtime_summary(plan)),
        "",
    ])


# ---- torchtitan 0.3.0: `torchrun -m torchtitan.train --module M --config F` and its
# `--section.key value` overrides (torchtitan/config/manager.py ConfigManager); torchtitan
# 0.3.0 reads no TOML file: its jobs are config functions and these arguments -----------------


def torchtitan_refusal(plan: Plan) -> str | None:
    """Why torchtitan cannot run this plan as planned, or None: its column of the capability
    table (plans.execution.TORCHTITAN)."""
    found = refusals(plan, target=ExportOnly.torchtitan)
    return found[0] if found else None


def torchtitan_model_parts(plan: Plan) -> list[list[str]]:
    """The plan's exact split as torchtitan's --parallelism.module_fqns_per_model_part: the
    pp x vpp chunks in pipeline order (part c on stage c mod pp, its Interleaved1F1B loop
    order), the embedding on the first, the final norm and LM head on the last."""
    parts, first = [], 0
    last = len(plan.stage_layers) - 1
    for c, n in enumerate(plan.stage_layers):
        part = (["tok_embeddings"] if c == 0 else []) + [f"layers.{i}"
                                                         for i in range(first, first + n)]
        parts.append(part + (["norm", "lm_head"] if c == last else []))
        first += n
    return parts


def torchtitan_parallelism(plan: Plan) -> list[str]:
    """--parallelism.* of the plan: data parallelism as FSDP2 (zero1) or replicas (none), TP
    with sequence parallelism, ring CP, EP, and the pipeline with its exact split."""
    d = plan.degrees
    shard = d.dp if plan.optimizer_sharding == OptimizerSharding.zero1 else 1
    p = "--parallelism."
    args = [f"{p}data_parallel_replicate_degree", str(d.dp // shard),
            f"{p}data_parallel_shard_degree", str(shard),
            f"{p}tensor_parallel_degree", str(d.tp),
            f"{p}context_parallel_degree", str(d.cp),
            f"{p}expert_parallel_degree", str(d.ep),
            f"{p}pipeline_parallel_degree", str(d.pp)]
    if d.tp > 1:
        args.append(f"{p}enable_sequence_parallel")
    if d.cp > 1:
        balancer = "headtail" if getattr(plan.attention, "zigzag", False) else "None"
        args += [f"{p}context_parallel_load_balancer", balancer]
    if d.pp > 1:
        schedule = {PipelineSchedule.one_f_one_b: "1F1B",
                    PipelineSchedule.interleaved_1f1b: "Interleaved1F1B"}[plan.schedule]
        args += [f"{p}pipeline_parallel_schedule", schedule,
                 f"{p}pipeline_parallel_microbatch_size", str(plan.micro_batch_size),
                 f"{p}module_fqns_per_model_part",
                 *(",".join(part) for part in torchtitan_model_parts(plan))]
    return args


def torchtitan_training(plan: Plan, steps: int | None) -> list[str]:
    """--training.* and --compile.*: the batch (torchtitan accumulates gradients to
    global_batch_size over local_batch_size per replica; with PP the micro-batches are the
    pipeline's), the sequence, bf16 parameters with fp32 reductions, torch.compile for fused
    kernels."""
    t, d = plan.training, plan.degrees
    local = plan.micro_batch_size if d.pp == 1 else t.global_batch // d.dp
    args = ["--training.local_batch_size", str(local),
            "--training.global_batch_size", str(t.global_batch),
            "--training.seq_len", str(t.seq_len),
            "--training.mixed_precision_param", "bfloat16",
            "--training.mixed_precision_reduce", "float32"]
    if steps is not None:
        args += ["--training.steps", str(steps)]
    if plan.kernels == Kernels.fused:
        return args + ["--compile.enable", "--compile.components", "model,loss"]
    return args + ["--compile.no-enable"]


TORCHTITAN_AC = {Recompute.none: "activation_checkpoint:none",
                 Recompute.full: "activation_checkpoint:full"}
"""The activation_checkpoint subcommand of each recomputation torchtitan runs (the column
refuses selective)."""


@dataclass(frozen=True)
class TorchtitanJob:
    """torchtitan.train's arguments for a plan: the config function, the overrides, the
    activation-checkpoint subcommand (tyro takes it last), notes on what runs differently."""

    module: str
    config: str
    args: list[str]
    checkpointing: str
    notes: list[str]


def torchtitan_job(plan: Plan, steps: int | None = None) -> TorchtitanJob:
    """The torchtitan job of ``plan``; SpecError when torchtitan cannot run it."""
    why = torchtitan_refusal(plan)
    if why is not None:
        raise SpecError(f"--to torchtitan: {why}")
    module, config = torchtitan_model(plan.model)
    notes = [d.note().removeprefix("note: ") for d in
             deviations(plan, target=ExportOnly.torchtitan)]
    if plan.optimizer_sharding == OptimizerSharding.zero1 and plan.degrees.dp > 1:
        notes.append("optimizer_sharding zero1 runs as FSDP2: torchtitan shards the "
                     "parameters and gradients with the states and all-gathers the parameters "
                     "for the forward and the backward")
    if plan.model.aux_loss_coeff > 0:
        notes.append(f"model.aux_loss_coeff {plan.model.aux_loss_coeff:g}: torchtitan's MoE "
                     "balances the experts by expert-bias updates (load_balance_coeff), with "
                     "no auxiliary loss")
    args = torchtitan_parallelism(plan) + torchtitan_training(plan, steps)
    return TorchtitanJob(module, config, args, TORCHTITAN_AC[plan.recompute], notes)


def torchtitan_script(plan: Plan, steps: int | None = None) -> str:
    """A bash script launching torchtitan's trainer with the plan on every node: the config
    function with the plan's overrides, then EXTRA_ARGS and the script's arguments (later
    overrides win), the activation-checkpoint subcommand last. DRY_RUN=1 prints the command
    and starts nothing."""
    job = torchtitan_job(plan, steps)
    per_node = min(plan.cluster.gpus, plan.cluster.node.gpus_per_node)
    lines = ["#!/bin/bash", f"# moeplan export: {plan.summary()}", *prediction_lines(plan),
             f"#   (the plan priced as written, for target {plan.target}: torchtitan's step "
             "differs where the notes say)"]
    for n in job.notes:
        lines += textwrap.wrap(f"note: {n}", 98, initial_indent="# ", subsequent_indent="#   ",
                               break_long_words=False, break_on_hyphens=False)
    lines += [
        f"# world size {plan.degrees.world} = {plan.cluster.nodes} nodes x {per_node} GPUs; "
        "run this script once on every node",
        f"# torchtitan 0.3.0 config function {job.module}.{job.config}: its data set, "
        "tokenizer, optimizer and",
        "# schedule; HF_ASSETS (the tokenizer folder), DUMP_FOLDER (checkpoints, logs) and "
        "EXTRA_ARGS or this",
        "# script's arguments (--section.key value) override it",
        "set -euo pipefail",
        _array("TITAN_ARGS", _pairs(job.args)),
        'DUMP_FOLDER="${DUMP_FOLDER:-./outputs}"',
        'TITAN_ARGS+=(--dump_folder "$DUMP_FOLDER")',
        'if [[ -n "${HF_ASSETS:-}" ]]; then TITAN_ARGS+=(--hf_assets_path "$HF_ASSETS"); fi',
        'read -r -a EXTRA <<< "${EXTRA_ARGS:-}"',
    ]
    launch = _torchrun_launch(plan)
    lines += launch.checks
    lines.append("CMD=(" + " ".join([*launch.words, "-m", "torchtitan.train", "--module",
                                     job.module, "--config", job.config,
                                     '"${TITAN_ARGS[@]}"', '"${EXTRA[@]}"', '"$@"',
                                     job.checkpointing]) + ")")
    lines += _say([f"torchtitan: {plan.summary()}",
                   f"{plan.cluster.nodes} node(s) x {per_node} GPUs; {job.module}."
                   f"{job.config}; outputs: $DUMP_FOLDER"])
    return "\n".join(lines) + "\n"
